"""The engine the shard tasks will start, resolved on the Airflow side (operators/engine_identity.py)."""

from __future__ import annotations

import json

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.utils.engine_identity import layered_pod_settings, shard_engine_identity
from tests.support.data import make_spec

A = "registry.example.com/vllm-worker:1@sha256:" + "a" * 64
B = "registry.example.com/vllm-worker:1@sha256:" + "b" * 64


@pytest.fixture
def spec(tmp_path):
    return make_spec(tmp_path / "in", tmp_path / "out", cache={"uri": str(tmp_path / "cache")})


def defaults(monkeypatch, **settings):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__KUBERNETES_DEFAULTS", json.dumps(settings))


def test_the_image_of_every_layer_reaches_the_key(monkeypatch, spec):
    defaults(monkeypatch, image=A)
    a = shard_engine_identity(spec, "kubernetes")
    assert a.startswith(f"image {A}")
    defaults(monkeypatch, image=B)  # the deployment moves to a new image: the key changes with it
    assert shard_engine_identity(spec, "kubernetes").startswith(f"image {B}")
    # the kubernetes argument (or its Variable) over the deployment's defaults, the job's section over both
    assert shard_engine_identity(spec, "kubernetes", kubernetes={"image": A}).startswith(f"image {A}")
    job = spec.model_copy(update={"kubernetes": spec.kubernetes.model_copy(update={"image": A})})
    assert shard_engine_identity(job, "kubernetes", kubernetes=json.dumps({"image": B})).startswith(f"image {A}")


def test_env_that_reaches_vllm_is_in_the_key(monkeypatch, spec):
    defaults(monkeypatch, image=A, env={"VLLM_ATTENTION_BACKEND": "FLASH_ATTN"})
    a = shard_engine_identity(spec, "kubernetes")
    assert '"VLLM_ATTENTION_BACKEND":"FLASH_ATTN"' in a
    b = shard_engine_identity(spec, "kubernetes", env={"VLLM_ATTENTION_BACKEND": "FLASHINFER"})  # shard_env
    assert '"VLLM_ATTENTION_BACKEND":"FLASHINFER"' in b and b != a
    defaults(monkeypatch, image=A, env={"VLLM_LOGGING_LEVEL": "DEBUG"})  # operational: not an answer
    assert shard_engine_identity(spec, "kubernetes") == f"image {A}"
    defaults(monkeypatch, image=A, secret_env={"VLLM_API_KEY": {"name": "s", "key": "k"}})
    assert '"VLLM_API_KEY":"secret:s/k"' in shard_engine_identity(spec, "kubernetes")  # named by reference


def test_an_image_not_pinned_by_digest_is_refused_with_the_cache(monkeypatch, spec, tmp_path):
    defaults(monkeypatch, image="registry.example.com/vllm-worker:latest")
    with pytest.raises(AirflowFailException, match="not pinned by digest"):
        shard_engine_identity(spec, "kubernetes")
    no_cache = make_spec(tmp_path / "in", tmp_path / "out")
    assert shard_engine_identity(no_cache, "kubernetes").startswith("image registry.example.com/vllm-worker:latest")


def test_the_local_runner_keys_on_this_vllm_and_the_task_env(spec):
    base = shard_engine_identity(spec, "local")
    assert "==" in base.split(" env ", 1)[0]
    assert shard_engine_identity(spec, "local", env={"VLLM_ATTENTION_BACKEND": "X"}) != base


def test_a_malformed_layer_is_a_clear_failure(monkeypatch, spec):
    defaults(monkeypatch, image=A)
    with pytest.raises(AirflowFailException, match="invalid kubernetes settings"):
        shard_engine_identity(spec, "kubernetes", kubernetes="[1, 2]")
    with pytest.raises(ValueError):
        layered_pod_settings(spec, {"image": 7}, None)
