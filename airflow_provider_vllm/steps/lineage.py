"""What each task of a batch job read and wrote, as lineage facts (no Airflow, no OpenLineage).

Datasets are named by the OpenLineage naming conventions: ``s3://bucket/key`` -> namespace
``s3://bucket``, name ``key`` (the same for ``gs://`` and other ``scheme://authority/path``
stores); a local path or ``file://`` URI -> namespace ``file``, name the absolute path.
Folders are named without a trailing slash. ``utils/openlineage_facets.py`` turns these facts into
OpenLineage objects; the operators record them in ``execute()``.

Datasets are what a user reads or what a run reads from outside: the input, ``results/``,
``errors/``, the QA report, the published output. The run's own bookkeeping (``_plan.json``,
commit markers, attempt files) is not. The tasks that make or publish answers (merge, publish)
also carry ``InferenceFacts``: which model, revision, adapter and vLLM version, with which
settings, produced the results.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_vllm.core.adapters import AdapterRef
from airflow_provider_vllm.core.records import MergeSummary
from airflow_provider_vllm.core.rows import ERROR_COLUMNS, RESULT_COLUMNS, ROW_SCHEMA
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.steps.cache.key import KEY_ENGINE_KWARGS
from airflow_provider_vllm.steps.merge.merger import ERRORS, RESULTS

QA_REPORT = "qa/report.json"
_TYPES = {f.name: str(f.type) for f in ROW_SCHEMA}


@dataclass(frozen=True)
class Assertion:
    """One QA check as a data-quality assertion: ``success`` is False when it crossed a threshold."""

    name: str
    success: bool
    severity: str | None  # "warn" / "error" (the check's fail threshold) when it did not pass
    expected: str | None = None
    actual: str | None = None
    description: str | None = None


@dataclass(frozen=True)
class DatasetFacts:
    """One dataset a task read or wrote: its OpenLineage name and what is cheaply known of it."""

    namespace: str
    name: str
    rows: int | None = None
    files: int | None = None
    fields: tuple[tuple[str, str], ...] = ()  # (column, type)
    assertions: tuple[Assertion, ...] = ()
    version: str | None = None  # an Iceberg table's snapshot id (OpenLineage's datasetVersion facet)
    table: str | None = None  # an Iceberg table's identifier (a symlink of type TABLE to the location's name)


@dataclass(frozen=True)
class InferenceFacts:
    """What produced a run's answers: the model and engine, and every setting that decides an answer.

    ``settings`` holds the spec's answer-deciding sections as the spec has them: ``prompt``,
    ``sampling`` (with the structured-output constraint) and the engine's seed and the
    ``engine_kwargs`` that change answers (the result cache's key covers the same,
    ``steps/cache.py``). ``vllm_versions``: every vLLM version the run's committed shards ran
    (one, unless shards ran on different images). ``adapter``: the job's LoRA adapters' names (comma
    separated; None: base weights only); ``adapters``: each one's name, source, hub revision and, when the plan
    is at hand (merge), its identity (``sha256:<every byte>`` or ``<repo>@<commit>``), with which rows run
    with which adapter (``default_adapter``, ``adapter_column``) in ``settings``.
    """

    model: str
    revision: str | None
    tokenizer: str | None
    adapter: str | None
    dtype: str
    quantization: str | None
    max_model_len: int | None
    task: str
    vllm_versions: tuple[str, ...]
    config_hash: str
    settings: Mapping[str, Any]
    adapters: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class Lineage:
    """A task's inputs and outputs, and (merge, publish) what produced the answers."""

    inputs: tuple[DatasetFacts, ...] = field(default_factory=tuple)
    outputs: tuple[DatasetFacts, ...] = field(default_factory=tuple)
    inference: InferenceFacts | None = None


