"""The operators and the builder without a scheduler: execute() with a small fake context,
the worker process with the fake engine (real CLI, real subprocess), no vLLM, no DB."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.data import PINNED_REVISION, make_spec, write_parquet
from tests.support.task_context import context

HERE = Path(__file__).resolve().parent


@pytest.fixture
def fake_python(tmp_path) -> str:
    """An executable that runs the worker CLI with the fake engine (stands in for `python`)."""
    path = tmp_path / "fake-python"
    root = str(HERE.parents[1])
    path.write_text(
        f"#!{sys.executable}\nimport sys; sys.path.insert(0, {root!r})\n" + (HERE / "fake_python.py").read_text()
    )
    path.chmod(0o755)
    return str(path)


def dataset(tmp_path: Path, n: int = 120, empty: tuple[int, ...] = ()) -> Path:
    texts = [f"ticket number {i}: I was charged twice, please refund" for i in range(n)]
    for i in empty:
        texts[i] = ""
    write_parquet(tmp_path / "in" / "part-0.parquet", [f"t{i:04d}" for i in range(n)], texts)
    return tmp_path / "in"


def run_job(tmp_path, fake_python, spec_doc, params=None):
    """plan -> shards (fake engine, real subprocess) -> merge, through the operators."""
    from airflow_provider_vllm.operators import VllmLocalShardOperator, VllmMergeOperator, VllmPlanOperator

    plan_ctx = context(params)
    shards = VllmPlanOperator(task_id="plan", spec=spec_doc).execute(plan_ctx)
    spec = plan_ctx["ti"].xcoms["spec"]
    manifests = [
        VllmLocalShardOperator(
            task_id="shard", spec=spec, shard=s, python=fake_python, progress_interval_s=0.01
        ).execute(context(map_index=i))
        for i, s in enumerate(shards)
    ]
    merged = VllmMergeOperator(task_id="merge", spec=spec, plan=plan_ctx["ti"].xcoms["plan"]).execute(context())
    return spec, shards, manifests, merged


def spec_doc(tmp_path, **over):
    return make_spec(tmp_path / "in", tmp_path / "out", **over).model_dump(mode="json")


# ---- plan --------------------------------------------------------------------------------


def test_plan_layers_spec_overrides_and_params_and_pushes_the_spec(tmp_path):
    from airflow_provider_vllm.core.spec import JobSpec
    from airflow_provider_vllm.operators import VllmPlanOperator

    dataset(tmp_path, 250)
    doc = spec_doc(tmp_path)
    doc["sharding"]["target_rows"] = "1000"  # rendered templates are strings; the spec coerces them
    op = VllmPlanOperator(
        task_id="plan",
        spec=doc,
        overrides='{"sampling.max_tokens": 16, "shard_rows": 200}',
        param_overrides=["shard_rows", "labels", "model"],
    )
    ctx = context({"shard_rows": 100, "labels": ["a", "b"], "model": None, "runner": "local"})
    shards = op.execute(ctx)
    assert len(shards) == 3 and sum(s["rows"] for s in shards) == 250  # ceil(250 / 100) balanced shards
    assert set(shards[0]) == {"shard_id", "index", "rows", "est_tokens", "bucket", "name", "plan_mac", "plan_sha256"}
    # each shard task's value names the sealed plan the plan task wrote (its worker checks _plan.json is that one)
    from airflow_provider_vllm.core.plan import Plan, plan_sha256

    written = Plan.model_validate_json((tmp_path / "out" / "_plan.json").read_bytes())
    assert {(s["plan_mac"], s["plan_sha256"]) for s in shards} == {(written.seal.mac, plan_sha256(written))}
    assert [s["name"] for s in shards] == ["shard 0/3 rows 0-82", "shard 1/3 rows 83-166", "shard 2/3 rows 167-249"]
    spec = JobSpec.load(ctx["ti"].xcoms["spec"])
    assert spec.sampling.max_tokens == 16 and spec.sharding.target_rows == 100
    assert spec.sampling.structured.choice == ["a", "b"] and spec.model.name == "fake"  # None keeps the spec's
    assert json.loads((tmp_path / "out" / "_plan.json").read_text())["spec_hash"] == spec.content_hash()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"temperature": "hot"}, "sampling.temperature"),
        ({"runner": "docker"}, "runner='docker' is not a runner"),
        ({"model": {"name": "@TMP@/nonexistent/model"}}, "does not exist"),  # inside the allow-list
        ({"duplicate_ids": True}, "duplicate"),
    ],
)
def test_plan_fails_without_retry(tmp_path, change, message):
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.operators import VllmPlanOperator

    if change.pop("duplicate_ids", False):
        write_parquet(tmp_path / "in" / "part-0.parquet", ["a", "b", "a"], ["x y", "y z", "z w"])
    else:
        dataset(tmp_path, 10)
    runner = change.pop("runner", "local")
    temperature = change.pop("temperature", None)
    if "model" in change:
        change["model"]["name"] = change["model"]["name"].replace("@TMP@", str(tmp_path))
    doc = spec_doc(tmp_path, **change)
    if temperature is not None:
        doc["sampling"]["temperature"] = temperature  # as a bad form value would arrive
    with pytest.raises(AirflowFailException, match=message):
        VllmPlanOperator(task_id="plan", spec=doc, runner=runner).execute(context())
    assert not (tmp_path / "out" / "shards").exists()


def test_plan_accepts_a_yaml_spec_text(tmp_path):
    import yaml

    from airflow_provider_vllm.operators import VllmPlanOperator

    dataset(tmp_path, 10)
    text = yaml.safe_dump({"job": spec_doc(tmp_path)})
    ctx = context()
    assert len(VllmPlanOperator(task_id="plan", spec=text).execute(ctx)) == 1
    assert ctx["ti"].xcoms["spec"]["io"]["output_uri"] == str(tmp_path / "out")


def test_plan_with_the_result_cache_keys_on_the_runners_engine(tmp_path, fake_python):
    """The plan operator puts the runner's engine in the cache key: the local vLLM and the worker's
    environment here; the workers seal the engine they saw, the same one, so the run is cached. With the
    Kubernetes runner the key needs the pods' image pinned by digest."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.core.engine_identity import local_engine_identity
    from airflow_provider_vllm.operators import VllmPlanOperator

    dataset(tmp_path, 30)
    doc = spec_doc(
        tmp_path, model={"name": "fake", "revision": PINNED_REVISION}, cache={"uri": str(tmp_path / "cache")}
    )
    spec, shards, _, merged = run_job(tmp_path, fake_python, doc)
    plan = json.loads((tmp_path / "out" / "_plan.json").read_text())
    assert plan["cache"]["key_config"]["engine_identity"] == local_engine_identity()
    assert (plan["cache"]["hits"], plan["cache"]["misses"]) == (0, 30) and sum(s["rows"] for s in shards) == 30
    assert merged["ok_rows"] == 30 and merged["cache"]["appended"] == 30 and "skipped" not in merged["cache"]
    k8s = spec_doc(
        tmp_path,
        model={"name": "fake", "revision": PINNED_REVISION},
        cache={"uri": str(tmp_path / "cache")},
        io={"output_uri": str(tmp_path / "out-k8s")},
    )
    with pytest.raises(AirflowFailException, match="not pinned by digest"):
        VllmPlanOperator(task_id="plan", spec=k8s, runner="kubernetes").execute(context())
    no_pin = spec_doc(tmp_path, cache={"uri": str(tmp_path / "cache")}, io={"output_uri": str(tmp_path / "o2")})
    with pytest.raises(AirflowFailException, match="model.revision"):
        VllmPlanOperator(task_id="plan", spec=no_pin).execute(context())


