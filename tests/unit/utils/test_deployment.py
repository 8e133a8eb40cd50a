"""The deployment's rules read from [vllm_batch] (utils/deployment.py): the signing key, the Secret the pods
get it from, and where result caches may live."""

from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.utils.deployment import (
    cache_prefixes,
    check_spec_allowed,
    kubernetes_signing_secret,
    signing_keyring,
)
from tests.support.data import make_spec


def test_no_signing_key_fails_closed_naming_the_option(monkeypatch):
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__SIGNING_KEY", raising=False)
    with pytest.raises(AirflowFailException, match=r"\[vllm_batch\] signing_key .*AIRFLOW__VLLM_BATCH__SIGNING_KEY"):
        signing_keyring()
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__SIGNING_KEY", "too-short")
    with pytest.raises(AirflowFailException, match="shorter than 32"):
        signing_keyring()
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__SIGNING_KEY", "n" * 40 + ",o" + "o" * 40)
    assert isinstance(signing_keyring(), Keyring) and signing_keyring().text().startswith("n" * 40)


@pytest.mark.parametrize("value", ["", "only-a-name", ":key", "name:"])
def test_the_pods_signing_secret_must_be_named(monkeypatch, value):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__KUBERNETES_SIGNING_SECRET", value)
    with pytest.raises(AirflowFailException, match="kubernetes_signing_secret"):
        kubernetes_signing_secret()


def test_the_pods_signing_secret_is_name_and_key(monkeypatch):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__KUBERNETES_SIGNING_SECRET", "vllm-signing:key")
    assert kubernetes_signing_secret() == ("vllm-signing", "key")


@pytest.mark.reliability
def test_a_job_cannot_point_its_cache_at_another_teams(monkeypatch, tmp_path):
    """Where caches live is the deployment's choice: none configured, nowhere; else only under its prefixes
    (a job of team b naming team a's cache, inside the allow-list, is refused)."""
    spec = make_spec(tmp_path / "in", tmp_path / "out", cache={"uri": str(tmp_path / "team-a" / "cache")})
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__CACHE_URI_PREFIXES", raising=False)
    assert cache_prefixes() == []
    with pytest.raises(AirflowFailException, match=r"cache_uri_prefixes .*is empty"):
        check_spec_allowed(spec, "plan")
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__CACHE_URI_PREFIXES", str(tmp_path / "team-b"))
    with pytest.raises(AirflowFailException, match="outside the deployment's cache locations"):
        check_spec_allowed(spec, "plan")
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__CACHE_URI_PREFIXES", f"{tmp_path / 'team-b'},{tmp_path / 'team-a'}")
    check_spec_allowed(spec, "plan")
    no_cache = make_spec(tmp_path / "in", tmp_path / "out")
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__CACHE_URI_PREFIXES")
    check_spec_allowed(no_cache, "plan")  # a job without a cache needs no cache location
