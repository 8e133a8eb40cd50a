"""What the plan refuses, terminally and with a message, before any worker runs: stores without a
tested create-only write (abfs://, az://), ids that are only whitespace (every input format), and a
plan with more shards than Airflow's ``[core] max_map_length``."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import re

import pyarrow as pa
import pytest

from airflow_provider_vllm.core.allow_list import SCHEMES, canonical_uri
from airflow_provider_vllm.core.errors import DatasetError, SpecError
from airflow_provider_vllm.core.formats.base import BLANK_ID_PATTERN, is_blank_id
from airflow_provider_vllm.core.plan import PLAN_FILE
from airflow_provider_vllm.steps.plan.planner import build_plan, plan_job
from tests.support.data import make_spec, write_parquet
from tests.support.ledger import record_bad_rows

# ---- schemes ------------------------------------------------------------------------------
UNSUPPORTED = [
    "abfs://container/in",
    "az://container/runs/r1",
    "abfss://c@acct.dfs.core.windows.net/x",
    "adl://store/x",
    "AZ://container/x",
]


@pytest.mark.parametrize("uri", UNSUPPORTED)
@pytest.mark.parametrize("field", ["input_uri", "output_uri"])
def test_azure_schemes_are_refused_at_validation_naming_why(tmp_path, uri, field):
    io = {"input_uri": str(tmp_path / "in.parquet"), "output_uri": str(tmp_path / "out"), field: uri}
    with pytest.raises(SpecError) as e:
        make_spec(io["input_uri"], io["output_uri"])
    msg = str(e.value)
    assert f"io.{field}" in msg and "not supported" in msg and "create-only" in msg
    assert e.value.terminal


def test_supported_schemes_are_exactly_those_with_a_create_only_write():
    assert set(SCHEMES) == {"s3", "s3a", "gs", "gcs", "memory", "file"}
    for uri in ("s3://bk/x", "gs://bk/x", "gcs://bk/x", "s3a://bk/x", "memory://x/y"):
        assert canonical_uri(uri) == uri


def test_the_dag_param_schema_refuses_them_too():
    from airflow_provider_vllm.core.param_schemas import URI_PATTERN

    for uri in UNSUPPORTED[:4]:
        assert re.match(URI_PATTERN, uri) is None, uri
    assert re.match(URI_PATTERN, "s3://b/x") and re.match(URI_PATTERN, "gs://b/x")


@pytest.mark.parametrize("uri", ["s3://key:s3cr3t@bucket/x", "gs://s3cr3t@bucket/x", "memory://k:s3cr3t@x/y"])
def test_the_dag_param_schema_refuses_credentials_in_a_uri_without_showing_them(uri):
    from airflow_provider_vllm.core.param_schemas import URI_PATTERN, validate_params

    assert re.match(URI_PATTERN, uri) is None
    assert re.match(URI_PATTERN, "s3://bucket/x@2026") and re.match(URI_PATTERN, "/data/a@b")
    for name in ("input_uri", "output_uri", "compare_with"):
        with pytest.raises(SpecError, match=f"param {name}=") as e:
            validate_params({name: uri})
        assert "s3cr3t" not in str(e.value) and "***@" in str(e.value)


# ---- blank ids ------------------------------------------------------------------------------
BLANKS = [" ", "   ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\u2028", " \t\u2003 ", "\x0b", "\x1f", "\x85"]


def test_the_duckdb_blank_pattern_matches_exactly_pythons_whitespace():
    """Parquet ids are checked in DuckDB, JSONL ids in Python: one definition, every code point."""
    import duckdb

    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    t = pa.table({"c": chars})  # noqa: F841 (read by name in the SQL: a DuckDB replacement scan)
    got = {r[0] for r in duckdb.sql(f"SELECT c FROM t WHERE regexp_matches(c, '{BLANK_ID_PATTERN}')").fetchall()}
    assert got == {c for c in chars if c.isspace()} and len(got) > 20
    assert is_blank_id("") and all(is_blank_id(b) for b in BLANKS)
    assert not any(is_blank_id(x) for x in ("a", " a ", "\u200b", "0", "_"))  # zero-width space is not whitespace


@pytest.mark.parametrize("blank", BLANKS)
def test_whitespace_only_ids_are_refused_in_every_format(tmp_path, blank):
    ids = [f"r{i}" for i in range(6)]
    rows = [{"id": i, "text": f"ticket {i}"} for i in ids]
    rows[4]["id"] = blank
    # JSONL
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DatasetError, match=r"in\.jsonl line 5: id field 'id' is .*only whitespace"):
        build_plan(make_spec(tmp_path / "in.jsonl", tmp_path / "o1"))
    # OpenAI batch: custom_id
    reqs = [
        {
            "custom_id": r["id"],
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": r["text"]}]},
        }
        for r in rows
    ]
    (tmp_path / "batch.jsonl").write_text("\n".join(json.dumps(r) for r in reqs) + "\n")
    with pytest.raises(DatasetError, match=r"batch\.jsonl line 5: id field 'custom_id' is .*only whitespace"):
        build_plan(
            make_spec(
                tmp_path / "batch.jsonl",
                tmp_path / "o2",
                io={"input_format": "openai_batch"},
                prompt={"system_prompt": None},
            )
        )
    # Parquet
    write_parquet(tmp_path / "in.parquet", [r["id"] for r in rows], [r["text"] for r in rows])
    with pytest.raises(
        DatasetError,
        match=r"1 row\(s\) have an empty id \(empty or only whitespace\).*"
        r"in\.parquet row 4",
    ):
        build_plan(make_spec(tmp_path / "in.parquet", tmp_path / "o3"))


@pytest.mark.reliability
def test_blank_id_refusals_are_recorded(tmp_path):
    """All blank ids of BLANKS, planted one per file in the three formats: each refused by the plan."""
    planted = refused = 0
    for n, blank in enumerate(BLANKS):
        for fmt in ("jsonl", "openai_batch", "parquet"):
            planted += 1
            d = tmp_path / f"{fmt}{n}"
            d.mkdir()
            if fmt == "parquet":
                write_parquet(d / "in.parquet", ["a", blank], ["x", "y"])
                src = d / "in.parquet"
            else:
                key = "custom_id" if fmt == "openai_batch" else "id"
                line = (
                    {key: blank, "text": "y"}
                    if fmt == "jsonl"
                    else {key: blank, "method": "POST", "url": "/v1/embeddings", "body": {"input": "y"}}
                )
                (d / "in.jsonl").write_text(json.dumps(line) + "\n")
                src = d / "in.jsonl"
            try:
                build_plan(make_spec(src, d / "out", prompt={"system_prompt": None}))
            except DatasetError as e:
                refused += "whitespace" in str(e)
    record_bad_rows("blank_ids_refused_at_plan", planted, refused)
    assert refused == planted == 3 * len(BLANKS)


def test_ids_with_surrounding_spaces_are_still_ids(tmp_path):
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"id": i, "text": "t"}) for i in [" a", "a", "a "]))
    plan = build_plan(make_spec(tmp_path / "in.jsonl", tmp_path / "out"))
    assert plan.total_rows == 3


@pytest.mark.parametrize("name", ["[_]data.parquet", "p*.parquet", "a?b.jsonl"])
def test_an_input_file_name_with_a_glob_character_is_refused_naming_it(tmp_path, name):
    """``[_]data.parquet`` (duplicate ids) was read by DuckDB as ``_data.parquet`` (distinct ids) and published."""
    (tmp_path / "in").mkdir()
    if name.endswith(".jsonl"):
        (tmp_path / "in" / name).write_text(json.dumps({"id": "b", "text": "x"}) + "\n")
    else:
        write_parquet(tmp_path / "in" / name, ["b", "a", "b"], ["x", "y", "z"])
        write_parquet(tmp_path / "in" / "_data.parquet", ["q", "r", "s"], ["x", "y", "z"])
    with pytest.raises(
        DatasetError, match=re.escape(f"input file {tmp_path / 'in' / name}: its path holds a glob character")
    ):
        build_plan(make_spec(tmp_path / "in", tmp_path / "out"))


def test_an_output_prefix_with_a_glob_character_is_refused(tmp_path):
    write_parquet(tmp_path / "in.parquet", ["a"], ["x"])
    with pytest.raises(SpecError, match=re.escape("io.output_uri") + ".*holds a glob character"):
        plan_job(make_spec(tmp_path / "in.parquet", tmp_path / "run[1]"))


# ---- more shards than the orchestrator can map ---------------------------------------------
def test_more_shards_than_max_shards_is_refused_naming_target_rows(tmp_path):
    write_parquet(tmp_path / "in.parquet", [f"r{i}" for i in range(100)], [f"t{i}" for i in range(100)])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"target_rows": 10})
    assert len(build_plan(spec).shards) == 10
    assert len(plan_job(spec.model_copy(), max_shards=10).shards) == 10  # at the limit: fine
    out2 = make_spec(tmp_path / "in.parquet", tmp_path / "out2", sharding={"target_rows": 10})
    with pytest.raises(SpecError) as e:
        plan_job(out2, max_shards=4)
    msg = str(e.value)
    assert "10 shards, more than the 4 mapped tasks" in msg and "[core] max_map_length" in msg
    assert "sharding.target_rows (now 10; at least 25 for 100 rows)" in msg and "sharding.max_shards" in msg
    assert "AIRFLOW__CORE__MAX_MAP_LENGTH" in msg and e.value.terminal
    assert not (tmp_path / "out2").exists() or not any((tmp_path / "out2").iterdir())  # nothing written
    # following the message works
    fixed = make_spec(tmp_path / "in.parquet", tmp_path / "out3", sharding={"target_rows": 25})
    assert len(plan_job(fixed, max_shards=4).shards) == 4


def test_by_tokens_the_message_names_target_tokens(tmp_path):
    write_parquet(tmp_path / "in.parquet", [f"r{i}" for i in range(50)], ["word " * 40] * 50)
    spec = make_spec(
        tmp_path / "in.parquet",
        tmp_path / "out",
        sharding={"target_rows": None, "target_tokens": 100, "chars_per_token": 4.0},
    )
    n = len(build_plan(spec).shards)
    assert n > 3
    with pytest.raises(SpecError, match=r"raise sharding\.target_tokens \(now 100; at least \d+ for \d+ estimated"):
        build_plan(spec, max_shards=3)


def test_the_plan_operator_reads_max_map_length_from_airflow(tmp_path, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.operators import VllmPlanOperator

    write_parquet(tmp_path / "in.parquet", [f"r{i}" for i in range(30)], [f"t{i}" for i in range(30)])
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", str(tmp_path))
    monkeypatch.setenv("AIRFLOW__CORE__MAX_MAP_LENGTH", "2")
    doc = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"target_rows": 10}).model_dump(mode="json")
    ti = type("TI", (), {"xcoms": {}, "xcom_push": lambda self, key, value: self.xcoms.update({key: value})})()
    with pytest.raises(AirflowFailException, match=r"3 shards, more than the 2 mapped tasks.*target_rows"):
        VllmPlanOperator(task_id="plan", spec=doc).execute({"ti": ti, "params": {}})
    assert ti.xcoms == {} and not (tmp_path / "out" / PLAN_FILE).exists()
    monkeypatch.setenv("AIRFLOW__CORE__MAX_MAP_LENGTH", "3")
    assert len(VllmPlanOperator(task_id="plan", spec=doc).execute({"ti": ti, "params": {}})) == 3


@pytest.mark.reliability
@pytest.mark.parametrize("marker", ["_plan.json", "_SUCCESS.json"])
def test_a_new_run_inside_another_runs_folder_is_refused(tmp_path, marker):
    """An output prefix below a folder that holds a run (its sealed plan, or once published its _SUCCESS.json),
    up to the allow-list's prefix, is refused before anything is written: the new run's parts would land among
    that run's files (e.g. in a nightly's results/, which readers list recursively). A sibling prefix, the same
    prefix again (a re-run) and a run above the allow-list's prefix still plan."""
    write_parquet(tmp_path / "in.parquet", ["a", "b"], ["x", "y"])
    root = tmp_path / "allowed"
    nightly = root / "nightly" / "dt=2026-12-05"
    if marker == PLAN_FILE:
        plan_job(make_spec(tmp_path / "in.parquet", nightly), allowed_prefixes=[str(root)])
    else:
        nightly.mkdir(parents=True)
        (nightly / marker).write_text("{}")
    assert (nightly / marker).exists()
    for inside in (nightly / "results" / "x", nightly / "sub"):
        with pytest.raises(SpecError, match=rf"io\.output_uri=.* lies inside the run at {re.escape(str(nightly))} "):
            plan_job(make_spec(tmp_path / "in.parquet", inside), allowed_prefixes=[str(root)])
        assert not inside.exists()
    plan_job(make_spec(tmp_path / "in.parquet", root / "nightly" / "dt=2026-12-06"), allowed_prefixes=[str(root)])
    if marker == PLAN_FILE:
        plan_job(make_spec(tmp_path / "in.parquet", nightly), allowed_prefixes=[str(root)])  # the same run again
    # a run above the allow-list's prefix is not this deployment's to judge (and costs no exists() there)
    (tmp_path / marker).write_text("{}")
    plan_job(make_spec(tmp_path / "in.parquet", root / "other"), allowed_prefixes=[str(root)])