# ---- shard -------------------------------------------------------------------------------


def test_shard_runs_the_worker_command_streams_progress_and_returns_its_manifest(tmp_path, fake_python):
    from airflow_provider_vllm.operators import VllmLocalShardOperator, VllmPlanOperator

    dataset(tmp_path, 100)
    ctx = context()
    (shard,) = VllmPlanOperator(task_id="plan", spec=spec_doc(tmp_path)).execute(ctx)
    op = VllmLocalShardOperator(
        task_id="shard",
        spec=ctx["ti"].xcoms["spec"],
        shard=shard,
        python=fake_python,
        progress_interval_s=0.01,
        env={"VLLM_BATCH_LOG_LEVEL": "DEBUG"},
    )
    lines: list[str] = []
    op._worker_line = lines.append
    manifest = op.execute(context(map_index=0))
    assert manifest["status"] == "committed" and manifest["shard_id"] == shard["shard_id"]
    assert manifest["rows"] == manifest["ok_rows"] == 100
    assert any(" progress " in line and "rows=100/100" in line for line in lines), lines[-5:]
    again = op.execute(context(map_index=0, try_number=2))  # a retry after success is a no-op
    assert again["status"] == "already_committed" and again["attempt_id"] == manifest["attempt_id"]


@pytest.mark.parametrize(
    "inject, try_number, outcome",
    [
        ("0:1:75", 1, "retry"),
        ("0:1:2", 1, "fail"),
        ("*:1:137", 1, "retry"),
        ("0:1:75", 2, "ok"),  # the retry runs the real worker
        ("1:1:75", 1, "ok"),  # another map index
    ],
)
def test_shard_exit_codes_map_to_retry_or_fail(tmp_path, fake_python, monkeypatch, inject, try_number, outcome):
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    from airflow_provider_vllm.operators import VllmLocalShardOperator, VllmPlanOperator

    dataset(tmp_path, 20)
    ctx = context()
    (shard,) = VllmPlanOperator(task_id="plan", spec=spec_doc(tmp_path)).execute(ctx)
    monkeypatch.setenv("VLLM_BATCH_INJECT_EXIT", inject)
    op = VllmLocalShardOperator(task_id="shard", spec=ctx["ti"].xcoms["spec"], shard=shard, python=fake_python)
    run = lambda: op.execute(context(map_index=0, try_number=try_number))  # noqa: E731
    if outcome == "ok":
        assert run()["status"] == "committed"
    elif outcome == "fail":
        with pytest.raises(AirflowFailException, match="exit 2, not retried"):
            run()
    else:
        with pytest.raises(AirflowException) as e:
            run()
        assert not isinstance(e.value, AirflowFailException) and "retried" in str(e.value)
    assert (tmp_path / "out" / "shards" / shard["shard_id"] / "_COMMITTED.json").exists() == (outcome == "ok")


