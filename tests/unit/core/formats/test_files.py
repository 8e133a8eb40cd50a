"""Input files: the check that a planned file is still the one the plan read, and what its refusal says to do."""

from __future__ import annotations

import re

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


@pytest.mark.parametrize("how", ["in place", "replaced by a rename"])
def test_a_local_file_rewritten_with_the_same_size_and_mtime_is_refused(tmp_path, how):
    """On local disk a file's mtime is anyone's to set (``touch -d``, ``os.utime``): a rewrite of the same size
    with the old mtime put back (a repeated id, other texts) must still fail the check. The change time is not
    settable by the writer (``os.utime`` moves it too; a file renamed over the planned one was changed after it)."""
    import os

    folder, root, planned = _planned(tmp_path)
    path = folder / "a.jsonl"
    before = path.stat()
    forged = '{"id": "b", "text": "hello"}\n'  # the same size: a repeated id
    assert len(forged) == before.st_size
    if how == "in place":
        path.write_text(forged)
    else:
        (folder / ".a.tmp").write_text(forged)
        os.replace(folder / ".a.tmp", path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns
    with pytest.raises(InputChangedError, match=r"a\.jsonl changed since the plan"):
        check_unchanged(root, planned)


def test_a_rewrite_in_place_is_refused_where_the_platform_reports_a_birth_time(tmp_path, monkeypatch):
    """fsspec's ``created`` is the file's birth time where ``os.stat`` has one (macOS, BSD; Windows with Python
    3.12): a rewrite in place keeps it, and keeps the inode. The version takes the change time from ``stat``."""
    import os

    from fsspec.implementations.local import LocalFileSystem

    info = LocalFileSystem.info

    def with_birth_time(self, path, **kwargs):
        got = info(self, path, **kwargs)
        return {**got, "created": 1_600_000_000.0}  # a birth time: the same before and after a rewrite in place

    monkeypatch.setattr(LocalFileSystem, "info", with_birth_time)
    folder, root, planned = _planned(tmp_path)
    path = folder / "a.jsonl"
    before = path.stat()
    path.write_text('{"id": "b", "text": "hello"}\n')  # the same size: a repeated id
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(InputChangedError, match=r"a\.jsonl changed since the plan"):
        check_unchanged(root, planned)


def test_a_shared_volume_that_numbers_inodes_per_mount_passes_the_check(tmp_path, monkeypatch):
    """The plan (Airflow worker) and the shards (pods) may read one shared volume through two mounts; a FUSE mount
    (gcsfuse, Mountpoint for S3) numbers inodes per mount, so the same unchanged file has another inode number
    there. Its size, mtime and change time are the store's: the version must not name the inode number."""
    from fsspec.implementations.local import LocalFileSystem

    info = LocalFileSystem.info
    mount = {"offset": 0}

    def per_mount(self, path, **kwargs):
        got = info(self, path, **kwargs)
        return {**got, "ino": got["ino"] + mount["offset"]}

    monkeypatch.setattr(LocalFileSystem, "info", per_mount)
    folder, root, planned = _planned(tmp_path)
    mount["offset"] = 1_000_003  # the worker pod's mount of the same volume
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


def test_an_input_folder_of_more_files_than_its_bound_is_a_dataset_error_after_listing_no_more(tmp_path, monkeypatch):
    """``INPUT_LISTED`` files and folders (hidden ones included) are listed at most: one more fails the plan naming
    the input and the bound; the code before listed any number of them."""
    from airflow_provider_vllm.core.formats import files

    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(4):
        (folder / f"p{i}.jsonl").write_text(f'{{"id": "{i}", "text": "t"}}\n')
    monkeypatch.setattr(files, "INPUT_LISTED", 3, raising=False)
    with pytest.raises(DatasetError, match=rf"input {folder} holds more than 3 files and folders"):
        input_storage(str(folder), {})
    (folder / "p3.jsonl").unlink()
    assert input_storage(str(folder), {})[1] == ["p0.jsonl", "p1.jsonl", "p2.jsonl"]


def test_an_input_given_as_a_linked_folder_or_as_a_folder_of_links_is_read(tmp_path):
    """The user's links are the user's (the allow-list resolves them): a linked input folder and a folder of links
    to data files are planned and read as before (only folders the pipeline writes refuse links below their root);
    a linked subfolder is not walked, as before (fsspec's ``find`` did not either)."""
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.jsonl").write_text('{"id": "a", "text": "hello"}\n')
    (data / "sub" / "b.jsonl").write_text('{"id": "b", "text": "world"}\n')
    links = tmp_path / "links"
    links.mkdir()
    (links / "a.jsonl").symlink_to(data / "a.jsonl")
    (links / "sub").symlink_to(data / "sub")
    (tmp_path / "linked").symlink_to(data)
    root, names = input_storage(str(tmp_path / "linked"), {})
    assert names == ["a.jsonl", "sub/b.jsonl"]
    assert [root.read_bytes(n) for n in names] == [b'{"id": "a", "text": "hello"}\n', b'{"id": "b", "text": "world"}\n']
    assert len(describe_files(root, names)) == 2
    root, names = input_storage(str(links), {})
    assert names == ["a.jsonl"] and root.read_bytes("a.jsonl") == b'{"id": "a", "text": "hello"}\n'
    assert root.sub("sub").read_bytes("b.jsonl") == b'{"id": "b", "text": "world"}\n'  # links followed below it


@pytest.mark.parametrize("name", ["b.jsonl.gz", "sub/b.ndjson.zst", "B.PARQUET.GZ"])
def test_a_compressed_data_file_in_the_input_folder_is_refused_not_left_out(tmp_path, name):
    """A folder of a.jsonl and b.jsonl.gz was planned over a.jsonl alone: b's rows were never run, never errors,
    and the run's accounting (against the plan) complete."""
    folder = tmp_path / "in"
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / "a.jsonl").write_text('{"id": "a", "text": "hello"}\n')
    (folder / name).write_bytes(b"\x1f\x8b compressed")
    with pytest.raises(DatasetError, match=rf"1 compressed data file\(s\) \({re.escape(name)}\).*left out of the run"):
        find_input(str(folder), {}, "auto")


def test_parquet_compressed_inside_and_hidden_files_are_still_read_or_skipped(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "part-0.snappy.parquet").write_bytes(b"x")
    (folder / ".part-0.jsonl.gz").write_bytes(b"x")
    (folder / "_tmp.jsonl.gz").write_bytes(b"x")
    assert input_storage(str(folder), {})[1] == ["part-0.snappy.parquet"]
