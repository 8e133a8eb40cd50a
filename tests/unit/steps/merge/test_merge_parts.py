"""The merged layout: results/ and errors/ as folders of Parquet parts published by reference.

Fake engine, local files. Readers (DuckDB glob, pandas, pyarrow.dataset, ``result_parts``)
see the same rows; parts are the workers' files (hard links), named in plan order; the
manifests list them; empty result sets are one empty part; foreign files are refused and stale
parts removed; merge killed (-9) at each new step converges on a rerun to the same bytes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.commit import MARKER
from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.rows import ERROR_SCHEMA, RESULT_SCHEMA
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.merge.merger import (
    MERGED,
    read_manifest,
    read_merged,
    result_parts,
    verified_parts,
)
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import make_spec, merge, shard_task, write_parquet
from tests.support.reconcile import check, check_no_partial, reconcile

IDS = [f"r{i:03d}" for i in range(60)]
EMPTY = {7, 23, 24, 41}  # empty texts: EMPTY_INPUT error rows in 3 of the 6 chunks
MERGE = (
    "import sys\nfrom airflow_provider_vllm.steps.merge.merger import merge\nfrom airflow_provider_vllm.core.spec "
    "import JobSpec\nfrom airflow_provider_vllm.core.plan import current_plan_ref\n"
    "s = JobSpec.load(sys.argv[1])\nmerge(s, plan=current_plan_ref(s))\n"
)


def _run(tmp_path: Path, factory, texts=None, name="out"):
    texts = texts or ["" if i in EMPTY else f"ticket {i}" for i in range(len(IDS))]
    write_parquet(tmp_path / "in.parquet", IDS[: len(texts)], texts)
    # the empty texts repeat: without the dedupe every shard commits its own rows, which these tests follow
    spec = make_spec(
        tmp_path / "in.parquet", tmp_path / name, sharding={"target_rows": 20, "chunk_rows": 10, "dedupe": False}
    )
    plan = plan_job(spec)
    for s in plan.shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=factory)
    return spec, plan, tmp_path / name


def _folder(out: Path) -> dict[str, bytes]:
    """Every file under results/ and errors/ (temp files included) -> its bytes."""
    return {
        str(p.relative_to(out)): p.read_bytes()
        for kind in ("results", "errors")
        for p in sorted((out / kind).iterdir())
        if p.is_file()
    }


def test_duckdb_pandas_and_pyarrow_dataset_read_the_folders_as_one_table(tmp_path, fake_engine_factory):
    spec, plan, out = _run(tmp_path, fake_engine_factory)
    s = merge(spec).dump()
    assert (s["ok_rows"], s["error_rows"]) == (len(IDS) - len(EMPTY), len(EMPTY))
    o = Storage(str(out))
    via_parts = pq.ParquetDataset([str(out / r) for r in result_parts(o)]).read().sort_by("id")
    via_duck = duckdb.sql(f"SELECT * FROM read_parquet('{out}/results/*.parquet') ORDER BY id").to_arrow_table()
    via_pandas = pd.read_parquet(out / "results").sort_values("id").reset_index(drop=True)
    via_dataset = ds.dataset(out / "results", format="parquet").to_table().sort_by("id")
    assert via_parts.schema.remove_metadata() == RESULT_SCHEMA
    assert via_dataset.to_pylist() == via_parts.to_pylist() == via_duck.to_pylist()
    assert via_pandas["id"].tolist() == via_parts.column("id").to_pylist()
    assert via_parts.column("cached_from").null_count == via_parts.num_rows  # computed here, not cached
    errs = duckdb.sql(f"SELECT id, error_code FROM read_parquet('{out}/errors/*.parquet') ORDER BY id").fetchall()
    assert errs == [(IDS[i], "EMPTY_INPUT") for i in sorted(EMPTY)]
    assert pd.read_parquet(out / "errors").columns.tolist() == ERROR_SCHEMA.names
    check(out, IDS)


def test_parts_are_the_committed_files_named_in_plan_order_with_a_manifest(tmp_path, fake_engine_factory):
    spec, plan, out = _run(tmp_path, fake_engine_factory)
    merge(spec)
    o = Storage(str(out))
    man = read_manifest(o, "results")
    names = [p.name for p in man.parts]
    assert names == sorted(names) == sorted(p.name for p in (out / "results").glob("*.parquet"))
    committed = [
        f for s in plan.shards for f in json.loads((out / "shards" / s.shard_id / MARKER).read_text())["files"]
    ]
    assert len(names) == len(committed) == 6
    for part, f in zip(man.parts, committed):
        assert os.path.samefile(out / "results" / part.name, out / f["path"])  # by reference: a hard link
        assert (part.bytes, part.sha256, part.rows) == (f["bytes"], f["sha256"], f["ok_rows"])
        assert part.name.endswith(f"-{f['path'].split('/')[1]}-{f['path'][-13:-8]}.parquet")
    ids = [i for r in result_parts(o) for i in pq.read_table(out / r, columns=["id"])["id"].to_pylist()]
    assert ids == [i for n, i in enumerate(IDS) if n not in EMPTY]  # plan order (one length bucket)
    err = read_manifest(o, "errors")
    assert [p.rows for p in err.parts] == [1, 2, 1] and err.rows == len(EMPTY)  # chunks without errors left out
    merged = json.loads((out / MERGED).read_text())
    assert merged["files"]["results"] == "results/" and merged["parts"] == {"results": 6, "errors": 3}
    assert merged["checksums"] == {r: o.sha256(r) for r in ("results/_manifest.json", "errors/_manifest.json")}


def test_an_empty_folder_is_one_empty_part_every_reader_opens(tmp_path, fake_engine_factory):
    spec, plan, out = _run(tmp_path, fake_engine_factory, texts=[""] * 20)  # every row an error
    s = merge(spec).dump()
    assert (s["ok_rows"], s["error_rows"]) == (0, 20)
    o = Storage(str(out))
    (part,) = read_manifest(o, "results").parts
    assert part.rows == 0 and result_parts(o) == [f"results/{part.name}"]
    assert pd.read_parquet(out / "results").columns.tolist() == RESULT_SCHEMA.names
    assert duckdb.sql(f"SELECT count(*) FROM read_parquet('{out}/results/*.parquet')").fetchall() == [(0,)]
    assert ds.dataset(out / "results", format="parquet").to_table().num_rows == 0
    check(out, IDS[:20])


def test_foreign_files_are_refused_and_stale_parts_removed(tmp_path, fake_engine_factory):
    spec, plan, out = _run(tmp_path, fake_engine_factory)
    (out / "results").mkdir(parents=True)
    (out / "results" / "results.parquet").write_bytes(b"the layout before 0.2")
    with pytest.raises(CommitError, match=r"results\.parquet.*merge did not write"):
        merge(spec)
    assert (out / "results" / "results.parquet").exists() and not (out / MERGED).exists()  # nothing deleted
    (out / "results" / "results.parquet").unlink()
    ref = merge(spec).dump()
    before = _folder(out)
    (out / "results" / "part-99999-stale-00000.parquet").write_bytes(b"a part of an older merge")
    (out / "errors" / ".part-00001-x-00000.parquet.tmp-123").write_bytes(b"half a copy")
    assert merge(spec).dump()["checksums"] == ref["checksums"]
    assert _folder(out) == before  # stale part and temp file gone, the rest byte-identical
    check(out, IDS)


def test_a_results_folder_flooded_with_stale_parts_is_listed_no_further_than_its_bound(
    tmp_path, fake_engine_factory, monkeypatch
):
    """``results/`` holding more than twice the parts merge publishes there (plus ``FOLDER_SLACK``) fails the merge
    with a ``ListingTooLarge`` naming the folder and the bound, listed no further and nothing written; the code
    before listed (and removed one by one) every planted object."""
    from airflow_provider_vllm.core.errors import ListingTooLarge
    from airflow_provider_vllm.steps.merge import merger

    spec, plan, out = _run(tmp_path, fake_engine_factory)
    monkeypatch.setattr(merger, "FOLDER_SLACK", 0, raising=False)
    (out / "results").mkdir(parents=True)
    for i in range(100):
        (out / "results" / f"part-{90000 + i}-stale-00000.parquet").write_bytes(b"planted")
    with pytest.raises(ListingTooLarge, match=rf"{out / 'results'} holds more than \d+ entries") as e:
        merge(spec)
    assert e.value.limit < 100 and e.value.limit == merger.folder_bound(e.value.limit // 2)
    assert not (out / MERGED).exists() and len(list((out / "results").iterdir())) == 100
    for i in range(1, 100):
        (out / "results" / f"part-{90000 + i}-stale-00000.parquet").unlink()
    merge(spec)  # one stale part: listed and removed
    assert not (out / "results" / "part-90000-stale-00000.parquet").exists()
    check(out, IDS)


def test_a_changed_part_is_named_first_in_the_manifests_order(tmp_path, fake_engine_factory):
    """The parts are hashed side by side; what fails is still the first part in the manifest's order."""
    spec, plan, out = _run(tmp_path, fake_engine_factory)
    merge(spec)
    o = Storage(str(out))
    merged = read_merged(o)
    names = [p.name for p in read_manifest(o, "results").parts]
    assert verified_parts(o, "results", merged) == [f"results/{n}" for n in names] and len(names) == 6

    def replace(name: str, edit) -> None:  # a part is a hard link to the committed chunk: replace, not edit
        part = out / "results" / name
        data = edit(bytearray(part.read_bytes()))
        part.unlink()
        part.write_bytes(bytes(data))

    replace(names[4], lambda d: d[:-1])  # shorter
    replace(names[2], lambda d: d[:10] + bytes([d[10] ^ 0xFF]) + d[11:])  # same size, other bytes
    for _ in range(5):
        with pytest.raises(CommitError, match=rf"{names[2]} does not have the size and sha256"):
            verified_parts(o, "results", merged)


