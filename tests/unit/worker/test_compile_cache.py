"""The shared compile cache: a pod restores a verified snapshot, publishes one after a cold start, and two
pods publishing at once can never leave a torn or mixed snapshot (the rename is atomic and create-only)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest

from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.worker import compile_cache as cc

KEY = "k" * 40


def _spec(**engine) -> JobSpec:
    return JobSpec.load(
        {
            "name": "warm",
            "model": {"name": "/models/llama"},
            "engine": engine,
            "prompt": {"template": "{text}"},
            "io": {"input_uri": "/data/in/", "output_uri": "/data/out/"},
        }
    )


def _dirs(base: Path) -> dict[str, str]:
    return {n: str(base / n) for n in ("vllm", "torchinductor", "triton")}


def _env(root: Path, base: Path, **more: str) -> dict[str, str]:
    d = _dirs(base)
    return {
        "VLLM_BATCH_COMPILE_CACHE": str(root),
        "VLLM_CACHE_ROOT": d["vllm"],
        "TORCHINDUCTOR_CACHE_DIR": d["torchinductor"],
        "TRITON_CACHE_DIR": d["triton"],
        **more,
    }


def _pod(root: Path, base: Path, tag: str = "a", key: str = KEY, **more: str) -> cc.CompileCache:
    """A pod's view, with the accelerator fixed (no nvidia-smi in a unit test). Pods mount their emptyDir at the
    same path, so they share a key; test pods live in different folders: key them as if they were at /cache."""
    cache = _from_env(root, base, key, **more)
    assert cache is not None
    cache.key = cc.cache_key({**cache.facts, "dirs": _dirs(Path("/cache"))})
    return cache


def _from_env(root: Path, base: Path, key: str = KEY, **more: str) -> cc.CompileCache | None:
    orig = cc.accelerator
    cc.accelerator = lambda: "gpu:NVIDIA H200 (cc 9.0)"  # type: ignore[assignment]
    try:
        return cc.from_env(_spec(), Keyring.from_text(key), _env(root, base, **more))
    finally:
        cc.accelerator = orig  # type: ignore[assignment]


def _published(tmp_path: Path) -> tuple[Path, cc.CompileCache, dict[str, bytes]]:
    """A shared folder under ``tmp_path`` with the first pod's snapshot published: (the folder, that pod, what it
    compiled)."""
    root = tmp_path / "shared"
    root.mkdir()
    first = _pod(root, tmp_path / "pod1")
    first.restore()
    compiled = _compile(tmp_path / "pod1", "a")
    first.publish("s/a")
    return root, first, compiled


def _compile(base: Path, tag: str, files: int = 5) -> dict[str, bytes]:
    """What an engine leaves in its private folders, plus the temporaries a copy must skip."""
    out = {}
    for i in range(files):
        for name, sub in (
            ("vllm", "torch_compile_cache/abc/rank_0_0/backbone"),
            ("triton", f"K{i}"),
            ("torchinductor", "fxgraph/x"),
        ):
            p = base / name / sub / f"art{i}.bin"
            p.parent.mkdir(parents=True, exist_ok=True)
            data = (f"{tag}:{name}:{i}:".encode()) * (2000 + i)
            p.write_bytes(data)
            out[f"{name}/{sub}/art{i}.bin"] = data
    (base / "triton" / "tmp.pid_7_x").mkdir(parents=True)
    (base / "triton" / "tmp.pid_7_x" / "half.cubin").write_bytes(b"torn")
    (base / "torchinductor" / ".7.1234.tmp").write_bytes(b"torn")
    return out


def _tree(base: Path) -> dict[str, bytes]:
    return {p.relative_to(base).as_posix(): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()}


def test_first_pod_publishes_and_a_later_pod_restores_exactly_its_files(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    first = _pod(root, tmp_path / "pod1")
    assert first.restore() == "cold"
    compiled = _compile(tmp_path / "pod1", "a")
    assert first.publish("shard-0/att-1") is True
    assert first.stats()["compile_cache"] == "cold"

    later = _pod(root, tmp_path / "pod2")
    assert later.key == first.key
    assert later.restore() == "warm"
    assert _tree(tmp_path / "pod2") == compiled  # every artefact, none of the half-written temporaries
    assert later.publish("shard-1/att-1") is False  # a warm pod never republishes
    assert later.stats()["compile_cache"] == "warm"
    manifest = json.loads((root / later.key / cc.SNAPSHOT / cc.MANIFEST).read_text())
    assert manifest["publisher"] == "shard-0/att-1" and manifest["facts"]["accelerator"].startswith("gpu:NVIDIA H200")


def _publisher(root: str, base: str, tag: str, barrier, results) -> None:
    pod = _pod(Path(root), Path(base))
    pod.restore()
    _compile(Path(base), tag, files=40)
    barrier.wait()  # both copy and rename at the same moment
    results.put((tag, pod.publish(f"shard-{tag}/att")))


def test_two_pods_publishing_at_once_leave_one_whole_snapshot_never_a_mix(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_publisher, args=(str(root), str(tmp_path / f"pod-{t}"), t, barrier, results))
        for t in ("A", "B")
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    won = dict(results.get(timeout=5) for _ in procs)
    assert sorted(won.values()) == [False, True]  # exactly one publisher won
    winner = next(t for t, ok in won.items() if ok)
    (key_dir,) = [p for p in root.iterdir()]
    assert [p.name for p in key_dir.iterdir()] == [cc.SNAPSHOT]  # the loser's copy is gone

    reader = _pod(root, tmp_path / "reader")
    assert reader.restore() == "warm"
    restored = _tree(tmp_path / "reader")
    assert restored == {k: v for k, v in _tree(tmp_path / f"pod-{winner}").items() if "tmp" not in k}
    assert all(v.startswith(f"{winner}:".encode()) for v in restored.values())  # one writer's files only


def test_a_changed_file_is_refused_and_nothing_half_restored_stays(tmp_path):
    root, first, _ = _published(tmp_path)
    victim = sorted((root / first.key / cc.SNAPSHOT / "triton").rglob("*.bin"))[-1]
    victim.write_bytes(b"print('owned')")  # whoever can write the volume but lacks the signing key

    later = _pod(root, tmp_path / "pod2")
    assert later.restore() == "cold"
    assert _tree(tmp_path / "pod2") == {}
    assert later.publish("s/b") is False  # the name is taken: the bad snapshot stays until removed
    assert "does not match its manifest entry" in later.notes[0]


def test_a_snapshot_sealed_with_another_key_or_moved_to_another_key_is_refused(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    other = _pod(root, tmp_path / "pod1", key="z" * 40)  # same engine, another deployment's signing key
    other.restore()
    _compile(tmp_path / "pod1", "a")
    other.publish("s/a")
    assert _pod(root, tmp_path / "pod2").restore() == "cold"

    mine = _pod(root, tmp_path / "pod3")
    (root / mine.key).rename(root / "key-x")
    mine.restore()
    _compile(tmp_path / "pod3", "b")
    assert mine.publish("s/b") is True
    moved = "0" * 32
    (root / mine.key).rename(root / moved)  # this deployment's snapshot, renamed to another key's folder
    reader = _pod(root, tmp_path / "pod4")
    reader.key = moved
    assert reader.restore() == "cold"
    assert "does not match its content" in reader.notes[0]


def test_manifest_paths_outside_the_private_folders_and_links_are_refused(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    pod = _pod(root, tmp_path / "pod1")
    for bad in ("../x", "/etc/passwd", "vllm", "home/x", "vllm/../../x", "vllm/./x", "vllm\\x"):
        with pytest.raises(cc.SnapshotInvalid):
            cc._split(bad, pod.dirs)
    link_root = tmp_path / "snap"
    (link_root / "vllm").mkdir(parents=True)
    (link_root / "vllm" / "f").symlink_to("/etc/hostname")
    with pytest.raises(OSError):
        cc._open_regular(link_root / "vllm" / "f", link_root)  # O_NOFOLLOW
    (link_root / "triton").symlink_to("/etc")
    with pytest.raises(cc.SnapshotInvalid, match="outside"):
        cc._open_regular(link_root / "triton" / "hostname", link_root)


def test_a_restarted_container_keeps_its_own_files(tmp_path):
    root, first, compiled = _published(tmp_path)
    mine = tmp_path / "pod2" / next(iter(compiled))
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"mine")
    assert _pod(root, tmp_path / "pod2").restore() == "warm"
    assert mine.read_bytes() == b"mine"


def test_the_key_changes_with_what_artefacts_depend_on(tmp_path):
    dirs = _dirs(tmp_path)
    base = cc.key_facts(_spec(), dirs, "gpu:NVIDIA H200 (cc 9.0)")
    key = cc.cache_key(base)
    assert cc.cache_key(cc.key_facts(_spec(), dirs, "gpu:NVIDIA H200 (cc 9.0)")) == key  # stable
    changed = [
        {**base, "accelerator": "gpu:NVIDIA A100-SXM4-80GB (cc 8.0)"},
        {**base, "accelerator": "cpu:AMD EPYC"},
        {**base, "vllm": "vllm==0.26.0"},
        {**base, "torch": "2.12.0"},
        {**base, "triton": "3.7.0"},
        cc.key_facts(_spec(max_num_seqs=512), dirs, "gpu:NVIDIA H200 (cc 9.0)"),
        cc.key_facts(_spec(batch_invariant=True), dirs, "gpu:NVIDIA H200 (cc 9.0)"),
        cc.key_facts(
            _spec().model_copy(update={"model": _spec().model.model_copy(update={"name": "/m/b"})}), dirs, "x"
        ),
        cc.key_facts(_spec(), _dirs(tmp_path / "elsewhere"), "gpu:NVIDIA H200 (cc 9.0)"),
        # another worker image with the same packages (another CUDA or compiler build)
        cc.key_facts(_spec(), dirs, "gpu:NVIDIA H200 (cc 9.0)", "registry.example/vllm-batch@sha256:" + "b" * 64),
    ]
    keys = {cc.cache_key(f) for f in changed}
    assert key not in keys and len(keys) == len(changed)


def test_the_key_changes_with_vllms_batch_invariant_variable_not_with_this_packages(tmp_path, monkeypatch):
    """VLLM_BATCH_INVARIANT swaps torch operations for vLLM's batch-invariant kernels (other compiled graphs);
    this package's VLLM_BATCH_* variables (the compile cache's own folder, say) are not the engine's."""
    dirs = _dirs(tmp_path)
    key = cc.cache_key(cc.key_facts(_spec(), dirs, "gpu:NVIDIA H200 (cc 9.0)"))
    monkeypatch.setenv("VLLM_BATCH_COMPILE_CACHE_PUBLISH", "0")
    monkeypatch.setenv("VLLM_BATCH_LOG_LEVEL", "DEBUG")
    assert cc.cache_key(cc.key_facts(_spec(), dirs, "gpu:NVIDIA H200 (cc 9.0)")) == key
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert cc.cache_key(cc.key_facts(_spec(), dirs, "gpu:NVIDIA H200 (cc 9.0)")) != key


