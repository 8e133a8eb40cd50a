"""Prompts are data: shell text in a row, the template or the system prompt reaches the engine
verbatim, and the worker's command line is an argv list (no shell).
"""

from __future__ import annotations

import json

import pytest

from airflow_provider_vllm.core.spec import JobSpec
from tests.support.data import shard_task, write_parquet
from tests.support.security import base_doc

pytestmark = pytest.mark.reliability


# ---- verbatim to the engine, never a shell --------------------------------------------
def test_shell_text_reaches_the_engine_verbatim(allowed, tmp_path, fake_engine_factory):
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.worker.shard import run_shard
    from airflow_provider_vllm.worker.task import worker_command
    from tests.support.fakes import recording

    canary = tmp_path / "pwned"
    payload = f"; touch {canary} $(touch {canary}) `touch {canary}` | sh && echo 'x' \"y\""
    write_parquet(allowed / "in2" / "p.parquet", ["r1"], [f"row text {payload}"])
    doc = base_doc(allowed)
    doc["io"] = {"input_uri": str(allowed / "in2"), "output_uri": str(allowed / "out2")}
    doc["prompt"]["system_prompt"] = f"System {payload}"
    doc["prompt"]["template"] = "Ticket: {text} " + payload
    doc["model"]["max_model_len"] = 4096
    spec = JobSpec.load(doc)
    plan = plan_job(spec)
    factory = recording(fake_engine_factory)
    seen = factory.prompts
    task = shard_task(spec=spec, shard_id=plan.shards[0].shard_id)
    assert run_shard(task, engine_factory=factory)["ok_rows"] == 1
    assert seen == [f"<system>System {payload}\n<user>Ticket: row text {payload} {payload}\n<assistant>"]
    argv = worker_command(task)
    assert argv[1:3] == ["-m", "airflow_provider_vllm.worker"] and len(argv) == 4
    assert json.loads(argv[3])["spec"]["prompt"]["system_prompt"] == f"System {payload}"
    assert not canary.exists()


# ---- a chat template that reads the clock --------------------------------------------------
# The date logic of Llama 3.1/3.2/3.3 Instruct's chat template (tokenizer_config.json), around a minimal conversation
LLAMA31_LIKE_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- if strftime_now is defined %}"
    '{%- set date_string = strftime_now("%d %b %Y") %}'
    '{%- else %}{%- set date_string = "26 Jul 2024" %}{%- endif %}{%- endif %}'
    '{{- "Today Date: " + date_string + "\\n\\n" }}'
    "{%- for message in messages %}{{- message['role'] + ': ' + message['content'] + '\\n' }}{%- endfor %}"
)


def _hf_tokenizer(template: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tk = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="!", chat_template=template)


def test_the_builder_finds_a_chat_template_that_reads_the_clock(tmp_path):
    """transformers gives chat templates strftime_now (Llama 3.x: "Today Date: ..."): one row, another prompt every
    day. The builder renders its probe at two dates and says so (the worker seals it; the result cache then files
    nothing); a template without the clock, or a job without a chat template, does not. The real clock is put back."""
    import datetime as dt

    import transformers.utils.chat_template_utils as ctu

    from airflow_provider_vllm.worker.prompts import PromptBuilder
    from tests.support.data import make_spec

    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", model={"name": "m", "max_model_len": 4096})
    assert PromptBuilder(spec, _hf_tokenizer(LLAMA31_LIKE_TEMPLATE), 4096).reads_clock is True
    assert ctu.datetime is dt.datetime
    dateless = LLAMA31_LIKE_TEMPLATE.replace('strftime_now("%d %b %Y")', '"26 Jul 2024"')
    assert PromptBuilder(spec, _hf_tokenizer(dateless), 4096).reads_clock is False
    generate = make_spec(
        tmp_path / "in.parquet", tmp_path / "out", task="generate", model={"name": "m"}, prompt={"system_prompt": None}
    )
    assert PromptBuilder(generate, _hf_tokenizer(LLAMA31_LIKE_TEMPLATE), 1024).reads_clock is False


# ---- typed template columns: dates, times, timestamps, decimals --------------------------------------
def _typed_builder(tmp_path, template: str):
    from airflow_provider_vllm.worker.prompts import PromptBuilder
    from tests.support.data import make_spec
    from tests.support.fakes import FakeTokenizer

    spec = make_spec(
        tmp_path / "in.parquet",
        tmp_path / "out",
        task="generate",
        prompt={"template": template, "text_columns": ["text"], "system_prompt": None},
    )
    return PromptBuilder(spec, FakeTokenizer(), 4096), FakeTokenizer()


