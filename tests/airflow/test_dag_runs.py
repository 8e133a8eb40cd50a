"""The DAG templates end to end: real Airflow (`airflow dags test`, SQLite), real vLLM CPU.

The tiny random Llama stands in for the chat model (labels are meaningless, rows are real);
MiniLM embeds. One Airflow home for the module; each test uses its own dates and folders.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.support.airflow_env import tail
from tests.support.data import files_under, write_parquet

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

NIGHTLY = "vllm_nightly_reclassification"
RERUN = "vllm_batch_rerun"
DAY = "2026-11-27"


def write_day(data: Path, day: str, n: int) -> list[str]:
    from sample_tickets import write_tickets

    paths = write_tickets(data / "tickets" / f"dt={day}", n, seed=int(day[-2:]), truth_dir=data / "truth" / day)
    return pq.read_table(paths["tickets"], columns=["id"]).column("id").to_pylist()


def read_ids(out: Path) -> tuple[list[str], list[str]]:
    res = pq.read_table(out / "results", columns=["id"]).column("id").to_pylist()
    err = pq.read_table(out / "errors", columns=["id"]).column("id").to_pylist()
    return res, err


def states(db: dict, run_id: str | None = None) -> dict[tuple[str, int], str]:
    return {
        (t["task_id"].split(".")[-1], t["map_index"]): t["state"]
        for t in db["tis"]
        if run_id is None or t["run_id"] == run_id
    }


def local_states(db: dict, run_id: str) -> dict[tuple[str, int], str]:
    """``states`` of a local-runner run, less the runner branch and the skipped Kubernetes shard task."""
    st = states(db, run_id)
    assert st.pop(("runner", -1)) == "success" and st.pop(("shard_kubernetes", -1)) == "skipped"
    return st


def latest_run(db: dict) -> str:
    return db["runs"][-1]["run_id"]


@pytest.fixture(scope="module")
def nightly(airflow_sandbox):
    """One nightly run for DAY over 240 tickets in 2 shards."""
    box = airflow_sandbox
    ids = write_day(box.data, DAY, 240)
    p = box.dags_test(NIGHTLY, DAY, env={"AIRFLOW_VAR_VLLM_BATCH_SHARD_ROWS": "120"})
    out = box.data / "reclassification" / f"dt={DAY}"
    return {"proc": p, "ids": ids, "out": out, "db": box.inspect(NIGHTLY)}


def test_nightly_run_succeeds_with_complete_outputs(nightly):
    p, out, db = nightly["proc"], nightly["out"], nightly["db"]
    assert p.returncode == 0, tail(p)
    run_id = latest_run(db)
    plan = json.loads((out / "_plan.json").read_text())
    shard_ids = [s["shard_id"] for s in plan["shards"]]
    assert len(shard_ids) == 2
    assert local_states(db, run_id) == {
        ("plan", -1): "success",
        ("shard", 0): "success",
        ("shard", 1): "success",
        ("merge", -1): "success",
        ("qa", -1): "success",
        ("review", -1): "success",
        ("publish", -1): "success",
    }
    named = {t["map_index"]: t["rendered_map_index"] for t in db["tis"] if t["task_id"].endswith(".shard")}
    # the grid shows shard names; they count the rows the shards infer: 8 of the 240 tickets repeat an earlier
    # ticket's text and take its answer at merge (each distinct prompt once)
    assert named == {0: "shard 0/2 rows 0-115", 1: "shard 1/2 rows 116-231"}
    assert (plan["dedupe"]["leaders"], plan["dedupe"]["followers"]) == (232, 8)
    res, err = read_ids(out)
    assert sorted(res + err) == sorted(nightly["ids"]) and len(set(res + err)) == len(res + err)
    merged = json.loads((out / "_MERGED.json").read_text())
    assert merged["rows"] == 240 == merged["ok_rows"] + merged["error_rows"]
    assert merged["dedupe"]["followers"] == 8
    success = json.loads((out / "_SUCCESS.json").read_text())
    assert success["rows"] == 240 and success["qa"]["status"] != "fail"
    # the merged manifests as merge sealed them, and every QA file (and the change set) as QA wrote it
    assert success["checksums"].items() >= merged["checksums"].items()
    qa_files = ("qa/report.html", "qa/report.json", "qa/sample.parquet")
    assert {f: success["checksums"][f] for f in qa_files} == {
        f: hashlib.sha256((out / f).read_bytes()).hexdigest() for f in qa_files
    }
    newest = max((f for f in out.rglob("*") if f.is_file()), key=lambda f: f.stat().st_mtime_ns)
    assert newest.name == "_SUCCESS.json"  # written last
    # QA's verdict and the review's decision name this DAG run; publish decided from the sealed decision
    verdict = json.loads((out / "qa" / "_QA.json").read_text())
    decision = json.loads((out / "qa" / "_REVIEW.json").read_text())
    assert verdict["dag_run"] == decision["dag_run"] == {"dag_id": NIGHTLY, "run_id": run_id}
    assert decision["qa_record_mac"] == verdict["seal"]["mac"] and decision["approved"] is True
    assert decision["qa_status"] == verdict["status"] == success["qa"]["status"]
    assert success["review"]["review_mac"] == decision["seal"]["mac"]
    (event,) = [e for e in db["asset_events"] if e["run_id"] == run_id]
    assert event["uri"] == "x-vllm-batch://ticket_reclassification"
    assert event["extra"]["output_uri"] == f"{out}/" and event["extra"]["rows"] == 240
    spec = next(x["value"] for x in db["xcoms"] if x["key"] == "spec" and x["run_id"] == run_id)
    assert spec["io"]["input_uri"].endswith(f"/tickets/dt={DAY}/")  # rendered at run time, passed as data
    log = p.stdout + p.stderr
    assert "worker | " in log and " progress shard-" in log  # worker stderr streamed into the task log
    assert "QA report: " in log
    # nothing was published before (no event of the DAG's Asset): no change set, the churn check skipped
    pinned = json.loads((out / "_plan.json").read_text())["changes_from"]
    assert (pinned["source"], pinned["identifier"]) == ("published", "x-vllm-batch://ticket_reclassification")
    assert pinned["previous_uri"] is None and pinned.get("event_id") is None
    assert not (out / "changes").exists() and "changes" not in success["files"]
    report = json.loads((out / "qa" / "report.json").read_text())
    assert next(c for c in report["checks"] if c["name"] == "churn_rate")["status"] == "skip"


def test_the_next_night_infers_only_new_and_edited_tickets_and_lists_the_moved_labels(nightly, airflow_sandbox):
    """Day D+1 of the nightly template: 12 tickets edited, 5 gone, 6 new; the cache answers the rest."""
    import pyarrow as pa

    box, day2 = airflow_sandbox, "2026-11-28"
    assert nightly["proc"].returncode == 0
    day1 = pq.read_table(box.data / "tickets" / f"dt={DAY}").to_pylist()
    edited = {r["id"] for i, r in enumerate(day1) if i % 20 == 7}
    gone = {r["id"] for r in day1[:5]}
    rows = [
        {**r, "text": r["text"] + " It happened again today." if r["id"] in edited else r["text"]}
        for r in day1
        if r["id"] not in gone
    ]
    rows += [
        {"id": f"new-{i}", "text": f"I was charged twice for order {i}, please refund", "channel": "email"}
        for i in range(6)
    ]
    (box.data / "tickets" / f"dt={day2}").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), box.data / "tickets" / f"dt={day2}" / "tickets.parquet")
    p = box.dags_test(NIGHTLY, day2, env={"AIRFLOW_VAR_VLLM_BATCH_SHARD_ROWS": "120"})
    assert p.returncode == 0, tail(p)
    out1, out2 = nightly["out"], box.data / "reclassification" / f"dt={day2}"
    ok1 = set(read_ids(out1)[0])
    plan = json.loads((out2 / "_plan.json").read_text())
    assert plan["cache"]["hits"] == len(ok1 - gone - edited)  # only edited and new tickets reach the engine
    assert plan["cache"]["misses"] == len(rows) - plan["cache"]["hits"]

    def labels(out):
        return dict(zip(*pq.read_table(out / "results", columns=["id", "label"]).to_pydict().values()))

    old, new = labels(out1), labels(out2)
    moved = {i for i in set(old) & set(new) if old[i] != new[i]}
    assert moved <= edited  # an unedited ticket keeps its label (answered by the cache)
    changes = {r["id"]: r for r in pq.read_table(out2 / "changes" / "changes.parquet").to_pylist()}
    assert {i for i, r in changes.items() if r["change"] == "changed"} == moved
    assert {i for i, r in changes.items() if r["change"] == "removed"} == gone
    assert {i for i, r in changes.items() if r["old_status"] is None} == {f"new-{i}" for i in range(6)}
    summary = json.loads((out2 / "changes" / "_changes.json").read_text())
    assert summary["previous_state"] == "complete" and summary["previous_uri"] == f"{out1}/"
    # the baseline came from Airflow's metadata database: the event night 1's publish task emitted, and the merge
    # its sealed _SUCCESS.json names
    pinned = plan["changes_from"]
    (event,) = [e for e in airflow_sandbox.inspect(NIGHTLY)["asset_events"] if e["extra"]["output_uri"] == f"{out1}/"]
    assert pinned["source"] == "published" and pinned["event_id"] == event["id"]
    assert event["extra"]["logical_date"].startswith(DAY)  # ordered by the runs' logical dates
    success1 = json.loads((out1 / "_SUCCESS.json").read_text())
    assert pinned["results_manifest_sha256"] == success1["checksums"]["results/_manifest.json"]
    report = json.loads((out2 / "qa" / "report.json").read_text())
    assert report["metrics"]["cache"]["hits"] == plan["cache"]["hits"]
    # QA's drift baseline is the same published run: its report, as night 1's _SUCCESS.json names it
    assert pinned["report_sha256"] == success1["checksums"]["qa/report.json"]
    assert report["metrics"]["previous"]["run"]["output_uri"] == f"{out1}/"
    assert report["metrics"]["label_drift"]["tvd"] is not None
    churn = next(c for c in report["checks"] if c["name"] == "churn_rate")
    assert churn["value"] == summary["churn_rate"] == len(moved) / summary["in_both"]
    assert json.loads((out2 / "_SUCCESS.json").read_text())["files"]["changes"] == "changes/changes.parquet"


def test_a_rerun_compared_with_the_nightly_writes_what_changed(nightly, airflow_sandbox):
    """The re-run form's 'Compare with' (changes.previous_uri) against the nightly output of the same tickets."""
    from airflow_provider_vllm.task_groups.batch_job import TEMPLATE_FILTERS

    box = airflow_sandbox
    assert nightly["proc"].returncode == 0
    conf = {
        "input_uri": str(box.data / "tickets" / f"dt={DAY}"),
        "compare_with": f"{nightly['out']}/",
        "shard_rows": 240,  # one shard, one engine start: the nightly run above has the two-shard case
    }
    p = box.dags_test(RERUN, "2026-11-23", conf=conf)
    assert p.returncode == 0, tail(p)
    db = box.inspect(RERUN)
    run_id = latest_run(db)
    assert set(local_states(db, run_id).values()) == {"success"}
    out = box.data / "reruns" / TEMPLATE_FILTERS["path_safe"](run_id)
    changes = json.loads((out / "changes" / "_changes.json").read_text())
    assert changes["previous_state"] == "complete" and changes["previous_uri"] == f"{nightly['out']}/"
    c = changes["counts"]
    assert changes["ids"] == 240 and c["added"] == 0 and c["removed"] == 0
    assert changes["in_both"] + c["error"] + c["recovered"] == 240
    rows = pq.read_table(out / "changes" / "changes.parquet").to_pylist()
    assert sorted(r["id"] for r in rows) == sorted(nightly["ids"])
    report = json.loads((out / "qa" / "report.json").read_text())
    assert report["metrics"]["changes"]["counts"] == c
    assert any(ch["name"] == "churn_rate" and ch["status"] != "skip" for ch in report["checks"])


