"""Object-store access through Airflow Connections: the factory, the worker's environment, the wiring.

S3 end to end (moto) is in test_s3_connection.py. GCS goes through the real google provider
(``airflow.providers.google.cloud.fs.gcs.get_fs`` with a Connection) against
``gcp-storage-emulator`` on loopback.
"""

from __future__ import annotations

import json
import os

import pytest

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.hooks.filesystems import (
    DEFAULT_AWS_CONN_ID,
    DEFAULT_GCP_CONN_ID,
    ConnectionFileSystems,
    child_env,
    conn_ids_from_config,
    gcs_helper_options,
    s3_helper_options,
    worker_env,
)
from tests.support.data import make_spec
from tests.support.s3server import free_port

# gcsfs >= 2026 first asks the storage-control gRPC API whether a bucket is zonal/hierarchical,
# which the emulator does not serve (a 60 s timeout per bucket); the plain JSON API is what we use.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


@pytest.fixture(scope="module")
def gcs_endpoint():
    """``gcp-storage-emulator`` on loopback with a bucket ``gbucket``."""
    from gcp_storage_emulator.server import create_server

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="gbucket")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def gcp_connection(gcs_endpoint, monkeypatch):
    """``gcp_batch``: an anonymous Connection whose extra names the emulator (what the provider's get_fs reads)."""
    extra = {"is_anonymous": True, "project": "test", "gcs.endpoint": gcs_endpoint}
    monkeypatch.setenv("AIRFLOW_CONN_GCP_BATCH", json.dumps({"conn_type": "google_cloud_platform", "extra": extra}))
    return "gcp_batch"


def test_gcs_goes_through_the_google_providers_helper_with_the_connection(gcp_connection, tmp_path):
    """The real provider: its get_fs builds gcsfs from the Connection (endpoint, anonymous credentials)."""
    import gcsfs

    from airflow_provider_vllm.steps.plan.planner import plan_job
    from tests.support.data import write_parquet

    fs = ConnectionFileSystems(aws_conn_id="unused", gcp_conn_id=gcp_connection)
    st = Storage("gs://gbucket/runs/r1", {"consistency": "md5"}, fs)
    st.write_atomic("a.txt", b"hello")
    assert st.read_bytes("a.txt") == b"hello" and st.sub("x").filesystems is fs
    assert isinstance(st.fs, gcsfs.GCSFileSystem) and st.fs is fs("gs://gbucket/other", {"consistency": "md5"})
    assert st.fs.session_kwargs["auto_decompress"] is False  # GCS's bytes as stored (tests/s3/test_gcs_encoding.py)
    # a whole plan reads its input from GCS through the Connection
    local = write_parquet(tmp_path / "part-0.parquet", [f"g{i}" for i in range(9)], [f"ticket {i}" for i in range(9)])
    Storage("gs://gbucket/in", {}, fs).write_atomic("part-0.parquet", local.read_bytes())
    plan = plan_job(make_spec("gs://gbucket/in", tmp_path / "out", sharding={"target_rows": 4}), filesystems=fs)
    assert plan.total_rows == 9 and len(plan.shards) == 3