@pytest.mark.reliability
@pytest.mark.parametrize(
    "point",
    [
        "merge.before_write",
        "merge.mid_file#2",
        "merge.between_parts#1",
        "merge.between_parts#7",
        "merge.after_manifests",
        "merge.after_data",
        "merge.after_marker",
    ],
)
def test_merge_killed_at_each_step_reruns_to_the_same_bytes(tmp_path, fake_engine_factory, point):
    spec, plan, out = _run(tmp_path, fake_engine_factory)
    ref = merge(spec).dump()
    ref_files, ref_merged = _folder(out), json.loads((out / MERGED).read_text())
    for kind in ("results", "errors"):
        for p in (out / kind).iterdir():
            p.unlink()
    (out / MERGED).unlink()
    env = {**os.environ, "VLLM_BATCH_FAULTS": f"{point}=kill"}
    p = subprocess.run(
        [sys.executable, "-c", MERGE, spec.model_dump_json()], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert (out / MERGED).exists() == (point == "merge.after_marker")  # never "complete" before the end
    check_no_partial(out)
    visible = {k: v for k, v in _folder(out).items() if "/." not in k}
    assert all(ref_files[k] == v for k, v in visible.items())  # what is visible is whole and final
    again = merge(spec).dump()
    assert _folder(out) == ref_files and again["checksums"] == ref["checksums"]
    assert {k: v for k, v in json.loads((out / MERGED).read_text()).items() if k not in ("merge_s", "seal")} == {
        k: v for k, v in ref_merged.items() if k not in ("merge_s", "seal")
    }
    check(out, IDS, kind=f"kill9.{point.split('#')[0]}", level="process")


KILL_AT_MANIFEST_RENAME = (
    "import os, signal, sys\nreal = os.replace\n"
    "def replace(src, dst, *a, **k):\n"
    "    if str(dst).endswith('/results/_manifest.json') or (\n"
    "        str(dst) == '_manifest.json' and os.readlink(f'/proc/self/fd/{k[\"dst_dir_fd\"]}').endswith('/results')\n"
    "    ):\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n"
    "    return real(src, dst, *a, **k)\n"
    "os.replace = replace\n" + MERGE
)


@pytest.mark.reliability
def test_a_merge_killed_before_renaming_its_manifest_is_resumed_by_a_rerun(tmp_path, fake_engine_factory):
    """kill -9 inside ``write_atomic`` of results/_manifest.json leaves its temp copy
    (``_manifest.json.tmp-<32 hex>``): the rerun takes it for merge's own, removes it and converges."""
    spec, plan, out = _run(tmp_path, fake_engine_factory)
    ref = merge(spec).dump()
    ref_files = _folder(out)
    (out / MERGED).unlink()
    (out / "results" / "_manifest.json").unlink()
    p = subprocess.run(
        [sys.executable, "-c", KILL_AT_MANIFEST_RENAME, spec.model_dump_json()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    left = [n.name for n in (out / "results").iterdir() if ".tmp-" in n.name]
    assert len(left) == 1 and left[0].startswith("_manifest.json.tmp-") and not (out / MERGED).exists()
    assert merge(spec).dump()["checksums"] == ref["checksums"]
    assert _folder(out) == ref_files  # the temp copy removed, the rest byte-identical
    (out / "results" / "_manifest.json.tmp-not-merges").write_bytes(b"{}")  # not write_atomic's name: foreign
    with pytest.raises(CommitError, match=r"_manifest\.json\.tmp-not-merges.*merge did not write"):
        merge(spec)
    check(out, IDS)


def test_the_seal_covers_the_manifest_bytes_merge_wrote_not_one_swapped_in_before_it_sealed(
    tmp_path, fake_engine_factory, monkeypatch
):
    """Merge seals the sha256 of the manifest bytes it wrote: a manifest another writer of the prefix swaps in
    after the write (naming a forged part) is refused by every reader of the sealed run."""
    import hashlib

    import pyarrow as pa

    from airflow_provider_vllm.core import faults

    spec, plan, out = _run(tmp_path, fake_engine_factory)
    real_hit = faults.hit

    def swap(point, *a, **k):
        if point == "merge.after_manifests":
            m = json.loads((out / "results" / "_manifest.json").read_text())
            victim = m["parts"][0]
            t = pq.read_table(out / "results" / victim["name"])
            i = t.column_names.index("label")
            forged = t.set_column(i, "label", pa.array(["FORGED"] * t.num_rows, t.schema.field(i).type))
            name = victim["name"].replace(".parquet", "-x.parquet")
            pq.write_table(forged, out / "results" / name)
            data = (out / "results" / name).read_bytes()
            victim.update(name=name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
            (out / "results" / "_manifest.json").write_text(json.dumps(m, indent=1, sort_keys=True))
        return real_hit(point, *a, **k)

    monkeypatch.setattr(faults, "hit", swap)
    merge(spec)
    o = Storage(str(out))
    with pytest.raises(CommitError, match=r"results/_manifest\.json is not the manifest the sealed _MERGED\.json"):
        verified_parts(o, "results", read_merged(o))
    monkeypatch.setattr(faults, "hit", real_hit)
    merge(spec)  # a rerun writes (and seals) its own manifest again
    parts = verified_parts(o, "results", read_merged(o))
    assert "FORGED" not in {x for r in parts for x in pq.read_table(out / r, columns=["label"])["label"].to_pylist()}
    check(out, IDS)


@pytest.mark.reliability
def test_a_worker_killed_between_a_chunks_two_files_redoes_that_chunk(tmp_path, fake_engine_factory, set_faults):
    from airflow_provider_vllm.core import faults

    texts = ["" if i in EMPTY else f"ticket {i}" for i in range(len(IDS))]
    write_parquet(tmp_path / "in.parquet", IDS, texts)
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"target_rows": 60, "chunk_rows": 10})
    (shard,) = plan_job(spec).shards
    set_faults("chunk.between_parts#3=raise")
    with pytest.raises(faults.InjectedFault):
        run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=fake_engine_factory)
    set_faults("")
    attempts = tmp_path / "out" / "shards" / shard.shard_id / "attempts"
    (first,) = attempts.iterdir()
    assert (first / "chunk-00002.errors.parquet").exists() and not (first / "chunk-00002.parquet").exists()
    m = run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=fake_engine_factory)
    assert m["status"] == "committed" and m["stats"]["reused_chunks"] == 2  # chunk 2 is redone, not reused
    merge(spec)
    check(tmp_path / "out", IDS, kind="chunk_between_parts")


