"""Object-store credentials from Airflow Connections, for the Airflow-side tasks and the report page.

Plan, merge, QA, publish and the QA report page reach S3 and GCS through the official
providers' fsspec helpers: ``airflow.providers.amazon.aws.fs.s3.get_fs(aws_conn_id)`` and
``airflow.providers.google.cloud.fs.gcs.get_fs(gcp_conn_id)``. The Connection ids are
deployment or DAG-file settings (operator and builder arguments, defaulting to
``[vllm_batch] aws_conn_id`` / ``gcp_conn_id``, else ``aws_default`` / ``google_cloud_default``),
never trigger params, XCom or the job spec, so the credentials and the endpoint never land in
the spec, XCom, ``_plan.json``, the worker's command line or a log line.

``ConnectionFileSystems`` is the ``storage.FileSystems`` factory the operators hand to the pure
modules (``plan_job(spec, filesystems=...)``); ``worker_env`` gives the local runner's worker
process the same identity through its environment (``AWS_ACCESS_KEY_ID`` ...), never its
arguments. Pods get theirs from workload identity or Secret references (docs/kubernetes.md).

What the Connection owns, the spec's ``io.storage_options`` cannot set: on S3 only
``config_kwargs`` timeouts/retries pass (as the helper's botocore config), on GCS only a few
read/consistency options. Anything else (endpoints, credentials, client kwargs, headers,
proxies) is refused with a message naming the Connection as the place for it.

A Connection id that does not exist falls back to the provider's default chain: the AWS
provider's own behaviour (environment, instance role, IRSA), and Application Default
Credentials (GKE Workload Identity) on GCS.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.storage import gcs_options
from airflow_provider_vllm.provider import AWS_CONN_ID as AWS_CONN_OPTION
from airflow_provider_vllm.provider import CONFIG_SECTION
from airflow_provider_vllm.provider import GCP_CONN_ID as GCP_CONN_OPTION

log = logging.getLogger(__name__)

DEFAULT_AWS_CONN_ID = "aws_default"  # the amazon provider's default
DEFAULT_GCP_CONN_ID = "google_cloud_default"  # the google provider's default
S3_SCHEMES = ("s3", "s3a")
GCS_SCHEMES = ("gs", "gcs")
# botocore Config fields a spec may tune; the rest (proxies, endpoints, signing, client certs,
# user agent) belongs to the Connection.
S3_CONFIG_KWARGS = frozenset(
    {
        "connect_timeout",
        "read_timeout",
        "retries",
        "max_pool_connections",
        "tcp_keepalive",
        "request_checksum_calculation",
        "response_checksum_validation",
    }
)
GCS_OPTIONS = frozenset({"consistency", "cache_timeout", "version_aware", "default_location"})


def scheme_of(uri: str) -> str:
    head, sep, _ = uri.partition("://")
    return head.lower() if sep else ""


def conn_ids_from_config(conf: Any, aws_conn_id: str | None = None, gcp_conn_id: str | None = None) -> tuple[str, str]:
    """``(aws_conn_id, gcp_conn_id)``: the arguments when given, else ``[vllm_batch]``, else the providers' defaults."""
    aws = aws_conn_id or (conf.get(CONFIG_SECTION, AWS_CONN_OPTION, fallback="") or "").strip() or DEFAULT_AWS_CONN_ID
    gcp = gcp_conn_id or (conf.get(CONFIG_SECTION, GCP_CONN_OPTION, fallback="") or "").strip() or DEFAULT_GCP_CONN_ID
    return aws, gcp


def s3_helper_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The spec's storage options as the amazon helper's ``storage_options`` (botocore config), or SpecError."""
    options = dict(options or {})
    other = sorted(k for k in options if k != "config_kwargs")
    if other:
        raise SpecError(
            f"io.storage_options {other}: with an Airflow Connection, the endpoint, region, credentials "
            "and client options of S3 come from the Connection (aws_conn_id), not the job spec; only "
            f"config_kwargs {sorted(S3_CONFIG_KWARGS)} may be set here"
        )
    config = options.get("config_kwargs") or {}
    if not isinstance(config, Mapping):
        raise SpecError("io.storage_options.config_kwargs must be a mapping")
    bad = sorted(k for k in config if k not in S3_CONFIG_KWARGS)
    if bad:
        raise SpecError(
            f"io.storage_options.config_kwargs {bad}: not allowed in a job spec (they belong to the "
            f"Connection); allowed: {sorted(S3_CONFIG_KWARGS)}"
        )
    return dict(config)


def gcs_helper_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The spec's storage options that a GCS Connection lets through, or SpecError."""
    options = dict(options or {})
    bad = sorted(k for k in options if k not in GCS_OPTIONS)
    if bad:
        raise SpecError(
            f"io.storage_options {bad}: with an Airflow Connection, the project, token, endpoint and "
            "session options of GCS come from the Connection (gcp_conn_id), not the job spec; "
            f"allowed here: {sorted(GCS_OPTIONS)}"
        )
    return options