def inference_facts(
    spec: JobSpec, vllm_versions: Sequence[str] = (), adapters: Sequence[AdapterRef] = ()
) -> InferenceFacts:
    """The model, engine and answer-deciding settings of ``spec``; ``vllm_versions`` as the shards recorded;
    ``adapters``: the plan's adapter identities (``Plan.adapters``), when known."""
    m, e = spec.model, spec.engine
    known = {a.name: a.identity() for a in adapters}
    return InferenceFacts(
        model=m.name,
        revision=m.revision,
        tokenizer=m.tokenizer,
        adapter=", ".join(a.name for a in m.adapters) or None,
        adapters=tuple(
            {
                "name": a.name,
                "source": a.source,
                **({"revision": a.revision} if a.revision else {}),
                **({"identity": known[a.name]} if a.name in known else {}),
            }
            for a in m.adapters
        ),
        dtype=m.dtype,
        quantization=m.quantization,
        max_model_len=m.max_model_len,
        task=spec.task,
        vllm_versions=tuple(sorted({v for v in vllm_versions if v})),
        config_hash=spec.output_hash(),
        settings={
            "prompt": spec.prompt.model_dump(mode="json"),
            "sampling": spec.sampling.model_dump(mode="json"),
            "engine": {
                "seed": e.seed,
                "engine_kwargs": {k: v for k, v in sorted(e.engine_kwargs.items()) if k in KEY_ENGINE_KWARGS},
            },
            **(
                {"adapters": {"default_adapter": m.default_adapter, "adapter_column": m.adapter_column}}
                if m.adapters
                else {}
            ),
        },
    )


def dataset_id(uri: str) -> tuple[str, str]:
    """(namespace, name) of a location, by the OpenLineage naming conventions."""
    text = str(uri).strip()
    stripped = text.rstrip("/")
    if "://" not in text:
        return "file", stripped or "/"
    scheme, rest = stripped.split("://", 1)
    if scheme == "file":
        return "file", rest or "/"  # file:///data/x -> /data/x
    authority, _, path = rest.partition("/")
    return f"{scheme}://{authority}", path or "/"


def under(uri: str, rel: str) -> str:
    """``rel`` under the folder ``uri``."""
    return f"{uri.rstrip('/')}/{rel.lstrip('/')}"


def _dataset(uri: str, **facts: Any) -> DatasetFacts:
    namespace, name = dataset_id(uri)
    return DatasetFacts(namespace=namespace, name=name, **facts)


def _fields(columns: Sequence[str]) -> tuple[tuple[str, str], ...]:
    return tuple((c, _TYPES.get(c, "string")) for c in columns)


def input_dataset(spec: JobSpec, table: Any = None, **facts: Any) -> DatasetFacts:
    """The job's input: its location, or an Iceberg table named by its location (the OpenLineage convention for
    tables of files, as the Spark integration names Iceberg tables) at the snapshot the plan pinned
    (``table``: the plan's ``TablePin``)."""
    if table is not None:
        return _dataset(table.location, version=str(table.snapshot_id), table=table.identifier, **facts)
    assert spec.io.input_uri is not None
    return _dataset(spec.io.input_uri, **facts)


def plan_lineage(spec: JobSpec, *, rows: int, files: int | None = None, table: Any = None) -> Lineage:
    """Plan read the input (``rows`` valid rows in ``files`` files; ``table``: the pinned snapshot);
    ``_plan.json`` is bookkeeping, not a dataset."""
    return Lineage(inputs=(input_dataset(spec, table, rows=rows, files=files),))


def merge_lineage(
    spec: JobSpec,
    summary: MergeSummary,
    adapters: Sequence[AdapterRef] = (),
    passthrough: Any = None,
    table: Any = None,
) -> Lineage:
    """Merge checked the input's ids and published the results/ and errors/ folders.

    Row counts, part counts, columns (with the passthrough columns, ``Plan.passthrough``, in their types);
    what produced the answers (``inference_facts``, with the plan's ``adapters``).
    """
    carried: tuple[tuple[str, str], ...] = ()
    if passthrough is not None:
        carried = tuple(zip(passthrough.names, passthrough.types))
    files = summary.files
    parts = summary.parts
    out = spec.io.output_uri
    return Lineage(
        inputs=(input_dataset(spec, table, rows=summary.rows),),
        outputs=(
            _dataset(
                under(out, files.get("results", RESULTS).rstrip("/")),
                rows=summary.ok_rows,
                files=parts.get(RESULTS),
                fields=_fields(RESULT_COLUMNS) + carried,
            ),
            _dataset(
                under(out, files.get("errors", ERRORS).rstrip("/")),
                rows=summary.error_rows,
                files=parts.get(ERRORS),
                fields=_fields(ERROR_COLUMNS) + carried,
            ),
        ),
        inference=inference_facts(spec, summary.engine_versions, adapters),
    )


