"""Names read back from bucket files never leave their run: attacks on local files (tests/s3: on moto).

Another team's run ``other`` holds an answer for id SECRET. A writer of the previous run ``prev``
edits its ``results/_manifest.json`` / ``errors/_manifest.json`` (or plants symlinks) so that the
changes step of this run reads ``other``'s file and copies SECRET into ``changes/changes.parquet``.
Each attempt must end with the previous run refused, the error naming the manifest and the name,
and nothing written under this run's ``changes/``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from airflow_provider_vllm.core.errors import CommitError, SpecError
from airflow_provider_vllm.core.part_names import cache_part_path, check_inside, part_name, run_file
from airflow_provider_vllm.core.records import CacheFileEntry, MergeSummary, PartEntry
from airflow_provider_vllm.core.rows import ERROR_SCHEMA, RESULT_SCHEMA
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.merge.changes import CHANGES, compute_changes
from airflow_provider_vllm.steps.merge.merger import ERRORS, MERGED, RESULTS, read_manifest, result_parts
from tests.support.data import (
    make_spec,
    merge_summary,
    shard_task,
    write_merged_folder,
    write_merged_summary,
)
from tests.support.ledger import record_malicious

pytestmark = pytest.mark.unit

GOOD_NAMES = [
    "part-00000.parquet",
    "part-00000-shard-00003-1a2b3c4d-00012.parquet",
    "part-00007-cache-hits.parquet",
    "part-123456789.parquet",
]
# Hostile part names; OTHER stands for the absolute path of the other team's part.
HOSTILE_NAMES = [
    "../other/results/part-00000.parquet",
    "../../other/results/part-00000.parquet",
    "../../../../../../etc/passwd",
    "OTHER",
    "/etc/passwd",
    "results/part-00000.parquet",
    "sub/part-00000.parquet",
    "part-*.parquet",
    "part-0000[0-9].parquet",
    "part-0000?.parquet",
    "part-{00000,00001}.parquet",
    "**/part-00000.parquet",
    "../../*/results/part-*.parquet",
    "part-00000.parquet/",
    "part-00000.parquet\n",
    "part-00000.parquet\x00.txt",
    "part-٠٠٠٠٠.parquet",  # Arabic-Indic digits: \\d would take them
    "part-00000-x.parquet::s3://other/part.parquet",
    "s3://other-team/run/results/part-00000.parquet",
    "file:///etc/passwd",
    "~/part-00000.parquet",
    "part-00000-%2e%2e.parquet",
    "part-00000-x\\..\\..\\other.parquet",
    "..",
    ".",
    "",
    "part-00000.PARQUET",
    "part-.parquet",
]


def _hostile(name: str, root: Path) -> str:
    return str(root / "other" / RESULTS / "part-00000.parquet") if name == "OTHER" else name


# ---- the checks themselves --------------------------------------------------------------------
@pytest.mark.parametrize("name", GOOD_NAMES)
def test_part_names_merge_writes_pass(name):
    assert part_name(name) == name and PartEntry(name=name, bytes=1, sha256="0" * 64, rows=1).name == name


def test_hostile_part_names_are_refused_by_the_record(tmp_path):
    tried = rejected = 0
    for raw in HOSTILE_NAMES:
        name = _hostile(raw, tmp_path)
        tried += 1
        with pytest.raises(ValidationError) as e:
            PartEntry(name=name, bytes=1, sha256="0" * 64, rows=1)
        assert repr(name) in str(e.value), name
        rejected += 1
    record_malicious("manifest_part_names", tried, rejected)


@pytest.mark.parametrize(
    "path",
    [
        f"entries/{'0' * 32}/../../commits/x.parquet",
        f"entries/{'0' * 32}/part-*.parquet",
        f"entries/{'0' * 32}/sub/part-00000.parquet",
        f"/entries/{'0' * 32}/part-00000.parquet",
        f"entries/{'A' * 32}/part-00000.parquet",
        f"entries/{'0' * 31}/part-00000.parquet",
        f"entries/{'0' * 32}/part-0000.parquet",
        f"entries/{'0' * 32}/part-00000.parquet\n",
        "../other-cache/entries/x/part-00000.parquet",
        f"s3://other/entries/{'0' * 32}/part-00000.parquet",
    ],
)
def test_cache_entry_paths_are_one_part_under_one_entry(path):
    with pytest.raises(ValidationError, match="not a cache entry part"):
        CacheFileEntry(path=path, bytes=1, sha256="0" * 64, rows=1)
    ok = f"entries/{'0' * 32}/part-00000.parquet"
    assert cache_part_path(ok) == ok and CacheFileEntry(path=ok, bytes=1, sha256="0" * 64, rows=1).path == ok


@pytest.mark.parametrize(
    "path", ["../other/results/", "/etc/passwd", "results/*.parquet", "results/../../x", ".hidden", "a//b", ""]
)
def test_summary_file_paths_stay_in_the_run(path):
    with pytest.raises(ValueError):
        run_file(path)
    with pytest.raises(ValidationError):
        merge_summary(1, 1, 0, files={RESULTS: path})
    with pytest.raises(ValidationError):
        MergeSummary.model_validate({**merge_summary(1, 1, 0).dump(), "checksums": {path: "0"}})
    for ok in ("results/", "results/_manifest.json", "openai/output.jsonl", "changes/changes.parquet"):
        assert run_file(ok) == ok


# ---- end to end: the changes step reading a previous run -------------------------------------
def write_run(out: Path, labels: dict[str, str]) -> Path:
    rows = [{"id": i, "label": v, "model": "fake", "config_hash": "c"} for i, v in labels.items()]
    write_merged_folder(out, RESULTS, pa.Table.from_pylist(rows, schema=RESULT_SCHEMA))
    write_merged_folder(out, ERRORS, pa.Table.from_pylist([], schema=ERROR_SCHEMA))
    summary = merge_summary(len(labels), len(labels), 0).model_copy(update={"task": "chat", "id_column": "id"})
    write_merged_summary(out, summary)
    return out


@pytest.fixture
def runs(tmp_path):
    """(root, spec of run 'now' comparing with 'prev'); 'other' is another team's run with SECRET."""
    write_run(tmp_path / "other", {"SECRET": "leaked"})
    write_run(tmp_path / "prev", {"a": "bug", "b": "billing"})
    write_run(tmp_path / "now", {"a": "bug", "b": "other"})
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "now", changes={"previous_uri": str(tmp_path / "prev")})
    return tmp_path, spec