def _shown(tmp_path, value) -> str:
    """What the worker sends the engine for a row whose template column ``v`` holds ``value``, or the row's error."""
    builder, tok = _typed_builder(tmp_path, "{text}={v}")
    prep = builder.prepare({"text": "x", "v": value})
    return tok.decode(prep.token_ids) if prep.token_ids else f"error {prep.fault}"


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("2024-03-01", "x=2024-03-01"),  # text, numbers, booleans, NULL: as they always were
        (7, "x=7"),
        (0.1, "x=0.1"),
        (True, "x=True"),
        (None, "x="),
        ("date", "x=2024-03-01"),
        ("date_min", "x=0001-01-01"),
        ("time", "x=14:05:00"),
        ("time_us", "x=14:05:00.250000"),
        ("naive", "x=2024-03-01 14:05:00"),
        ("naive_us", "x=2024-03-01 14:05:00.000001"),
        ("berlin", "x=2024-03-01 13:05:00+00:00"),  # the instant, in UTC: never the value's zone
        ("tokyo", "x=2024-03-01 13:05:00+00:00"),
        ("ns", "x=2024-03-01 14:05:00.000000001"),
        ("ns_tz", "x=2024-03-01 05:05:00.000000001+00:00"),
        ("dec_scale", "x=12.50"),  # the column's scale kept
        ("dec_tiny", "x=0.000001"),  # fixed point, never 1E-6
        ("dec_int", "x=1000"),
    ],
)
def test_a_typed_template_value_renders_deterministically(tmp_path, value, shown):
    import datetime as dt
    import decimal
    import zoneinfo

    import pandas as pd

    at = dt.datetime(2024, 3, 1, 14, 5)
    values = {
        "date": dt.date(2024, 3, 1),
        "date_min": dt.date(1, 1, 1),
        "time": dt.time(14, 5),
        "time_us": dt.time(14, 5, 0, 250000),
        "naive": at,
        "naive_us": at.replace(microsecond=1),
        "berlin": at.replace(tzinfo=zoneinfo.ZoneInfo("Europe/Berlin")),
        "tokyo": (at - dt.timedelta(hours=1)).replace(tzinfo=dt.UTC).astimezone(zoneinfo.ZoneInfo("Asia/Tokyo")),
        "ns": pd.Timestamp(at) + pd.Timedelta(1, "ns"),  # pyarrow's value of a nanosecond timestamp
        "ns_tz": (pd.Timestamp(at) + pd.Timedelta(1, "ns")).tz_localize("Asia/Tokyo"),
        "dec_scale": decimal.Decimal("12.50"),
        "dec_tiny": decimal.Decimal("1E-6"),
        "dec_int": decimal.Decimal("1E+3"),
    }
    assert _shown(tmp_path, values.get(value, value) if isinstance(value, str) else value) == shown


def test_values_the_worker_cannot_render_stay_row_errors(tmp_path):
    import datetime as dt

    for value, kind in [({"a": 1}, "dict"), ([1, 2], "list"), (b"\x00", "bytes"), (dt.timedelta(1), "timedelta")]:
        assert _shown(tmp_path, value) == f"error ('INVALID_ROW', \"column 'v' holds {kind}, expected a scalar\")"


