"""Which object stores a local worker gets the Connections' identity for (also tests/airflow/test_connections.py)."""

from __future__ import annotations

from airflow_provider_vllm.hooks.filesystems import spec_schemes
from tests.support.data import make_spec


def test_a_table_jobs_input_scheme_comes_from_its_plan():
    spec = make_spec("/unused", "/out", io={"input_uri": None, "input_table": {"identifier": "lake.t"}})
    assert spec_schemes(spec) == {""}  # the (local) output only: the table's data files are not in the spec
    assert spec_schemes(spec, ["s3://lake/warehouse/lake/t/data"]) == {"", "s3"}
    folder = make_spec("s3://in/x/", "gs://out/y/")
    assert spec_schemes(folder) == {"s3", "gs"}


def test_a_local_worker_reads_an_object_store_adapter_with_the_connections_identity(monkeypatch):
    """The worker copies an s3:// / gs:// LoRA adapter again (worker/adapters.py): with local data it needs the
    Connection's identity for it, not the Airflow worker's ambient one; a hub adapter needs none."""
    from airflow_provider_vllm.core.spec import JobSpec
    from airflow_provider_vllm.hooks import filesystems

    monkeypatch.setattr(filesystems, "_aws_env", lambda conn_id: {"AWS_ACCESS_KEY_ID": f"from-{conn_id}"})

    def spec(source, **adapter):
        return JobSpec.load(
            {
                "model": {"name": "m", "adapters": [{"name": "a", "source": source, **adapter}]},
                "io": {"input_uri": "/i", "output_uri": "/o"},
            }
        )

    s3 = spec("s3://bk/adapters/a")
    assert spec_schemes(s3) == {"", "s3"}
    assert filesystems.worker_env(s3, "aws_batch", "google_cloud_default")["AWS_ACCESS_KEY_ID"] == "from-aws_batch"
    assert spec_schemes(spec("gs://bk/adapters/a")) == {"", "gs"}
    assert spec_schemes(spec("org/lora", revision="a" * 40)) == {""}