def _reseal(run: Path) -> None:
    """Seal the run's summary again over its manifests as they are now: what only a holder of the signing key
    (a merge with a bug) could do; a writer without it is already refused by the seal (test_merger.py)."""
    summary = MergeSummary.model_validate_json((run / MERGED).read_bytes())
    write_merged_summary(run, summary.model_copy(update={"seal": None}))


def _add_part(run: Path, kind: str, name: str, like: Path) -> None:
    man = json.loads((run / kind / "_manifest.json").read_text())
    entry = dict(man["parts"][0], name=name, bytes=like.stat().st_size, rows=pq.ParquetFile(like).metadata.num_rows)
    man["parts"].append(entry)
    man["rows"] += entry["rows"]
    (run / kind / "_manifest.json").write_text(json.dumps(man))
    _reseal(run)


def _refused(spec, root: Path, *needles: str) -> str:
    with pytest.raises(CommitError) as e:
        compute_changes(spec)
    msg = str(e.value)
    assert "changes.previous_uri" in msg and "refusing the previous run" in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    assert not (root / "now" / "changes").exists(), "something was written under changes/"
    return msg


@pytest.mark.parametrize("kind", [RESULTS, ERRORS])
def test_changes_refuses_a_previous_run_whose_manifest_names_a_path(runs, kind):
    root, spec = runs
    other_part = root / "other" / RESULTS / "part-00000.parquet"
    # glob names would also match a foreign file planted in prev's own folder
    (root / "prev" / RESULTS / "part-00001-x.parquet").write_bytes(other_part.read_bytes())
    tried = rejected = 0
    saved = (root / "prev" / kind / "_manifest.json").read_text()
    for raw in HOSTILE_NAMES:
        name = _hostile(raw, root)
        (root / "prev" / kind / "_manifest.json").write_text(saved)
        _add_part(root / "prev", kind, name, other_part)
        tried += 1
        _refused(spec, root, str(root / "prev" / kind / "_manifest.json"), repr(name).strip("'\""))
        rejected += 1
    record_malicious(f"previous_run_{kind}_manifest_names", tried, rejected)
    # the control: the same previous run with its own manifest compares
    (root / "prev" / kind / "_manifest.json").write_text(saved)
    _reseal(root / "prev")
    (root / "prev" / RESULTS / "part-00001-x.parquet").unlink()
    assert compute_changes(spec).counts.changed == 1
    assert "SECRET" not in pq.read_table(root / "now" / CHANGES)["id"].to_pylist()