def test_shard_with_an_invalid_spec_fails_without_retry(tmp_path):
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.operators import VllmLocalShardOperator

    doc = spec_doc(tmp_path)
    doc["sampling"]["max_tokens"] = -1
    with pytest.raises(AirflowFailException, match="sampling.max_tokens"):
        VllmLocalShardOperator(task_id="s", spec=doc, shard={"shard_id": "shard-00000-0123abcd"}).execute(context())


def test_local_runner_helpers():
    from airflow_provider_vllm.utils.worker_process import injected_exit, parse_manifest

    assert parse_manifest(['{"a": 1}', "noise", '{"status": "ok"}', "tail"]) == {"status": "ok"}
    assert parse_manifest(["{not json", "x"]) is None
    assert injected_exit(0, 1, {}) is None
    assert injected_exit(3, 2, {"VLLM_BATCH_INJECT_EXIT": "1:1:75, 3:2:2"}) == 2
    with pytest.raises(ValueError, match="MAP_INDEX:TRY:EXIT"):
        injected_exit(0, 1, {"VLLM_BATCH_INJECT_EXIT": "0:75"})


# ---- merge, QA, publish ----------------------------------------------------------------


def test_merge_qa_publish_write_the_marker_last_and_fill_the_asset_event(tmp_path, fake_python):
    from airflow.sdk import Asset

    from airflow_provider_vllm.operators import VllmPublishOperator, VllmQAOperator

    dataset(tmp_path, 300, empty=(7,))
    spec, shards, manifests, merged = run_job(tmp_path, fake_python, spec_doc(tmp_path))
    assert len(shards) == 3 and all(m["status"] == "committed" for m in manifests)
    assert merged["rows"] == 300 and merged["ok_rows"] == 299 and merged["error_rows"] == 1
    assert "shard_stats" not in merged and set(merged["checksums"]) == {
        "results/_manifest.json",
        "errors/_manifest.json",
    }
    qa_ctx = context()
    summary = VllmQAOperator(task_id="qa", spec=spec).execute(qa_ctx)
    assert summary["status"] in ("pass", "warn") and summary["report_html"].endswith("qa/report.html")
    asset = Asset(uri="x-vllm-batch://test")
    pub_ctx = context()
    event = VllmPublishOperator(task_id="publish", spec=spec, outlets=[asset]).execute(pub_ctx)
    out = tmp_path / "out"
    marker = json.loads((out / "_SUCCESS.json").read_text())
    assert marker["rows"] == 300 and marker["checksums"].items() >= merged["checksums"].items()
    qa_files = ("qa/report.html", "qa/report.json", "qa/sample.parquet")
    assert {f: marker["checksums"][f] for f in qa_files} == {
        f: hashlib.sha256((out / f).read_bytes()).hexdigest() for f in qa_files
    }
    assert marker["qa"]["status"] == summary["status"] and marker["airflow"]["run_id"] == "r1"
    newest = max((p for p in out.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime_ns)
    assert newest.name == "_SUCCESS.json"
    assert pub_ctx["outlet_events"][asset].extra == event
    assert event["output_uri"] == str(out) and event["rows"] == 300
    assert "changes" not in marker["files"]  # no changes.previous_uri


def test_qa_writes_changes_against_a_previous_run_and_publish_lists_them(tmp_path, fake_python):
    from airflow_provider_vllm.operators import VllmPublishOperator, VllmQAOperator

    dataset(tmp_path, 60)
    first, *_ = run_job(tmp_path, fake_python, spec_doc(tmp_path))
    doc = spec_doc(tmp_path)
    doc["io"]["output_uri"] = str(tmp_path / "out2")
    doc["changes"] = {"previous_uri": str(tmp_path / "out")}
    spec, *_ = run_job(tmp_path, fake_python, doc)
    summary = VllmQAOperator(task_id="qa", spec=spec).execute(context())
    assert any(c["name"] == "churn_rate" and c["value"] == 0 for c in summary["checks"])  # same input, same answers
    VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    marker = json.loads((tmp_path / "out2" / "_SUCCESS.json").read_text())
    assert marker["files"]["changes"] == "changes/changes.parquet"
    assert marker["files"]["changes_summary"] == "changes/_changes.json"
    changes = json.loads((tmp_path / "out2" / "changes" / "_changes.json").read_text())
    assert changes["counts"]["unchanged"] + changes["counts"]["error"] == 60 and changes["churn_rate"] == 0


def test_qa_fail_pushes_the_summary_then_raises_and_publish_refuses(tmp_path, fake_python):
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.operators import VllmPublishOperator, VllmQAFailed, VllmQAOperator
    from airflow_provider_vllm.steps.qa.report import QAFailed

    dataset(tmp_path, 50, empty=(3, 4))
    doc = spec_doc(tmp_path, qa={"warn_error_rate": 0.0, "fail_error_rate": 0.01})
    spec, *_ = run_job(tmp_path, fake_python, doc)
    ctx = context()
    with pytest.raises(VllmQAFailed) as e:
        VllmQAOperator(task_id="qa", spec=spec).execute(ctx)
    assert isinstance(e.value, QAFailed) and isinstance(e.value, AirflowFailException)
    assert [c["name"] for c in e.value.failing] == ["error_rate"]
    assert ctx["ti"].xcoms["return_value"]["status"] == "fail"
    with pytest.raises(AirflowFailException, match="QA failed"):
        VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    assert not (tmp_path / "out" / "_SUCCESS.json").exists()


def _embeddings_dag():
    import importlib.util

    sys.path.insert(0, str(HERE.parents[1] / "dags"))
    mod_spec = importlib.util.spec_from_file_location(
        "vllm_embeddings_dag", HERE.parents[1] / "dags" / "vllm_embeddings.py"
    )
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def _embed_run(tmp_path, fake_python, texts=None):
    """A fake embed run of 40 articles (``texts``); returns the spec and the merge task's value."""
    texts = texts or [f"a {i}" for i in range(40)]
    write_parquet(tmp_path / "in" / "part-0.parquet", [f"t{i:04d}" for i in range(40)], texts)
    doc = spec_doc(
        tmp_path,
        task="embed",
        prompt={"system_prompt": None, "template": "{text}", "truncation": "truncate"},
        sampling={"structured": None},
    )
    spec, _, _, merged = run_job(tmp_path, fake_python, doc)
    return spec, merged


def test_embedding_table_task(tmp_path, fake_python):
    """The embeddings DAG's before-publish step, on a fake embed run."""
    mod = _embeddings_dag()
    texts = [f"article {i}" for i in range(40)]
    texts[7] = "refund " * 3000  # longer than the model takes: its vector covers only the start
    spec, merged = _embed_run(tmp_path, fake_python, texts)
    uri = mod.embedding_table.function(spec, merged["merged_mac"])
    table = pq.read_table(uri)
    assert table.column_names == ["id", "vector", "model", "truncated"] and table.num_rows == 40
    # an index builder can tell which vectors stand for only the start of their text
    assert {r["id"] for r in table.to_pylist() if r["truncated"]} == {"t0007"}


def test_the_embedding_table_reads_only_the_merge_the_merge_task_reported(tmp_path, fake_python):
    """Another sealed _MERGED.json of the folder (an earlier merge put back) builds no table; the merge task's does."""
    from airflow.sdk.exceptions import AirflowFailException

    mod = _embeddings_dag()
    spec, merged = _embed_run(tmp_path, fake_python)
    with pytest.raises(AirflowFailException, match="not the merge the merge task reported"):  # and not retried
        mod.embedding_table.function(spec, "0" * 64)
    assert not (tmp_path / "out" / "embeddings").exists()
    assert pq.read_table(mod.embedding_table.function(spec, merged["merged_mac"])).num_rows == 40


def test_the_embedding_table_holds_the_checked_bytes_when_a_part_is_swapped_after_its_check(
    tmp_path, fake_python, monkeypatch
):
    """A writer of the bucket who swaps a results part right after it was checked (and could put it back before
    publish, which hashes the table as written) gets none of the swapped rows into the published table."""
    import airflow_provider_vllm.steps.merge.merger as merger

    mod = _embeddings_dag()
    spec, merged = _embed_run(tmp_path, fake_python)
    parts = sorted((tmp_path / "out" / "results").glob("part-*.parquet"))
    forged = pq.read_table(parts[0])
    field = forged.schema.field("id")
    forged = forged.set_column(
        forged.schema.get_field_index("id"), field, pa.array(["forged"] * forged.num_rows, field.type)
    )

    def swap_after(real):
        def wrapped(*a, **kw):
            got = real(*a, **kw)
            pq.write_table(forged, parts[0])  # after the check, before the table is built
            return got

        return wrapped

    for name in ("checked_parts", "verified_parts"):  # whichever the table is built through
        monkeypatch.setattr(merger, name, swap_after(getattr(merger, name)))
    ids = pq.read_table(mod.embedding_table.function(spec, merged["merged_mac"])).column("id").to_pylist()
    assert "forged" not in ids and sorted(ids) == [f"t{i:04d}" for i in range(40)]


# ---- builder -----------------------------------------------------------------------------


def build(**kw):
    import pendulum
    from airflow.sdk import DAG

    from airflow_provider_vllm.task_groups.batch_job import vllm_batch_job

    spec = {"model": {"name": "m"}, "io": {"input_uri": "/in/dt={{ ds }}/", "output_uri": "/out/dt={{ ds }}/"}}
    with DAG("t", schedule=None, start_date=pendulum.datetime(2026, 1, 1)) as dag:
        group = vllm_batch_job(spec, **kw)
    return dag, group


def test_builder_wires_plan_shards_merge_qa_publish():
    from airflow.sdk import task

    @task
    def extra(spec):
        return spec

    dag, group = build(group_id="job", shard_retries=3, max_active_shards=2, before_publish=extra)
    t = dag.task_dict
    assert set(t) == {"job.plan", "job.shard", "job.merge", "job.qa", "job.review", "job.extra", "job.publish"}
    shard = t["job.shard"]
    assert shard.is_mapped and "task.shard.get('name')" in shard.partial_kwargs["map_index_template"]
    assert shard.partial_kwargs["retries"] == 3 and shard.partial_kwargs["max_active_tis_per_dagrun"] == 2
    assert t["job.shard"].upstream_task_ids == {"job.plan"}
    assert t["job.merge"].upstream_task_ids == {"job.plan", "job.shard"}
    assert t["job.merge"].trigger_rule == "none_failed_min_one_success"  # runs after an empty plan, not a dry run
    # the review reads the sealed verdict where the plan task's spec says the run is, as publish does
    assert t["job.review"].upstream_task_ids == {"job.plan", "job.qa"} and t["job.review"].qa_task_id == "job.qa"
    assert t["job.extra"].upstream_task_ids == {"job.plan", "job.review"}
    # publish takes QA's XCom (the verdict QA sealed) and the review's (the verdict it approved), QA takes merge's
    # (the merge it sealed): all wired, required
    assert t["job.publish"].upstream_task_ids == {"job.plan", "job.extra", "job.qa", "job.review"}
    assert t["job.publish"].require_qa_result and t["job.qa"].require_merge_result
    assert t["job.publish"].require_review_result and t["job.publish"].review_result.operator is t["job.review"]
    assert t["job.merge"].require_shard_results and len(t["job.merge"].shard_results) == 1  # one runner's shards
    # merge takes the sealed plan the plan task named (its XCom under "plan"), not whatever plan the folder holds
    assert t["job.merge"].plan.operator is t["job.plan"] and t["job.merge"].plan.key == "plan"
    assert [a.uri for a in t["job.publish"].outlets] == ["x-vllm-batch://job"]  # templated output: a named asset


def test_builder_without_human_review_publishes_straight_after_qa():
    dag, _ = build(human_review=False)
    t = dag.task_dict
    assert "vllm_batch.review" not in t
    assert t["vllm_batch.publish"].upstream_task_ids == {"vllm_batch.plan", "vllm_batch.qa"}
    assert t["vllm_batch.publish"].review_result is None and not t["vllm_batch.publish"].require_review_result


def test_builder_static_output_is_the_asset_and_runner_switch():
    _, _ = build()
    dag, _ = build(asset="s3://bucket/table")
    assert dag.task_dict["vllm_batch.publish"].outlets[0].uri == "s3://bucket/table"
    dag, _ = build(runner="kubernetes")
    assert type(dag.task_dict["vllm_batch.shard"]).__name__ == "MappedOperator"
    assert dag.task_dict["vllm_batch.shard"].operator_class.__name__ == "VllmKubernetesShardOperator"
    with pytest.raises(ValueError, match="runner='docker'"):
        build(runner="docker")
    dag, _ = build(runner="{{ params.runner }}")
    assert dag.task_dict["vllm_batch.plan"].runner == "{{ params.runner }}"
    assert dag.task_dict["vllm_batch.runner"].shard_tasks == {
        "local": "vllm_batch.shard",
        "kubernetes": "vllm_batch.shard_kubernetes",
    }
    assert dag.task_dict["vllm_batch.runner"].downstream_task_ids == {"vllm_batch.shard", "vllm_batch.shard_kubernetes"}
    assert dag.task_dict["vllm_batch.shard"].operator_class.__name__ == "VllmLocalShardOperator"
    assert dag.task_dict["vllm_batch.shard_kubernetes"].operator_class.__name__ == "VllmKubernetesShardOperator"
    assert dag.task_dict["vllm_batch.merge"].upstream_task_ids >= {"vllm_batch.shard", "vllm_batch.shard_kubernetes"}


def build_static(io, **kw):
    import pendulum
    from airflow.sdk import DAG

    from airflow_provider_vllm.task_groups.batch_job import vllm_batch_job

    with DAG("t", schedule=None, start_date=pendulum.datetime(2026, 1, 1)) as dag:
        vllm_batch_job({"model": {"name": "m"}, "io": io}, group_id="job", **kw)
    return dag


@pytest.mark.parametrize(
    "io, inlets, outlets",
    [
        (
            {"input_uri": "s3://in-bucket/tickets/", "output_uri": "s3://out-bucket/labels/"},
            ["s3://in-bucket/tickets"],
            ["s3://out-bucket/labels"],
        ),
        (
            {"input_uri": "/data/tickets/", "output_uri": "/data/labels/"},
            ["file:///data/tickets"],
            ["file:///data/labels"],
        ),
        ({"input_uri": "/data/dt={{ ds }}/", "output_uri": "s3://out-bucket/dt={{ ds }}/"}, [], ["x-vllm-batch://job"]),
    ],
)
def test_builder_static_locations_are_real_asset_uris_templated_ones_fall_back(io, inlets, outlets):
    t = build_static(io).task_dict
    assert [a.uri for a in t["job.plan"].inlets] == inlets
    assert [a.uri for a in t["job.publish"].outlets] == outlets


@pytest.mark.parametrize(
    "runner, shard_ids",
    [
        ("local", ["job.shard"]),
        ("kubernetes", ["job.shard"]),
        ("{{ params.runner }}", ["job.shard", "job.shard_kubernetes"]),
    ],
)
def test_shard_task_kwargs_reach_the_mapped_shard_tasks_of_both_runners(runner, shard_ids):
    io = {"input_uri": "/data/in/", "output_uri": "/data/out/"}
    dag = build_static(
        io,
        runner=runner,
        shard_retries=1,
        shard_task_kwargs={"pool": "gpu", "queue": "gpu", "priority_weight": 7, "retries": 4},
    )
    for task_id in shard_ids:
        shard = dag.task_dict[task_id]
        assert shard.is_mapped
        kw = shard.partial_kwargs
        assert (shard.pool, shard.queue, shard.priority_weight) == ("gpu", "gpu", 7), task_id
        assert kw["retries"] == 4  # wins over shard_retries
        assert "task.shard.get('name')" in kw["map_index_template"]  # the builder's own keys stay
    assert dag.task_dict["job.merge"].pool != "gpu"  # only the shard tasks


@pytest.mark.parametrize(
    "key",
    [
        "task_id",
        "map_index_template",
        "spec",
        "python",
        "env",
        "service_account_name",
        "run_as_user",
        "trust",
        "namespace",
    ],
)
def test_shard_task_kwargs_refuses_keys_that_break_the_contract(key):
    with pytest.raises(ValueError, match=rf"shard_task_kwargs \['{key}'\]"):
        build_static({"input_uri": "/d/in", "output_uri": "/d/out"}, shard_task_kwargs={key: "x"})


@pytest.mark.parametrize("key", ["pod_template_dict", "full_pod_spec", "pod_template_file"])
def test_kubernetes_operator_kwargs_refuses_pod_spec_parts_the_provider_does_not_check(key):
    """A pod template or a full pod spec beside the checked settings would add containers, host mounts or host
    networking the provider never sees; the cluster Connection still passes through."""
    with pytest.raises(ValueError, match=rf"kubernetes_operator_kwargs \['{key}'\]"):
        build_static(
            {"input_uri": "/d/in", "output_uri": "/d/out"}, runner="kubernetes", kubernetes_operator_kwargs={key: {}}
        )
    dag = build_static(
        {"input_uri": "/d/in", "output_uri": "/d/out"},
        runner="kubernetes",
        kubernetes_operator_kwargs={"kubernetes_conn_id": "gpu_cluster"},
    )
    assert dag.task_dict["job.shard"].partial_kwargs["kubernetes_conn_id"] == "gpu_cluster"


@pytest.mark.parametrize("run_id", ["-", ":", "+", "~", "--", ".", "..", "a:b", "a+b", "a~b", "a" * 300])
def test_path_safe_gives_every_run_id_a_folder_of_its_own(run_id):
    """The re-run's default output is ``<root>/reruns/{{ run_id | path_safe }}/``. Run ids Airflow accepts
    (``^[A-Za-z0-9_.~:+-]+$``) that held nothing readable made it the shared ``reruns`` folder, and ``a:b`` /
    ``a+b`` shared one: now one non-empty segment per run id (its readable part and a hash), inside the allow-list."""
    import re

    import jinja2

    from airflow_provider_vllm.core.allow_list import check_uri
    from airflow_provider_vllm.task_groups.batch_job import TEMPLATE_FILTERS

    env = jinja2.Environment()
    env.filters.update(TEMPLATE_FILTERS)
    render = env.from_string("s3://bk/root/reruns/{{ run_id | path_safe }}/").render
    canon = check_uri(render(run_id=run_id), ["s3://bk/root"], "io.output_uri")
    segment = canon.removeprefix("s3://bk/root/reruns/")
    assert segment and "/" not in segment and segment not in (".", "..") and len(segment) <= 120
    assert re.fullmatch(r"[A-Za-z0-9_.=-]+", segment)
    others = ["-", ":", "+", "a:b", "a+b", "a-b", "manual__2026-12-05T03:00:00+00:00"]
    assert {TEMPLATE_FILTERS["path_safe"](r) for r in others if r != run_id}.isdisjoint({segment})
    readable = TEMPLATE_FILTERS["path_safe"]("manual__2026-12-05T03:00:00+00:00")
    assert readable.startswith("manual__2026-12-05T03-00-00-00-00-")  # still says which run it is


def test_shard_task_kwargs_refuses_what_is_not_a_base_operator_argument():
    with pytest.raises(ValueError, match=r"\['deferrable'\]: not BaseOperator arguments"):
        build_static({"input_uri": "/d/in", "output_uri": "/d/out"}, shard_task_kwargs={"deferrable": False})


# ---- provider registration -------------------------------------------------------------


def test_provider_info_lists_importable_operators_and_importing_the_package_needs_no_airflow():
    import importlib
    import subprocess

    import airflow
    import jsonschema
    from airflow.sdk import BaseOperator

    import airflow_provider_vllm

    info = airflow_provider_vllm.provider.get_provider_info()
    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    jsonschema.validate(info, schema)
    (ops,) = info["operators"]
    for name in ops["python-modules"]:
        mod = importlib.import_module(name)
        assert any(
            isinstance(v, type) and issubclass(v, BaseOperator) and v.__module__ == name for v in vars(mod).values()
        ), name
    code = (
        "import sys, airflow_provider_vllm.provider; airflow_provider_vllm.provider.get_provider_info(); "
        "assert not [m for m in sys.modules if m == 'airflow' or m.startswith('airflow.')], 'airflow imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})


def test_airflow_lists_the_provider(airflow_sandbox):
    p = airflow_sandbox.run("providers", "get", "airflow-provider-vllm", "--full", "-o", "json")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "airflow_provider_vllm.operators.shard" in p.stdout and "vLLM batch inference" in p.stdout
    p = airflow_sandbox.run("providers", "list", "-o", "json")
    listed = {e["package_name"]: e for e in json.loads(p.stdout[p.stdout.index("[") :])}
    assert listed["airflow-provider-vllm"]["version"] == "0.1.0"


def test_an_empty_input_plans_no_shard_and_still_merges_and_publishes(tmp_path):
    import pyarrow as pa

    from airflow_provider_vllm.operators import (
        VllmMergeOperator,
        VllmPlanOperator,
        VllmPublishOperator,
        VllmQAOperator,
    )

    write_parquet(tmp_path / "in" / "p.parquet", pa.array([], pa.string()), pa.array([], pa.string()))
    ctx = context()
    assert VllmPlanOperator(task_id="plan", spec=spec_doc(tmp_path)).execute(ctx) == []
    spec = ctx["ti"].xcoms["spec"]
    # a plan of no shard still names its sealed plan for merge (no shard value carries it)
    assert VllmMergeOperator(task_id="merge", spec=spec, plan=ctx["ti"].xcoms["plan"]).execute(context())["rows"] == 0
    assert VllmQAOperator(task_id="qa", spec=spec).execute(context())["status"] == "pass"
    assert VllmPublishOperator(task_id="publish", spec=spec).execute(context())["rows"] == 0
