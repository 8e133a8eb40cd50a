"""The Iceberg catalog from an Airflow Connection: the fields of Airflow's Iceberg provider, pyiceberg properties."""

from __future__ import annotations

import json

import pytest
from airflow.sdk import Connection
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.hooks import iceberg


def test_a_rest_connection_gives_uri_and_client_credential():
    conn = Connection(
        conn_id="iceberg_default",
        conn_type="iceberg",
        host="https://catalog.example.com/api/catalog",
        login="client-id",
        password="client-secret",
        extra=json.dumps({"warehouse": "lake", "scope": "PRINCIPAL_ROLE:ALL"}),
    )
    props = iceberg.catalog_properties(conn)
    assert props == {
        "uri": "https://catalog.example.com/api/catalog",
        "credential": "client-id:client-secret",
        "warehouse": "lake",
        "scope": "PRINCIPAL_ROLE:ALL",
    }


def test_a_sql_catalog_connection_loads_through_pyiceberg(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'c.db'}"
    extra = {"type": "sql", "uri": uri, "warehouse": f"file://{tmp_path}"}
    conn = Connection(conn_id="iceberg_lake", conn_type="iceberg", extra=json.dumps(extra))
    monkeypatch.setattr(Connection, "get", classmethod(lambda cls, conn_id: conn))
    catalog = iceberg.load_catalog_from_connection("iceberg_lake")
    assert type(catalog).__name__ == "SqlCatalog" and catalog.name == "iceberg_lake"
    conn.extra = json.dumps({**extra, "catalog-name": "lake"})  # a SQL catalog keys tables by the catalog's name
    assert iceberg.load_catalog_from_connection("iceberg_lake").name == "lake"


def test_the_deployment_names_the_connection_and_the_tables(monkeypatch):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ICEBERG_CONN_ID", "iceberg_lake")
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_TABLES", "lake.*")
    assert iceberg.iceberg_conn_id() == "iceberg_lake" and iceberg.allowed_tables() == ["lake.*"]
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_TABLES", "lake")
    with pytest.raises(AirflowFailException, match="allowed_tables"):
        iceberg.allowed_tables()
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__ALLOWED_TABLES")
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__ICEBERG_CONN_ID")
    assert iceberg.iceberg_conn_id() == "iceberg_default"
    assert iceberg.tables([]).catalog is None  # no table allowed: no catalog is reached


def test_catalog_credentials_reach_airflows_secrets_masker_wherever_the_connection_holds_them(monkeypatch):
    """Airflow masks a Connection's password, and its extra only as one whole string: until 2026-12 a token in the
    catalog's URI stood in clear in the traceback of a plan or publish task that could not reach the catalog
    (``Max retries exceeded with url: /?token=...``), and a token or key in the extra wherever a message put it."""
    import traceback

    from airflow.sdk._shared.secrets_masker import redact, reset_secrets_masker

    reset_secrets_masker()
    extra = {
        "type": "rest",
        "uri": "http://127.0.0.1:9/?token=URIs3cr3tTok",  # nothing listens there
        "token": "EXTRAs3cr3tTok",
        "s3.secret-access-key": "S3s3cr3tKey/abc",
        "warehouse": "lake",
    }
    conn = Connection(
        conn_id="iceberg_lake", conn_type="iceberg", login="client", password="PWs3cr3t", extra=json.dumps(extra)
    )
    monkeypatch.setattr(Connection, "get", classmethod(lambda cls, conn_id: conn))
    try:
        with pytest.raises(Exception) as e:  # requests' ConnectionError, naming the URL
            iceberg.load_catalog_from_connection("iceberg_lake")
        text = "".join(traceback.format_exception(e.value))
        assert "URIs3cr3tTok" in text  # what Airflow's task log would show, before the masker
        shown = redact(text + " EXTRAs3cr3tTok S3s3cr3tKey/abc client:PWs3cr3t lake")
        assert "s3cr3t" not in shown, shown
        assert "127.0.0.1" in shown and " lake" in shown  # the rest stays
    finally:
        reset_secrets_masker()


def test_a_catalog_password_with_a_slash_in_its_uri_reaches_the_masker():
    """SQLAlchemy reads ``user:pa/ss@host`` as the password ``pa/ss`` (a SQL catalog's URI in the Connection's extra);
    the userinfo pattern stopped at the first slash and handed nothing of it to the masker. An ``@`` in a URL's path
    or query is still not taken for userinfo."""
    from sqlalchemy.engine import make_url

    uri = "postgresql+psycopg2://cat_user:s3cr/et?x@db.example.com:5432/catalog"
    assert make_url(uri).password == "s3cr/et?x"
    found = iceberg.catalog_secrets({"type": "sql", "uri": uri})
    assert "s3cr/et?x" in found and "cat_user:s3cr/et?x" in found
    assert iceberg.catalog_secrets({"uri": "https://cat.example.com/api/catalog?owner=a@b.c"}) == []