def task_filesystems(aws_conn_id: str | None = None, gcp_conn_id: str | None = None) -> ConnectionFileSystems:
    """The factory for code running in an Airflow task (operators, ``@task`` functions of a DAG).

    ``aws_conn_id`` / ``gcp_conn_id``: DAG-file settings; None: ``[vllm_batch]`` config, else the
    providers' defaults. Read at run time from the task's Airflow configuration.
    """
    from airflow.sdk.configuration import conf

    return ConnectionFileSystems(*conn_ids_from_config(conf, aws_conn_id, gcp_conn_id))


class ConnectionFileSystems:
    """``storage.FileSystems`` from Airflow Connections: S3 and GCS through the providers' helpers.

    Other schemes (local paths, ``file://``, ``memory://``, ``abfs://``) return None: plain fsspec.
    One file system per (scheme, options) for the life of the object; the helpers are
    imported when first needed, so a deployment without the google provider reads S3 and
    local data all the same.
    """

    def __init__(
        self, aws_conn_id: str | None = DEFAULT_AWS_CONN_ID, gcp_conn_id: str | None = DEFAULT_GCP_CONN_ID
    ) -> None:
        self.aws_conn_id = aws_conn_id
        self.gcp_conn_id = gcp_conn_id
        self._cache: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ConnectionFileSystems(aws_conn_id={self.aws_conn_id!r}, gcp_conn_id={self.gcp_conn_id!r})"

    def __call__(self, uri: str, options: dict[str, Any] | None = None):
        scheme = scheme_of(uri)
        if scheme in S3_SCHEMES:
            config = s3_helper_options(options)
            return self._cached(("s3", repr(sorted(config.items()))), lambda: s3_fs(self.aws_conn_id, config))
        if scheme in GCS_SCHEMES:
            opts = gcs_helper_options(options)
            return self._cached(("gs", repr(sorted(opts.items()))), lambda: gcs_fs(self.gcp_conn_id, opts))
        return None

    def _cached(self, key: tuple, make):
        with self._lock:
            fs = self._cache.get(key)
            if fs is None:
                fs = self._cache[key] = make()
            return fs


def s3_fs(conn_id: str | None, config_kwargs: dict[str, Any] | None = None):
    """The amazon provider's S3 file system for ``conn_id`` (endpoint, region, keys from the Connection)."""
    try:
        from airflow.providers.amazon.aws.fs.s3 import get_fs
    except ImportError as e:
        raise SpecError(
            f"s3:// locations need apache-airflow-providers-amazon on the Airflow side "
            f"(pip install 'airflow-provider-vllm[s3]'): {e}"
        ) from None
    return get_fs(conn_id, dict(config_kwargs or {}) or None)


def gcs_fs(conn_id: str | None, options: dict[str, Any] | None = None):
    """The google provider's GCS file system for ``conn_id``; Application Default Credentials when it does not exist."""
    try:
        from airflow.providers.google.cloud.fs.gcs import get_fs
    except ImportError as e:
        raise SpecError(
            f"gs:// locations need apache-airflow-providers-google on the Airflow side "
            f"(pip install 'airflow-provider-vllm[gcs]'): {e}"
        ) from None
    if conn_id and not _connection_exists(conn_id):
        log.info("no Airflow Connection %r: GCS through Application Default Credentials", conn_id)
        conn_id = None
    options = gcs_options(options)  # the bytes GCS serves as they are (no gzip decoding): what is checked is read
    if conn_id is None:
        from gcsfs import GCSFileSystem  # what get_fs(None) builds, with the spec's allowed options

        return GCSFileSystem(**options)
    return get_fs(conn_id, options)


def _connection_exists(conn_id: str) -> bool:
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        from airflow.sdk import BaseHook

        BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        return False
    return True


# ---- the local runner's worker process ---------------------------------------------------
AWS_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL_S3",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
)