def test_clearing_and_rerunning_a_finished_run_gives_identical_outputs(nightly, airflow_sandbox):
    box, out = airflow_sandbox, nightly["out"]
    assert nightly["proc"].returncode == 0
    before = files_under(out)
    merged_before = json.loads(before["_MERGED.json"])
    p = box.run("tasks", "clear", "-y", "-s", DAY, "-e", DAY, NIGHTLY)
    assert p.returncode == 0, tail(p)
    p = box.dags_test(NIGHTLY, DAY, env={"AIRFLOW_VAR_VLLM_BATCH_SHARD_ROWS": "120"})
    assert p.returncode == 0, tail(p)
    db = box.inspect(NIGHTLY)
    run_id = latest_run(db)
    assert set(local_states(db, run_id).values()) == {"success"}
    manifests = [
        x["value"]
        for x in db["xcoms"]
        if x["run_id"] == run_id and x["task_id"].endswith(".shard") and x["key"] == "return_value"
    ]
    assert [m["status"] for m in manifests] == ["already_committed"] * 2  # no shard recomputed
    after = files_under(out)
    merged_after = json.loads(after["_MERGED.json"])
    assert merged_after["checksums"] == merged_before["checksums"]
    for rel in ("results/_manifest.json", "errors/_manifest.json", "_plan.json"):
        assert after[rel] == before[rel], rel
    assert {k: v for k, v in after.items() if "_COMMITTED" in k} == {
        k: v for k, v in before.items() if "_COMMITTED" in k
    }
    res, err = read_ids(out)
    assert len(res) + len(err) == len(set(res + err)) == 240