def test_the_folders_checked_for_a_run_stop_at_the_allow_lists_prefix():
    from airflow_provider_vllm.core.allow_list import enclosing_folders

    assert enclosing_folders("s3://bk/root/nightly/dt=1/results", ["s3://bk/root", "s3://bk"]) == [
        "s3://bk/root/nightly/dt=1",
        "s3://bk/root/nightly",
        "s3://bk/root",
    ]
    assert enclosing_folders("s3://bk/root", ["s3://bk/root"]) == []
    assert enclosing_folders("s3://bk/a/b", []) == ["s3://bk/a", "s3://bk"]
    assert enclosing_folders("/data/a/b", ["/data"]) == ["/data/a", "/data"]
    assert enclosing_folders("/data/a", None) == ["/data", "/"]


def test_a_text_that_is_not_utf8_refused_by_the_dedupe_names_the_way_to_run_it_as_a_bad_row(tmp_path):
    """The dedupe (on by default for deterministic sampling over Parquet) reads every row's text with DuckDB, which
    refuses the whole file for one value that is not UTF-8; the message said so but not how to run the row as an
    INVALID_ROW error, which is what the same job gets with the dedupe off."""
    bad = pa.Array.from_buffers(pa.string(), 3, pa.array([b"hello a", b"b\xff bad", b"fine c"], pa.binary()).buffers())
    write_parquet(tmp_path / "in" / "a.parquet", ["a", "b", "c"], bad)
    spec = make_spec(tmp_path / "in", tmp_path / "out", sampling={"temperature": 0})
    with pytest.raises(DatasetError, match=r"not valid UTF8.*sharding\.dedupe: false.*INVALID_ROW"):
        plan_job(spec)
    off = make_spec(tmp_path / "in", tmp_path / "out2", sampling={"temperature": 0}, sharding={"dedupe": False})
    assert plan_job(off).total_rows == 3


