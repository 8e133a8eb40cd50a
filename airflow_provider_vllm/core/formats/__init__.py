"""Input formats: one ``InputFormat`` per format, found by name with ``input_format``.

``files`` finds an input's files and its format name; ``base`` holds the interface
(``InputFormat.scan`` for the planner, ``InputFormat.read_rows`` for the worker).
"""

from __future__ import annotations

from airflow_provider_vllm.core.formats.base import InputFormat, RowBatch, Scan
from airflow_provider_vllm.core.formats.jsonl import JsonlFormat
from airflow_provider_vllm.core.formats.openai_batch import OpenAIBatchFormat
from airflow_provider_vllm.core.formats.parquet import ParquetFormat

FORMATS: dict[str, InputFormat] = {f.name: f for f in (ParquetFormat(), JsonlFormat(), OpenAIBatchFormat())}

__all__ = ["FORMATS", "InputFormat", "RowBatch", "Scan", "input_format"]


def input_format(name: str) -> InputFormat:
    """The format called ``name`` ('parquet', 'jsonl', 'openai_batch'); ValueError for another name."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown input format {name!r}; known: {sorted(FORMATS)}") from None
