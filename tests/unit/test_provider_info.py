import json
from importlib.metadata import entry_points
from pathlib import Path

import jsonschema

import airflow_provider_vllm
from airflow_provider_vllm.core.spec import JobSpec
from tests.support import ROOT  # noqa: E402


def test_provider_info_valid_against_airflow_schema():
    import airflow

    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    info = airflow_provider_vllm.get_provider_info()
    jsonschema.validate(info, schema)
    assert info["package-name"] == "airflow-provider-vllm"


def test_entry_point_is_registered():
    eps = [e for e in entry_points(group="apache_airflow_provider") if e.value.startswith("airflow_provider_vllm")]
    assert len(eps) == 1 and eps[0].load() is airflow_provider_vllm.get_provider_info


def test_example_yaml_loads():
    spec = JobSpec.from_yaml(ROOT / "examples" / "job.yaml")
    assert spec.sampling.structured.choice == ["billing", "bug", "other"]
    assert spec.sharding.long_row_tokens == 1500


def test_every_vllm_batch_option_is_declared_with_a_fail_closed_default():
    from airflow_provider_vllm.operators import deployment

    options = airflow_provider_vllm.get_provider_info()["config"]["vllm_batch"]["options"]
    read = {deployment.CONFIG_OPTION, deployment.ALLOW_ANY_OPTION, deployment.REMOTE_CODE_OPTION,
            deployment.VARIABLES_OPTION, deployment.KUBERNETES_OPTION}
    assert read <= set(options)
    for name in read:
        assert options[name]["description"] and options[name]["type"] in ("string", "boolean"), name
    # nothing allowed until the deployment says so
    assert options["allowed_uri_prefixes"]["default"] == "" and options["kubernetes_defaults"]["default"] == ""
    for name in ("allow_any_location", "allow_remote_code", "deployment_settings_from_variables"):
        assert options[name]["type"] == "boolean" and options[name]["default"] == "False", name
