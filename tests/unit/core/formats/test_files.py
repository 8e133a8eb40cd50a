"""Input files: the check that a planned file is still the one the plan read, and what its refusal says to do."""

from __future__ import annotations

import pytest

from airflow_provider_vllm.core.errors import DatasetError, InputChangedError
from airflow_provider_vllm.core.formats.files import check_unchanged, describe_files, find_input, input_storage


def _planned(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"id": "a", "text": "hello"}\n')
    (folder / "b.jsonl").write_text('{"id": "b", "text": "world"}\n')
    root, names = input_storage(str(folder), {})
    return folder, root, describe_files(root, names)


def test_a_planned_file_renamed_since_the_plan_is_refused_saying_what_to_do(tmp_path):
    folder, root, planned = _planned(tmp_path)
    (folder / "b.jsonl").rename(folder / "c.jsonl")
    with pytest.raises(
        InputChangedError, match=r"gone since the plan.*b\.jsonl.*put the planned file back.*new output"
    ):
        check_unchanged(root, planned)


def test_a_planned_file_rewritten_since_the_plan_is_refused_naming_it_and_saying_what_to_do(tmp_path):
    folder, root, planned = _planned(tmp_path)
    (folder / "a.jsonl").write_text('{"id": "a", "text": "hello again"}\n')
    with pytest.raises(InputChangedError, match=r"a\.jsonl changed since the plan.*plan the run again into a new"):
        check_unchanged(root, planned)


def test_a_file_added_to_the_folder_since_the_plan_is_not_a_change(tmp_path):
    """The plan pins its files: a file added later is not read, and not refused."""
    folder, root, planned = _planned(tmp_path)
    (folder / "z.jsonl").write_text('{"id": "z", "text": "late"}\n')
    check_unchanged(root, planned)


def test_a_symbolic_link_to_nothing_in_the_input_folder_is_a_dataset_error_naming_it(tmp_path):
    """A raw FileNotFoundError before: the plan task failed as if the store had blinked, and was retried."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"id": "a", "text": "hello"}\n')
    (folder / "z.jsonl").symlink_to(tmp_path / "gone.jsonl")
    with pytest.raises(DatasetError, match=r"cannot be opened.*z\.jsonl.*symbolic link"):
        find_input(str(folder), {}, "auto")
