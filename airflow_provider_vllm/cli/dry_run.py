"""Dry run: what a job would cost, before anything is launched.

    python -m airflow_provider_vllm.cli.dry_run examples/job.yaml [--set io.input_uri=/data/in/] [--json]
        [--gpu-memory-gib 139.8] [--gpus N] [--model-config path/config.json] [--tokens-per-s N]
        [--engine-start-s S]

Validates the spec and the input (the plan step's checks, nothing written), then prints rows,
estimated prompt and output tokens, shards, estimated inference time and GPU-hours, and a GPU
memory plan from the model's config.json (``steps/plan/memory.py``) with the GPU layout it picks
(``choose_layout``: tensor_parallel_size and GPUs per shard pod, and why; with ``--gpus N``, the
shards to run at once). A spec whose engine.tensor_parallel_size cannot run (too small for the
model on a GPU of known memory, or one the heads do not divide over) is refused. Throughput comes from the
throughput history (``sharding.history_uri``, see ``sizing.py``) when it has records for the
model; otherwise from ``--tokens-per-s`` / ``--engine-start-s``, and the report says so.
Exit status: 0, or 2 on an invalid spec or dataset (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from airflow_provider_vllm.core.errors import EXIT_TERMINAL, VllmBatchError
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.steps.plan.dry_run import (
    ASSUMED_ENGINE_START_S,
    ASSUMED_TOKENS_PER_S,
    dry_run_report,
    format_report,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m airflow_provider_vllm.cli.dry_run", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("spec", help="job spec: YAML file (a 'job:' key or the spec at top level) or JSON file")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec field (dotted path or DAG param alias); VALUE is JSON or a string",
    )
    ap.add_argument("--gpu-memory-gib", type=float, help="memory per GPU (default: from sharding.hardware / history)")
    ap.add_argument(
        "--gpus", type=_positive_int, help="GPU budget (GPUs the job may use at once): prints max_active_shards"
    )
    ap.add_argument("--model-config", help="the model's config.json when model.name is neither a folder nor cached")
    ap.add_argument("--tokens-per-s", type=float, default=ASSUMED_TOKENS_PER_S, help="throughput without history")
    ap.add_argument("--engine-start-s", type=float, default=ASSUMED_ENGINE_START_S, help="engine start without history")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    try:
        spec = JobSpec.from_yaml(args.spec)
        if args.set:
            spec = JobSpec.from_params(dict(_kv(s) for s in args.set), base=spec)
        cfg = None
        if args.model_config:
            with open(args.model_config, encoding="utf-8") as f:
                cfg = json.load(f)
        report = dry_run_report(
            spec,
            tokens_per_s=args.tokens_per_s,
            engine_start_s=args.engine_start_s,
            gpu_memory=args.gpu_memory_gib,
            model_config=cfg,
            gpus=args.gpus,
        )
    except VllmBatchError as e:
        print(f"dry run failed: {e}", file=sys.stderr)
        return e.exit_code
    except (OSError, ValueError) as e:
        print(f"dry run failed: {e}", file=sys.stderr)
        return EXIT_TERMINAL
    print(json.dumps(report, indent=1, default=str) if args.json else format_report(report))
    return 0


def _positive_int(raw: str) -> int:
    n = int(raw)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


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