def test_off_unless_the_pod_names_the_folder_and_three_separate_private_folders(tmp_path, monkeypatch):
    root = tmp_path / "shared"
    root.mkdir()
    keyring = Keyring.from_text(KEY)
    assert cc.from_env(_spec(), keyring, {}) is None
    env = _env(root, tmp_path / "p")
    assert cc.from_env(_spec(), keyring, {k: v for k, v in env.items() if k != "TRITON_CACHE_DIR"}) is None
    assert cc.from_env(_spec(), keyring, {**env, "TRITON_CACHE_DIR": env["VLLM_CACHE_ROOT"] + "/triton"}) is None
    assert cc.from_env(_spec(), keyring, {**env, "VLLM_BATCH_COMPILE_CACHE": str(tmp_path / "absent")}) is None
    monkeypatch.setattr(cc, "accelerator", lambda: None)  # NVIDIA devices nobody can name
    assert cc.from_env(_spec(), keyring, env) is None


def test_a_read_only_pod_restores_but_never_publishes(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    pod = _pod(root, tmp_path / "pod1", VLLM_BATCH_COMPILE_CACHE_PUBLISH="0")
    assert pod.restore() == "cold"
    _compile(tmp_path / "pod1", "a")
    assert pod.publish("s/a") is False
    assert list(root.iterdir()) == []


def test_a_stale_publish_folder_of_a_killed_pod_is_removed_and_never_read(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    pod = _pod(root, tmp_path / "pod1")
    stale = root / pod.key / f"{cc.PUBLISHING}dead"
    (stale / "vllm").mkdir(parents=True)
    (stale / "vllm" / "half").write_bytes(b"to")
    assert _pod(root, tmp_path / "pod0").restore() == "cold"  # a publish folder is never a snapshot
    os.utime(stale, (0, 0))
    pod.restore()
    _compile(tmp_path / "pod1", "a")
    assert pod.publish("s/a") is True
    assert not stale.exists()


def test_a_key_folder_flooded_with_entries_is_swept_no_further_than_its_bound(tmp_path, monkeypatch, caplog):
    """A writer of the volume plants entries in a key's folder: the publisher's sweep for stale publish folders
    lists at most ``KEY_FOLDER_LISTED`` of them, warns naming the folder and the bound, and still publishes; the
    code before listed every entry (``glob``)."""
    root = tmp_path / "shared"
    root.mkdir()
    pod = _pod(root, tmp_path / "pod1")
    folder = root / pod.key
    folder.mkdir(parents=True)
    for i in range(20):
        (folder / f"planted-{i:02d}").write_bytes(b"")
    monkeypatch.setattr(cc, "KEY_FOLDER_LISTED", 5, raising=False)
    seen = []
    real = os.scandir

    def counted(p):
        if str(p) != str(folder):
            return real(p)

        class It:
            def __enter__(self):
                self.it = real(p)
                return self

            def __exit__(self, *exc):
                self.it.close()

            def __iter__(self):
                for e in self.it:
                    seen.append(e.name)
                    yield e

        return It()

    pod.restore()
    _compile(tmp_path / "pod1", "a")
    monkeypatch.setattr(os, "scandir", counted)
    with caplog.at_level("WARNING"):
        assert pod.publish("s/a") is True
    monkeypatch.undo()
    assert f"compile cache {folder}: holds more than 5 entries" in caplog.text
    assert len([n for n in seen if n.startswith("planted-")]) <= 6


def test_a_file_swapped_for_a_huge_one_is_refused_unread_and_a_growing_one_is_read_no_further(tmp_path, monkeypatch):
    """A writer of the volume replaces a snapshot file with a huge (sparse) one: the pod must not copy it into
    its emptyDir (past the emptyDir's size limit the pod is evicted: a failed shard, not a cold start). The
    manifest is sealed, so the size it names bounds every read."""
    root, first, _ = _published(tmp_path)
    snap = root / first.key / cc.SNAPSHOT
    victim = sorted((snap / "torchinductor").rglob("*.bin"))[0]
    manifest_size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(64 * 1024 * 1024)  # sparse: costs the writer nothing
    copied: list[int] = []
    real_copy = cc._copy

    def spy(*args, **kwargs):
        out = real_copy(*args, **kwargs)
        copied.append(out[0])
        return out

    monkeypatch.setattr(cc, "_copy", spy)
    later = _pod(root, tmp_path / "pod2")
    assert later.restore() == "cold"
    assert _tree(tmp_path / "pod2") == {}
    assert max(copied, default=0) <= manifest_size + 1  # before: all 64 MiB copied into the pod's folder
    assert "manifest entry" in later.notes[0]

    # the right size when checked, growing while read (a writer appending): the copy stops one byte past it
    grown = tmp_path / "grown"
    grown.write_bytes(b"x" * (3 * cc._COPY_BLOCK))
    real_fstat = os.fstat
    monkeypatch.setattr(cc.os, "fstat", lambda fd: os.stat_result((*real_fstat(fd)[:6], 10, *real_fstat(fd)[7:])))
    size, _ = real_copy(grown, tmp_path / "dest", tmp_path, expect=10)
    assert size == 11 and (tmp_path / "dest").stat().st_size == 11


def test_a_key_folder_planted_as_a_link_makes_the_publisher_write_and_delete_nothing_elsewhere(tmp_path):
    """A writer of the claim plants ``<key>`` as a symbolic link to another folder the pod can write (its data
    PVC, say): the publisher must not create its snapshot there, nor remove ``.publish-*`` folders there."""
    root = tmp_path / "shared"
    root.mkdir()
    elsewhere = tmp_path / "data-pvc" / "team-b"
    old = elsewhere / f"{cc.PUBLISHING}theirs"
    old.mkdir(parents=True)
    (old / "keep.parquet").write_bytes(b"theirs")
    os.utime(old, (0, 0))
    pod = _pod(root, tmp_path / "pod1")
    (root / pod.key).symlink_to(elsewhere, target_is_directory=True)
    assert pod.restore() == "cold"
    _compile(tmp_path / "pod1", "a")
    assert pod.publish("s/a") is False
    assert sorted(p.name for p in elsewhere.iterdir()) == [old.name]  # before: a snapshot written here too
    assert (old / "keep.parquet").read_bytes() == b"theirs"  # before: removed as a stale publish folder
    assert "not a folder of" in pod.notes[0]


def test_a_worker_whose_job_may_run_model_repo_code_never_publishes_whatever_its_environment_says(tmp_path):
    """The Kubernetes runner mounts the claim read-only for such a job and says VLLM_BATCH_COMPILE_CACHE_PUBLISH=0;
    the worker decides from its own (re-checked) spec too, so an environment that forgot it (a pod template, the
    local runner on a machine that sets VLLM_BATCH_COMPILE_CACHE) never seals what model-repo code could have
    put in the private folders for later pods to execute."""
    root = tmp_path / "shared"
    root.mkdir()
    remote = _spec().model_copy(update={"model": _spec().model.model_copy(update={"trust_remote_code": True})})
    orig = cc.accelerator
    cc.accelerator = lambda: "gpu:NVIDIA H200 (cc 9.0)"  # type: ignore[assignment]
    try:
        pod = cc.from_env(remote, Keyring.from_text(KEY), _env(root, tmp_path / "pod1"))
    finally:
        cc.accelerator = orig  # type: ignore[assignment]
    assert pod is not None and pod.may_publish is False
    assert pod.restore() == "cold"
    _compile(tmp_path / "pod1", "a")
    assert pod.publish("s/a") is False
    assert list(root.iterdir()) == []


def test_the_worker_image_the_runner_names_keys_the_cache(tmp_path):
    """VLLM_BATCH_IMAGE (set by the Kubernetes runner) is part of the key: pods of two images never share
    artefacts; it is this package's variable, not an engine one (the result cache's identity does not move)."""
    from airflow_provider_vllm.core.engine_identity import engine_env

    root = tmp_path / "shared"
    root.mkdir()
    keys = set()
    for image in (
        None,
        "registry.example/vllm-batch@sha256:" + "a" * 64,
        "registry.example/vllm-batch@sha256:" + "b" * 64,
    ):
        cache = _from_env(root, tmp_path / "pod", **({"VLLM_BATCH_IMAGE": image} if image else {}))
        assert cache is not None and cache.facts["image"] == image
        keys.add(cache.key)
    assert len(keys) == 3
    assert "VLLM_BATCH_IMAGE" not in engine_env({"VLLM_BATCH_IMAGE": "x"})


def test_an_image_not_pinned_by_digest_uses_no_shared_cache(tmp_path, caplog):
    """A tag can be moved to another build, whose pods would then read (and publish) artefacts under the same
    key: an image named by tag only gets no shared compile cache (a cold start), with a warning naming it."""
    root = tmp_path / "shared"
    root.mkdir()
    assert _from_env(root, tmp_path / "pod", VLLM_BATCH_IMAGE="registry.example/vllm-batch:0.1.0") is None
    assert "registry.example/vllm-batch:0.1.0 is not pinned by digest" in caplog.text
