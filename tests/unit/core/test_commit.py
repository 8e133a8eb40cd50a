"""A hypothesis state machine over the commit protocol (real ShardStore, real merge, tmp dir).

Rules: start an attempt of a shard, write one of its chunks, crash an attempt (its in-flight
temp file stays behind, the attempt never acts again), commit (as the worker does: reuse
complete chunks of earlier attempts, write the missing ones, create the marker), a duplicate
commit by another attempt of a committed shard, a retry that runs to its commit, and merge.

Invariants after every step: a marker, once created, never changes; every file a marker
names exists with the size and sha256 it records; every file that looks like a chunk opens
as a complete Parquet file with the footer of its chunk (no partial file is visible: temp
files never match the chunk name readers look for). At merge: every input id exactly once
in results + errors when all shards are committed, and a refusal (with nothing published)
when one is not.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from airflow_provider_vllm.core.commit import (
    _CHUNK_RE,
    ERRORS_SUFFIX,
    MARKER,
    PART_KEY,
    SEAL_SUFFIX,
    ChunkMeta,
    CommitMarker,
    RunSeal,
    ShardStore,
    errors_rel,
)
from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.plan import PLAN_FILE
from airflow_provider_vllm.core.rows import rows_table, split_rows
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.merge.merger import ERRORS, RESULTS
from airflow_provider_vllm.steps.plan.planner import plan_job
from tests.support.data import make_spec, merge, write_parquet
from tests.support.ledger import record_fault

pytestmark = pytest.mark.reliability
N_ROWS, CHUNK_ROWS = 7, 2
IDS = [f"r{i}" for i in range(N_ROWS)]
_BASE: dict = {}
_TOTALS = {"examples": 0, "steps": 0, "crashes": 0, "duplicate_commits": 0, "merges": 0, "lost": 0, "dups": 0}


def _base(tmp_root: Path) -> dict:
    """One input and one plan for all examples; each example copies the plan into a fresh prefix (sealed
    again for it: a seal names its run's folder)."""
    if not _BASE:
        write_parquet(tmp_root / "in" / "p.parquet", IDS, [f"text {i}" for i in IDS], row_group_size=3)
        spec = make_spec(tmp_root / "in", tmp_root / "plan", sharding={"target_rows": 4, "chunk_rows": CHUNK_ROWS})
        plan = plan_job(spec)
        # the rows of each shard, in plan order (the planner cuts by row ranges here)
        rows, pos = {}, 0
        for s in plan.shards:
            rows[s.shard_id] = IDS[pos : pos + s.rows]
            pos += s.rows
        _BASE.update(root=tmp_root, spec=spec, plan=plan, rows=rows)
    return _BASE


class CommitProtocol(RuleBasedStateMachine):
    attempts = Bundle("attempts")

    def __init__(self):
        super().__init__()
        base = _BASE
        self.out_dir = base["root"] / f"out-{uuid.uuid4().hex[:8]}"
        self.out_dir.mkdir()
        keyring = Keyring.from_env()
        self.spec = base["spec"].model_copy(
            update={"io": base["spec"].io.model_copy(update={"output_uri": str(self.out_dir)})}
        )
        plan = base["plan"].model_copy(update={"seal": None, "spec_hash": self.spec.content_hash()})
        plan = plan.sealed(keyring, str(self.out_dir))
        (self.out_dir / PLAN_FILE).write_bytes(plan.dump_json())
        self.run = RunSeal(keyring, plan.seal.mac)
        self.plan = plan
        self.rows = base["rows"]
        self.out = Storage(str(self.out_dir))
        self.written: dict[str, dict] = {}  # attempt -> chunk -> the entry write_chunk returned
        self.shard_of: dict[str, str] = {}
        self.dead: set[str] = set()
        self.markers: dict[str, bytes] = {}  # shard -> marker bytes when first committed
        self.merged = False
        # files no_partial_chunk_is_visible has read whole, by what stat says of them: a file that changes, or another
        # file under the same name (every write ends with a rename), stats differently and is read again
        self.read_whole: set[tuple] = set()
        _TOTALS["examples"] += 1

    def teardown(self):
        shutil.rmtree(self.out_dir, ignore_errors=True)

    # ---- helpers ----------------------------------------------------------------------
    def metas(self, shard_id: str) -> dict[int, ChunkMeta]:
        n = len(self.rows[shard_id])
        return {
            k: ChunkMeta(
                shard_id=shard_id,
                chunk=k,
                first_row=k * CHUNK_ROWS,
                rows=min(CHUNK_ROWS, n - k * CHUNK_ROWS),
                config_hash=self.plan.config_hash,
            )
            for k in range(-(-n // CHUNK_ROWS))
        }

    def table(self, shard_id: str, attempt: str, meta: ChunkMeta):
        ids = self.rows[shard_id][meta.first_row : meta.first_row + meta.rows]
        return rows_table(
            [
                {
                    "id": i,
                    "status": "error" if i == "r3" else "ok",
                    "output": f"{i}@{attempt}",
                    "error_code": "EMPTY_INPUT" if i == "r3" else None,
                    "shard_id": shard_id,
                    "attempt_id": attempt,
                }
                for i in ids
            ]
        )

    # ---- rules ------------------------------------------------------------------------
    @rule(target=attempts, shard=st.integers(0, 10))
    def start_attempt(self, shard):
        shard_id = self.plan.shards[shard % len(self.plan.shards)].shard_id
        attempt = f"a{len(self.shard_of):03d}-{uuid.uuid4().hex[:6]}"
        self.shard_of[attempt] = shard_id
        self.written[attempt] = {}
        return attempt

    @rule(attempt=attempts, k=st.integers(0, 10))
    def write_chunk(self, attempt, k):
        if attempt in self.dead:
            return
        shard_id = self.shard_of[attempt]
        metas = self.metas(shard_id)
        meta = metas[k % len(metas)]
        entry = ShardStore(self.out, shard_id, self.run).write_chunk(attempt, meta, self.table(shard_id, attempt, meta))
        self.written[attempt][meta.chunk] = entry

    @rule(attempt=consumes(attempts), k=st.integers(0, 10), cut=st.floats(0.0, 0.99))
    def crash(self, attempt, k, cut):
        """The attempt dies while writing a chunk: a partial temp file stays, nothing else happens."""
        if attempt in self.dead:
            return
        shard_id = self.shard_of[attempt]
        store = ShardStore(self.out, shard_id, self.run)
        metas = self.metas(shard_id)
        meta = metas[k % len(metas)]
        sink = Path(self.out.path(store.chunk_rel(attempt, meta.chunk)))
        sink.parent.mkdir(parents=True, exist_ok=True)
        import io

        if cut >= 0.5:  # killed between the chunk's two files: its errors part is complete, its ok part is not
            _, err = split_rows(self.table(shard_id, attempt, meta))
            self.out.write_parquet_atomic(
                errors_rel(store.chunk_rel(attempt, meta.chunk)), err, metadata={**meta.to_kv(), PART_KEY: "errors"}
            )
        buf = io.BytesIO()
        pq.write_table(self.table(shard_id, attempt, meta), buf)
        data = buf.getvalue()
        Path(f"{sink}.tmp-{uuid.uuid4().hex}").write_bytes(data[: int(len(data) * cut)])
        self.dead.add(attempt)
        _TOTALS["crashes"] += 1

    @rule(attempt=attempts)
    def commit(self, attempt):
        if attempt in self.dead:
            return
        shard_id = self.shard_of[attempt]
        store = ShardStore(self.out, shard_id, self.run)
        metas = self.metas(shard_id)
        own = dict(self.written[attempt])
        reused = store.reusable_chunks({k: m for k, m in metas.items() if k not in own})
        for k in sorted(set(metas) - set(own) - set(reused)):  # as the worker: write what is missing first
            own[k] = store.write_chunk(attempt, metas[k], self.table(shard_id, attempt, metas[k]))
        files = {**reused, **own}
        entries = [files[k] for k in sorted(files)]
        marker = CommitMarker(
            shard_id=shard_id,
            attempt_id=attempt,
            config_hash=self.plan.config_hash,
            spec_hash=self.plan.spec_hash,
            plan_fingerprint=self.plan.fingerprint,
            files=entries,
            rows=sum(e.rows for e in entries),
            ok_rows=sum(e.ok_rows for e in entries),
            error_rows=sum(e.error_rows for e in entries),
            stats={},
            committed_at="2026-11-30T00:00:00Z",
        )
        first = shard_id not in self.markers
        won = store.commit(marker)
        assert won == first, "create-only: exactly the first commit of a shard wins"
        if won:
            self.markers[shard_id] = (self.out_dir / store.dir / MARKER).read_bytes()
        else:
            _TOTALS["duplicate_commits"] += 1

    @rule(shard=st.integers(0, 10))
    def retry_to_completion(self, shard):
        """A fresh attempt (an Airflow retry) that runs its shard to the commit, as most retries do."""
        attempt = self.start_attempt(shard)
        self.commit(attempt)

    @precondition(lambda self: not self.merged)
    @rule()
    def merge(self):
        before = (
            sorted(p.name for p in (self.out_dir / "results").glob("*")) if (self.out_dir / "results").exists() else []
        )
        if len(self.markers) < len(self.plan.shards):
            with pytest.raises(CommitError, match="not committed"):
                merge(self.spec, memory_limit="256MB")
            after = (
                sorted(p.name for p in (self.out_dir / "results").glob("*"))
                if (self.out_dir / "results").exists()
                else []
            )
            assert after == before == []  # nothing published
            return
        # duplicates are counted where they were committed, before merge could drop any
        committed = [
            i
            for raw in self.markers.values()
            for f in json.loads(raw)["files"]
            for i in pq.read_table(self.out_dir / f["path"], columns=["id"]).column("id").to_pylist()
        ]
        summary = merge(self.spec, memory_limit="256MB").dump()
        self.merged = True
        _TOTALS["merges"] += 1
        res = pq.read_table(self.out_dir / RESULTS, columns=["id"]).column("id").to_pylist()
        err = pq.read_table(self.out_dir / ERRORS, columns=["id"]).column("id").to_pylist()
        lost = len(set(IDS) - set(res + err))
        dups = max(
            len(committed) - len(set(committed)),
            len(res + err) - len(set(res + err)),
            summary["duplicates"]["rows_dropped"],
        )
        _TOTALS["lost"] += lost
        _TOTALS["dups"] += dups
        assert lost == 0 and dups == 0 and sorted(res + err) == sorted(IDS)
        assert err == ["r3"]
        # each row comes from the chunk files its shard's marker names, and from no other attempt
        for shard_id, raw in self.markers.items():
            named = {f["path"] for f in json.loads(raw)["files"]}
            got = pq.read_table(self.out_dir / RESULTS, columns=["id", "attempt_id"]).to_pylist()
            owners = {r["attempt_id"] for r in got if r["id"] in self.rows[shard_id]}
            assert owners <= {p.split("/")[3] for p in named}

    # ---- invariants -------------------------------------------------------------------
    @invariant()
    def count_steps(self):
        _TOTALS["steps"] += 1  # invariants run once after init and once after every step

    @invariant()
    def markers_never_change_and_name_good_files(self):
        for shard_id, raw in self.markers.items():
            path = self.out_dir / "shards" / shard_id / MARKER
            assert path.read_bytes() == raw
            m = json.loads(raw)
            assert m["rows"] == len(self.rows[shard_id])
            for f in m["files"]:
                for part in (f, f["errors"]):
                    seen = (_stat_key(str(self.out_dir / part["path"])), part["bytes"], part["sha256"])
                    if seen in self.read_whole:  # these bytes were hashed against this marker already
                        continue
                    assert self.out.size(part["path"]) == part["bytes"]
                    assert self.out.sha256(part["path"]) == part["sha256"]
                    self.read_whole.add(seen)
                assert f["ok_rows"] + f["errors"]["rows"] == f["rows"]

    @invariant()
    def no_partial_chunk_is_visible(self):
        shards = self.out_dir / "shards"
        if not shards.exists():
            return
        for dirpath, _, names in os.walk(shards):
            for name in names:
                if _CHUNK_RE.match(name):  # a chunk's ok part: complete, and so is its errors part
                    ok_path, err_path = os.path.join(dirpath, name), os.path.join(dirpath, errors_rel(name))
                    seen = (_stat_key(ok_path), _stat_key(err_path))
                    if seen in self.read_whole:
                        continue
                    md = pq.ParquetFile(ok_path).metadata  # opens: complete
                    emd = pq.ParquetFile(err_path).metadata
                    meta = json.loads(md.metadata[b"vllm_batch.chunk"])
                    assert md.num_rows + emd.num_rows == meta["rows"] and name == f"chunk-{meta['chunk']:05d}.parquet"
                    assert md.metadata[PART_KEY.encode()] == b"results" and emd.metadata[PART_KEY.encode()] == b"errors"
                    self.read_whole.add(seen)
                elif name.endswith(ERRORS_SUFFIX):
                    seen = (_stat_key(os.path.join(dirpath, name)),)
                    if seen not in self.read_whole:
                        pq.ParquetFile(os.path.join(dirpath, name))  # opens: an errors part is written whole too
                        self.read_whole.add(seen)
                elif name != MARKER and not name.endswith(SEAL_SUFFIX):
                    assert ".tmp-" in name, name  # only a crashed writer's temp file


def _stat_key(path: str) -> tuple:
    st = os.stat(path)
    return (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def test_commit_protocol_state_machine(tmp_path_factory):
    _base(tmp_path_factory.mktemp("commit_sm"))
    CommitProtocol.TestCase.settings = settings(
        max_examples=500,
        stateful_step_count=12,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    CommitProtocol.TestCase().runTest()
    # partial_visible is 0: no_partial_chunk_is_visible held after every step of every example
    steps = _TOTALS["steps"] - _TOTALS["examples"]
    record_fault(
        "commit_protocol_crash",
        rows=N_ROWS * _TOTALS["merges"],
        faults=_TOTALS["crashes"],
        lost=_TOTALS["lost"],
        duplicates=_TOTALS["dups"],
        partial_visible=0,
        level="hypothesis",
        examples=_TOTALS["examples"],
        steps=steps,
    )
    record_fault(
        "commit_protocol_duplicate_commit",
        rows=0,
        faults=_TOTALS["duplicate_commits"],
        level="hypothesis",
        examples=_TOTALS["examples"],
        steps=steps,
    )
    assert _TOTALS["examples"] >= 500 and _TOTALS["merges"] > 0 and _TOTALS["crashes"] > 0


def _planned_shard_store(tmp_path):
    """A planned run of two rows in ``tmp_path/out``: its plan, its one shard and that shard's store."""
    write_parquet(tmp_path / "in.parquet", ["a", "b"], ["x", "y"])
    plan = plan_job(make_spec(tmp_path / "in.parquet", tmp_path / "out"))
    (shard,) = plan.shards
    assert plan.seal is not None
    return (
        plan,
        shard,
        ShardStore(Storage(str(tmp_path / "out")), shard.shard_id, RunSeal(Keyring.from_env(), plan.seal.mac)),
    )


def test_a_chunk_numbered_past_99999_is_reused_and_merged_under_its_name(tmp_path):
    """A shard of more than 100,000 chunks (a small ``sharding.chunk_rows``) names chunk 100000 with six digits, as
    ``{k:05d}`` writes it: a retry's reuse scan finds it, and merge takes it from a marker. Another spelling of a
    number (``chunk-000001``) is neither: one chunk has one name."""
    from airflow_provider_vllm.steps.merge.merger import check_marker_path

    plan, shard, store = _planned_shard_store(tmp_path)
    k = 100_000
    meta = ChunkMeta(shard_id=shard.shard_id, chunk=k, first_row=k, rows=2, config_hash=plan.config_hash)
    rows = [{"id": i, "status": "ok", "output": "o", "shard_id": shard.shard_id, "attempt_id": "a1"} for i in "ab"]
    entry = store.write_chunk("a1", meta, rows_table(rows))
    assert entry.path.endswith("/chunk-100000.parquet")
    assert store.reusable_chunks({k: meta}) == {k: entry}
    where = "the marker"
    assert check_marker_path(entry.path, shard.shard_id, where, RESULTS) == k
    assert entry.errors is not None and check_marker_path(entry.errors.path, shard.shard_id, where, ERRORS) == k
    # chunk 1 written, then its seal put under a second spelling of its number: not a second chunk 1
    one = ChunkMeta(shard_id=shard.shard_id, chunk=1, first_row=1, rows=2, config_hash=plan.config_hash)
    first = store.write_chunk("a2", one, rows_table(rows))
    folder = tmp_path / "out" / "shards" / shard.shard_id / "attempts" / "a2"
    (folder / "chunk-00001.seal.json").rename(folder / "chunk-000001.seal.json")
    assert store.reusable_chunks({1: one}) == {}
    with pytest.raises(CommitError, match="not a chunk file"):
        check_marker_path(first.path.replace("chunk-00001", "chunk-000001"), shard.shard_id, where, RESULTS)


def test_a_shards_attempt_folders_are_listed_for_reuse_no_further_than_their_bound(tmp_path, monkeypatch, caplog):
    """The reuse scan is advisory: a shard's ``attempts/`` holding more than ``ATTEMPTS_LISTED`` folders, or attempt
    folders holding more entries than its chunks explain (``REUSE_LISTED_PER_CHUNK`` per chunk and
    ``REUSE_LISTED_SLACK``), is listed no further, named in a warning, and the chunks not found are redone; an
    attempt folder that is a link is skipped. The code before listed every planted folder and file."""
    from airflow_provider_vllm.core import commit

    plan, shard, store = _planned_shard_store(tmp_path)
    meta = ChunkMeta(shard_id=shard.shard_id, chunk=0, first_row=0, rows=2, config_hash=plan.config_hash)
    rows = [{"id": i, "status": "ok", "output": "o", "shard_id": shard.shard_id, "attempt_id": "a1"} for i in "ab"]
    entry = store.write_chunk("a1", meta, rows_table(rows))
    attempts = tmp_path / "out" / "shards" / shard.shard_id / "attempts"
    (attempts / "zz-link").symlink_to(tmp_path)  # a link: not scanned (its listing would be refused)
    assert store.reusable_chunks({0: meta}) == {0: entry}

    monkeypatch.setattr(commit, "ATTEMPTS_LISTED", 3, raising=False)
    for i in range(2):
        (attempts / f"planted-{i}").mkdir()
    with caplog.at_level("WARNING"):
        assert store.reusable_chunks({0: meta}) == {}
    assert f"{attempts} holds more than 3 entries" in caplog.text
    (attempts / "planted-0").rmdir()
    (attempts / "planted-1").rmdir()

    monkeypatch.setattr(commit, "REUSE_LISTED_SLACK", 0, raising=False)
    monkeypatch.setattr(commit, "REUSE_LISTED_PER_CHUNK", 3, raising=False)  # a1 holds 3 files: its chunk's
    assert store.reusable_chunks({0: meta}) == {0: entry}
    (attempts / "a1" / "planted").write_text("")
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert store.reusable_chunks({0: meta}) == {}
    assert "hold more than the 3 entries listed" in caplog.text and f"{attempts / 'a1'}" in caplog.text


def test_a_worker_writes_no_chunk_seal_or_marker_through_a_link_planted_in_its_shard_folder(tmp_path):
    """A writer of the output plants ``shards/<id>/attempts -> another tenant's folder``, a link where a chunk is
    written, or ``_COMMITTED.json -> a file elsewhere``: the worker's chunk commit and its marker refuse each
    (``LinkRefused``, naming it) and write nothing where they point; before, the chunks and seals landed in the
    other folder, and the marker's create-only write took the link for a marker another attempt had written."""
    from airflow_provider_vllm.core.errors import LinkRefused

    write_parquet(tmp_path / "in.parquet", ["a", "b"], ["x", "y"])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out")
    plan = plan_job(spec)
    (shard,) = plan.shards
    assert plan.seal is not None
    out = Storage(str(tmp_path / "out"))
    store = ShardStore(out, shard.shard_id, RunSeal(Keyring.from_env(), plan.seal.mac))
    meta = ChunkMeta(shard_id=shard.shard_id, chunk=0, first_row=0, rows=2, config_hash=plan.config_hash)
    rows = [{"id": i, "status": "ok", "output": "o", "shard_id": shard.shard_id, "attempt_id": "a1"} for i in "ab"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "victim.json").write_bytes(b"another tenant's")
    folder = tmp_path / "out" / store.dir
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "attempts").symlink_to(other)
    with pytest.raises(LinkRefused, match="attempts is a symbolic link"):
        store.write_chunk("a1", meta, rows_table(rows))
    (folder / "attempts").unlink()
    chunk = tmp_path / "out" / store.chunk_rel("a1", 0)
    chunk.parent.mkdir(parents=True)
    chunk.symlink_to(other / "victim.json")
    with pytest.raises(LinkRefused, match="chunk-00000.parquet is a symbolic link"):
        store.write_chunk("a1", meta, rows_table(rows))
    chunk.unlink()
    entry = store.write_chunk("a1", meta, rows_table(rows))
    (folder / MARKER).symlink_to(other / "victim.json")
    marker = CommitMarker(
        shard_id=shard.shard_id,
        attempt_id="a1",
        config_hash=plan.config_hash,
        spec_hash=plan.spec_hash,
        plan_fingerprint=plan.fingerprint,
        files=[entry],
        rows=entry.rows,
        ok_rows=entry.ok_rows,
        error_rows=entry.error_rows,
        stats={},
        committed_at="2026-11-30T00:00:00Z",
    )
    with pytest.raises(LinkRefused, match="_COMMITTED.json is a symbolic link"):
        store.commit(marker)
    assert sorted(os.listdir(other)) == ["victim.json"] and (other / "victim.json").read_bytes() == b"another tenant's"
    (folder / MARKER).unlink()
    assert store.commit(marker) and store.marker() is not None
