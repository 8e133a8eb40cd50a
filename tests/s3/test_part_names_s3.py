"""Names read back from bucket files never leave their run, on an S3-compatible server (moto).

The local-file twin is tests/unit/core/test_part_names.py. Here a key is a key (no symlinks),
but a manifest of the previous run may still name ``../other/...``, a glob, another bucket or an
absolute key: the changes step must refuse the previous run, naming the manifest and the name,
and write nothing under this run's ``changes/``. An object whose key holds glob characters is
planted too, so a name that reached DuckDB as a pattern would have something to match.
"""

from __future__ import annotations

import hashlib
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core import seal as seals
from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.records import MergeSummary, PartEntry, PartsManifest
from airflow_provider_vllm.core.rows import ERROR_SCHEMA, RESULT_SCHEMA
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.merge.changes import CHANGES, compute_changes
from airflow_provider_vllm.steps.merge.merger import ERRORS, MERGED, RESULTS
from tests.support.data import make_spec, merge_summary
from tests.support.ledger import record_malicious
from tests.support.s3server import MotoServer

pytestmark = pytest.mark.reliability

HOSTILE_NAMES = [
    "../other/results/part-00000.parquet",
    "../../other/results/part-00000.parquet",
    "/data/runs/other/results/part-00000.parquet",
    "data/runs/other/results/part-00000.parquet",
    "s3://data/runs/other/results/part-00000.parquet",
    "s3://other-team/results/part-00000.parquet",
    "sub/part-00000.parquet",
    "part-*.parquet",
    "part-0000[0-9].parquet",
    "part-0000?.parquet",
    "part-{00000,00001}.parquet",
    "**/part-00000.parquet",
    "../../*/results/part-*.parquet",
    "part-00000.parquet\n",
    "part-00000-x.parquet::s3://data/runs/other/results/part-00000.parquet",
    "part-00000-%2e%2e%2fother.parquet",
]


@pytest.fixture(scope="module")
def s3():
    with MotoServer() as server:
        server.make_bucket("data")
        yield server


def _parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def write_run(st: Storage, labels: dict[str, str]) -> bytes:
    """A merged run on S3 as merge lays it out; returns the bytes of its results part."""
    rows = [{"id": i, "label": v, "model": "fake", "config_hash": "c"} for i, v in labels.items()]
    for kind, table in (
        (RESULTS, pa.Table.from_pylist(rows, schema=RESULT_SCHEMA)),
        (ERRORS, ERROR_SCHEMA.empty_table()),
    ):
        data = _parquet(table)
        st.write_atomic(f"{kind}/part-00000.parquet", data)
        entry = PartEntry(
            name="part-00000.parquet", bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), rows=table.num_rows
        )
        manifest = PartsManifest(kind=kind, rows=table.num_rows, parts=[entry])  # type: ignore[arg-type]
        st.write_atomic(f"{kind}/_manifest.json", manifest.model_dump_json().encode())
    summary = merge_summary(len(labels), len(labels), 0).model_copy(update={"task": "chat", "id_column": "id"})
    _seal_summary(st, summary)
    return _parquet(pa.Table.from_pylist(rows, schema=RESULT_SCHEMA))


def _seal_summary(st: Storage, summary: MergeSummary) -> None:
    """``_MERGED.json`` naming the sha256 of the manifests there now, sealed with the test deployment's key for
    this run's folder: as a merge writes it, or (after a manifest edit) what only a holder of the key (a merge
    with a bug) could write; a writer without the key is already refused by the seal (test_trust_s3.py)."""
    checksums = {f"{k}/_manifest.json": st.sha256(f"{k}/_manifest.json") for k in (RESULTS, ERRORS)}
    summary = summary.model_copy(update={"checksums": checksums, "seal": None})
    st.write_atomic(
        MERGED,
        seals.record_bytes(seals.seal_record(Keyring.from_env(), seals.MERGED, seals.scope_of(st.uri()), summary)),
    )


@pytest.mark.parametrize("kind", [RESULTS, ERRORS])
def test_changes_refuses_a_previous_run_whose_manifest_names_a_path_on_s3(s3, monkeypatch, kind):
    for k, v in s3.deployment_env.items():
        monkeypatch.setenv(k, v)
    root = f"s3://data/runs-{kind}"
    other, now = Storage(f"{root}/other"), Storage(f"{root}/now")
    secret = write_run(other, {"SECRET": "leaked"})
    write_run(now, {"a": "bug", "b": "other"})
    tried = rejected = 0
    # a fresh previous run per name: rewriting one run's manifest and summary over and over, moto answered
    # a GET right after an overwrite of the same key with the old bytes now and then
    for n, name in enumerate(HOSTILE_NAMES):
        prev = Storage(f"{root}/prev-{n}")
        write_run(prev, {"a": "bug", "b": "billing"})
        for planted in ("part-*.parquet", "part-00001-x.parquet", "part-0000[0-9].parquet"):
            prev.write_atomic(f"{RESULTS}/{planted}", secret)  # keys are keys: even '*' and '[' are valid
        man = json.loads(prev.read_bytes(f"{kind}/_manifest.json"))
        man["parts"].append(dict(man["parts"][0], name=name, bytes=len(secret), rows=1))
        prev.write_atomic(f"{kind}/_manifest.json", json.dumps(man).encode())
        _seal_summary(prev, MergeSummary.model_validate_json(prev.read_bytes(MERGED)))
        spec = make_spec("s3://data/in", f"{root}/now", changes={"previous_uri": prev.uri()})
        tried += 1
        with pytest.raises(CommitError) as e:
            compute_changes(spec)
        msg = str(e.value)
        assert "refusing the previous run" in msg and prev.uri(f"{kind}/_manifest.json") in msg, msg
        assert repr(name).strip("'") in msg, (name, msg)
        assert not now.exists(CHANGES) and not now.listdir("changes")
        rejected += 1
    record_malicious(f"previous_run_{kind}_manifest_names_s3", tried, rejected)
    # the control: the same previous run with its own manifest (and the planted files beside it) compares
    prev = Storage(f"{root}/prev-control")
    write_run(prev, {"a": "bug", "b": "billing"})
    for planted in ("part-*.parquet", "part-00001-x.parquet", "part-0000[0-9].parquet"):
        prev.write_atomic(f"{RESULTS}/{planted}", secret)
    spec = make_spec("s3://data/in", f"{root}/now", changes={"previous_uri": prev.uri()})
    assert compute_changes(spec).counts.changed == 1
    with now.open(CHANGES) as f:
        assert "SECRET" not in pq.read_table(f)["id"].to_pylist()
