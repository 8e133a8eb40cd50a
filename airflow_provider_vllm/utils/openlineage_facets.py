"""Lineage facts (``steps/lineage.py``) -> OpenLineage ``OperatorLineage``, for the OpenLineage provider.

The operators' ``get_openlineage_facets_on_complete`` call ``operator_lineage``; OpenLineage is
imported here, inside the function, so the provider works without
``apache-airflow-providers-openlineage`` installed (its listener is the only caller).
"""

from __future__ import annotations

from typing import Any

from airflow_provider_vllm.steps.lineage import DatasetFacts, Lineage


def operator_lineage(lineage: Lineage | None) -> Any:
    """An ``OperatorLineage`` of ``lineage``'s inputs and outputs (empty when nothing was recorded)."""
    from airflow.providers.openlineage.extractors import OperatorLineage

    if lineage is None:
        return OperatorLineage()
    return OperatorLineage(inputs=[_input(d) for d in lineage.inputs], outputs=[_output(d) for d in lineage.outputs])


def _facets(d: DatasetFacts) -> dict[str, Any]:
    from openlineage.client.generated.schema_dataset import SchemaDatasetFacet, SchemaDatasetFacetFields

    if not d.fields:
        return {}
    return {"schema": SchemaDatasetFacet(fields=[SchemaDatasetFacetFields(name=n, type=t) for n, t in d.fields])}


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
