"""Print the shard workers' key for this deployment's signing key.

    python -m airflow_provider_vllm.cli.worker_key [--from-stdin]

Reads ``[vllm_batch] signing_key`` the way the provider's tasks read it (Airflow's configuration:
``airflow.cfg``, ``AIRFLOW__VLLM_BATCH__SIGNING_KEY`` or its ``_SECRET`` / ``_CMD`` form), or with
``--from-stdin`` the key text from standard input (a key not in this machine's configuration), and
prints the worker keys (comma separated, in the same order: the first seals) on one line. Put that
line in the Kubernetes Secret named by ``[vllm_batch] kubernetes_signing_secret``; the shard pods
get it as ``VLLM_BATCH_WORKER_KEY``. The local runner derives it itself. Nothing else is printed on
stdout. Exit status 0, or 2 (one line on stderr) when no valid key is set.

A worker key seals and checks only a worker's own records (chunks, commit markers, compile cache
snapshots); it does not give the deployment's key back (docs/adr/0011-per-role-keys.md).
"""

from __future__ import annotations

import argparse
import sys

from airflow_provider_vllm.core.errors import EXIT_TERMINAL, SealError
from airflow_provider_vllm.core.seal import SETTING, Keyring

PROG = "python -m airflow_provider_vllm.cli.worker_key"


def worker_key(text: str | None, source: str = SETTING) -> str:
    """The worker keys of the deployment key text ``text`` (SealError naming ``source`` when it holds no valid key,
    or a worker key)."""
    return Keyring.from_text(text, source).worker_text()


def _configured() -> str:
    from airflow.sdk.configuration import conf

    from airflow_provider_vllm.provider import CONFIG_SECTION, SIGNING_KEY

    return conf.get(CONFIG_SECTION, SIGNING_KEY, fallback="") or ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--from-stdin", action="store_true", help="read the deployment's key text from stdin, not the configuration"
    )
    args = p.parse_args(argv)
    try:
        if args.from_stdin:
            line = worker_key(sys.stdin.read(), "the key text on stdin")
        else:
            line = worker_key(_configured())
    except SealError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return EXIT_TERMINAL
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
