"""``vouch_run``: after the upgrade, the cache entries of runs published before it serve again, on sealed evidence
only. A run published before the upgrade is a run published now whose vouch record is removed (and whose merge
summary, as one merged before the upgrade, names no commit seal)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from airflow_provider_vllm.core import seal as seals
from airflow_provider_vllm.core.records import CacheCommit, Seal
from airflow_provider_vllm.core.seal import Keyring, record_bytes, scope_of, seal_record
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.cache.vouch_runs import vouch_run
from airflow_provider_vllm.steps.merge.merger import MERGED, SUCCESS, read_merged
from tests.support.data import files_under, plan_xcom, shard_task
from tests.support.ledger import record_malicious
from tests.support.task_context import context

IDS = [f"t{i:04d}" for i in range(40)]


def texts(run: str) -> list[str]:
    return [f"ticket {run}-{i}: I was charged twice, please refund" for i in range(40)]


def cached_run(
    tmp_path: Path,
    factory,
    run: str,
    *,
    publish: bool = True,
    text_of: str | None = None,
    rows: list[str] | None = None,
) -> Path:
    """A run of the job with the result cache (``tmp_path/cache``) under ``tmp_path/out-<run>``: planned, its shards
    run, merged (the merge files its entry), QA'd and, with ``publish``, published; then, standing for a run
    published before the upgrade, its vouch record removed and its merge summary sealed without the commit seal
    (merged before it was recorded). ``rows``: the 40 rows' texts (default: ``texts(text_of or run)``)."""
    from airflow_provider_vllm.core.engine_identity import local_engine_identity
    from airflow_provider_vllm.operators.merge import VllmMergeOperator
    from airflow_provider_vllm.operators.publish import VllmPublishOperator
    from airflow_provider_vllm.operators.qa import VllmQAOperator
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.worker.shard import run_shard
    from tests.support.data import cached_job_spec

    spec = cached_job_spec(tmp_path, run, IDS, rows or texts(text_of or run))
    for s in plan_job(spec, engine_identity=local_engine_identity()).shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=factory)
    doc = spec.model_dump(mode="json")
    VllmMergeOperator(task_id="merge", spec=doc, plan=plan_xcom(doc)).execute(context())
    VllmQAOperator(task_id="qa", spec=doc).execute(context())
    if publish:
        VllmPublishOperator(task_id="publish", spec=doc).execute(context())
    for f in (tmp_path / "cache" / "published").glob("*/*.json"):
        f.unlink()
    out = tmp_path / f"out-{run}"
    keyring = Keyring.from_env()
    merged = read_merged(Storage(str(out)), keyring)
    if merged.cache is None or merged.cache.entry_id is None:
        return out
    old = merged.model_copy(update={"cache": merged.cache.model_copy(update={"commit_mac": None})})
    (out / MERGED).write_bytes(record_bytes(seal_record(keyring, seals.MERGED, scope_of(str(out)), old)))
    return out


def hits(tmp_path: Path, run: str) -> int:
    """The cache hits of a run of ``run``'s texts planned now."""
    from airflow_provider_vllm.core.engine_identity import local_engine_identity
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from tests.support.data import cached_job_spec

    spec = cached_job_spec(tmp_path, f"probe-{len(list(tmp_path.glob('in-probe-*')))}", IDS, texts(run))
    plan = plan_job(spec, engine_identity=local_engine_identity())
    assert plan.cache is not None
    return plan.cache.hits


