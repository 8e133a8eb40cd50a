"""What the security tests share: an allowed local folder holding an input, a spec inside it, the
deployment's prefixes, and the refusal (if any) the spec meets at validation and the deployment check; the
bytes the checked readers read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.spec_guard import check_deployment
from tests.support.data import write_parquet

A = "@ALLOWED@"  # replaced by the test's allowed local folder


@pytest.fixture
def allowed(tmp_path):
    base = tmp_path / "allowed"
    write_parquet(base / "in" / "part-0.parquet", ["a", "b", "c"], ["one", "two", "three"])
    (tmp_path / "allowed-sibling" / "in").mkdir(parents=True)
    return base


def base_doc(allowed: Path) -> dict:
    return {
        "name": "sec",
        "model": {"name": "fake", "max_model_len": 256},
        "io": {"input_uri": str(allowed / "in"), "output_uri": str(allowed / "out")},
        "prompt": {"template": "Ticket: {text}", "system_prompt": "Classify."},
        "sampling": {"max_tokens": 4, "structured": {"choice": ["a", "b"]}},
        "sharding": {"target_rows": 10, "chunk_rows": 2},
    }


def prefixes(allowed: Path) -> list[str]:
    return [str(allowed), "s3://data/in", "s3://data/out"]


def refused(doc: dict, allowed_prefixes: list[str]) -> str | None:
    """The refusal message, or None when the spec would be accepted."""
    try:
        spec = JobSpec.load(doc)
        check_deployment(spec, allowed_prefixes)
    except SpecError as e:
        return str(e)
    return None


def with_value(doc: dict, field: str, value):
    doc = json.loads(json.dumps(doc))
    *parents, leaf = field.split(".")
    node = doc
    for p in parents:
        node = node.setdefault(p, {})
    if field in ("prompt.text_columns", "sampling.structured.choice", "sampling.stop"):
        value = [value, "b"] if field == "sampling.structured.choice" else [value]
    if field == "prompt.template":
        value = "Ticket: {text} " + value
    if field == "sampling.structured.regex":
        doc["sampling"]["structured"] = {}
        node = doc["sampling"]["structured"]
    node[leaf] = value
    return doc


# ---- fail closed: the deployment's allow-list (issue 12) ------------------------------
def _ti():
    return type(
        "TI",
        (),
        {
            "xcoms": {},
            "xcom_push": lambda self, key, value: self.xcoms.update({key: value}),
            "map_index": 0,
            "try_number": 1,
        },
    )()


def counted_reads(monkeypatch) -> list[int]:
    """The sizes of every read of a file opened by ``Storage._open_read`` (the checked readers) from now on: what a
    test of "not read" sums."""
    from airflow_provider_vllm.core.storage import Storage

    read: list[int] = []
    real_open = Storage._open_read

    def counted(self, rel):
        f = real_open(self, rel)
        real_read = f.read
        f.read = lambda n=-1: read.append(len(b := real_read(n))) or b
        return f

    monkeypatch.setattr(Storage, "_open_read", counted)
    return read


PLANTED_KINDS = ["link", "dangling link", "fifo", "folder"]
"""What another writer of a local prefix can put where the pipeline writes a regular file (``plant``)."""


def plant(path: Path, kind: str, outside: Path, data: bytes = b"another tenant's") -> None:
    """Put at ``path`` what another writer of its folder could (a kind of ``PLANTED_KINDS``): a link to the file
    ``outside/victim`` (which holds ``data``), a dangling link, a FIFO (a read that opens it would block), or a
    folder holding links to ``outside`` and to its file, a FIFO and a nested folder."""
    import os

    outside.mkdir(parents=True, exist_ok=True)
    victim = outside / "victim"
    victim.write_bytes(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "link":
        path.symlink_to(victim)
    elif kind == "dangling link":
        path.symlink_to(outside / "missing")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        (path / "deep" / "er").mkdir(parents=True)
        (path / "deep" / "er" / "file").write_bytes(b"x")
        (path / "to-file").symlink_to(victim)
        (path / "deep" / "to-folder").symlink_to(outside, target_is_directory=True)
        os.mkfifo(path / "fifo")
    else:
        raise ValueError(kind)


def untouched(outside: Path, data: bytes = b"another tenant's") -> bool:
    """Whether ``outside`` (``plant``'s) holds its file alone, with its bytes: nothing removed or written there."""
    import os

    return sorted(os.listdir(outside)) == ["victim"] and (outside / "victim").read_bytes() == data