def test_the_same_instant_in_two_zones_renders_the_same_prompt_from_parquet(tmp_path):
    """As the worker reads them (``ParquetFormat.read_rows``: pyarrow's values): a timestamp with a time zone renders
    its instant in UTC, so two files that hold the same instants in two zones (one cache key: the key of a
    TIMESTAMPTZ is its instant) give byte-identical prompts, in any unit; dates, times and decimals alike."""
    import datetime as dt
    import decimal

    import pyarrow as pa

    from airflow_provider_vllm.core.formats.parquet import ParquetFormat
    from airflow_provider_vllm.core.plan import Segment
    from airflow_provider_vllm.core.storage import Storage

    builder, tok = _typed_builder(tmp_path, "{text} {d} {t} {at} {ms} {ns} {naive} {amount}")
    micros = [1_709_301_900_000_000, 1_709_301_900_123_456, None]
    prompts = {}
    for zone in ("Europe/Berlin", "America/New_York", "UTC"):
        name = f"{zone.replace('/', '-')}.parquet"
        write_parquet(
            tmp_path / name,
            ["a", "b", "c"],
            ["x", "y", "z"],
            d=pa.array([dt.date(2024, 3, 1), dt.date(1999, 12, 31), None], pa.date32()),
            t=pa.array([dt.time(14, 5), dt.time(0, 0, 0, 1), None], pa.time64("us")),
            at=pa.array(micros, pa.timestamp("us", tz=zone)),
            ms=pa.array([m // 1000 if m is not None else None for m in micros], pa.timestamp("ms", tz=zone)),
            ns=pa.array([m * 1000 + 7 if m is not None else None for m in micros], pa.timestamp("ns", tz=zone)),
            naive=pa.array(micros, pa.timestamp("us")),
            amount=pa.array([decimal.Decimal("12.50"), decimal.Decimal("-0.05"), None], pa.decimal128(10, 2)),
        )
        spec = builder.spec
        batch = ParquetFormat().read_rows(Storage(str(tmp_path)), name, Segment(file=0, start=0, count=3), spec)
        rows = [{c: v[i] for c, v in batch.values.items()} for i in range(3)]
        prompts[zone] = [tok.decode(builder.prepare(r).token_ids) for r in rows]
    assert (
        prompts["Europe/Berlin"]
        == prompts["America/New_York"]
        == prompts["UTC"]
        == [
            "x 2024-03-01 14:05:00 2024-03-01 14:05:00+00:00 2024-03-01 14:05:00+00:00 "
            "2024-03-01 14:05:00.000000007+00:00 2024-03-01 14:05:00 12.50",
            "y 1999-12-31 00:00:00.000001 2024-03-01 14:05:00.123456+00:00 2024-03-01 14:05:00.123000+00:00 "
            "2024-03-01 14:05:00.123456007+00:00 2024-03-01 14:05:00.123456 -0.05",
            "z" + " " * 7,  # NULL renders as an empty string, as it always did
        ]
    )


def test_nanosecond_timestamps_render_alike_with_and_without_pandas(tmp_path):
    """pyarrow gives pandas' Timestamp for a nanosecond timestamp when pandas is installed, else a datetime, or a
    ValueError for the whole batch when a value has nanoseconds past its microseconds: a worker image without pandas
    failed the shard, one with it rendered the nanoseconds. The worker reads such a column itself now: the same
    prompts either way (a worker process where pandas cannot be imported renders what this process renders)."""
    import subprocess
    import sys

    import pyarrow as pa

    ns = [1_709_301_900_000_000_007, 1_709_301_900_000_001_000, -1, None]
    write_parquet(
        tmp_path / "ns.parquet",
        ["a", "b", "c", "d"],
        ["x"] * 4,
        naive=pa.array(ns, pa.timestamp("ns")),
        zoned=pa.array(ns, pa.timestamp("ns", tz="Asia/Tokyo")),
    )
    script = f"""
import builtins, json, sys
real = builtins.__import__
def no_pandas(name, *a, **k):
    if sys.argv[1] == "without" and name.split(".")[0] == "pandas":
        raise ImportError("no pandas here")
    return real(name, *a, **k)
builtins.__import__ = no_pandas
from airflow_provider_vllm.core.formats.parquet import ParquetFormat
from airflow_provider_vllm.core.plan import Segment
from airflow_provider_vllm.core.storage import Storage
from tests.unit.worker.test_prompts import _typed_builder
from pathlib import Path
folder = Path({str(tmp_path)!r})
builder, tok = _typed_builder(folder, "{{text}} {{naive}} {{zoned}}")
seg = Segment(file=0, start=0, count=4)
batch = ParquetFormat().read_rows(Storage(str(folder)), "ns.parquet", seg, builder.spec)
rows = [{{c: v[i] for c, v in batch.values.items()}} for i in range(4)]
print(json.dumps([tok.decode(builder.prepare(r).token_ids) for r in rows]))
"""
    shown = {}
    for how in ("with", "without"):
        proc = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        shown[how] = json.loads(proc.stdout.splitlines()[-1])
    assert (
        shown["with"]
        == shown["without"]
        == [
            "x 2024-03-01 14:05:00.000000007 2024-03-01 14:05:00.000000007+00:00",
            "x 2024-03-01 14:05:00.000001 2024-03-01 14:05:00.000001+00:00",
            "x 1969-12-31 23:59:59.999999999 1969-12-31 23:59:59.999999999+00:00",
            "x  ",
        ]
    )