# ---- OpenAI batch input found by io.input_format auto ------------------------------------
@pytest.mark.parametrize(
    "over, names",
    [
        ({"prompt": {"system_prompt": "Be terse.", "template": "{text}"}}, "prompt.system_prompt"),
        ({"task": "classify", "prompt": {"system_prompt": None}, "sampling": {"structured": None}}, "task 'chat'"),
        ({"model": {"adapter_column": "team"}, "prompt": {"system_prompt": None}}, "model.adapter_column"),
    ],
)
def test_an_openai_batch_file_found_by_auto_is_refused_as_one_declared_would_be(tmp_path, over, names):
    """The spec's refusals for OpenAI batch input held only for io.input_format: openai_batch; a file found by
    auto ran with the job's system prompt (or adapter column) dropped without a word, or a classify job over
    /v1/embeddings requests."""
    req = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}
    (tmp_path / "batch.jsonl").write_text(json.dumps(req) + "\n")
    if "model" in over:
        over = {
            **over,
            "model": {"name": "fake", "adapters": [{"name": "team", "source": str(tmp_path)}], **over["model"]},
        }
    spec = make_spec(tmp_path / "batch.jsonl", tmp_path / "out", **over)
    assert spec.io.input_format == "auto"
    with pytest.raises(SpecError, match="found by io.input_format auto") as e:
        build_plan(spec)
    assert names in str(e.value)
    declared = spec.model_dump(mode="json")
    declared["io"]["input_format"] = "openai_batch"
    with pytest.raises(SpecError, match=re.escape(names)):
        type(spec).load(declared)
    ok = make_spec(tmp_path / "batch.jsonl", tmp_path / "out2", prompt={"system_prompt": None, "template": "{text}"})
    assert sum(s.rows for s in build_plan(ok).shards) == 1


