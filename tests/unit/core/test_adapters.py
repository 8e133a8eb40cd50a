"""LoRA adapters: their identity (every byte) and the worker's checked private copy."""

from __future__ import annotations

import json
import os
import threading

import pytest

from airflow_provider_vllm.core import adapters
from airflow_provider_vllm.core.adapters import (
    AdapterRef,
    check_refs,
    describe_adapter,
    engine_max_rank,
    fetch_adapter,
    lora_rank,
)
from airflow_provider_vllm.core.errors import InputChangedError, SpecError
from airflow_provider_vllm.core.spec import AdapterSpec, JobSpec
from airflow_provider_vllm.core.storage import Storage
from tests.support.lora import write_adapter
from tests.support.security import counted_reads

LLAMA = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2}


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA))
    return d


def spec_with(adapters, **model):
    return JobSpec.load(
        {"model": {"name": "/m", "adapters": adapters, **model}, "io": {"input_uri": "/i", "output_uri": "/o"}}
    )


def test_the_identity_covers_every_byte_and_the_copy_is_checked(tmp_path, model_dir):
    src = write_adapter(tmp_path / "ad", model_dir, seed=1)
    a = AdapterSpec(name="billing", source=str(src))
    ref = describe_adapter(a, {})
    assert ref.kind == "local" and ref.rank == 8 and ref.files == 2 and len(ref.sha256 or "") == 64
    assert describe_adapter(a, {}).sha256 == ref.sha256  # deterministic
    copy = fetch_adapter(a, ref, str(tmp_path / "copy"), {})
    assert (tmp_path / "copy" / "adapter_model.safetensors").read_bytes() == (
        src / "adapter_model.safetensors"
    ).read_bytes()
    assert copy == str(tmp_path / "copy")

    # one byte of the weights changed after the plan: the worker refuses the adapter (terminal)
    raw = bytearray((src / "adapter_model.safetensors").read_bytes())
    raw[-1] ^= 1
    (src / "adapter_model.safetensors").write_bytes(bytes(raw))
    assert describe_adapter(a, {}).sha256 != ref.sha256
    with pytest.raises(InputChangedError, match="billing.*changed since the plan"):
        fetch_adapter(a, ref, str(tmp_path / "copy2"), {})
    # a file added next to it changes the identity too
    (src / "README.md").write_text("x")
    assert describe_adapter(a, {}).files == 3


def test_a_folder_that_is_not_an_adapter_is_refused_naming_it(tmp_path, model_dir):
    with pytest.raises(SpecError, match=r"adapters\[x\].*not a LoRA adapter folder"):
        describe_adapter(AdapterSpec(name="x", source=str(model_dir)), {})
    with pytest.raises(SpecError, match=r"adapters\[x\].*not a LoRA adapter folder.*it is missing or empty"):
        describe_adapter(AdapterSpec(name="x", source=str(tmp_path / "missing")), {})
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"r": "eight"}')
    with pytest.raises(SpecError, match="not a LoRA config"):
        describe_adapter(AdapterSpec(name="x", source=str(bad)), {})


def test_an_object_store_adapter_is_read_with_the_deployments_filesystems(tmp_path, model_dir):
    import fsspec

    src = write_adapter(tmp_path / "ad", model_dir, seed=2, rank=16)
    mem = fsspec.filesystem("memory")  # stands in for the Connection's S3 filesystem
    for f in src.iterdir():
        mem.pipe(f"s3://bucket/adapters/ad/{f.name}", f.read_bytes())
    a = AdapterSpec(name="obj", source="s3://bucket/adapters/ad")
    assert a.kind == "object_store"
    ref = describe_adapter(a, {}, lambda uri, options: mem)
    assert ref.rank == 16 and ref.sha256 == describe_adapter(AdapterSpec(name="obj", source=str(src)), {}).sha256
    fetch_adapter(a, ref, str(tmp_path / "copy"), {}, lambda uri, options: mem)
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    mem.pipe("s3://bucket/adapters/ad/adapter_config.json", b'{"r": 16, "lora_alpha": 1, "target_modules": []}')
    with pytest.raises(InputChangedError, match="changed since the plan"):
        fetch_adapter(a, ref, str(tmp_path / "copy2"), {}, lambda uri, options: mem)


