"""Every environment variable the package reads, declared once: name, default, one-line description.

Read at call time (``VAR.get()``, ``VAR.flag()``), so a test that sets the environment sees the
change; pass ``env`` to read from a mapping instead of the process environment. An unset or empty
variable gives the default. Nothing else in the package reads ``os.environ``
(``tests/unit/core/test_envs.py`` checks). The table in ``docs/environment.md`` is ``markdown_table()``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, default (None: unset) and what it does."""

    name: str
    default: str | None
    description: str
    read_by: str  # "worker" (the pod / child process), "airflow" (the task process), "tests", or several

    def get(self, env: Mapping[str, str] | None = None) -> str | None:
        """The value (whitespace stripped) from ``env`` (default: the process environment), else the default."""
        value = environ(env).get(self.name)
        value = value.strip() if value is not None else ""
        return value if value else self.default

    def value(self, env: Mapping[str, str] | None = None) -> str:
        """``get`` for a variable with a default (never None)."""
        value = self.get(env)
        if value is None:
            raise ValueError(f"{self.name} is not set and has no default")
        return value

    def drop(self) -> None:
        """Remove the variable from this process's environment (child processes no longer inherit it)."""
        os.environ.pop(self.name, None)

    def flag(self, env: Mapping[str, str] | None = None) -> bool:
        """A yes/no switch: "1", "true" or "yes" (any case) -> True, anything else False."""
        return str(self.get(env) or "").lower() in ("1", "true", "yes")


# Names of variables that hold secrets (HF_TOKEN, AWS_SECRET_ACCESS_KEY, VLLM_API_KEY, ...): the worker masks their
# values in its output (worker/redact.py), and the engine identity names them by hash (core/engine_identity.py)
SECRET_NAME = re.compile(
    r"(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_KEY|ACCESS_KEY|PRIVATE_KEY|SIGNING_KEY|WORKER_KEY|SAS)", re.I
)


def secret_names(env: Mapping[str, str] | None = None) -> set[str]:
    """Names of ``env``'s variables that hold secrets: those ``SECRET_NAME`` matches, and those the deployment
    listed in ``VLLM_BATCH_MASKED_ENV`` (set from Secrets, whatever their names)."""
    e = environ(env)
    listed = {n.strip() for n in (SECRET_ENV_NAMES.get(e) or "").split(",") if n.strip()}
    # a Secret the pod takes whole (envFrom): its keys are the names of the files of its mounted folder
    for folder in (d.strip() for d in (SECRET_ENV_DIRS.get(e) or "").split(",") if d.strip()):
        try:
            listed |= {n for n in os.listdir(folder) if not n.startswith(".")}
        except OSError:
            continue
    return ({k for k in e if SECRET_NAME.search(k)} | (listed & set(e))) - {SECRET_ENV_NAMES.name, SECRET_ENV_DIRS.name}


def environ(env: Mapping[str, str] | None = None) -> Mapping[str, str]:
    """``env``, or the process environment (for code that scans all of it, e.g. secret redaction)."""
    return os.environ if env is None else env


def remove(names: Iterable[str]) -> None:
    """Take the variables ``names`` out of the process environment (secrets read once, or refused): the processes
    started after it, vLLM's and the model's code, never inherit them."""
    for name in names:
        os.environ.pop(name, None)


VARS: list[EnvVar] = []


def _var(name: str, default: str | None, description: str, read_by: str) -> EnvVar:
    v = EnvVar(name, default, description, read_by)
    VARS.append(v)
    return v


# ---- deployment rules handed to the worker by the Airflow side --------------------------------
ALLOWED_PREFIXES = _var(
    "VLLM_BATCH_ALLOWED_PREFIXES",
    None,
    "URI prefixes the worker may read and write (JSON list or comma/newline separated); "
    "set by the shard operators from [vllm_batch] allowed_uri_prefixes",
    "worker",
)
ALLOW_ANY_LOCATION = _var(
    "VLLM_BATCH_ALLOW_ANY_LOCATION", None, "1: the deployment allows any location (no allow-list)", "worker"
)
ALLOW_REMOTE_CODE = _var(
    "VLLM_BATCH_ALLOW_REMOTE_CODE", None, "1: trust_remote_code and code-loading engine options are allowed", "worker"
)

SIGNING_KEY = _var(
    "VLLM_BATCH_SIGNING_KEY",
    None,
    "the deployment's signing key(s) for the pipeline's steps run outside Airflow (scripts, benchmarks, tests; "
    "Airflow tasks read [vllm_batch] signing_key). Never a worker's: a worker that finds it in its environment "
    "refuses to start. Never logged",
    "scripts, tests",
)

