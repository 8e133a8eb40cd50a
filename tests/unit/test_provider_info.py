import json
from importlib.metadata import entry_points
from pathlib import Path

import jsonschema

import airflow_provider_vllm.provider
from airflow_provider_vllm.core.spec import JobSpec
from tests.support import ROOT  # noqa: E402


def test_provider_info_valid_against_airflow_schema():
    import airflow

    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    info = airflow_provider_vllm.provider.get_provider_info()
    jsonschema.validate(info, schema)
    assert info["package-name"] == "airflow-provider-vllm"


def test_entry_point_is_registered():
    eps = [e for e in entry_points(group="apache_airflow_provider") if e.value.startswith("airflow_provider_vllm")]
    assert len(eps) == 1 and eps[0].load() is airflow_provider_vllm.provider.get_provider_info


def test_example_yaml_loads():
    spec = JobSpec.from_yaml(ROOT / "examples" / "job.yaml")
    assert spec.sampling.structured.choice == ["billing", "bug", "other"]
    assert spec.sharding.long_row_tokens == 1500


def test_every_vllm_batch_option_is_declared_with_a_fail_closed_default():
    from airflow_provider_vllm.utils import deployment

    options = airflow_provider_vllm.provider.get_provider_info()["config"]["vllm_batch"]["options"]
    read = {
        deployment.CONFIG_OPTION,
        deployment.ALLOW_ANY_OPTION,
        deployment.REMOTE_CODE_OPTION,
        deployment.VARIABLES_OPTION,
        deployment.KUBERNETES_OPTION,
    }
    assert read <= set(options)
    for name in read:
        assert options[name]["description"] and options[name]["type"] in ("string", "boolean"), name
    # nothing allowed until the deployment says so
    assert options["allowed_uri_prefixes"]["default"] == "" and options["kubernetes_defaults"]["default"] == ""
    # a runner chosen at run time: only the one the deployment configured (utils/deployment.allowed_runners)
    assert options["allowed_runners"]["default"] == ""
    for name in ("allow_any_location", "allow_remote_code", "deployment_settings_from_variables"):
        assert options[name]["type"] == "boolean" and options[name]["default"] == "False", name


def _config_reads() -> dict[str, set[str]]:
    """Every ``conf.get*(<section>, <option>, ...)`` in the package: option -> modules reading it.

    Section and option are resolved through the names the module imported from ``provider``; a
    module that reads through a helper (``_get(option)``) counts as reading every option it imports.
    """
    import ast

    from airflow_provider_vllm import provider

    reads: dict[str, set[str]] = {}
    for path in (ROOT / "airflow_provider_vllm").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {}  # local name -> provider attribute value
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "airflow_provider_vllm.provider":
                for a in node.names:
                    names[a.asname or a.name] = getattr(provider, a.name)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("get", "getboolean", "getint", "getfloat", "getjson")
                and len(node.args) >= 2
            ):
                section, option = (
                    names.get(a.id) if isinstance(a, ast.Name) else a.value if isinstance(a, ast.Constant) else None
                    for a in node.args[:2]
                )
                if section == provider.CONFIG_SECTION:
                    indirect = [v for k, v in names.items() if k != "CONFIG_SECTION" and isinstance(v, str)]
                    for opt in [option] if isinstance(option, str) else indirect:
                        reads.setdefault(opt, set()).add(path.name)
                elif section is None and isinstance(node.args[0], ast.Name) and "SECTION" in node.args[0].id:
                    raise AssertionError(f"{path}: a config section {node.args[0].id} not imported from provider")
    return reads


def test_every_option_read_is_declared_and_every_declared_option_is_read():
    options = airflow_provider_vllm.provider.get_provider_info()["config"]["vllm_batch"]["options"]
    reads = _config_reads()
    assert set(reads) - set(options) == set()  # read but not declared: `airflow config list` would hide it
    assert set(options) - set(reads) == set()  # declared but never read: a setting that does nothing
    assert {"deployment.py", "report.py", "filesystems.py"} <= set().union(*reads.values())


def test_the_section_name_is_written_once():
    """Only provider.py spells the section; everyone else imports CONFIG_SECTION."""
    spelled = [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "airflow_provider_vllm").rglob("*.py")
        if '"vllm_batch", "' in p.read_text(encoding="utf-8")
        or 'SECTION = "vllm_batch"' in p.read_text(encoding="utf-8")
    ]
    assert spelled == ["airflow_provider_vllm/provider.py"]
