"""The Iceberg catalog from an Airflow Connection, for the plan and publish tasks of table jobs.

The Connection id is the deployment's (``[vllm_batch] iceberg_conn_id``, default ``iceberg_default``), never a
trigger param, Variable, XCom or the job spec. Its fields follow Airflow's Iceberg provider: connection type
``iceberg``, ``host`` the catalog URI, ``login`` / ``password`` a REST catalog's OAuth client id and secret
(pyiceberg's ``credential``); the extra (a JSON object) holds any other pyiceberg catalog property: ``type``
(``rest``, ``sql``, ``glue``, ``hive``), ``warehouse``, ``uri`` (when ``host`` cannot hold it, e.g. a SQL
catalog's SQLAlchemy URL), ``s3.endpoint``, ...; ``catalog-name`` (default: the Connection id) is the catalog's
name, which a SQL catalog keys its tables by. ``tables(...)`` bundles the catalog with the deployment's
table rules for the pure steps (``steps/tables/``).
"""

from __future__ import annotations

import re
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.core.allow_list import CREDENTIAL_QUERY_NAMES
from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.provider import ALLOWED_TABLES, CONFIG_SECTION, ICEBERG_CONN_ID, setting
from airflow_provider_vllm.steps.tables.access import Tables, parse_allowed_tables

DEFAULT_ICEBERG_CONN_ID = "iceberg_default"  # Airflow's Iceberg provider's default
# The extra's key for the catalog's name (default: the Connection id). A SQL catalog keys its tables by it:
# a catalog database shared with Spark or Trino needs the name they use.
CATALOG_NAME = "catalog-name"
# pyiceberg properties that hold credentials (token, credential, s3.secret-access-key, s3.session-token,
# gcs.oauth2.token, adls.account-key, adls.sas-token, header.Authorization, rest.signing ...)
_SECRET_PROPERTY = re.compile(r"(token|credential|secret|password|passwd|account-key|sas|authorization)", re.I)
# userinfo: a user name up to the first ':' (no '/', '?' or '#'), then a password that may hold them (SQLAlchemy's
# URLs: ``user:pa/ss@host``)
_URI_USERINFO = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://([^/\s@?#:]*(?::[^\s@]*)?)@")
_URI_QUERY_CREDENTIAL = re.compile(
    r"[?&;][A-Za-z0-9_.-]*(?:" + "|".join(CREDENTIAL_QUERY_NAMES) + r")[A-Za-z0-9_.-]*=([^&;#\s]+)", re.I
)


def iceberg_conn_id() -> str:
    """``[vllm_batch] iceberg_conn_id`` (default ``iceberg_default``)."""
    from airflow.sdk.configuration import conf

    return (conf.get(CONFIG_SECTION, ICEBERG_CONN_ID, fallback="") or "").strip() or DEFAULT_ICEBERG_CONN_ID


def allowed_tables() -> list[str]:
    """``[vllm_batch] allowed_tables``; fails the task (no retry) when malformed."""
    from airflow.sdk.configuration import conf

    raw = conf.get(CONFIG_SECTION, ALLOWED_TABLES, fallback="") or ""
    try:
        return parse_allowed_tables(raw, setting(ALLOWED_TABLES))
    except SpecError as e:
        raise AirflowFailException(str(e)) from None


def catalog_properties(conn: Any) -> dict[str, str]:
    """pyiceberg catalog properties from a Connection's fields (see the module docstring)."""
    extra = conn.extra_dejson if conn.extra else {}
    if not isinstance(extra, dict):
        raise AirflowFailException(
            f"Connection {conn.conn_id!r}: the extra must be a JSON object of catalog properties"
        )
    props = {str(k): str(v) for k, v in extra.items()}
    if conn.host and "uri" not in props:
        host = conn.host if "://" in conn.host else f"{conn.schema or 'https'}://{conn.host}"
        props["uri"] = f"{host}:{conn.port}" if conn.port and "://" not in conn.host else host
    if (conn.login or conn.password) and "credential" not in props:
        props["credential"] = f"{conn.login or ''}:{conn.password or ''}"
    return props


def catalog_secrets(props: dict[str, str]) -> list[str]:
    """The credentials among catalog properties: the value of a property whose name says it holds one (``token``,
    ``credential``, ``s3.secret-access-key``, ``header.Authorization`` ...), and the userinfo and credential query
    parameters of any URI (``http://cat/?token=...``, ``postgresql://user:pass@db/x``)."""
    found: list[str] = []
    for key, value in props.items():
        if _SECRET_PROPERTY.search(key):
            found.append(value)
            found += [p for p in value.split(":", 1)[1:] if p]  # client-id:secret, the secret alone too
        for m in _URI_USERINFO.finditer(value):
            userinfo = m.group(1)
            found += [userinfo, userinfo.partition(":")[2]]
        found += [m.group(1) for m in _URI_QUERY_CREDENTIAL.finditer(value)]
    return [f for f in found if f]


def mask_catalog_secrets(props: dict[str, str]) -> None:
    """Hand the credentials among ``props`` to Airflow's secrets masker.

    Airflow masks a Connection's password, and its extra only as one whole string: a token in the extra, or in the
    catalog's URI, stood in clear wherever pyiceberg or its HTTP client put it in a message (a failed task's
    traceback names the URL it could not reach)."""
    from airflow.sdk.log import mask_secret

    for secret in catalog_secrets(props):
        mask_secret(secret)


def load_catalog_from_connection(conn_id: str) -> Any:
    """The pyiceberg catalog of Connection ``conn_id`` (named after it, or its extra's ``catalog-name``); fails the
    task when there is none."""
    from airflow.sdk import Connection
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        conn = Connection.get(conn_id)
    except AirflowNotFoundException as e:
        raise AirflowFailException(
            f"no Airflow Connection {conn_id!r} for the Iceberg catalog ({setting(ICEBERG_CONN_ID)}): {e}"
        ) from None
    try:
        from pyiceberg.catalog import load_catalog
    except ImportError:
        raise AirflowFailException(
            "table jobs need pyiceberg: install the provider's iceberg extra (airflow-provider-vllm[iceberg])"
        ) from None
    props = catalog_properties(conn)
    mask_catalog_secrets(props)
    name = props.pop(CATALOG_NAME, conn_id)
    try:
        return load_catalog(name, **props)
    except (ValueError, NotImplementedError) as e:
        raise AirflowFailException(f"Connection {conn_id!r} does not describe an Iceberg catalog: {e}") from None


def tables(uri_prefixes: list[str]) -> Tables:
    """The deployment's catalog and table rules (``uri_prefixes``: the canonical ``allowed_uri_prefixes``)."""
    allowed = allowed_tables()
    conn_id = iceberg_conn_id()
    if not allowed:  # fail before reaching any catalog
        return Tables(catalog=None, allowed=[], setting=setting(ALLOWED_TABLES), conn_id=conn_id)
    return Tables(
        catalog=load_catalog_from_connection(conn_id),
        allowed=allowed,
        setting=setting(ALLOWED_TABLES),
        conn_id=conn_id,
        uri_prefixes=uri_prefixes,
    )