def vouches(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache" / "published").glob("*/*.json"))


def _reseal_success(out: Path, keyring: Keyring | None, change=None, seal: Seal | None = None) -> None:
    doc = json.loads((out / SUCCESS).read_bytes())
    doc.pop("seal")
    if change:
        change(doc)
    if keyring is not None:
        seal = keyring.seal(seals.SUCCESS, scope_of(str(out)), doc)
    if seal is not None:
        doc["seal"] = seal.model_dump(mode="json")
    (out / SUCCESS).write_text(json.dumps(doc, indent=1, sort_keys=True))


def test_a_run_published_before_the_upgrade_serves_again_once_and_a_second_call_changes_nothing(
    tmp_path, fake_engine_factory
):
    out = cached_run(tmp_path, fake_engine_factory, "a")
    assert hits(tmp_path, "a") == 0  # the cold night the upgrade brings
    done = vouch_run(str(out), Keyring.from_env())
    assert done.outcome == "vouched" and done.entry_id and done.cache_uri == str(tmp_path / "cache"), done
    assert len(vouches(tmp_path)) == 1
    assert hits(tmp_path, "a") == 40

    before = files_under(tmp_path / "cache")
    again = vouch_run(str(out) + "/", Keyring.from_env())
    assert again.outcome == "already_vouched" and again.entry_id == done.entry_id, again
    assert files_under(tmp_path / "cache") == before
    assert hits(tmp_path, "a") == 40


def test_a_dry_run_checks_and_writes_nothing(tmp_path, fake_engine_factory):
    out = cached_run(tmp_path, fake_engine_factory, "a")
    before = files_under(tmp_path)
    done = vouch_run(str(out), Keyring.from_env(), dry_run=True)
    assert done.outcome == "would_vouch" and done.entry_id, done
    assert files_under(tmp_path) == before and not vouches(tmp_path)
    assert hits(tmp_path, "a") == 0


def test_a_run_merged_but_never_published_is_skipped(tmp_path, fake_engine_factory):
    out = cached_run(tmp_path, fake_engine_factory, "a", publish=False)
    done = vouch_run(str(out), Keyring.from_env())
    assert done.outcome == "skipped" and "not published" in done.reason, done
    assert not vouches(tmp_path) and hits(tmp_path, "a") == 0


def test_a_forged_success_marker_is_refused(tmp_path, fake_engine_factory):
    """A marker without a seal, or sealed with the shard workers' key (which every pod holds), proves nothing."""
    keyring = Keyring.from_env()
    worker = keyring.worker_keyring()
    wkey = worker._workers.signing  # what code in a shard pod could seal with
    out = cached_run(tmp_path, fake_engine_factory, "a", publish=False)
    genuine_run = cached_run(tmp_path, fake_engine_factory, "b")
    template = (genuine_run / SUCCESS).read_bytes()
    tried = 0
    for forge in ("unsealed", "worker"):
        (out / SUCCESS).write_bytes(template)
        doc = json.loads(template)
        doc.pop("seal")
        doc["output_uri"] = str(out)
        if forge == "worker":
            mac = keyring._mac(wkey, seals.SUCCESS, scope_of(str(out)), doc)
            doc["seal"] = Seal(kid=seals.kid_of(wkey), mac=mac).model_dump(mode="json")
        (out / SUCCESS).write_text(json.dumps(doc))
        done = vouch_run(str(out), keyring)
        tried += 1
        assert done.outcome == "refused" and SUCCESS in done.reason, (forge, done)
    record_malicious("forged_success_marker_vouching_a_cache_entry", tried, tried)
    assert not vouches(tmp_path) and hits(tmp_path, "a") == 0


def test_the_success_marker_of_another_run_or_another_merge_is_refused(tmp_path, fake_engine_factory):
    keyring = Keyring.from_env()
    out = cached_run(tmp_path, fake_engine_factory, "a", publish=False)
    other = cached_run(tmp_path, fake_engine_factory, "b")
    shutil.copy(other / SUCCESS, out / SUCCESS)  # genuine, for another folder
    done = vouch_run(str(out), keyring)
    assert done.outcome == "refused" and "seal" in done.reason, done

    # a genuine marker of this very folder, but the publish of another merge of it (an earlier one put back)
    published = cached_run(tmp_path, fake_engine_factory, "c")
    _reseal_success(published, keyring, change=lambda d: d["checksums"].update({"results/_manifest.json": "0" * 64}))
    done = vouch_run(str(published), keyring)
    assert done.outcome == "refused" and "another merge" in done.reason, done
    record_malicious("success_marker_of_another_run_or_merge_vouching_a_cache_entry", 2, 2)
    assert not vouches(tmp_path) and hits(tmp_path, "a") == hits(tmp_path, "c") == 0


def test_an_entry_whose_commit_was_rewritten_is_refused(tmp_path, fake_engine_factory):
    keyring = Keyring.from_env()
    out = cached_run(tmp_path, fake_engine_factory, "a")
    (commit_file,) = (tmp_path / "cache" / "commits").glob("*/*.json")
    genuine = commit_file.read_bytes()
    commit = CacheCommit.model_validate_json(genuine)

    commit_file.write_bytes(genuine.replace(b'"rows": 40', b'"rows": 41'))  # changed, seal kept
    done = vouch_run(str(out), keyring)
    assert done.outcome == "refused" and "does not verify" in done.reason, done

    # sealed by this deployment, but filed by another run's merge under this entry's id
    moved = commit.model_copy(update={"source_output_uri": str(tmp_path / "out-z"), "seal": None})
    commit_file.write_bytes(
        record_bytes(seal_record(keyring, seals.CACHE_ENTRY, scope_of(str(tmp_path / "cache")), moved))
    )
    done = vouch_run(str(out), keyring)
    assert done.outcome == "refused" and "another run" in done.reason, done

    # a merge summary that names its commit's seal (merged after the upgrade): only exactly that commit
    merged = read_merged(Storage(str(out)), keyring)
    assert merged.cache is not None
    named = merged.model_copy(update={"cache": merged.cache.model_copy(update={"commit_mac": "0" * 64})})
    (out / MERGED).write_bytes(record_bytes(seal_record(keyring, seals.MERGED, scope_of(str(out)), named)))
    commit_file.write_bytes(genuine)
    done = vouch_run(str(out), keyring)
    assert done.outcome == "refused" and "not the one the merge summary names" in done.reason, done
    record_malicious("rewritten_cache_commit_vouched_after_upgrade", 3, 3)
    assert not vouches(tmp_path) and hits(tmp_path, "a") == 0

    assert commit.seal is not None
    ok = merged.model_copy(update={"cache": merged.cache.model_copy(update={"commit_mac": commit.seal.mac})})
    (out / MERGED).write_bytes(record_bytes(seal_record(keyring, seals.MERGED, scope_of(str(out)), ok)))
    assert vouch_run(str(out), keyring).outcome == "vouched"
    assert hits(tmp_path, "a") == 40


def test_a_run_without_the_cache_or_an_entry_is_skipped(tmp_path, fake_engine_factory):
    keyring = Keyring.from_env()
    assert vouch_run(str(tmp_path / "nothing"), keyring).outcome == "skipped"
    out = cached_run(tmp_path, fake_engine_factory, "a")
    vouch_run(str(out), keyring)
    again = cached_run(tmp_path, fake_engine_factory, "b", text_of="a")  # every row a hit: nothing filed
    done = vouch_run(str(again), keyring)
    assert done.outcome == "skipped" and "no cache entry" in done.reason, done


def test_a_run_whose_entry_is_gone_is_skipped(tmp_path, fake_engine_factory):
    """Folded into a compacted entry before the upgrade (the compaction removed its commit), or removed: nothing to
    vouch for, and the compacted entry is not vouched for on this run's word."""
    out = cached_run(tmp_path, fake_engine_factory, "a")
    (commit_file,) = (tmp_path / "cache" / "commits").glob("*/*.json")
    commit_file.unlink()
    done = vouch_run(str(out), Keyring.from_env())
    assert done.outcome == "skipped" and "not in the cache folder" in done.reason, done
    assert not vouches(tmp_path)


def merged_by_an_earlier_version(tmp_path: Path, factory, run: str, *, committed_by: str, faulty: bool) -> Path:
    """A run merged and published by a version whose entry id came from the run alone (spec hash and output prefix,
    before the id covered the parts it was made from), then QA'd and published as such a version did.

    ``committed_by`` ``earlier_merge`` with ``faulty``: the run was merged twice, its first merge filed answers a
    faulty node gave (QA caught them, the shards ran again) and the second found that commit under the same id,
    appended nothing and was published: the entry holds the first merge's answers, which no publish approved.
    ``this_merge`` without ``faulty``: merged once, the entry holds exactly the published answers."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    from airflow_provider_vllm.core.engine_identity import local_engine_identity
    from airflow_provider_vllm.core.records import CacheFileEntry
    from airflow_provider_vllm.operators.merge import VllmMergeOperator
    from airflow_provider_vllm.operators.publish import VllmPublishOperator
    from airflow_provider_vllm.operators.qa import VllmQAOperator
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.worker.shard import run_shard
    from tests.support.data import cached_job_spec

    spec = cached_job_spec(tmp_path, run, IDS, texts(run))
    for s in plan_job(spec, engine_identity=local_engine_identity()).shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=factory)
    doc = spec.model_dump(mode="json")
    VllmMergeOperator(task_id="merge", spec=doc, plan=plan_xcom(doc)).execute(context())
    out, cache = tmp_path / f"out-{run}", tmp_path / "cache"
    keyring = Keyring.from_env()
    merged = read_merged(Storage(str(out)), keyring)
    assert merged.cache is not None and merged.cache.entry_id is not None
    new = merged.cache.entry_id
    (commit_file,) = (cache / "commits").glob(f"*/{new}.json")
    commit = CacheCommit.model_validate_json(commit_file.read_bytes())
    old = hashlib.sha256(f"{merged.spec_hash}\n{commit.source_output_uri}".encode()).hexdigest()[:32]
    table = pq.read_table(cache / "entries" / new / "part-00000.parquet")
    if faulty:
        table = table.set_column(table.schema.get_field_index("label"), "label", pa.array(["other"] * table.num_rows))
    part = cache / "entries" / old / "part-00000.parquet"
    part.parent.mkdir(parents=True)
    pq.write_table(table, part)
    data = part.read_bytes()
    rel = f"entries/{old}/part-00000.parquet"
    filed = commit.model_copy(
        update={
            "entry_id": old,
            "files": [
                CacheFileEntry(path=rel, bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), rows=len(table))
            ],
            "seal": None,
        }
    )
    (commit_file.parent / f"{old}.json").write_bytes(
        record_bytes(seal_record(keyring, seals.CACHE_ENTRY, scope_of(str(cache)), filed))
    )
    commit_file.unlink()
    shutil.rmtree(cache / "entries" / new)
    summary = merged.cache.model_copy(update={"entry_id": old, "committed_by": committed_by, "commit_mac": None})
    earlier = merged.model_copy(update={"cache": summary, "seal": None})
    (out / MERGED).write_bytes(record_bytes(seal_record(keyring, seals.MERGED, scope_of(str(out)), earlier)))
    VllmQAOperator(task_id="qa", spec=doc).execute(context())
    VllmPublishOperator(task_id="publish", spec=doc).execute(context())
    assert (out / SUCCESS).exists() and not vouches(tmp_path)  # no commit seal named: publish vouched for nothing
    return out


def test_an_entry_of_an_earlier_version_holding_a_replaced_merges_answers_is_not_vouched_for(
    tmp_path, fake_engine_factory
):
    """Before an entry's id covered the parts it was made from, a run merged again over other parts (its shards run
    again after QA caught a faulty node) found its first merge's commit under the same id and appended nothing: the
    published merge summary names an entry that holds the answers QA failed. Nothing sealed says those are the answers
    published, so the entry is not vouched for (its rows are inferred once)."""
    out = merged_by_an_earlier_version(tmp_path, fake_engine_factory, "a", committed_by="earlier_merge", faulty=True)
    done = vouch_run(str(out), Keyring.from_env())
    assert done.outcome == "skipped" and "earlier merge" in done.reason, done
    record_malicious("entry_of_a_replaced_merge_vouched_after_upgrade", 1, 1)
    assert not vouches(tmp_path) and hits(tmp_path, "a") == 0


def test_an_entry_of_an_earlier_version_that_its_published_merge_filed_is_vouched_for(tmp_path, fake_engine_factory):
    """The same version's entry that the published merge itself committed (``this_merge``) holds exactly the published
    answers: vouched for, and it serves."""
    out = merged_by_an_earlier_version(tmp_path, fake_engine_factory, "a", committed_by="this_merge", faulty=False)
    done = vouch_run(str(out), Keyring.from_env())
    assert done.outcome == "vouched", done
    assert hits(tmp_path, "a") == 40


def test_a_run_with_cache_hits_and_repeated_prompts_is_vouched_for(tmp_path, fake_engine_factory):
    """The entry's id covers only the parts the run's shards computed: the merge's own parts (the cache's hits, the
    dedupe's followers) in the published results manifest are left out, as the merge files the entry."""
    from airflow_provider_vllm.steps.merge.merger import RESULTS, read_manifest

    keyring = Keyring.from_env()
    assert vouch_run(str(cached_run(tmp_path, fake_engine_factory, "a")), keyring).outcome == "vouched"
    rows = texts("a")[:10] + [f"ticket b-{i % 10}: the app crashes on start" for i in range(30)]
    out = cached_run(tmp_path, fake_engine_factory, "b", rows=rows)
    names = [p.name for p in read_manifest(Storage(str(out)), RESULTS).parts]
    assert any(n.endswith("-cache-hits.parquet") for n in names) and any(
        n.endswith("-followers.parquet") for n in names
    )
    done = vouch_run(str(out), keyring)
    assert done.outcome == "vouched", done
    assert len(vouches(tmp_path)) == 1  # b's (cached_run removed a's record with b's)
