"""The shared exit-code handling of both runners: what a finished worker becomes in Airflow."""

from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_vllm.utils.worker_outcome import worker_result

GOOD = {"status": "committed", "shard_id": "s-0", "attempt_id": "a1", "rows": 2, "ok_rows": 2, "error_rows": 0}


def _manifest(**over):
    return {**GOOD, **over}


def test_a_valid_manifest_of_this_shard_is_the_result():
    m = worker_result(0, "s-0", _manifest())
    assert m.shard_id == "s-0" and m.rows == 2


def test_a_manifest_with_a_field_this_version_does_not_know_names_it_and_the_version_rule():
    with pytest.raises(AirflowException) as e:
        worker_result(0, "s-0", _manifest(new_field_of_a_later_version=1))
    assert not isinstance(e.value, AirflowFailException)  # retried, like any exit 0 without a usable manifest
    assert "new_field_of_a_later_version" in str(e.value) and "same airflow-provider-vllm version" in str(e.value)


def test_another_shards_manifest_or_none_is_retried():
    for doc in (None, _manifest(shard_id="s-1")):
        with pytest.raises(AirflowException, match="without its manifest") as e:
            worker_result(0, "s-0", doc)
        assert not isinstance(e.value, AirflowFailException)


def test_exit_2_fails_without_retry_and_75_retries():
    with pytest.raises(AirflowFailException):
        worker_result(2, "s-0", {"status": "failed", "error": "SpecError", "message": "bad", "terminal": True})
    with pytest.raises(AirflowException) as e:
        worker_result(75, "s-0", None)
    assert not isinstance(e.value, AirflowFailException)
