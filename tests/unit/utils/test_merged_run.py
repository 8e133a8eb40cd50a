"""``merged_run.merged_parts``: what a step between QA and publish reads is the merge the merge task reported, as
checked local copies (runs merged in this process with the fake engine, no Airflow process)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.operators.merge import VllmMergeOperator
from airflow_provider_vllm.utils.merged_run import merge_task_of, merged_parts, reported_merge
from tests.support.data import plan_xcom
from tests.support.ledger import record_malicious
from tests.support.task_context import committed_job, context


def merged_job(tmp_path, factory, **kw) -> tuple[dict, str]:
    spec, _ = committed_job(tmp_path, factory, n=60, **kw)
    told = VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    return spec, told["merged_mac"]


def ids_of(paths) -> list[str]:
    return sorted(i for p in paths for i in pq.read_table(p, columns=["id"]).column("id").to_pylist())


def test_the_parts_of_the_reported_merge_are_read_from_checked_copies_removed_after(tmp_path, fake_engine_factory):
    spec, mac = merged_job(tmp_path, fake_engine_factory, empty=(3,))
    with merged_parts(spec, mac) as run:
        assert run.merged.ok_rows == 59 and run.kind == "results"
        assert ids_of(run.paths) == sorted(f"t{i:04d}" for i in range(60) if i != 3)
        assert all(not p.startswith(str(tmp_path / "out")) for p in run.paths)  # copies, not the run's files
        assert run.output.uri("x") == f"{spec['io']['output_uri'].rstrip('/')}/x"
        copies = list(run.paths)
    assert not any(os.path.exists(p) for p in copies)
    with merged_parts(spec, mac, kind="errors") as run:
        assert ids_of(run.paths) == ["t0003"]
    with pytest.raises(ValueError, match="kind='shards'"):
        with merged_parts(spec, mac, kind="shards"):
            pass


def test_another_merge_or_a_part_swapped_after_the_merge_is_never_read(tmp_path, fake_engine_factory):
    """Another sealed merge of the folder (the mac differs), and a part rewritten after the merge sealed it: the
    task fails without retry, naming what it refused; nothing is yielded."""
    spec, mac = merged_job(tmp_path, fake_engine_factory)
    with pytest.raises(AirflowFailException, match="not the merge the merge task reported"):
        with merged_parts(spec, "0" * 64):
            pytest.fail("read another merge")
    part = sorted((tmp_path / "out" / "results").glob("*.parquet"))[0]
    table = pq.read_table(part)
    forged = table.set_column(table.schema.get_field_index("output"), "output", [["forged"] * table.num_rows])
    pq.write_table(forged, part)
    with pytest.raises(AirflowFailException, match=rf"{part.name}.*(sha256|size)"):
        with merged_parts(spec, mac):
            pytest.fail("read a swapped part")
    record_malicious("merged_parts_of_another_merge_or_a_swapped_part", 2, 2)


def test_the_merge_is_the_one_the_merge_task_of_the_group_reported(tmp_path, fake_engine_factory):
    spec, mac = merged_job(tmp_path, fake_engine_factory)
    assert merge_task_of("nightly.embedding_table") == "nightly.merge"
    assert merge_task_of("a.b.export") == "a.b.merge" and merge_task_of("export") == "merge"
    pulled = []

    def ctx(value):
        def xcom_pull(task_ids):
            pulled.append(task_ids)
            return value

        return {"ti": SimpleNamespace(task_id="nightly.export", xcom_pull=xcom_pull)}

    with merged_parts(spec, context=ctx({"merged_mac": mac, "rows": 60})) as run:
        assert run.merged.seal.mac == mac and len(ids_of(run.paths)) == 60
    assert pulled == ["nightly.merge"]
    for told in (None, {"rows": 60}, {"merged_mac": ""}, {"merged_mac": 7}, "not a dict"):
        with pytest.raises(AirflowFailException, match="'nightly.merge' of this run reported no merged run"):
            reported_merge(ctx(told))


def test_a_spec_outside_the_deployments_locations_is_refused(tmp_path, fake_engine_factory, monkeypatch):
    """The spec comes through XCom: the deployment's allow-list is applied again before anything is read."""
    spec, mac = merged_job(tmp_path, fake_engine_factory)
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", str(tmp_path / "elsewhere"))
    with pytest.raises(AirflowFailException, match="merged_parts: io.input_uri=.* is outside the allowed prefixes"):
        with merged_parts(spec, mac):
            pytest.fail("read outside the allow-list")


def test_a_step_in_a_task_group_of_its_own_reads_the_merge_of_the_jobs_group(tmp_path, fake_engine_factory):
    """A ``before_publish`` step inside a task group of its own (``nightly.exports.export``) looked for
    ``nightly.exports.merge``, which no job has: it failed saying the merge reported nothing, or read the XCom of a
    task of the user's that happens to be called ``merge``. The merge task is now the job's own (a
    ``VllmMergeOperator`` of the DAG, in the innermost group around the step that has one)."""
    from airflow.providers.standard.operators.empty import EmptyOperator
    from airflow.sdk import DAG, TaskGroup

    from airflow_provider_vllm.task_groups.batch_job import vllm_batch_job

    spec, mac = merged_job(tmp_path, fake_engine_factory)

    def steps(job):
        with TaskGroup("exports") as g:
            EmptyOperator(task_id="merge")  # a step of the user's that happens to be called so
            EmptyOperator(task_id="export")
        return g

    with DAG("nested_steps", schedule=None) as dag:
        vllm_batch_job(spec, group_id="nightly", before_publish=steps)
    assert {"nightly.merge", "nightly.exports.merge", "nightly.exports.export"} <= set(dag.task_dict)
    pulled = []

    def xcom_pull(task_ids):
        pulled.append(task_ids)
        return {"merged_mac": mac} if task_ids == "nightly.merge" else None

    task = dag.get_task("nightly.exports.export")
    ctx = {"ti": SimpleNamespace(task_id=task.task_id, xcom_pull=xcom_pull), "task": task}
    with merged_parts(spec, context=ctx) as run:
        assert run.merged.seal.mac == mac
    assert pulled == ["nightly.merge"]
    assert merge_task_of("a.b.export", {"a.merge"}) == "a.merge" and merge_task_of("export", {"merge"}) == "merge"
    assert merge_task_of("a.b.export", set()) == "a.b.merge"  # none found: its own group's, which then reports none


def test_what_the_callers_block_raises_is_its_own_and_the_copies_go(tmp_path, fake_engine_factory):
    """An error of the caller's code inside the block (its own SpecError, a storage error writing its file) came out
    as ``AirflowFailException('merged_parts: ...')``: blamed on the merge's parts and, for a terminal one, never
    retried whatever the caller meant. It now leaves the block as raised; the checked copies are removed all the
    same."""
    from airflow_provider_vllm.core.errors import SpecError, TransientError

    spec, mac = merged_job(tmp_path, fake_engine_factory)
    for error in (SpecError("export: no column 'vector'"), TransientError("export: the bucket timed out")):
        copies: list[str] = []
        with pytest.raises(type(error), match="^export: "):
            with merged_parts(spec, mac) as run:
                copies = list(run.paths)
                raise error
        assert copies and not any(os.path.exists(p) for p in copies)