@pytest.mark.reliability
def test_a_dropped_duplicate_re_encodes_only_the_part_that_held_it(tmp_path, fake_engine_factory):
    """A forged chunk named first repeats 5 rows of chunk 0: those copies in chunk 0's part are the
    later ones, so that one part is rewritten without them; every other part stays a link."""
    from airflow_provider_vllm.core.commit import ChunkMeta, ShardStore
    from tests.unit.steps.merge.test_merger import chunk_rows, edit_marker, run_seal

    spec, plan, out = _run(tmp_path, fake_engine_factory, texts=[f"ticket {i}" for i in range(len(IDS))])
    shard_id = plan.shards[0].shard_id
    first = json.loads((out / "shards" / shard_id / MARKER).read_text())["files"][0]
    t = chunk_rows(out, first["path"]).slice(0, 5)
    meta = ChunkMeta(shard_id=shard_id, chunk=0, first_row=0, rows=5, config_hash="forged")
    entry = ShardStore(Storage(str(out)), shard_id, run_seal(out)).write_chunk("a-forged-copy", meta, t)
    edit_marker(out, shard_id, lambda m: m["files"].insert(0, entry.dump()))
    s = merge(spec).dump()
    assert s["duplicates"]["ids"] == 5 and s["ok_rows"] == len(IDS)
    o = Storage(str(out))
    parts = read_manifest(o, "results").parts
    assert [p.rows for p in parts] == [5, 5] + [10] * 5
    rewritten = out / "results" / parts[1].name
    assert (
        not os.path.samefile(rewritten, out / first["path"]) and o.sha256(f"results/{parts[1].name}") == parts[1].sha256
    )
    assert os.path.samefile(out / "results" / parts[0].name, out / entry.path)  # the kept copies: a link
    assert sorted(pd.read_parquet(out / "results")["id"]) == IDS
    before = _folder(out)
    merge(spec)
    assert _folder(out) == before  # the rewrite is deterministic: a rerun converges
    rec = reconcile(out, IDS)  # committed twice is reported as such; nothing lost, nothing foreign
    assert rec.duplicates == IDS[:5] and not rec.lost and not rec.unknown and not rec.partial_visible


@pytest.mark.parametrize("garbage", [False, True])
def test_qa_writes_nothing_when_a_part_fails_its_check(tmp_path, fake_engine_factory, monkeypatch, garbage):
    """A changed part fails QA, on either path, with the sha256 check's CommitError and no qa/ file, also when
    the part is no Parquet any more (the check comes before DuckDB reads it)."""
    from airflow_provider_vllm.steps.qa import stage

    spec, plan, out = _run(tmp_path, fake_engine_factory)
    merge(spec)
    name = read_manifest(Storage(str(out)), "results").parts[1].name
    part = out / "results" / name
    data = part.read_bytes()
    part.unlink()
    part.write_bytes(b"not parquet at all" * 64 if garbage else data[:-9] + bytes([data[-9] ^ 0xFF]) + data[-8:])
    for streamed in (False, True):
        monkeypatch.setattr(stage, "STREAM_ABOVE_ROWS", 0 if streamed else 10**9)
        with pytest.raises(CommitError, match=rf"{name} is not the file its sealed record names"):
            stage.qa_run(spec)
        assert not (out / "qa").exists()