WORKER_KEY = _var(
    "VLLM_BATCH_WORKER_KEY",
    None,
    "the shard worker's key(s) (vbw1. ..., comma separated, the first seals): derived from [vllm_batch] signing_key, "
    "they seal and check only the worker's chunks, commit markers and compile cache snapshots. The local runner sets "
    "it; pods get it from the Secret named by [vllm_batch] kubernetes_signing_secret (print it with python -m "
    "airflow_provider_vllm.cli.worker_key). Never logged",
    "worker",
)

# Variables that name the deployment's signing key (upper-cased prefixes): the steps' own and the Airflow option with
# its _CMD / _SECRET forms. No shard worker may hold one: the worker refuses them, the local runner strips them, and
# pod settings naming one (or the worker key, which only the operator sets) build no pod.
DEPLOYMENT_KEY_NAMES = (SIGNING_KEY.name, "AIRFLOW__VLLM_BATCH__SIGNING_KEY")
KEY_NAMES = (*DEPLOYMENT_KEY_NAMES, WORKER_KEY.name)


def names_a_key(name: str, prefixes: tuple[str, ...] = KEY_NAMES) -> bool:
    """Whether the variable ``name`` (any case) is one of ``prefixes``' (default: a deployment key's or the worker
    key's)."""
    return name.upper().startswith(prefixes)


SECRET_ENV_NAMES = _var(
    "VLLM_BATCH_MASKED_ENV",
    None,
    "names of the worker's variables the deployment set from Secrets (comma separated): the worker masks their "
    "values in all it prints and writes (logs, progress, manifests, error rows) and the engine identity names "
    "them by hash, whatever their names; set last by the shard operators (Kubernetes: `secret_env`, "
    "`hf_token_secret`, the worker key; local: the Connection's keys, the worker key), never by a job",
    "worker",
)

SECRET_ENV_DIRS = _var(
    "VLLM_BATCH_MASKED_ENV_DIRS",
    None,
    "folders (comma separated) where the pod mounts each Secret it takes whole (`env_from_secrets`): the names "
    "of their files are names of variables the worker masks as those of VLLM_BATCH_MASKED_ENV; set last by the "
    "Kubernetes shard operator",
    "worker",
)

# ---- worker process -------------------------------------------------------------------------
XCOM_DIR = _var(
    "VLLM_BATCH_XCOM_DIR",
    "/airflow/xcom",
    "folder where the worker also writes its manifest as return.json (the KPO XCom sidecar's)",
    "worker",
)
LOG_LEVEL = _var("VLLM_BATCH_LOG_LEVEL", "INFO", "the worker's log level", "worker")
SKIP_IMPORTS = _var(
    "VLLM_BATCH_SKIP_IMPORTS",
    "sklearn,scipy,opentelemetry,ray",
    "top-level modules kept out of the worker's process and of those vLLM spawns from it (its engine core), "
    "comma-separated, or `none`: transformers and vLLM "
    "import them whenever they are installed (scikit-learn, scipy and Ray through an Airflow venv's providers; "
    "OpenTelemetry's exporters with vLLM itself, for a tracing the worker never turns on), no task of the worker "
    "uses them, and they cost about a third of the worker's `import vllm` (worker/imports.py)",
    "worker",
)
HARDWARE = _var(
    "VLLM_BATCH_HARDWARE", None, "hardware name recorded in throughput history instead of the detected one", "worker"
)
PARENT_PID = _var(
    "VLLM_BATCH_PARENT_PID",
    None,
    "pid of the task process that started the worker (local runner): the worker ends with it",
    "worker",
)
LOCK_DIR = _var(
    "VLLM_BATCH_LOCK_DIR", None, "folder of the host-local shard locks (unset: $TMPDIR/vllm-batch-locks-$UID)", "worker"
)
ADAPTER_DIR = _var(
    "VLLM_BATCH_ADAPTER_DIR",
    None,
    "folder the worker copies the job's local and object store LoRA adapters into (unset: the system's temp "
    "folder; pods: the /cache emptyDir, as large as adapters may be)",
    "worker",
)
LOCK_WAIT_S = _var(
    "VLLM_BATCH_LOCK_WAIT_S",
    "600",
    "seconds a local worker waits for its shard's lock held by another worker",
    "worker",
)
RESOURCE_SAMPLE_S = _var(
    "VLLM_BATCH_RESOURCE_SAMPLE_S", "2", "seconds between two memory/GPU samples of the worker", "worker"
)
STORAGE_ATTEMPTS = _var(
    "VLLM_BATCH_STORAGE_ATTEMPTS",
    "6",
    "tries of a storage call on transient errors before the worker exits 75",
    "worker",
)
CUDA_VISIBLE_DEVICES = _var(
    "CUDA_VISIBLE_DEVICES", None, "GPU indices the worker may use (resource sampling only samples these)", "worker"
)