def test_a_folder_flooded_with_files_is_refused_after_listing_no_more_than_its_bound(tmp_path, model_dir, monkeypatch):
    """An adapter folder is listed up to twice ``MAX_FILES`` entries (its folders count): one more is refused,
    naming the bound, without listing the rest; the code before listed every planted file, then counted them."""
    src = write_adapter(tmp_path / "ad", model_dir, seed=1)
    monkeypatch.setattr(adapters, "MAX_FILES", 100)
    for i in range(300):
        (src / f"planted-{i:03d}").write_bytes(b"")
    with pytest.raises(SpecError, match=r"adapters\[x\]: .* holds more than 200 entries; an adapter has a few"):
        describe_adapter(AdapterSpec(name="x", source=str(src)), {})


def test_the_plan_refuses_a_planted_huge_file_before_it_reads_a_byte(tmp_path, model_dir, monkeypatch):
    """A writer of the folder plants a sparse file (free on local disk; 64 MiB past a MAX_BYTES of 1 MiB stands
    for a TB past 8 GiB): the plan refuses the folder on the sizes the store states, having read nothing. The code
    before hashed every file first (hours for a TB)."""
    src = write_adapter(tmp_path / "ad", model_dir, seed=1)
    with open(src / "zz-planted.bin", "wb") as f:
        f.truncate(64 << 20)
    monkeypatch.setattr(adapters, "MAX_BYTES", 1 << 20)
    read = counted_reads(monkeypatch)
    with pytest.raises(SpecError, match=r"adapters\[x\]: .* holds \d+ bytes, more than an adapter"):
        describe_adapter(AdapterSpec(name="x", source=str(src)), {})
    assert read == []


def test_a_file_that_changes_size_while_the_plan_reads_it_is_refused_naming_it(tmp_path, model_dir, monkeypatch):
    """A writer still copying the adapter appends to a file between the plan's sizing and its hash: the plan refuses
    the adapter naming the file. The code before fingerprinted what it read (no file of that size and sha256), and
    every worker then refused the adapter after the plan, with an error that did not say why."""
    src = write_adapter(tmp_path / "ad", model_dir, seed=1)
    real = Storage.sha256

    def appended_first(self, rel, size=None):
        if rel == "adapter_config.json":
            with open(self.path(rel), "ab") as f:
                f.write(b" ")
        return real(self, rel, size)

    monkeypatch.setattr(Storage, "sha256", appended_first)
    with pytest.raises(SpecError, match=r"adapters\[x\]: .* changed while the plan read it: adapter_config\.json"):
        describe_adapter(AdapterSpec(name="x", source=str(src)), {})


def test_the_workers_copy_stops_at_the_plans_size(tmp_path, model_dir, monkeypatch):
    """The weights grown after the plan: a file the store states larger is refused unread; a store that states
    the old size (a stale listing) and serves more is read no further than the plan's total + 1 byte. The code
    before copied up to MAX_BYTES (8 GiB; 16 MiB here) of each before refusing it."""
    monkeypatch.setattr(adapters, "MAX_BYTES", 16 << 20)
    src = write_adapter(tmp_path / "ad", model_dir, seed=1)
    a = AdapterSpec(name="x", source=str(src))
    ref = describe_adapter(a, {})
    weights = src / "adapter_model.safetensors"
    planned = weights.stat().st_size
    with open(weights, "r+b") as f:  # sparse: 1 GiB stands for any size
        f.truncate(1 << 30)
    read = counted_reads(monkeypatch)
    with pytest.raises(InputChangedError, match=rf"adapters\[x\]: {weights} takes the adapter past the {ref.bytes} "):
        fetch_adapter(a, ref, str(tmp_path / "copy"), {})
    assert sum(read) == (src / "adapter_config.json").stat().st_size  # the config only
    assert not (tmp_path / "copy" / "adapter_model.safetensors").exists()

    real_size = Storage.size
    monkeypatch.setattr(Storage, "size", lambda self, rel: planned if rel == weights.name else real_size(self, rel))
    read.clear()
    with pytest.raises(InputChangedError, match=rf"{weights} takes the adapter past the {ref.bytes} bytes the plan"):
        fetch_adapter(a, ref, str(tmp_path / "copy2"), {})
    assert sum(read) == ref.bytes + 1
    assert (tmp_path / "copy2" / "adapter_model.safetensors").stat().st_size <= planned