def spec_schemes(spec: Any, extra_uris: Sequence[str] = ()) -> set[str]:
    """Schemes of the locations a job's worker reads or writes (input, output, QA previous report, history, object
    store LoRA adapters, which the worker copies again), and of ``extra_uris`` (a table job's input root, which only
    its plan knows)."""
    uris = [
        *(a.source for a in spec.model.adapters if a.kind == "object_store"),
        *extra_uris,
        spec.io.input_uri,
        spec.io.output_uri,
        spec.qa.previous_report_uri,
        spec.qa.reference.golden_uri,
        spec.qa.reference.ride_along_uri,
        spec.sharding.history_uri,
        spec.cache.uri,
        spec.changes.previous_uri,
    ]
    return {scheme_of(u) for u in uris if u}


# the variables of worker_env that hold the Connection's secrets (the worker masks their values)
CONNECTION_SECRET_ENV = frozenset({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"})


def worker_env(
    spec: Any, aws_conn_id: str | None, gcp_conn_id: str | None, extra_uris: Sequence[str] = ()
) -> dict[str, str]:
    """Environment that gives the local worker process the Connection's object-store identity.

    S3: the Connection's (possibly assumed-role, temporary) keys, session token, region and S3
    endpoint as ``AWS_*`` variables; nothing when the job touches no ``s3://`` location or the
    provider finds no credentials (then the worker uses the default chain, as before). GCS:
    ``GOOGLE_APPLICATION_CREDENTIALS`` when the Connection names a key file (``key_path``);
    otherwise Application Default Credentials. Values go to the child's environment only.
    """
    schemes = spec_schemes(spec, extra_uris)
    env: dict[str, str] = {}
    if schemes & set(S3_SCHEMES) and aws_conn_id:
        env.update(_aws_env(aws_conn_id))
    if schemes & set(GCS_SCHEMES) and gcp_conn_id:
        env.update(_gcp_env(gcp_conn_id))
    return env


def _aws_env(conn_id: str) -> dict[str, str]:
    try:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook
    except ImportError as e:
        raise SpecError(f"s3:// locations need apache-airflow-providers-amazon on the Airflow side: {e}") from None
    hook = S3Hook(aws_conn_id=conn_id)
    creds = hook.get_session().get_credentials()
    env: dict[str, str] = {}
    if creds is not None:
        frozen = creds.get_frozen_credentials()  # one consistent set of refreshable credentials
        _mask(frozen.secret_key, frozen.token)
        env.update({"AWS_ACCESS_KEY_ID": frozen.access_key, "AWS_SECRET_ACCESS_KEY": frozen.secret_key})
        if frozen.token:
            env["AWS_SESSION_TOKEN"] = frozen.token
    endpoint = hook.conn_config.get_service_endpoint_url(service_name="s3")
    if endpoint:
        env["AWS_ENDPOINT_URL_S3"] = endpoint
    if hook.conn_config.region_name:
        env["AWS_DEFAULT_REGION"] = env["AWS_REGION"] = hook.conn_config.region_name
    return env


def _gcp_env(conn_id: str) -> dict[str, str]:
    if not _connection_exists(conn_id):
        return {}
    from airflow.sdk import BaseHook

    extra = BaseHook.get_connection(conn_id).extra_dejson
    key_path = extra.get("key_path") or extra.get("extra__google_cloud_platform__key_path")
    if key_path:
        return {"GOOGLE_APPLICATION_CREDENTIALS": str(key_path)}
    if extra.get("keyfile_dict") or extra.get("extra__google_cloud_platform__keyfile_dict"):
        log.warning(
            "Connection %r holds a key as keyfile_dict: the local worker cannot take it through its "
            "environment; give it a key_path or use Application Default Credentials",
            conn_id,
        )
    return {}


def _mask(*secrets: str | None) -> None:
    try:
        from airflow.sdk.log import mask_secret
    except ImportError:  # pragma: no cover - older task SDKs
        return
    for s in secrets:
        if s:
            mask_secret(s)


def child_env(base: Mapping[str, str], creds: Mapping[str, str]) -> dict[str, str]:
    """``base`` with the Connection's variables set; stale ambient ``AWS_*`` of the same identity removed.

    When the Connection supplied AWS keys, an ambient session token or endpoint from the
    Airflow worker's own environment must not be paired with them.
    """
    env = dict(base)
    if "AWS_ACCESS_KEY_ID" in creds:
        for k in AWS_ENV:
            env.pop(k, None)
    env.update(creds)
    return env
