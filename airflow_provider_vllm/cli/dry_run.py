"""Dry run: what a job would cost, before anything is launched.

    airflow vllm-batch dry-run examples/job.yaml [--set io.input_uri=/data/in/] [--json]
    python -m airflow_provider_vllm.cli.dry_run examples/job.yaml [the same options]
        [--gpu-memory-gib 139.8] [--gpus N] [--model-config path/config.json] [--tokens-per-s N]
        [--engine-start-s S] [--runner local|kubernetes] [--aws-conn-id ID] [--gcp-conn-id ID]

Validates the spec and the input (the plan step's checks, nothing written), then prints rows,
estimated prompt and output tokens, shards, estimated inference time and GPU-hours, and a GPU
memory plan from the model's config.json (``steps/plan/memory.py``) with the GPU layout it picks
(``choose_layout``: tensor_parallel_size and GPUs per shard pod, and why; with ``--gpus N``, the
shards to run at once). A spec whose engine.tensor_parallel_size cannot run (too small for the
model on a GPU of known memory, or one the heads do not divide over) is refused. Throughput comes from the
throughput history (``sharding.history_uri``, see ``sizing.py``) when it has records for the
model; otherwise from ``--tokens-per-s`` / ``--engine-start-s``, and the report says so.

``s3://`` and ``gs://`` locations are read the way the plan task reads them: through the Airflow
Connections ``[vllm_batch] aws_conn_id`` / ``gcp_conn_id`` (or ``--aws-conn-id`` / ``--gcp-conn-id``;
a Connection that does not exist means the provider's default credential chain).

Exit status: 0, or 2 on an invalid spec, dataset, option or location. Every error is one line on
stderr, ``dry run failed: ...``, naming the field, option or setting to change (no tracebacks).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from airflow_provider_vllm.core.errors import EXIT_TERMINAL, VllmBatchError

if TYPE_CHECKING:
    from airflow_provider_vllm.steps.plan.dry_run import DryRunReport

PROG = "python -m airflow_provider_vllm.cli.dry_run"
LOCATION_FIELDS = (
    "io.input_uri",
    "io.output_uri",
    "sharding.history_uri",
    "qa.previous_report_uri",
    "cache.uri",
    "changes.previous_uri",
)
MAX_DETAIL = 400


def positive_int(raw: str) -> int:
    n = int(raw)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


# (flags, argparse keyword arguments): one table for this module's parser and the Airflow CLI command
# (cli/definition.py). Defaults of None mean "the report's stated assumption".
ARGUMENTS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (("spec",), {"help": "job spec: YAML file (a 'job:' key or the spec at top level) or JSON file"}),
    (
        ("--set",),
        {
            "action": "append",
            "default": [],
            "metavar": "KEY=VALUE",
            "help": "override a spec field (dotted path or DAG param alias); VALUE is JSON or a string",
        },
    ),
    (("--gpu-memory-gib",), {"type": float, "help": "memory per GPU (default: from sharding.hardware / history)"}),
    (
        ("--gpus",),
        {"type": positive_int, "help": "GPU budget (GPUs the job may use at once): prints max_active_shards"},
    ),
    (("--model-config",), {"help": "the model's config.json when model.name is neither a folder nor cached"}),
    (("--tokens-per-s",), {"type": float, "help": "throughput without history (default: an assumed figure)"}),
    (("--engine-start-s",), {"type": float, "help": "engine start without history (default: an assumed figure)"}),
    (
        ("--runner",),
        {
            "choices": ["local", "kubernetes"],
            "help": "the shards' runner: with kubernetes, the engine start counts the deployment's shared compile "
            "cache (the vllm_batch kubernetes_compile_cache_pvc option): warm starts with it, cold without",
        },
    ),
    (("--json",), {"action": "store_true", "help": "print the report as JSON"}),
    # (no square brackets in help texts: Airflow's CLI renders them as markup)
    (
        ("--aws-conn-id",),
        {
            "help": "Airflow Connection for s3:// locations "
            "(default: the vllm_batch aws_conn_id option, else aws_default)"
        },
    ),
    (
        ("--gcp-conn-id",),
        {
            "help": "Airflow Connection for gs:// locations "
            "(default: the vllm_batch gcp_conn_id option, else google_cloud_default)"
        },
    ),
)


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a usage error as one line instead of the usage block and the error."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_TERMINAL, f"dry run failed: {message} (--help shows the options)\n")


def parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    for flags, kwargs in ARGUMENTS:
        ap.add_argument(*flags, **kwargs)
    return ap


def main(argv: list[str] | None = None) -> int:
    # Airflow and the providers log what they fall back to (a missing Connection, anonymous access) at
    # INFO and WARNING: not errors of the dry run. Set before Airflow configures its logging (on import).
    os.environ.setdefault("AIRFLOW__LOGGING__LOGGING_LEVEL", "ERROR")
    return run(parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """The dry run for parsed arguments: prints the report (stdout) or one error line (stderr); the exit status."""
    from airflow_provider_vllm.core.spec import JobSpec

    spec = None
    where = _Where()
    try:
        spec = JobSpec.from_yaml(args.spec)
        if args.set:
            spec = JobSpec.from_params(dict(_kv(s) for s in args.set), base=spec)
        cfg = _model_config(args.model_config)
        with _report_only_on_stdout():
            report = _report(spec, args, cfg, where)
    except Exception as e:  # noqa: BLE001 - every failure becomes one line naming what to change
        print(f"dry run failed: {describe(e, spec, where.last, args)}", file=sys.stderr)
        return e.exit_code if isinstance(e, VllmBatchError) else EXIT_TERMINAL
    from airflow_provider_vllm.steps.plan.dry_run import format_report

    print(json.dumps(report.dump(), indent=1) if args.json else format_report(report))
    return 0


def airflow_command(args: argparse.Namespace) -> None:
    """``airflow vllm-batch dry-run``: ``run``, with its exit status as the process's."""
    code = run(args)
    if code:
        raise SystemExit(code)