def test_a_fifo_put_in_place_of_the_weights_after_the_plan_is_refused_unopened(tmp_path, model_dir):
    """A FIFO opened for reading blocks until a writer comes: the copy refuses it unopened, naming it. The code
    before opened it and blocked the worker forever (the thread here: released after the join timeout)."""
    src = write_adapter(tmp_path / "ad", model_dir, seed=1)
    a = AdapterSpec(name="x", source=str(src))
    ref = describe_adapter(a, {})
    weights = src / "adapter_model.safetensors"
    weights.unlink()
    os.mkfifo(weights)
    got: list[BaseException | None] = []

    def copy() -> None:
        try:
            fetch_adapter(a, ref, str(tmp_path / "copy"), {})
            got.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            got.append(e)

    th = threading.Thread(target=copy, daemon=True)
    th.start()
    th.join(30)
    blocked = th.is_alive()
    if blocked:  # the code before: a writer's open releases it
        os.close(os.open(weights, os.O_WRONLY | os.O_NONBLOCK))
        th.join(30)
    assert not blocked
    assert isinstance(got[0], InputChangedError)
    assert f"adapters[x]: {weights} is not a regular file" in str(got[0])
    assert "changed since the plan" in str(got[0])


def test_hub_adapters_are_named_by_their_commit():
    a = AdapterSpec(name="h", source="org/adapter", revision="a" * 40)
    ref = describe_adapter(a, {})
    assert ref.kind == "hub" and ref.sha256 is None and ref.identity() == "org/adapter@" + "a" * 40


def test_ranks_and_the_engines_max_lora_rank():
    assert lora_rank({"r": 8}) == 8 and lora_rank({"r": 8, "rank_pattern": {"q_proj": 32}}) == 32
    with pytest.raises(ValueError):
        lora_rank({"r": 0})
    s = spec_with([{"name": "a", "source": "/a"}])
    assert engine_max_rank(s, [8]) == 8 and engine_max_rank(s, [9]) == 16 and engine_max_rank(s, [None]) == 8
    with pytest.raises(SpecError, match="up to 512"):
        engine_max_rank(s, [600])
    s64 = JobSpec.load(
        {
            "model": {"name": "/m", "adapters": [{"name": "a", "source": "/a"}]},
            "engine": {"max_lora_rank": 64},
            "io": {"input_uri": "/i", "output_uri": "/o"},
        }
    )
    assert engine_max_rank(s64, [8]) == 64
    with pytest.raises(SpecError, match="below the adapters' largest rank 128"):
        engine_max_rank(s64, [128])


def test_the_plans_refs_must_be_the_specs_adapters():
    s = spec_with([{"name": "a", "source": "/a"}])
    ref = AdapterRef(name="a", source="/a", kind="local", sha256="0" * 64)
    assert check_refs(s, [ref]) == {"a": ref}
    with pytest.raises(SpecError, match="plan the run again"):
        check_refs(s, [])
    with pytest.raises(SpecError, match="plan the run again"):
        check_refs(s, [ref.model_copy(update={"source": "/b"})])


@pytest.mark.parametrize(
    "adapters, model, match",
    [
        ([{"name": "a", "source": "org/x"}], {}, "needs revision"),
        ([{"name": "a", "source": "org/x", "revision": "main"}], {}, "needs revision"),
        ([{"name": "a", "source": "org/x", "revision": "A" * 40}], {}, "needs revision"),
        ([{"name": "a", "source": "/x", "revision": "a" * 40}], {}, "hub adapters only"),
        ([{"name": "a", "source": "./x"}], {}, "neither a hub repo id"),
        ([{"name": "a", "source": "s3://bucket/x/../y"}], {}, "'..' path segments"),
        ([{"name": "a", "source": "/x"}, {"name": "a", "source": "/y"}], {}, "must be unique"),
        ([{"name": "a", "source": "/x"}], {"default_adapter": "b"}, "not one of model.adapters"),
        ([], {"adapter_column": "which"}, "model.adapters is empty"),
        ([{"name": "m", "source": "/x"}], {"served_model_names": ["m"]}, "ambiguous"),
        ([{"name": "a b", "source": "/x"}], {}, "should match pattern"),
        ([{"name": "a", "source": "/x"}], {"adapter_column": "a;b"}, "must be a column name"),
    ],
)
def test_what_the_spec_refuses(adapters, model, match):
    with pytest.raises(SpecError, match=match):
        spec_with(adapters, **model)


def test_adapters_apply_to_generation_tasks_only():
    with pytest.raises(SpecError, match="tasks 'chat' and 'generate', not 'embed'"):
        JobSpec.load(
            {
                "task": "embed",
                "model": {"name": "/m", "adapters": [{"name": "a", "source": "/a"}]},
                "io": {"input_uri": "/i", "output_uri": "/o"},
            }
        )
