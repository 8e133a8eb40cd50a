"""Lineage facts (``steps/lineage.py``) -> OpenLineage ``OperatorLineage``, for the OpenLineage provider.

The operators' ``get_openlineage_facets_on_complete`` call ``operator_lineage``; OpenLineage is
imported here, inside the function, so the provider works without
``apache-airflow-providers-openlineage`` installed (its listener is the only caller; the
``openlineage`` extra installs it).

Merge and publish carry the run facet ``vllmBatch`` (``VllmBatchRunFacet``): the model, its
revision and tokenizer, the LoRA adapters (their names; each one's source and identity), the vLLM
versions the shards ran, and the settings that decide an answer (prompt, sampling, engine seed and
answer-changing engine options), with the config hash the results' rows carry.
"""

from __future__ import annotations

import functools
from typing import Any

from airflow_provider_vllm.steps.lineage import DatasetFacts, InferenceFacts, Lineage

RUN_FACET = "vllmBatch"


def operator_lineage(lineage: Lineage | None) -> Any:
    """An ``OperatorLineage`` of ``lineage``'s inputs and outputs (empty when nothing was recorded)."""
    from airflow.providers.openlineage.extractors import OperatorLineage

    if lineage is None:
        return OperatorLineage()
    run_facets = {RUN_FACET: run_facet(lineage.inference)} if lineage.inference is not None else {}
    return OperatorLineage(
        inputs=[_input(d) for d in lineage.inputs],
        outputs=[_output(d) for d in lineage.outputs],
        run_facets=run_facets,
    )


def run_facet(facts: InferenceFacts) -> Any:
    """The ``vllmBatch`` run facet of ``facts``."""
    return _facet_class()(
        model=facts.model,
        revision=facts.revision,
        tokenizer=facts.tokenizer,
        adapter=facts.adapter,
        adapters=[dict(a) for a in facts.adapters],
        dtype=facts.dtype,
        quantization=facts.quantization,
        maxModelLen=facts.max_model_len,
        task=facts.task,
        vllmVersions=list(facts.vllm_versions),
        configHash=facts.config_hash,
        settings=dict(facts.settings),
    )


@functools.cache
def _facet_class() -> type:
    import attr
    from openlineage.client.generated.base import RunFacet

    @attr.define
    class VllmBatchRunFacet(RunFacet):
        """What produced a vLLM batch run's answers (airflow-provider-vllm)."""

        model: str
        revision: str | None
        tokenizer: str | None
        adapter: str | None
        dtype: str
        quantization: str | None
        maxModelLen: int | None  # noqa: N815 - OpenLineage facets use camelCase keys
        task: str
        vllmVersions: list[str]  # noqa: N815
        configHash: str  # noqa: N815
        settings: dict[str, Any]
        adapters: list[dict[str, Any]] = attr.field(factory=list)  # name, source, revision, identity

    return VllmBatchRunFacet


def _facets(d: DatasetFacts) -> dict[str, Any]:
    from openlineage.client.generated.dataset_version_dataset import DatasetVersionDatasetFacet
    from openlineage.client.generated.schema_dataset import SchemaDatasetFacet, SchemaDatasetFacetFields
    from openlineage.client.generated.symlinks_dataset import Identifier, SymlinksDatasetFacet

    facets: dict[str, Any] = {}
    if d.fields:
        facets["schema"] = SchemaDatasetFacet(fields=[SchemaDatasetFacetFields(name=n, type=t) for n, t in d.fields])
    if d.version is not None:  # an Iceberg table: the snapshot read or committed
        facets["version"] = DatasetVersionDatasetFacet(datasetVersion=d.version)
    if d.table is not None:
        facets["symlinks"] = SymlinksDatasetFacet(
            identifiers=[Identifier(namespace=d.namespace, name=d.table, type="TABLE")]
        )
    return facets


def _input(d: DatasetFacts) -> Any:
    from openlineage.client.generated import data_quality_assertions_dataset as dqa
    from openlineage.client.generated.base import InputDataset
    from openlineage.client.generated.input_statistics_input_dataset import InputStatisticsInputDatasetFacet

    facets: dict[str, Any] = {}
    if d.rows is not None or d.files is not None:
        facets["inputStatistics"] = InputStatisticsInputDatasetFacet(rowCount=d.rows, fileCount=d.files)
    if d.assertions:
        facets["dataQualityAssertions"] = dqa.DataQualityAssertionsDatasetFacet(
            assertions=[
                dqa.Assertion(
                    assertion=a.name,
                    name=a.name,
                    success=a.success,
                    severity=a.severity,
                    expected=a.expected,
                    actual=a.actual,
                    description=a.description,
                )
                for a in d.assertions
            ]
        )
    return InputDataset(namespace=d.namespace, name=d.name, facets=_facets(d), inputFacets=facets)


def _output(d: DatasetFacts) -> Any:
    from openlineage.client.generated.base import OutputDataset
    from openlineage.client.generated.output_statistics_output_dataset import OutputStatisticsOutputDatasetFacet

    facets: dict[str, Any] = {}
    if d.rows is not None or d.files is not None:
        facets["outputStatistics"] = OutputStatisticsOutputDatasetFacet(rowCount=d.rows, fileCount=d.files)
    return OutputDataset(namespace=d.namespace, name=d.name, facets=_facets(d), outputFacets=facets)
