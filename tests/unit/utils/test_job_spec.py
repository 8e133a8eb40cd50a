"""The job spec as a task receives it, and data-plane errors mapped to Airflow's retry / no-retry."""

from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_vllm.core.errors import DatasetError, SpecError, TransientError
from airflow_provider_vllm.core.plan import ShardSummary
from airflow_provider_vllm.utils.job_spec import (
    check_runner,
    data_plane_errors,
    overrides_document,
    shard_id_of,
    shard_summary,
    spec_document,
)


def test_a_spec_document_from_yaml_text_drops_the_job_key():
    assert spec_document("job:\n  name: j\n  model: {name: m}\n") == {"name": "j", "model": {"name": "m"}}


@pytest.mark.parametrize("text", ["[1, 2]", "just text", "a: [unclosed"])
def test_a_spec_that_is_not_a_mapping_is_a_spec_error(text):
    with pytest.raises(SpecError, match="job spec"):
        spec_document(text)


def test_overrides_empty_or_mapping_only():
    assert overrides_document("") == {} and overrides_document(None) == {} and overrides_document("null") == {}
    assert overrides_document('{"engine.max_num_seqs": 8}') == {"engine.max_num_seqs": 8}
    with pytest.raises(SpecError, match="spec overrides must be a mapping"):
        overrides_document("[1]")


@pytest.mark.parametrize("text", ["a: [unclosed", "{cache.uri: null", "key: value: other", "\tbad: tab"])
def test_malformed_overrides_are_a_spec_error_naming_the_variable(text):
    with pytest.raises(SpecError, match="vllm_batch_spec_overrides Variable.* not valid YAML or JSON"):
        overrides_document(text)


def test_an_unknown_runner_fails_without_retry_naming_the_param():
    assert check_runner(" kubernetes ") == "kubernetes"
    with pytest.raises(AirflowFailException, match="mode='gpu' is not a runner"):
        check_runner("gpu", param="mode")


def test_terminal_errors_fail_and_transient_ones_are_retried():
    with pytest.raises(AirflowFailException, match="merge: DatasetError: bad"):
        with data_plane_errors("merge"):
            raise DatasetError("bad")
    with pytest.raises(AirflowException, match="transient, retried") as caught:
        with data_plane_errors("merge"):
            raise TransientError("storage hiccup")
    assert not isinstance(caught.value, AirflowFailException)


SUMMARY = {"shard_id": "shard-00003-0a1b2c3d", "index": 3, "rows": 1, "est_tokens": 9, "bucket": "all"}


def test_shard_id_of_a_summary_or_a_bare_id():
    assert shard_id_of(SUMMARY) == "shard-00003-0a1b2c3d" and shard_id_of("s-4") == "s-4"
    assert shard_id_of({**SUMMARY, "name": "shard 3/8 rows 0-0"}) == "shard-00003-0a1b2c3d"
    assert shard_summary(SUMMARY) == ShardSummary(**SUMMARY)


@pytest.mark.parametrize(
    "bad, field",
    [
        ({k: v for k, v in SUMMARY.items() if k != "index"}, "index"),
        ({**SUMMARY, "shard_id": "../../x"}, "shard_id"),
        ({**SUMMARY, "rows": -1}, "rows"),
        ({**SUMMARY, "bucket": None}, "bucket"),
        ({**SUMMARY, "spec": {"model": "x"}}, "spec"),
        (["shard-00003-0a1b2c3d"], "<spec>"),
    ],
)
def test_a_shard_item_that_is_not_a_summary_fails_without_retry_naming_the_field(bad, field):
    with pytest.raises(AirflowFailException, match=f"not a shard of the plan: {field}"):
        shard_id_of(bad)


def test_a_model_name_that_is_a_relative_path_fails_the_local_runner(tmp_path, monkeypatch):
    from airflow_provider_vllm.core.spec import JobSpec
    from airflow_provider_vllm.utils.job_spec import check_local_model

    spec = JobSpec.load(
        {
            "name": "j",
            "model": {"name": "outside/evil"},
            "io": {"input_uri": "/data/in", "output_uri": "/data/out"},
            "prompt": {"template": "{text}"},
        }
    )
    monkeypatch.chdir(tmp_path)
    check_local_model(spec)  # a hub id
    (tmp_path / "outside" / "evil").mkdir(parents=True)
    with pytest.raises(AirflowFailException, match="model.name='outside/evil' is a hub id but also a path relative"):
        check_local_model(spec)
    for name, message in [
        ("./outside/evil", "a local model path must be absolute"),
        (f"{tmp_path}/nowhere", "is a local path that does not exist on this machine"),
        (f"file://{tmp_path}/nowhere", "is a local path that does not exist on this machine"),
    ]:
        with pytest.raises(AirflowFailException, match=message):
            check_local_model(spec.model_copy(update={"model": spec.model.model_copy(update={"name": name})}))
    check_local_model(spec.model_copy(update={"model": spec.model.model_copy(update={"name": str(tmp_path)})}))