# ---- the shared compile cache (worker/compile_cache.py; off unless the deployment mounts one) -------
COMPILE_CACHE = _var(
    "VLLM_BATCH_COMPILE_CACHE",
    None,
    "folder shared by the shard pods where compile-cache snapshots are restored from and published to "
    "(set by the Kubernetes runner from [vllm_batch] kubernetes_compile_cache_pvc; unset: none)",
    "worker",
)
WORKER_IMAGE = _var(
    "VLLM_BATCH_IMAGE",
    None,
    "the image the Kubernetes runner started the worker from, as the deployment names it (set last, not "
    "overridable by a DAG or trigger); part of the shared compile cache's key, and one not pinned by digest "
    "(@sha256:) uses no shared cache (unset: the local runner)",
    "worker",
)
COMPILE_CACHE_PUBLISH = _var(
    "VLLM_BATCH_COMPILE_CACHE_PUBLISH",
    None,
    "0: restore snapshots but never publish one (pods that may run code from the model repo)",
    "worker",
)
VLLM_CACHE_ROOT = _var(
    "VLLM_CACHE_ROOT", None, "vLLM's cache folder (torch.compile artefacts); the pod's private copy", "worker"
)
TORCHINDUCTOR_CACHE_DIR = _var(
    "TORCHINDUCTOR_CACHE_DIR", None, "torch inductor's cache folder; the pod's private copy", "worker"
)
TRITON_CACHE_DIR = _var("TRITON_CACHE_DIR", None, "Triton's kernel cache folder; the pod's private copy", "worker")

# ---- worker metrics (off unless a push gateway or textfile folder is named) ----------------------
METRICS_PUSHGATEWAY = _var(
    "VLLM_BATCH_METRICS_PUSHGATEWAY",
    None,
    "Prometheus push gateway (host:port or URL) for the worker's metrics",
    "worker",
)
METRICS_TEXTFILE_DIR = _var(
    "VLLM_BATCH_METRICS_TEXTFILE_DIR",
    None,
    "node_exporter textfile collector folder for the worker's metrics",
    "worker",
)
METRICS_INTERVAL_S = _var(
    "VLLM_BATCH_METRICS_INTERVAL_S",
    None,
    "least seconds between two metric exports (unset: MetricsConfig's 15)",
    "worker",
)
METRICS_JOB = _var("VLLM_BATCH_METRICS_JOB", None, "push gateway job name (unset: vllm_batch)", "worker")
RUN_ID = _var("VLLM_BATCH_RUN_ID", None, "run label of the metrics (unset: first 12 hex of the spec hash)", "worker")

# ---- plan (Airflow task) -----------------------------------------------------------------------
FINGERPRINT_MEMO = _var(
    "VLLM_BATCH_FINGERPRINT_MEMO",
    None,
    "file that memoises the sha256 of local weights files by path, size, mtime, ctime, inode and device "
    "(result cache key); 'off': none (unset: airflow-provider-vllm/weights-fingerprints.json under "
    "$XDG_CACHE_HOME, else ~/.cache)",
    "airflow",
)
XDG_CACHE_HOME = _var("XDG_CACHE_HOME", None, "the user's cache folder (unset: ~/.cache)", "airflow")

# ---- fault injection (tests and drills only) ------------------------------------------------
FAULTS = _var(
    "VLLM_BATCH_FAULTS", None, "fault points to trigger in the data plane (core/faults.py)", "worker, airflow"
)
INJECT_EXIT = _var(
    "VLLM_BATCH_INJECT_EXIT",
    None,
    "MAP_INDEX:TRY:EXIT[,...]: the local runner replaces those worker tries by a process that exits EXIT",
    "airflow",
)

# ---- demo and test models ------------------------------------------------------------------------
MODEL_CACHE = _var(
    "VLLM_BATCH_MODEL_CACHE", ".cache/models", "folder of the demo/test models (testing/local_models.py)", "tests"
)


def by_name() -> dict[str, EnvVar]:
    return {v.name: v for v in VARS}


def markdown_table() -> str:
    """The variables as a Markdown table (docs/environment.md holds this text; a test keeps it equal)."""
    lines = ["| Variable | Default | Read by | What it does |", "|---|---|---|---|"]
    for v in VARS:
        default = f"`{v.default}`" if v.default is not None else "unset"
        lines.append(f"| `{v.name}` | {default} | {v.read_by} | {v.description} |")
    return "\n".join(lines) + "\n"