def _report(spec: Any, args: argparse.Namespace, cfg: dict | None, where: _Where) -> DryRunReport:
    from airflow_provider_vllm.hooks.filesystems import task_filesystems
    from airflow_provider_vllm.steps.plan.dry_run import ASSUMED_TOKENS_PER_S, dry_run_report

    where.filesystems = task_filesystems(args.aws_conn_id, args.gcp_conn_id)
    keyring = None
    if spec.cache.uri or spec.sharding.history_uri:  # only what this deployment's merge sealed counts (hits, history)
        from airflow_provider_vllm.utils.deployment import signing_keyring

        keyring = signing_keyring()
    warm = None
    if args.runner is not None:
        from airflow_provider_vllm.utils.deployment import warm_starts

        warm = warm_starts(spec, args.runner)
    return dry_run_report(
        spec,
        tokens_per_s=args.tokens_per_s if args.tokens_per_s is not None else ASSUMED_TOKENS_PER_S,
        engine_start_s=args.engine_start_s,
        warm_starts=warm,
        gpu_memory=args.gpu_memory_gib,
        model_config=cfg,
        gpus=args.gpus,
        filesystems=where,
        keyring=keyring,
    )


@contextlib.contextmanager
def _report_only_on_stdout() -> Iterator[None]:
    """While the report is computed, anything written to stdout goes to stderr, at the descriptor level
    (Airflow's log handlers hold the stdout stream they were configured with): stdout carries the report."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


class _Where:
    """The ``FileSystems`` factory of the run, remembering the last location asked for (to name it in an error)."""

    def __init__(self) -> None:
        self.filesystems: Any = None
        self.last: str | None = None

    def __call__(self, uri: str, options: dict[str, Any] | None = None):
        self.last = uri
        return self.filesystems(uri, options) if self.filesystems is not None else None


def _model_config(path: str | None) -> dict | None:
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model-config {path}: {_text(e)}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--model-config {path}: not a JSON object")
    return cfg


def describe(e: BaseException, spec: Any, uri: str | None, args: argparse.Namespace) -> str:
    """One line: the field (or option, or setting) and what went wrong, without a traceback."""
    if isinstance(e, VllmBatchError):
        return _text(e)
    field = _field(spec, uri)
    at = f"{field}={uri}" if field and uri else (uri or "the job spec")
    name = type(e).__name__
    scheme = (uri or "").partition("://")[0].lower() if "://" in (uri or "") else ""
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "NoAuthTokenError"):
        conn = args.aws_conn_id or "[vllm_batch] aws_conn_id (default aws_default)"
        return (
            f"{at}: no AWS credentials ({name}): the dry run reads s3:// through the Airflow Connection "
            f"{conn}; give it credentials, pass --aws-conn-id, or set the default AWS chain "
            "(AWS_PROFILE, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, an instance role)"
        )
    if name in ("DefaultCredentialsError", "RefreshError", "TransportError") and scheme in ("gs", "gcs"):
        conn = args.gcp_conn_id or "[vllm_batch] gcp_conn_id (default google_cloud_default)"
        return (
            f"{at}: no Google credentials ({name}): the dry run reads gs:// through the Airflow Connection "
            f"{conn}; give it a key, pass --gcp-conn-id, or set Application Default Credentials "
            "(GOOGLE_APPLICATION_CREDENTIALS)"
        )
    via = ""
    if scheme in ("s3", "s3a"):
        via = f" (s3:// is read through the Airflow Connection {args.aws_conn_id or '[vllm_batch] aws_conn_id'})"
    elif scheme in ("gs", "gcs"):
        via = f" (gs:// is read through the Airflow Connection {args.gcp_conn_id or '[vllm_batch] gcp_conn_id'})"
    if isinstance(e, FileNotFoundError):
        return f"{at}: not found ({_text(e)}){via}"
    if isinstance(e, PermissionError):
        return f"{at}: access denied ({_text(e)}){via}"
    if isinstance(e, (ValueError, argparse.ArgumentTypeError)) and uri is None:
        return _text(e)
    return f"{at}: {name}: {_text(e)}{via}"


def _field(spec: Any, uri: str | None) -> str | None:
    """The spec's location field ``uri`` lies under (the most specific one)."""
    if spec is None or not uri:
        return None
    best: tuple[int, str] | None = None
    for field in LOCATION_FIELDS:
        section, name = field.split(".")
        value = getattr(getattr(spec, section), name)
        if not value:
            continue
        root = str(value).rstrip("/")
        if (uri.rstrip("/") == root or uri.startswith(root + "/")) and (best is None or len(root) > best[0]):
            best = (len(root), field)
    return best[1] if best else None


def _text(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= MAX_DETAIL else text[: MAX_DETAIL - 3] + "..."


def _kv(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ValueError(f"--set {item!r}: expected KEY=VALUE")
    try:
        return key, json.loads(raw)
    except ValueError:
        return key, raw


if __name__ == "__main__":
    sys.exit(main())