@pytest.mark.parametrize("planted", [b"not json", b"{}"])
def test_a_retried_plan_refuses_a_plan_file_that_is_no_plan_without_retry(tmp_path, planted):
    """A retried plan task finds _plan.json already there and takes it only when it is this deployment's plan. Bytes
    that are no plan at all are a terminal CommitError naming the file, as the shard workers' and the other tasks'
    readers say, not pydantic's error as a failure retried until the task runs out of tries."""
    from airflow_provider_vllm.core.errors import CommitError

    write_parquet(tmp_path / "in" / "part-0.parquet", ["a", "b"], ["one", "two"])
    spec = make_spec(tmp_path / "in", tmp_path / "out")
    plan_job(spec)
    (tmp_path / "out" / PLAN_FILE).write_bytes(planted)
    with pytest.raises(CommitError, match=r"_plan\.json is not a plan") as e:
        plan_job(spec)
    assert e.value.terminal


# ---- template columns the worker cannot render --------------------------------------------------
@pytest.mark.parametrize(
    ("values", "shown"),
    [
        (pa.array([b"\x00", b"ab", None], pa.binary()), "binary"),
        (pa.array([[1, 2], [], None], pa.list_(pa.int64())), "list<element: int64>"),
        (pa.array([{"a": 1}, {"a": 2}, None], pa.struct([("a", pa.int64())])), "struct<a: int64>"),
        (pa.array([1, 2, None], pa.duration("s")), "duration[s]"),
    ],
    ids=["binary", "list", "struct", "duration"],
)
@pytest.mark.parametrize("cached", [False, True], ids=["plain", "cache"])
def test_a_template_column_the_worker_cannot_render_is_refused_by_the_plan(tmp_path, values, shown, cached):
    """Every row of such a column was an INVALID_ROW error, found only after the engine started: the plan refuses it
    now, naming the file, the column and its type, and says how to run the job (cast it, or carry it in
    io.passthrough). Nothing is written. The same column carried in io.passthrough (not in the template) is fine."""
    from tests.support.data import PINNED_REVISION

    write_parquet(tmp_path / "in" / "a.parquet", ["a", "b", "c"], ["x", "y", "z"], blob=values)
    over = {"prompt": {"template": "{text} {blob}", "text_columns": ["text"]}}
    if cached:
        over |= {
            "cache": {"uri": str(tmp_path / "cache")},
            "model": {"name": "fake", "max_model_len": 1024, "revision": PINNED_REVISION},
        }
    spec = make_spec(tmp_path / "in", tmp_path / "out", **over)
    why = (
        rf"input file a\.parquet: template column 'blob' has type {re.escape(shown)}, which the worker cannot render"
        r".*cast the column.*io\.passthrough"
    )
    with pytest.raises(DatasetError, match=why):
        plan_job(spec)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob(PLAN_FILE))
    carried = make_spec(tmp_path / "in", tmp_path / "out2", io={"passthrough": ["blob"]})
    assert plan_job(carried).total_rows == 3


