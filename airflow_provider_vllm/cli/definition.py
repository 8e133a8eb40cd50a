"""The provider's Airflow CLI commands: ``airflow vllm-batch dry-run ...``.

Declared in ``get_provider_info()["cli"]`` the way the amazon and cncf.kubernetes providers declare
theirs; Airflow imports this module whenever its CLI starts, so it imports nothing heavy: the
command's code loads when it runs (``lazy_load_command``).
"""

from __future__ import annotations

from airflow.cli.cli_config import ActionCommand, Arg, GroupCommand, lazy_load_command

from airflow_provider_vllm.cli.dry_run import ARGUMENTS

GROUP = "vllm-batch"

COMMANDS = (
    ActionCommand(
        name="dry-run",
        help="What a job would cost (rows, tokens, shards, GPU-hours, GPU memory plan); launches nothing",
        description="Validates the spec and the input (the plan step's checks, nothing written) and prints the "
        "sizing report; the same as python -m airflow_provider_vllm.cli.dry_run. Errors are one line on stderr.",
        func=lazy_load_command("airflow_provider_vllm.cli.dry_run.airflow_command"),
        args=tuple(Arg(flags, **kwargs) for flags, kwargs in ARGUMENTS),
    ),
)


def get_vllm_batch_cli_commands() -> list[GroupCommand]:
    """The ``airflow vllm-batch`` command group (``get_provider_info()["cli"]``)."""
    return [GroupCommand(name=GROUP, help="vLLM batch inference (airflow-provider-vllm)", subcommands=COMMANDS)]
