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