# ---- template columns whose files disagree on the type ------------------------------------------
_NAIVE = pa.array([dt.datetime(2024, 3, 1, 14, 5)], pa.timestamp("us"))
_AWARE = pa.array([dt.datetime(2024, 3, 1, 14, 5, tzinfo=dt.UTC)], pa.timestamp("us", "UTC"))


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (pa.array([True]), pa.array([1], pa.int64())),
        (pa.array([1], pa.int64()), pa.array([1.0], pa.float64())),
        (
            pa.array([decimal.Decimal("1.5")], pa.decimal128(2, 1)),
            pa.array([decimal.Decimal("1.50")], pa.decimal128(3, 2)),
        ),
        (_NAIVE, _AWARE),
        (pa.array(["1"]), pa.array([1], pa.int64())),
    ],
    ids=["bool-int", "int-double", "decimal-scales", "naive-aware", "string-int"],
)
@pytest.mark.parametrize("dedupe", [True, False], ids=["dedupe", "plain"])
def test_a_template_column_whose_files_disagree_on_its_type_is_refused_naming_both(tmp_path, first, second, dedupe):
    """With the cache or the dedupe the plan read such files through DuckDB, which widened the column to one type
    (``1`` for ``True``, ``1.0`` for ``1``, ``1.50`` for ``1.5``, ``+00:00`` on a naive timestamp), and a plain run
    rendered each file's own values: the prompts depended on the settings. Refused whatever they are, naming the
    column, both files and their types, before anything is written."""
    write_parquet(tmp_path / "in" / "a.parquet", ["a"], ["x"], v=first)
    write_parquet(tmp_path / "in" / "b.parquet", ["b"], ["y"], v=second)
    spec = make_spec(
        tmp_path / "in",
        tmp_path / "out",
        prompt={"template": "{text} {v}", "text_columns": ["text"]},
        sharding={"dedupe": dedupe},
    )
    why = (
        rf"template column 'v' has type {re.escape(str(first.type))} in input file a\.parquet and "
        rf"{re.escape(str(second.type))} in input file b\.parquet.*cast the column to one type in every file"
    )
    with pytest.raises(DatasetError, match=why):
        plan_job(spec)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob(PLAN_FILE))


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (pa.array([1], pa.int64()), pa.array([2], pa.int64())),
        (pa.array([1], pa.int32()), pa.array([2], pa.int64())),  # DuckDB widens to BIGINT: the same text
        (pa.array(["x"], pa.string()), pa.array(["y"], pa.large_string())),
        (
            pa.array([decimal.Decimal("1.5")], pa.decimal128(2, 1)),
            pa.array([decimal.Decimal("2.5")], pa.decimal128(2, 1)),
        ),
        (pa.nulls(1, pa.null()), pa.array([True])),  # a column all empty in one file agrees with any type
        (pa.array([1.5]), pa.nulls(1, pa.null())),
        (_AWARE, _AWARE.cast(pa.timestamp("us", "Europe/Paris"))),  # rendered as its instant in UTC either way
    ],
    ids=["int", "int-widths", "string-widths", "decimal", "null-bool", "double-null", "aware-zones"],
)
def test_template_columns_of_one_type_across_files_plan_as_before(tmp_path, first, second):
    write_parquet(tmp_path / "in" / "a.parquet", ["a"], ["x"], v=first)
    write_parquet(tmp_path / "in" / "b.parquet", ["b"], ["y"], v=second)
    spec = make_spec(tmp_path / "in", tmp_path / "out", prompt={"template": "{text} {v}", "text_columns": ["text"]})
    assert plan_job(spec).total_rows == 2


@pytest.mark.parametrize("dedupe", [True, False], ids=["dedupe", "plain"])
def test_a_decimal_template_column_of_more_than_38_digits_is_refused(tmp_path, dedupe):
    """DuckDB reads a DECIMAL(40,0) as a double: with the cache or the dedupe distinct values shared one key and one
    prompt (``1.2345678901234568e+22``). Refused, naming the file, column and type, with the way out."""
    v = pa.array(
        [decimal.Decimal(12345678901234567890123), decimal.Decimal(12345678901234567890124)], pa.decimal256(40, 0)
    )
    write_parquet(tmp_path / "in" / "a.parquet", ["a", "b"], ["x", "y"], v=v)
    spec = make_spec(
        tmp_path / "in",
        tmp_path / "out",
        prompt={"template": "{text} {v}", "text_columns": ["text"]},
        sharding={"dedupe": dedupe},
    )
    with pytest.raises(
        DatasetError,
        match=r"input file a\.parquet: template column 'v' has type decimal256\(40, 0\).*cast the column to a string",
    ):
        plan_job(spec)