def test_rerun_dag_from_params_retries_an_injected_shard_failure(airflow_sandbox, tiny_model):
    box = airflow_sandbox
    ids = [f"adhoc-{i:04d}" for i in range(90)]
    write_parquet(
        box.data / "adhoc" / "tickets.parquet",
        ids,
        [f"Please refund order {i}, I was charged twice." for i in range(90)],
    )
    conf = {
        "input_uri": str(box.data / "adhoc"),
        "model": tiny_model,
        "labels": ["billing", "bug", "other"],
        "shard_rows": 500,
        "max_tokens": 24,
        "temperature": 0.0,
    }
    p = box.dags_test(RERUN, "2026-11-20", conf=conf, env={"VLLM_BATCH_INJECT_EXIT": "0:1:75"})
    assert p.returncode == 0, tail(p)
    db = box.inspect(RERUN)
    run_id = latest_run(db)
    assert set(local_states(db, run_id).values()) == {"success"}
    (shard,) = [t for t in db["tis"] if t["run_id"] == run_id and t["task_id"] == "rerun.shard"]
    assert shard["try_number"] == 2  # the first try exited 75; Airflow retried it
    first = [h for h in db["history"] if h["run_id"] == run_id and h["task_id"] == "rerun.shard"]
    assert [h["try_number"] for h in first] == [1] and first[0]["state"] in ("failed", "up_for_retry")
    assert "fault injected by VLLM_BATCH_INJECT_EXIT: exit 75" in p.stdout + p.stderr
    event = next(x["value"] for x in db["xcoms"] if x["run_id"] == run_id and x["task_id"] == "rerun.publish")
    out = Path(event["output_uri"])
    assert out.parent == box.data / "reruns" and event["rows"] == 90
    res, err = read_ids(out)
    assert sorted(res + err) == sorted(ids) and len(set(res)) == len(res)
    labels = set(pq.read_table(out / "results", columns=["label"]).column("label").to_pylist())
    assert labels <= {"billing", "bug", "other"}  # the labels param reached the worker