def test_a_missing_gcp_connection_means_application_default_credentials(gcs_endpoint, monkeypatch):
    """No Connection: gcsfs's own chain (ADC, then anonymous), not the provider's hook; STORAGE_EMULATOR_HOST
    is how gcsfs finds the emulator without a Connection."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint)
    monkeypatch.setenv("NO_GCE_CHECK", "True")  # no metadata server here: skip google-auth's probe of it
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    st = Storage("gs://gbucket/adc", {}, ConnectionFileSystems(gcp_conn_id="missing"))
    st.write_atomic("b.txt", b"adc")
    assert st.read_bytes("b.txt") == b"adc"
    assert st.fs.session_kwargs["auto_decompress"] is False
    # the local worker gets a key file's path through its environment, nothing for a missing Connection
    monkeypatch.setenv(
        "AIRFLOW_CONN_GCP_KEYFILE",
        json.dumps({"conn_type": "google_cloud_platform", "extra": {"key_path": "/var/secrets/key.json"}}),
    )
    spec = make_spec("gs://bucket/in", "gs://bucket/out")
    assert worker_env(spec, None, "gcp_keyfile") == {"GOOGLE_APPLICATION_CREDENTIALS": "/var/secrets/key.json"}
    assert worker_env(spec, None, "missing") == {}


@pytest.mark.parametrize(
    "options",
    [
        {"token": "ya29.secret"},
        {"endpoint_url": "http://127.0.0.1:1"},
        {"project": "other"},
        {"session_kwargs": {"proxy": "http://127.0.0.1:1"}},
    ],
)
def test_gcs_options_the_connection_owns_are_refused(gcp_connection, options):
    fs = ConnectionFileSystems(gcp_conn_id=gcp_connection)
    with pytest.raises(SpecError, match="gcp_conn_id"):
        _ = Storage("gs://gbucket/x", options, fs).fs
    assert fs._cache == {}  # refused before any file system was built


def test_s3_options_only_tune_botocore_timeouts_and_retries():
    assert s3_helper_options(None) == {}
    ok = {"config_kwargs": {"read_timeout": 5, "retries": {"max_attempts": 2}}}
    assert s3_helper_options(ok) == ok["config_kwargs"]
    for bad in (
        {"endpoint_url": "http://x"},
        {"key": "k", "secret": "s"},
        {"client_kwargs": {"region_name": "x"}},
        {"config_kwargs": {"proxies": {"https": "http://x"}}},
        {"config_kwargs": "x"},
        {"config_kwargs": {"signature_version": "UNSIGNED"}},
    ):
        with pytest.raises(SpecError):
            s3_helper_options(bad)
    assert gcs_helper_options({"consistency": "md5"}) == {"consistency": "md5"}
    for bad in ({"requester_pays": True}, {"access": "full_control"}, {"project": "other"}, {"token": "anon"}):
        with pytest.raises(SpecError, match=next(iter(bad))):
            gcs_helper_options(bad)


def test_other_schemes_use_plain_fsspec(tmp_path):
    fs = ConnectionFileSystems()
    assert fs(str(tmp_path), {}) is None and fs(f"file://{tmp_path}", {}) is None and fs("memory://x", {}) is None
    st = Storage(str(tmp_path), {}, fs)
    st.write_atomic("a", b"1")
    assert st.is_local and (tmp_path / "a").read_bytes() == b"1"


def test_connection_ids_come_from_arguments_then_config_then_provider_defaults():
    class Conf:
        def __init__(self, values):
            self.values = values

        def get(self, section, option, fallback=None):
            return self.values.get((section, option), fallback)

    assert (
        conn_ids_from_config(Conf({}))
        == (DEFAULT_AWS_CONN_ID, DEFAULT_GCP_CONN_ID)
        == ("aws_default", "google_cloud_default")
    )
    cfg = Conf({("vllm_batch", "aws_conn_id"): "team_s3", ("vllm_batch", "gcp_conn_id"): " team_gcs "})
    assert conn_ids_from_config(cfg) == ("team_s3", "team_gcs")
    assert conn_ids_from_config(cfg, "dag_s3", "dag_gcs") == ("dag_s3", "dag_gcs")


def test_the_workers_environment_takes_the_connection_over_stale_ambient_credentials():
    base = {"PATH": "/bin", "AWS_SESSION_TOKEN": "stale", "AWS_ACCESS_KEY_ID": "ambient", "AWS_PROFILE": "x"}
    got = child_env(base, {"AWS_ACCESS_KEY_ID": "conn", "AWS_SECRET_ACCESS_KEY": "s"})
    assert got == {"PATH": "/bin", "AWS_PROFILE": "x", "AWS_ACCESS_KEY_ID": "conn", "AWS_SECRET_ACCESS_KEY": "s"}
    assert child_env(base, {}) == base  # no Connection credentials: the worker keeps the default chain
    # a job that touches no object store asks no Connection at all
    assert worker_env(make_spec("/in", "/out"), "does_not_matter", "does_not_matter") == {}


def test_builder_passes_connections_to_every_airflow_side_task_and_the_cluster_to_the_pods():
    import pendulum
    from airflow.sdk import DAG

    from airflow_provider_vllm.task_groups.batch_job import vllm_batch_job

    spec = {"model": {"name": "m"}, "io": {"input_uri": "s3://b1/in/", "output_uri": "s3://b1/out/"}}
    with DAG("t", schedule=None, start_date=pendulum.datetime(2026, 1, 1)) as dag:
        vllm_batch_job(
            spec,
            group_id="j",
            runner="{{ params.runner }}",
            aws_conn_id="team_s3",
            gcp_conn_id="team_gcs",
            kubernetes_conn_id="gke",
            namespace="batch",
            in_cluster=False,
            kubernetes_operator_kwargs={"namespace": "overridden", "startup_timeout_seconds": 60},
        )
    t = dag.task_dict
    for tid in ("j.plan", "j.merge", "j.qa", "j.publish"):
        assert (t[tid].aws_conn_id, t[tid].gcp_conn_id) == ("team_s3", "team_gcs"), tid
    local = t["j.shard"].partial_kwargs
    assert (local["aws_conn_id"], local["gcp_conn_id"]) == ("team_s3", "team_gcs")
    pods = t["j.shard_kubernetes"].partial_kwargs
    assert pods["kubernetes_conn_id"] == "gke" and pods["namespace"] == "batch" and pods["in_cluster"] is False
    assert pods["startup_timeout_seconds"] == 60 and "aws_conn_id" not in pods  # pods: workload identity
    # conn ids are DAG-file settings: never templated, so a trigger param cannot pick one
    for tid in ("j.plan", "j.merge", "j.qa", "j.publish"):
        assert not {"aws_conn_id", "gcp_conn_id"} & set(t[tid].template_fields)