def _symlink_cases(root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (link, target) planted in prev; each would serve another run's (or the system's) bytes."""
    other = root / "other" / RESULTS / "part-00000.parquet"
    prev = root / "prev" / RESULTS
    spare = root / "prev" / "spare.parquet"
    spare.write_bytes(other.read_bytes())
    return {
        "absolute link to another run's part": (prev / "part-00000.parquet", str(other)),
        "relative link to another run's part": (prev / "part-00000.parquet", "../../other/results/part-00000.parquet"),
        "link to a system file": (prev / "part-00000.parquet", "/etc/passwd"),
        "link inside the run": (prev / "part-00000.parquet", "../spare.parquet"),
        "folder link to another run's results": (prev, str(root / "other" / RESULTS)),
    }


@pytest.mark.parametrize(
    "case",
    [
        "absolute link to another run's part",
        "relative link to another run's part",
        "link to a system file",
        "link inside the run",
        "folder link to another run's results",
    ],
)
def test_changes_refuses_symlinked_parts(runs, case):
    root, spec = runs
    link, target = _symlink_cases(root)[case]
    if link.is_dir():
        os.rename(link, link.with_name("results.real"))
        os.symlink(target, link)
    else:
        link.unlink()
        os.symlink(target, link)
    if case == "folder link to another run's results":  # the manifest itself is then under the link
        _refused(spec, root, "results/_manifest.json", "symbolic link", str(root / "prev" / MERGED))
    else:
        _refused(
            spec, root, "results/part-00000.parquet", "symbolic link", str(root / "prev" / RESULTS / "_manifest.json")
        )
    record_malicious("previous_run_symlinked_parts", 1, 1)


def test_a_previous_run_reached_through_a_linked_root_still_compares(runs):
    """The run's own root may be a symlink (a mount point, /tmp on macOS): only what lies below it is checked."""
    root, spec = runs
    os.symlink(root / "prev", root / "prev-link")
    spec = spec.model_copy(
        update={"changes": spec.changes.model_copy(update={"previous_uri": str(root / "prev-link")})}
    )
    assert compute_changes(spec).counts.changed == 1


def test_a_previous_summary_naming_files_outside_its_run_is_not_a_summary(runs):
    root, spec = runs
    doc = json.loads((root / "prev" / MERGED).read_text())
    doc["files"] = {RESULTS: "../other/results/"}
    (root / "prev" / MERGED).write_text(json.dumps(doc))
    with pytest.raises(SpecError, match=r"_MERGED.json is not a merge summary.*\.\./other/results/"):
        compute_changes(spec)
    assert not (root / "now" / "changes").exists()


# ---- this run's own readers (QA, publish, OpenAI output, the embeddings DAG) -----------------
def test_result_parts_is_the_one_gate_for_a_runs_own_readers(runs):
    root, _ = runs
    out = Storage(str(root / "now"))
    assert result_parts(out) == ["results/part-00000.parquet"]
    _add_part(
        root / "now", RESULTS, "../../other/results/part-00000.parquet", root / "other/results/part-00000.parquet"
    )
    with pytest.raises(CommitError, match=r"results/_manifest.json is not a parts manifest.*'\.\./\.\./other"):
        read_manifest(out, RESULTS)
    with pytest.raises(CommitError):
        result_parts(out)
    # a manifest copied from the other folder
    (root / "now" / ERRORS / "_manifest.json").write_text((root / "now" / RESULTS / "_manifest.json").read_text())
    with pytest.raises(CommitError):
        read_manifest(out, ERRORS)


def test_check_inside_passes_object_store_keys_and_real_files(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "part-00000.parquet").write_bytes(b"x")
    check_inside(Storage(str(tmp_path)), "results/part-00000.parquet", "m")
    check_inside(Storage("memory://bucket/run"), "results/part-00000.parquet", "m")  # no links on object stores
    os.symlink(tmp_path / "results" / "part-00000.parquet", tmp_path / "results" / "part-00001.parquet")
    with pytest.raises(CommitError, match="m names 'results/part-00001.parquet'"):
        check_inside(Storage(str(tmp_path)), "results/part-00001.parquet", "m")


# ---- the result cache's commit markers -------------------------------------------------------
def test_a_cache_entry_whose_part_is_a_symlink_is_skipped(tmp_path, fake_engine_factory, caplog):
    from airflow_provider_vllm.core.engine_identity import local_engine_identity
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.worker.shard import run_shard
    from tests.support.data import cache_entry_id, cached_job_spec, merge, vouch_cache

    ids, texts = [f"r{i}" for i in range(12)], [f"ticket {i}" for i in range(12)]

    def spec(run: str):
        return cached_job_spec(tmp_path, run, ids, texts)

    s1 = spec("a")
    p1 = plan_job(s1, engine_identity=local_engine_identity())
    for s in p1.shards:
        run_shard(shard_task(spec=s1, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    merge(s1)
    vouch_cache(s1)  # published: its entry is read
    eid = cache_entry_id(s1, p1)
    part = tmp_path / "cache" / "entries" / eid / "part-00000.parquet"
    outside = tmp_path / "elsewhere.parquet"  # same bytes: size and sha256 still match the marker
    os.rename(part, outside)
    os.symlink(outside, part)
    assert plan_job(spec("b"), engine_identity=local_engine_identity()).cache.hits == 0
    assert "symbolic link" in caplog.text and f"{eid}.json" in caplog.text
