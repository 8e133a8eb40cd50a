"""The pin of a local model folder and its check (core/weights.py); through plan and worker:
tests/unit/worker/test_weights.py."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from airflow_provider_vllm.core import weights
from airflow_provider_vllm.core.errors import InputChangedError
from airflow_provider_vllm.core.records import PinnedFile
from airflow_provider_vllm.core.weights import WeightsPin, check_folder
from airflow_provider_vllm.steps.cache.fingerprint_memo import FingerprintMemo
from airflow_provider_vllm.steps.cache.key import describe_weights, weights_fingerprint
from tests.support.data import make_spec


def hub_layout(tmp_path: Path) -> Path:
    """A hub cache snapshot: the files are links into blobs/ (outside the folder vLLM is pointed at)."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for name, data in {"config.json": b"{}", "model.safetensors": b"w" * 1000}.items():
        (blobs / name).write_bytes(data)
        (snap / name).symlink_to(blobs / name)
    return snap


def pin_of(path: Path) -> WeightsPin:
    spec = make_spec("/i", "/o", model={"name": str(path)})
    [pin] = describe_weights(spec, FingerprintMemo(None))
    return pin


def test_a_hub_cache_snapshot_of_links_is_pinned_and_checked_as_vllm_reads_it(tmp_path):
    snap = hub_layout(tmp_path)
    pin = pin_of(snap)
    assert [f.path for f in pin.files] == ["config.json", "model.safetensors"]
    assert pin.fingerprint() == weights_fingerprint(str(snap), FingerprintMemo(None))  # the key's fingerprint
    check_folder(pin)
    (tmp_path / "blobs" / "model.safetensors").write_bytes(b"v" * 1000)  # the link's target changes
    with pytest.raises(InputChangedError, match=r"model\.safetensors is not the file the plan hashed"):
        check_folder(pin)


def test_a_growing_file_is_read_no_further_than_the_pinned_size(tmp_path, monkeypatch):
    m = tmp_path / "m"
    m.mkdir()
    (m / "w.bin").write_bytes(b"a" * 10)
    pin = pin_of(m)
    (m / "w.bin").write_bytes(b"a" * (5 << 20))  # it grew after its size was read: the stat still says 10
    real_fstat = os.fstat

    class Stat:
        def __init__(self, st):
            self._st = st

        def __getattr__(self, k):
            return 10 if k == "st_size" else getattr(self._st, k)

    monkeypatch.setattr(weights.os, "fstat", lambda fd: Stat(real_fstat(fd)))
    hashed: list[int] = []
    real_sha256 = hashlib.sha256

    class Counting:
        def __init__(self):
            self._h = real_sha256()

        def update(self, b):
            hashed.append(len(b))
            self._h.update(b)

        def hexdigest(self):
            return self._h.hexdigest()

    monkeypatch.setattr(weights.hashlib, "sha256", Counting)
    with pytest.raises(InputChangedError, match=r"w\.bin is not the file the plan hashed"):
        check_folder(pin)
    assert sum(hashed) == 11  # the pinned size + 1, of 5 MiB


def test_a_pin_names_files_inside_the_folder_only():
    with pytest.raises(ValueError):
        PinnedFile(path="../etc/passwd", bytes=1, sha256="0" * 64)
