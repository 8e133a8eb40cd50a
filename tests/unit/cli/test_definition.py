"""``airflow vllm-batch dry-run``: declared in get_provider_info like amazon's and cncf's commands, found by
Airflow's providers manager through the installed entry point, and parsed by Airflow's own CLI parser."""

from __future__ import annotations

from airflow_provider_vllm.cli import definition
from airflow_provider_vllm.cli.dry_run import ARGUMENTS
from airflow_provider_vllm.provider import get_provider_info
from tests.support.airflow_home import throwaway_airflow_home

throwaway_airflow_home()
FUNCTION = "airflow_provider_vllm.cli.definition.get_vllm_batch_cli_commands"


def test_the_provider_declares_its_cli_function_the_way_airflow_imports_it():
    from airflow._shared.module_loading import import_string  # what the providers manager uses

    assert get_provider_info()["cli"] == [FUNCTION]
    (group,) = import_string(FUNCTION)()
    assert group.name == "vllm-batch" and [c.name for c in group.subcommands] == ["dry-run"]
    (command,) = group.subcommands
    assert [a.flags for a in command.args] == [flags for flags, _ in ARGUMENTS]  # one table for both entry points


def test_airflows_providers_manager_finds_the_command():
    from airflow.providers_manager import ProvidersManager

    pm = ProvidersManager()
    assert definition.get_vllm_batch_cli_commands in pm.cli_command_functions
    assert "airflow-provider-vllm" in pm.cli_command_providers


def test_airflows_parser_builds_the_command_with_the_same_options():
    from airflow.cli import cli_parser

    args = cli_parser.get_parser().parse_args(
        ["vllm-batch", "dry-run", "job.yaml", "--gpus", "2", "--set", "a=1", "--set", "b=2", "--aws-conn-id", "s3x"]
    )
    assert (args.spec, args.gpus, args.set, args.aws_conn_id, args.json) == (
        "job.yaml",
        2,
        ["a=1", "b=2"],
        "s3x",
        False,
    )
    assert args.func.__name__ == "airflow_command"