BAD_PARAMS = {
    "unknown runner": {"runner": "docker"},
    "negative shard size": {"shard_rows": -5},
    "malformed uri": {"input_uri": "tickets dir/*.parquet"},
}
EMPTY_DAY = "2026-11-10"


@pytest.fixture(scope="module")
def engineless(airflow_sandbox) -> dict:
    """The runs below that start no engine, one after the other in one process (tests/airflow/cli_many.py):
    the invalid params through `airflow dags trigger` and through `airflow dags test`, a plan that fails on
    duplicate ids, an empty partition. What each test looks at, by name."""
    import pyarrow as pa

    box = airflow_sandbox
    write_parquet(box.data / "dups" / "part-0.parquet", ["a", "b", "a"], ["one ticket", "two tickets", "three"])
    write_parquet(
        box.data / "tickets" / f"dt={EMPTY_DAY}" / "tickets.parquet",
        pa.array([], pa.string()),
        pa.array([], pa.string()),
    )
    adhoc = {"input_uri": str(box.data / "adhoc")}
    rerun_runs, nightly_runs = len(box.inspect(RERUN)["runs"]), len(box.inspect(NIGHTLY)["runs"])
    triggered = box.cli_many(
        *(["dags", "trigger", RERUN, "-c", json.dumps({**adhoc, **bad})] for bad in BAD_PARAMS.values()),
        serialize=True,
    )
    docker, dups, empty = box.dags_test_many(
        (RERUN, "2026-11-21", {**adhoc, "runner": "docker"}, None),
        (RERUN, "2026-11-22", {"input_uri": str(box.data / "dups")}, None),
        (NIGHTLY, EMPTY_DAY, None, None),
    )
    return {
        "triggered": dict(zip(BAD_PARAMS, triggered)),
        "docker": docker,
        "dups": dups,
        "empty": empty,
        "new_rerun_runs": box.inspect(RERUN)["runs"][rerun_runs:],
        "new_nightly_runs": box.inspect(NIGHTLY)["runs"][nightly_runs:],
    }