def qa_assertions(qa: Mapping[str, Any]) -> tuple[Assertion, ...]:
    """The QA checks that ran, then the verdict itself (``qa_verdict``), as assertions."""
    out = []
    for c in qa.get("checks") or []:
        status = c.get("status")
        if status not in ("pass", "warn", "fail"):
            continue  # 'skip': not evaluated for this job
        below = c.get("direction") == "below"
        actual = str(c.get("value"))
        if c.get("interval"):
            lo, hi = c["interval"]
            actual += f" (95% interval {lo} to {hi})"
        out.append(
            Assertion(
                name=str(c.get("name")),
                success=status == "pass",
                severity={"warn": "warn", "fail": "error"}.get(status),
                expected=(
                    f">= {c.get('warn')} (fails below {c.get('fail')})"
                    if below
                    else f"<= {c.get('warn')} (fails above {c.get('fail')})"
                ),
                actual=actual,
                description=c.get("detail"),
            )
        )
    status = qa.get("status")
    out.append(
        Assertion(
            name="qa_verdict",
            success=status != "fail",
            severity="error" if status == "fail" else None,
            expected="pass or warn",
            actual=str(status),
            description=qa.get("summary"),
        )
    )
    return tuple(out)


ACCURACY_CHECKS = ("accuracy", "accuracy_drop")


def qa_lineage(spec: JobSpec, qa: Mapping[str, Any]) -> Lineage:
    """QA read the results (its checks are their assertions) and the errors, and wrote the report.

    With known labels (``qa.reference``), the golden set or ride-along file is an input too, carrying
    the accuracy assertions (the input column's labels are in the run's own input, not read here again).
    """
    out = spec.io.output_uri
    assertions = qa_assertions(qa)
    accuracy = tuple(a for a in assertions if a.name in ACCURACY_CHECKS)
    refs = [uri for source, uri in (qa.get("references") or {}).items() if source != "input_column" and uri]
    if spec.qa.reference.ride_along_uri and spec.qa.reference.ride_along_uri not in refs:
        refs.append(spec.qa.reference.ride_along_uri)
    return Lineage(
        inputs=(
            _dataset(under(out, RESULTS), assertions=assertions),
            _dataset(under(out, ERRORS)),
            *(_dataset(uri, assertions=accuracy) for uri in refs),
        ),
        outputs=(_dataset(qa.get("report_json") or under(out, QA_REPORT)),),
    )


def publish_lineage(spec: JobSpec, event: Mapping[str, Any], vllm_versions: Sequence[str] = ()) -> Lineage:
    """Publish marked the output folder current (the Asset it updates), over results and errors, and with
    ``io.output_table`` committed the results to that table (``event["table"]``: identifier, location and the
    snapshot); what produced the answers it published (``vllm_versions``: the merge summary's)."""
    out = spec.io.output_uri
    committed = event.get("table")
    table = (
        (
            _dataset(
                committed["location"],
                rows=event.get("ok_rows"),
                version=str(committed["snapshot_id"]),
                table=committed["identifier"],
            ),
        )
        if committed
        else ()
    )
    return Lineage(
        inputs=(
            _dataset(under(out, RESULTS), rows=event.get("ok_rows")),
            _dataset(under(out, ERRORS), rows=event.get("error_rows")),
        ),
        outputs=(_dataset(out, rows=event.get("rows")), *table),
        inference=inference_facts(spec, vllm_versions),
    )
