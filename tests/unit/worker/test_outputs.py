"""Structured-output checks: a label only when it is one of the choices, JSON checked by its schema."""

from __future__ import annotations

from airflow_provider_vllm.worker.outputs import check_structured
from tests.support.data import make_spec


def test_choice(tmp_path):
    spec = make_spec(tmp_path / "i", tmp_path / "o")  # choice over tests.support.data.LABELS
    assert check_structured(spec, " bug\n") == ("bug", None, True)
    assert check_structured(spec, "Bug") == (None, None, False)  # not a choice: no label, invalid


def test_json_schema(tmp_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    spec = make_spec(tmp_path / "i", tmp_path / "o", sampling={"structured": {"json_schema": schema}})
    assert check_structured(spec, '{"n": 3}') == (None, '{"n": 3}', True)
    assert check_structured(spec, '{"n": "x"}')[2] is False
    assert check_structured(spec, "not json") == (None, None, False)


def test_regex_and_unstructured(tmp_path):
    spec = make_spec(tmp_path / "i", tmp_path / "o", sampling={"structured": {"regex": "[0-9]{3}"}})
    assert check_structured(spec, "123")[2] is True and check_structured(spec, "12a")[2] is False
    plain = make_spec(tmp_path / "i", tmp_path / "o", sampling={"structured": None})
    assert check_structured(plain, "anything") == (None, None, None)


def test_json_answers_are_never_valid_unchecked_when_jsonschema_is_missing(tmp_path, monkeypatch):
    import sys

    import pytest

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    spec = make_spec(tmp_path / "i", tmp_path / "o", sampling={"structured": {"json_schema": schema}})
    monkeypatch.setitem(sys.modules, "jsonschema", None)  # import jsonschema -> ImportError, as in an image without it
    with pytest.raises(RuntimeError, match="jsonschema package is missing"):
        check_structured(spec, '{"n": "x"}')