def test_rerun_dag_refuses_invalid_params_before_any_task_runs(engineless):
    for name, result in engineless["triggered"].items():
        assert not result["ok"], f"{name}: accepted"
        assert "Invalid input for param" in result["error"], f"{name}: {result}"
    # `airflow dags test` creates its run through the same validation
    p = engineless["docker"]
    assert p.returncode != 0 and "Invalid input for param runner" in p.stdout + p.stderr, tail(p, 2000)
    # the only new re-run is the duplicate-ids one: no run was created for any invalid params, so no task ran
    (run,) = engineless["new_rerun_runs"]
    assert run["conf"]["input_uri"].endswith("/dups")


def test_plan_failures_are_terminal_and_no_shard_runs(airflow_sandbox, engineless):
    p = engineless["dups"]
    assert p.returncode != 0
    db = airflow_sandbox.inspect(RERUN)
    (run,) = engineless["new_rerun_runs"]
    tis = {t["task_id"].split(".")[-1]: t for t in db["tis"] if t["run_id"] == run["run_id"]}
    assert tis["plan"]["state"] == "failed" and tis["plan"]["try_number"] == 1  # no retry
    assert tis["shard"]["state"] == "upstream_failed" and tis["publish"]["state"] == "upstream_failed"
    assert tis["shard_kubernetes"]["state"] == "upstream_failed"
    assert "duplicate" in p.stdout + p.stderr


def test_an_empty_partition_maps_zero_shards_and_publishes_an_empty_result(airflow_sandbox, engineless):
    box, p = airflow_sandbox, engineless["empty"]
    assert p.returncode == 0, tail(p)
    (run,) = engineless["new_nightly_runs"]
    st = local_states(box.inspect(NIGHTLY), run["run_id"])
    assert st.pop(("shard", -1)) == "skipped" and set(st.values()) == {
        "success"
    }  # merge runs (none_failed_min_one_success)
    success = json.loads((box.data / "reclassification" / f"dt={EMPTY_DAY}" / "_SUCCESS.json").read_text())
    assert success["rows"] == 0


def test_embeddings_dag_builds_the_embedding_table(airflow_sandbox):
    from sample_tickets import write_kb

    box = airflow_sandbox
    write_kb(box.data / "knowledge_base", 60)
    p = box.dags_test("vllm_embeddings", "2026-11-15")
    assert p.returncode == 0, tail(p)
    db = box.inspect("vllm_embeddings")
    assert set(local_states(db, latest_run(db)).values()) == {"success"}
    out = box.data / "kb_embeddings" / "dt=2026-11-15"
    table = pq.read_table(out / "embeddings" / "embeddings.parquet")
    assert table.column_names == ["id", "vector", "model", "truncated"] and table.num_rows == 60
    rows = table.to_pylist()
    assert all(len(r["vector"]) == 384 for r in rows) and "minilm" in rows[0]["model"].lower()
    success = json.loads((out / "_SUCCESS.json").read_text())
    assert success["files"]["embedding_table"] == "embeddings/embeddings.parquet"
    assert (out / "_SUCCESS.json").stat().st_mtime_ns >= (out / "embeddings" / "embeddings.parquet").stat().st_mtime_ns
    import numpy as np

    # by id: rows of a repeated article come after the others (its twin's answer, one more part)
    v = np.array([r["vector"] for r in sorted(rows, key=lambda r: r["id"])])
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    sims = v @ v.T
    np.fill_diagonal(sims, -1)
    # articles i and i+10 share a topic: each one's nearest neighbour is on its topic
    assert all(sims[i].argmax() % 10 == i % 10 for i in range(60))
