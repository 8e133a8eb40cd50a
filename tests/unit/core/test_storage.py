"""``Storage.read_bytes`` reads a whole file only while it stays within a limit: a run folder's other writers
cannot exhaust a task's memory with a planted file of many GB where a record is read. (The same reads on S3 and
GCS: tests/s3/test_storage_s3.py and tests/s3/test_create_only_probe.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pytest

from airflow_provider_vllm.core.errors import CommitError, LinkRefused, ListingTooLarge
from airflow_provider_vllm.core.storage import RECORD_MAX_BYTES, Storage
from tests.support import ROOT
from tests.support.security import PLANTED_KINDS, counted_reads, plant, untouched


def check_capped_reads(st: Storage) -> None:
    """What every store must do (local here; S3 and GCS servers on loopback in tests/s3)."""
    st.write_atomic("empty.json", b"")
    st.write_atomic("r.json", b"x" * 3000)  # more than one read block of a small limit
    assert st.read_bytes("empty.json", limit=0) == b""
    assert st.read_bytes("r.json", limit=3000) == b"x" * 3000
    assert st.read_text("r.json") == "x" * 3000  # the default limit
    with pytest.raises(CommitError) as e:
        st.read_bytes("r.json", limit=2999)
    assert f"{st.uri('r.json')} is larger than 2999 bytes" in str(e.value) and "refused unread" in str(e.value)
    with pytest.raises(FileNotFoundError):
        st.read_bytes("missing.json")


def check_listed_sizes(st: Storage) -> None:
    """``listdir_sizes``: one listing gives each name's size; a folder has none (local and S3, tests/s3)."""
    st.write_atomic("sizes/a.jsonl", b"x" * 70)
    st.write_atomic("sizes/b.jsonl", b"")
    st.write_atomic("sizes/sub/c.jsonl", b"y")
    assert st.listdir_sizes("sizes") == {"a.jsonl": 70, "b.jsonl": 0, "sub": None}
    assert st.listdir_sizes("absent") == {}


def check_bounded_listings(st: Storage) -> None:
    """Every listing stops at its bound and names the folder and the bound (local here; S3 and GCS on loopback in
    tests/s3, with pages smaller than the folder: ``storage.LIST_PAGE``)."""
    for i in range(7):
        st.write_atomic(f"many/f{i}.json", b"x" * i)
    st.write_atomic("many/sub/deep.json", b"y")  # 8 entries directly under many/, 8 files at any depth
    assert st.listdir("many", limit=8) == [f"f{i}.json" for i in range(7)] + ["sub"]
    assert st.listdir_sizes("many", limit=8) == {**{f"f{i}.json": i for i in range(7)}, "sub": None}
    assert list(st.walk_files("many", limit=9)) == [f"many/f{i}.json" for i in range(7)] + ["many/sub/deep.json"]
    for listing in (
        lambda: st.listdir("many", limit=7),
        lambda: st.listdir_sizes("many", limit=7),
        lambda: list(st.walk_files("many", limit=7)),
    ):
        with pytest.raises(ListingTooLarge) as e:
            listing()
        assert f"{st.uri('many')} holds more than 7 entries" in str(e.value) and e.value.limit == 7
    assert st.listdir("absent", limit=0) == [] and list(st.walk_files("absent", limit=0)) == []


def test_listings_stop_at_their_bound_naming_the_folder(tmp_path):
    check_bounded_listings(Storage(str(tmp_path)))


def test_a_listing_over_its_bound_reads_no_further_than_the_bound(tmp_path, monkeypatch):
    """The bound is enforced while listing: a folder of 500 entries listed with a bound of 10 reads 11 of them."""
    for i in range(500):
        (tmp_path / f"p{i:03d}").write_bytes(b"")
    read = []
    real = os.scandir

    class Counted:
        def __init__(self, it):
            self.it = it

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.it.close()

        def __iter__(self):
            for e in self.it:
                read.append(e.name)
                yield e

    monkeypatch.setattr(os, "scandir", lambda p: Counted(real(p)))
    with pytest.raises(ListingTooLarge):
        Storage(str(tmp_path)).listdir("", limit=10)
    assert len(read) == 11


def test_links_below_a_folder_the_pipeline_writes_are_refused_unopened(tmp_path):
    """A link anywhere below the root (the file itself, or a folder in the middle of its path) is refused by the
    checked readers and the listings, naming it: ``_SUCCESS.json -> /etc/passwd``, ``shards -> another tenant's
    folder``, a link to a FIFO (which would block an open) or to /dev/zero (which never ends). The root itself may
    be a link (a prefix on a linked volume); an input folder (``follow_links``) follows the user's links."""
    other = tmp_path / "other"
    (other / "x").mkdir(parents=True)
    (other / "x" / "_SUCCESS.json").write_bytes(b"another tenant's")
    os.mkfifo(other / "fifo")
    run = tmp_path / "run"
    run.mkdir()
    (run / "_SUCCESS.json").symlink_to("/etc/passwd")
    (run / "fifo.json").symlink_to(other / "fifo")
    (run / "zero.json").symlink_to("/dev/zero")
    (run / "shards").symlink_to(other)  # a folder in the middle of the path
    (run / "own").mkdir()
    (run / "own" / "x").symlink_to(other / "x")
    st = Storage(str(run))
    cases = {
        "_SUCCESS.json": "_SUCCESS.json",
        "fifo.json": "fifo.json",
        "zero.json": "zero.json",
        "shards/x/_SUCCESS.json": "shards",
        "own/x/_SUCCESS.json": "own/x",
    }
    for rel, link in cases.items():
        for read in (
            lambda rel=rel: st.read_bytes(rel),
            lambda rel=rel: st.sha256(rel),
            lambda rel=rel: st.fetch_verified(rel, None, "0" * 64, str(tmp_path / "copy")),
            lambda rel=rel: st.open(rel).close(),
        ):
            with pytest.raises(LinkRefused) as e:
                read()
            assert f"{st.uri(link)} is a symbolic link" in str(e.value) and st.uri(rel) in str(e.value)
    assert not (tmp_path / "copy").exists()
    for rel in ("shards/x", "own/x"):
        with pytest.raises(LinkRefused):
            st.listdir(rel)
    assert list(st.walk_files("own")) == ["own/x"]  # listed, not walked into (and refused when read)
    with pytest.raises(LinkRefused):
        st.read_bytes("a/../_SUCCESS.json")
    # the root may be a link; an input folder follows the user's links
    (tmp_path / "linked-root").symlink_to(other)
    assert Storage(str(tmp_path / "linked-root")).read_bytes("x/_SUCCESS.json") == b"another tenant's"
    assert Storage(str(run), follow_links=True).read_bytes("shards/x/_SUCCESS.json") == b"another tenant's"
    assert Storage(str(run), follow_links=True).sub("own").read_bytes("x/_SUCCESS.json") == b"another tenant's"


def test_listed_sizes_name_each_plain_file_and_none_for_anything_else(tmp_path):
    check_listed_sizes(Storage(str(tmp_path)))
    (tmp_path / "sizes" / "link.jsonl").symlink_to(tmp_path / "sizes" / "a.jsonl")
    assert Storage(str(tmp_path)).listdir_sizes("sizes")["link.jsonl"] is None  # not what a writer here makes


def test_a_file_within_the_limit_is_read_whole_and_one_byte_more_is_refused_naming_it(tmp_path):
    check_capped_reads(Storage(str(tmp_path)))


def test_a_device_where_a_record_or_a_checked_file_is_read_is_refused_unread(tmp_path):
    """A symlink to /dev/zero where a record is read, or where publish hashes a file: fstat says 0 bytes and the
    reads never end (``sha256``, which has no limit, hashed it forever): refused as no regular file, naming it."""
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    (tmp_path / "_SUCCESS.json").symlink_to("/dev/zero")
    st = Storage(str(tmp_path), follow_links=True)  # an input folder: the user's links are followed, devices not
    for read in (
        lambda: st.read_bytes("_SUCCESS.json", limit=4096),
        lambda: st.sha256("_SUCCESS.json"),
        lambda: st.fetch_verified("_SUCCESS.json", None, "0" * 64, str(tmp_path / "copy")),
    ):
        with pytest.raises(CommitError, match=f"{tmp_path}/_SUCCESS.json is not a regular file"):
            read()
    assert not (tmp_path / "copy").exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_a_fifo_where_a_record_or_a_checked_file_is_read_is_refused_without_blocking(tmp_path):
    """A FIFO another writer of the folder made where a record is read (a cache commit, a marker, the merge
    summary) or a file is hashed: opening it for reading would wait for a writer forever; it is refused, naming
    it. (A reader still blocked after the guard is released by opening the FIFO's other end.)"""
    os.mkfifo(tmp_path / "_MERGED.json")
    st = Storage(str(tmp_path))
    for name, read in (
        ("read_bytes", lambda: st.read_bytes("_MERGED.json")),
        ("sha256", lambda: st.sha256("_MERGED.json")),
        ("fetch_verified", lambda: st.fetch_verified("_MERGED.json", 10, "0" * 64, str(tmp_path / "copy"))),
    ):
        got: list[BaseException | object] = []

        def run(read=read, got=got):
            try:
                got.append(read())
            except BaseException as e:  # noqa: BLE001 - the outcome is asserted below
                got.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(60)  # a guard against a hang, not a timing: it returns at once or blocks for good
        blocked = t.is_alive()
        if blocked:  # release it: a writer's open of a FIFO with a waiting reader succeeds
            os.close(os.open(tmp_path / "_MERGED.json", os.O_WRONLY | os.O_NONBLOCK))
            t.join(60)
        assert not blocked, f"{name} blocked opening a FIFO"
        assert isinstance(got[0], CommitError), (name, got)
        assert f"{tmp_path}/_MERGED.json is not a regular file" in str(got[0]), name


PLANTED = """
import json, sys
from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.steps.merge.merger import read_merged
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.storage import Storage
try:
    read_merged(Storage(sys.argv[1]), Keyring([b"k" * 32]))
    outcome = "read"
except CommitError as e:
    outcome = str(e)
# VmHWM: this process image's peak (ru_maxrss would count the forked parent's memory too)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"outcome": outcome, "peak_mib": hwm // 1024}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="peak memory from /proc (Linux)")
def test_a_planted_merge_summary_of_a_gigabyte_is_refused_unread(tmp_path):
    """A sparse 1 GiB ``_MERGED.json`` (no disk used): merge's readers refuse it naming the file, and the process
    never holds it (peak RSS far below its size; the code before read it all, then failed to parse it)."""
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "_MERGED.json", "wb") as f:
        f.truncate(1 << 30)
    assert RECORD_MAX_BYTES < 1 << 30
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    got = subprocess.run([sys.executable, "-c", PLANTED, str(run)], capture_output=True, text=True, env=env, check=True)
    doc = json.loads(got.stdout.strip().splitlines()[-1])
    assert doc["outcome"].startswith(f"{run}/_MERGED.json is larger than {RECORD_MAX_BYTES} bytes"), doc
    assert doc["peak_mib"] < 512, doc  # reading it whole would take at least 1,024 MiB


def test_a_planted_file_of_a_terabyte_where_a_sealed_file_is_checked_is_not_read(tmp_path, monkeypatch):
    """A sparse 1 TiB file (free to plant on local disk) where a part, a QA file or a cached chunk of a known size
    is checked: ``sha256`` with that size and ``fetch_verified`` read nothing of it (the store states another size)
    and never match; a file that grows past its size is not read beyond it. The code before hashed or copied the
    whole terabyte (hours, and the copy filled the disk)."""
    import hashlib

    from airflow_provider_vllm.core.storage import CheckedCopies

    genuine = b"x" * 1000
    sha = hashlib.sha256(genuine).hexdigest()
    with open(tmp_path / "part.parquet", "wb") as f:
        f.truncate(1 << 40)
    st = Storage(str(tmp_path))
    read = counted_reads(monkeypatch)
    assert st.sha256("part.parquet", len(genuine)) != sha
    with pytest.raises(CommitError, match="part.parquet is not the file its sealed record names"):
        CheckedCopies(st, str(tmp_path / "copies")).get("part.parquet", len(genuine), sha)
    assert sum(read) == 0 and os.listdir(tmp_path / "copies") == []
    # a store that states no size (or the right one) and serves more: never more than size + 1 bytes (the code
    # before read whole 1 MiB blocks: up to size + 1 MiB)
    (tmp_path / "grown.parquet").write_bytes(genuine + b"y" * (3 << 20))
    monkeypatch.setattr("airflow_provider_vllm.core.storage._open_size", lambda f: None)
    read.clear()
    assert st.sha256("grown.parquet", len(genuine)) != sha and sum(read) == len(genuine) + 1
    read.clear()
    assert st.sha256("grown.parquet", (1 << 20) + 10) != sha and sum(read) == (1 << 20) + 11
    read.clear()
    with pytest.raises(CommitError, match="grown.parquet is not the file its sealed record names"):
        CheckedCopies(st, str(tmp_path / "copies")).get("grown.parquet", (1 << 20) + 10, sha)
    assert sum(read) == (1 << 20) + 11 and os.listdir(tmp_path / "copies") == []
    # and what it read is named as such, never as a sha256 a caller could record (publish's extra files do)
    assert st.sha256("grown.parquet", len(genuine)) == f"at least {len(genuine) + 1} bytes, not {len(genuine)}"
    assert st.sha256("grown.parquet", 5 << 20) == f"{len(genuine) + (3 << 20)} bytes, not {5 << 20}"
    assert st.sha256("grown.parquet") == hashlib.sha256((tmp_path / "grown.parquet").read_bytes()).hexdigest()


def test_a_pinned_copy_is_hashed_as_it_is_copied_and_holds_the_bytes_pinned(tmp_path, monkeypatch):
    """``CheckedCopies.pin`` (``Storage.fetch_pinned``): one read gives the copy and the sha256 of its bytes; a file
    of another size than listed gets no copy and a value that is no sha256, reading no more than size + 1 bytes; a
    FIFO is refused unopened, as by every checked reader."""
    import hashlib

    from airflow_provider_vllm.core.storage import CheckedCopies

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "g.parquet").write_bytes(b"g" * 3000)
    (tmp_path / "run" / "grown.parquet").write_bytes(b"x" * (3 << 20))
    st, copies = Storage(str(tmp_path / "run")), CheckedCopies(Storage(str(tmp_path / "run")), str(tmp_path / "c"))
    read = counted_reads(monkeypatch)
    local, digest = copies.pin("g.parquet", 3000)
    assert sum(read) == 3000 and digest == hashlib.sha256(open(local, "rb").read()).hexdigest()
    assert copies.get("g.parquet", 3000, digest) == local  # checked once: QA-style reads share the copy
    monkeypatch.setattr("airflow_provider_vllm.core.storage._open_size", lambda f: None)  # a store stating no size
    read.clear()
    assert copies.pin("grown.parquet", 1000) == ("", "at least 1001 bytes, not 1000")
    assert sum(read) == 1001 and os.listdir(tmp_path / "c") == [os.path.basename(local)]
    os.mkfifo(tmp_path / "run" / "f.parquet")
    with pytest.raises(CommitError, match="is not a regular file"):
        st.fetch_pinned("f.parquet", 10, str(tmp_path / "c" / "f"))


def _files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_writes_below_a_folder_the_pipeline_writes_refuse_links_and_touch_nothing_they_point_to(tmp_path):
    """A writer of a run's folder plants ``shards -> another tenant's folder`` (a link in the middle of a path) or
    a link at the final name: every local write, rename, link, makedirs and removal below the root refuses it,
    naming it, and writes, replaces or removes nothing where it points."""
    other = tmp_path / "other"
    (other / "0").mkdir(parents=True)
    (other / "0" / "_SUCCESS.json").write_bytes(b"another tenant's")
    (other / "victim.json").write_bytes(b"another tenant's victim")
    run = tmp_path / "run"
    run.mkdir()
    (run / "shards").symlink_to(other)  # a folder in the middle of the path
    (run / "own").mkdir()
    (run / "own" / "m.json").symlink_to(other / "victim.json")  # a link at the final name
    (run / "own" / "sub").symlink_to(other / "0")
    (run / "src.parquet").write_bytes(b"a part")
    local = tmp_path / "local.bin"
    local.write_bytes(b"a finished local file")
    before = _files(other)
    st = Storage(str(run))
    cases = {
        "shards/0/_SUCCESS.json": "shards",
        "shards/new/_SUCCESS.json": "shards",
        "own/m.json": "own/m.json",
        "own/sub/_SUCCESS.json": "own/sub",
    }
    for rel, link in cases.items():
        for write in (
            lambda rel=rel: st.write_atomic(rel, b"planted"),
            lambda rel=rel: st.create_only(rel, b"planted"),
            lambda rel=rel: st.write_parquet_atomic(rel, pa.table({"a": [1]})),
            lambda rel=rel: st.publish(str(local), rel),
            lambda rel=rel: st.link_or_copy("src.parquet", rel),
            lambda rel=rel: st.copy("src.parquet", rel),
            lambda rel=rel: st.remove(rel),
            lambda rel=rel: st.remove(rel, recursive=True),
            lambda rel=rel: st.makedirs(f"{rel}/deeper"),
        ):
            with pytest.raises(LinkRefused) as e:
                write()
            assert f"{st.uri(link)} is a symbolic link" in str(e.value) and st.uri(rel) in str(e.value)
    for rel in ("shards", "own/sub"):  # the link itself is not removed through, nor what it points to
        with pytest.raises(LinkRefused):
            st.remove(rel, recursive=True)
        with pytest.raises(LinkRefused):
            st.rmdir(rel)
    with pytest.raises(LinkRefused):
        st.link_or_copy("own/m.json", "own/copy.json")  # a linked source is not linked or copied either
    assert _files(other) == before and sorted(os.listdir(other)) == ["0", "victim.json"]
    assert (run / "shards").is_symlink() and (run / "own" / "m.json").is_symlink()
    assert sorted(os.listdir(run / "own")) == ["m.json", "sub"]  # no temp file left behind either
    with pytest.raises(LinkRefused):
        st.write_atomic("a/../own/m.json", b"x")


def test_legitimate_writes_go_on_the_root_may_be_a_link(tmp_path):
    """The root itself may be a link (a prefix on a linked volume), and a tmp folder outside the root is the
    pipeline's own: every write primitive works there, folders are made as needed, a removal is recursive."""
    (tmp_path / "volume").mkdir()
    (tmp_path / "run").symlink_to(tmp_path / "volume")
    st = Storage(str(tmp_path / "run"))
    local = tmp_path / "local.bin"
    local.write_bytes(b"finished")
    st.write_atomic("a/b/c.json", b"1")
    st.write_atomic("a/b/c.json", b"2")
    assert st.create_only("a/m.json", b"m") and not st.create_only("a/m.json", b"other")
    st.publish(str(local), "p/part.parquet")
    st.link_or_copy("p/part.parquet", "q/part.parquet")
    st.copy("p/part.parquet", "q/copy.parquet")
    st.makedirs("empty/x")
    assert _files(tmp_path / "volume") == {
        "a/b/c.json": b"2",
        "a/m.json": b"m",
        "p/part.parquet": b"finished",
        "q/part.parquet": b"finished",
        "q/copy.parquet": b"finished",
    }
    assert os.path.samefile(tmp_path / "volume/p/part.parquet", tmp_path / "volume/q/part.parquet")  # a hard link
    assert not os.path.samefile(tmp_path / "volume/p/part.parquet", tmp_path / "volume/q/copy.parquet")
    st.rmdir("empty/x")
    st.remove("a", recursive=True)
    st.remove("q/part.parquet")
    st.remove("not/there", recursive=True)
    assert sorted(os.listdir(tmp_path / "volume")) == ["empty", "p", "q"]
    Storage(str(tmp_path / "new" / "root")).write_atomic("x.json", b"x")  # the root is made when missing
    assert (tmp_path / "new" / "root" / "x.json").read_bytes() == b"x"


def test_a_folder_swapped_for_a_link_while_a_write_is_under_way_gets_nothing_written_through_it(tmp_path, monkeypatch):
    """No check-then-act window: the folder is held by its descriptor from the moment it is opened (O_NOFOLLOW), so
    a folder swapped for a link after ``makedirs``, or while the temp file is written, never gets the file put where
    the link points: the swap after makedirs is refused, the one mid-write lands in the folder that was opened."""
    import airflow_provider_vllm.core.storage as storage_mod

    other = tmp_path / "other"
    other.mkdir()
    run = tmp_path / "run"
    st = Storage(str(run))
    st.makedirs("shards/0")
    os.rename(run / "shards", run / "moved")
    (run / "shards").symlink_to(other)  # swapped in between makedirs and the write
    with pytest.raises(LinkRefused, match="shards is a symbolic link"):
        st.write_atomic("shards/0/chunk.parquet", b"chunk")
    with pytest.raises(LinkRefused, match="shards is a symbolic link"):
        st.create_only("shards/0/_SUCCESS.json", b"marker")
    (run / "shards").unlink()
    os.rename(run / "moved", run / "shards")
    real = storage_mod._temp_at

    def swap_then_write(dfd, name, fill, sync=True):
        os.rename(run / "shards", run / "moved")
        (run / "shards").symlink_to(other)  # swapped while the write is under way
        return real(dfd, name, fill, sync)

    monkeypatch.setattr(storage_mod, "_temp_at", swap_then_write)
    assert st.create_only("shards/0/_SUCCESS.json", b"marker")
    assert os.listdir(other) == [] and (run / "moved" / "0" / "_SUCCESS.json").read_bytes() == b"marker"


def test_a_recursive_removal_stops_at_its_bound_and_never_follows_a_link_inside(tmp_path):
    """``remove(recursive=True)`` of a folder others can write: a link inside it is removed, not followed (what it
    points to stays), and a folder of more than ``limit`` entries stops the removal with ``ListingTooLarge``."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.json").write_bytes(b"another tenant's")
    run = tmp_path / "run"
    (run / "entries" / "e1" / "deep").mkdir(parents=True)
    (run / "entries" / "e1" / "deep" / "part.parquet").write_bytes(b"p")
    (run / "entries" / "e1" / "to-other").symlink_to(other)
    (run / "entries" / "e1" / "to-file").symlink_to(other / "keep.json")
    st = Storage(str(run))
    st.remove("entries/e1", recursive=True)
    assert not (run / "entries" / "e1").exists() and _files(other) == {"keep.json": b"another tenant's"}
    (run / "entries" / "e2").mkdir()
    for i in range(11):
        (run / "entries" / "e2" / f"{i}.json").write_bytes(b"x")
    with pytest.raises(ListingTooLarge, match="more than 10 entries"):
        st.remove("entries/e2", recursive=True, limit=10)
    with pytest.raises(IsADirectoryError):
        st.remove("entries/e2")


@pytest.mark.parametrize("kind", PLANTED_KINDS)
def test_publish_with_displace_replaces_a_link_fifo_or_folder_and_touches_nothing_else(tmp_path, kind):
    """``publish(..., displace=True)`` (a file named by its content, kept only when it has these bytes): what
    another writer put at the name is replaced, never followed or opened; ``holds`` says no to it first (an lstat,
    no open: a FIFO would block a read). Without ``displace`` a link there is still refused."""
    import hashlib

    local = tmp_path / "mine.parquet"
    local.write_bytes(b"the plan's bytes")
    sha = hashlib.sha256(b"the plan's bytes").hexdigest()
    out = Storage(str(tmp_path / "out"))
    plant(tmp_path / "out" / "t" / "f.parquet", kind, tmp_path / "outside", b"the plan's bytes")
    assert not out.holds("t/f.parquet", 16, sha)
    if kind == "link":
        with pytest.raises(LinkRefused, match="t/f.parquet is a symbolic link"):
            out.publish(str(local), "t/f.parquet")
    out.publish(str(local), "t/f.parquet", displace=True)
    assert os.listdir(tmp_path / "out" / "t") == ["f.parquet"]  # a folder moved aside is removed too
    assert (tmp_path / "out" / "t" / "f.parquet").read_bytes() == b"the plan's bytes"
    assert out.holds("t/f.parquet", 16, sha) and untouched(tmp_path / "outside", b"the plan's bytes")


def test_holds_needs_a_regular_file_of_the_size_and_sha256_and_a_hard_link_of_same_as_is_one(tmp_path):
    import hashlib

    out = Storage(str(tmp_path))
    out.write_atomic("a", b"abc")
    sha = hashlib.sha256(b"abc").hexdigest()
    assert out.holds("a", 3, sha) and not out.holds("a", 4, sha) and not out.holds("a", 3, "0" * 64)
    assert not out.holds("missing", 3, sha) and out.lstat("missing") is None
    os.link(tmp_path / "a", tmp_path / "b")
    assert out.holds("b", 3, "not read", same_as="a")  # the very file: kept unread
    (tmp_path / "c").symlink_to(tmp_path / "a")
    assert not out.holds("c", 3, sha, same_as="a")  # a link to it is no file of the run
    (tmp_path / "d").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(LinkRefused, match="d is a symbolic link"):
        out.holds("d/a", 3, sha)  # a link in the path below the root: refused as every read refuses it


def test_a_displaced_folder_too_large_to_remove_is_left_aside_with_a_warning(tmp_path, monkeypatch, caplog):
    """The removal of a folder moved aside is bounded (``LISTING_MAX`` entries): past it, what is left stays
    under the aside name, named in a warning; the file is in place either way."""
    from airflow_provider_vllm.core import storage

    monkeypatch.setattr(storage, "LISTING_MAX", 3)
    (tmp_path / "out" / "f").mkdir(parents=True)
    for i in range(5):
        (tmp_path / "out" / "f" / str(i)).write_bytes(b"x")
    (tmp_path / "mine").write_bytes(b"mine")
    with caplog.at_level("WARNING"):
        Storage(str(tmp_path / "out")).publish(str(tmp_path / "mine"), "f", displace=True)
    assert (tmp_path / "out" / "f").read_bytes() == b"mine"
    (aside,) = [n for n in os.listdir(tmp_path / "out") if n != "f"]
    assert aside.startswith(".f.displaced-") and aside in caplog.text and "could not be removed" in caplog.text


HOLDER = """
import sys, tempfile
tempfile.tempdir = sys.argv[1]
from airflow_provider_vllm.core.storage import copies_folder
with copies_folder(sys.argv[2]) as path:
    with open(path + "/part.parquet", "wb") as f:
        f.write(b"x" * 100)
    print(path, flush=True)
    sys.stdin.readline()  # holds its folder until told to go on
"""


def _holder(tmp: Path, step: str = "qa") -> tuple[subprocess.Popen, Path]:
    """A process that made a ``copies_folder`` of ``step`` under ``tmp`` and holds it: (process, folder)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp), step],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    line = proc.stdout.readline().strip()
    assert line, "the holder made no folder"
    return proc, Path(line)


def test_a_copies_folder_of_a_task_killed_with_sigkill_is_removed_by_the_next_one_at_once(tmp_path, monkeypatch):
    """A task killed with SIGKILL leaves its copies folder (up to a run's results/): the kernel drops the lock its
    owner held on it, and the next folder of that step removes it at once, not a day later."""
    from airflow_provider_vllm.core import storage

    monkeypatch.setattr(storage.tempfile, "tempdir", str(tmp_path))
    proc, left = _holder(tmp_path)
    proc.kill()  # SIGKILL: no finally, no atexit
    proc.wait()
    assert left.is_dir() and (left / "part.parquet").exists()
    with storage.copies_folder("merge"):  # another step's sweep leaves it
        assert left.is_dir()
    with storage.copies_folder("qa") as mine:
        assert not left.exists() and not Path(f"{left}.lock").exists()
        assert Path(mine).is_dir() and Path(f"{mine}.lock").is_file()
    assert list(tmp_path.iterdir()) == []


def test_a_live_owners_copies_folder_is_kept_whatever_its_age_and_whatever_process_ids_say(tmp_path, monkeypatch):
    """A long task's folder whose top level is two days old is kept while its owner lives, also when its process
    id means nothing here (another container sharing TMPDIR has other process ids: ``os.kill`` finds no such
    process)."""
    import time

    from airflow_provider_vllm.core import storage

    monkeypatch.setattr(storage.tempfile, "tempdir", str(tmp_path))
    proc, held = _holder(tmp_path)
    try:
        old = time.time() - 2 * 24 * 3600
        os.utime(held, (old, old))
        os.utime(f"{held}.lock", (old, old))

        def no_such_process(pid, sig):
            raise ProcessLookupError(pid)

        monkeypatch.setattr(storage.os, "kill", no_such_process)  # as from another pid namespace
        with storage.copies_folder("qa"):
            assert (held / "part.parquet").read_bytes() == b"x" * 100
    finally:
        proc.communicate("go on\n")
    assert proc.returncode == 0 and not held.exists() and list(tmp_path.iterdir()) == []  # its owner removed it


def test_the_sweep_removes_nothing_it_does_not_own_and_follows_no_link(tmp_path, monkeypatch):
    """Links at a folder's or a lock's name, a FIFO at a lock's name, a file, a folder whose owner is about to
    hold its lock (an empty lock) and another step's folder: all kept, nothing they point to touched, and no
    hang. A lock left without its folder (removal cut short) goes once nobody holds it."""
    import time

    from airflow_provider_vllm.core import storage

    monkeypatch.setattr(storage.tempfile, "tempdir", str(tmp_path / "tmp"))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    old = time.time() - 2 * 24 * 3600
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    owned = b"owned\n"

    def aged(*paths: Path) -> None:
        for p in paths:
            os.utime(p, (old, old), follow_symlinks=False)

    (tmp / f"vllm-batch-qa-{gone.pid}-link").symlink_to(target)  # a link at a folder's name, its lock free
    (tmp / f"vllm-batch-qa-{gone.pid}-link.lock").write_bytes(owned)
    (tmp / f"vllm-batch-qa-{gone.pid}-lockln").mkdir()  # the lock is a link to a lock nobody holds
    (target / "free.lock").write_bytes(owned)
    (tmp / f"vllm-batch-qa-{gone.pid}-lockln.lock").symlink_to(target / "free.lock")
    (tmp / f"vllm-batch-qa-{gone.pid}-fifo").mkdir()
    os.mkfifo(tmp / f"vllm-batch-qa-{gone.pid}-fifo.lock")
    (tmp / f"vllm-batch-qa-{gone.pid}-file").write_text("a file")
    (tmp / f"vllm-batch-qa-{gone.pid}-file.lock").write_bytes(owned)
    (tmp / f"vllm-batch-qa-{gone.pid}-being").mkdir()  # its owner between creating its lock and holding it
    (tmp / f"vllm-batch-qa-{gone.pid}-being.lock").write_bytes(b"")
    (tmp / f"vllm-batch-merge-{gone.pid}-other").mkdir()
    (tmp / f"vllm-batch-merge-{gone.pid}-other.lock").write_bytes(owned)
    (tmp / f"vllm-batch-qa-{gone.pid}-orphan.lock").write_bytes(owned)  # its folder already removed
    kept = sorted(p.name for p in tmp.iterdir() if not p.name.endswith("-orphan.lock"))
    aged(*tmp.iterdir())
    os.utime(tmp / f"vllm-batch-qa-{gone.pid}-being")  # just made, as it is while its owner makes its lock
    with storage.copies_folder("qa") as mine:
        assert sorted(p.name for p in tmp.iterdir() if not p.name.startswith(Path(mine).name)) == kept
    assert sorted(p.name for p in target.iterdir()) == ["free.lock", "keep.txt"]
    assert (target / "keep.txt").read_text() == "mine" and (target / "free.lock").read_bytes() == owned


def test_a_folder_without_an_owner_lock_is_kept_for_a_day_as_before(tmp_path, monkeypatch):
    """A folder without a lock (an older version's, or one whose lock its owner has not yet made) is removed only
    when its process is gone and it is a day old, as before the locks: a fresh one is never taken for dead."""
    import time

    from airflow_provider_vllm.core import storage

    monkeypatch.setattr(storage.tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    old = time.time() - storage.STALE_COPIES_S - 60
    fresh, stale, never = (tmp_path / f"vllm-batch-qa-{gone.pid}-{n}" for n in ("fresh", "stale", "never"))
    for p in (fresh, stale, never):
        p.mkdir()
    (tmp_path / f"{never.name}.lock").write_bytes(b"")  # made, never held: its owner died before holding it
    os.utime(stale, (old, old))
    os.utime(never, (old, old))
    with storage.copies_folder("qa") as mine:
        assert fresh.is_dir() and not stale.exists() and not never.exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [fresh.name, Path(mine).name, f"{Path(mine).name}.lock"]
        )


def test_a_killed_tasks_copies_folder_is_swept_where_flock_is_emulated_by_fcntl_as_on_nfs(tmp_path, monkeypatch):
    """On NFS (and CIFS) the kernel emulates ``flock`` with an ``fcntl`` lock of the whole file, which takes an
    exclusive lock only on a descriptor open for writing (flock(2)), else EBADF. The sweep opened owner locks
    read-only: there every lock read as held, and no folder a killed task left on such a TMPDIR or adapter
    folder was ever removed (not even a day later, as before the locks)."""
    import errno
    import fcntl
    import types

    from airflow_provider_vllm.core import storage

    def nfs_flock(fd: int, op: int) -> None:
        if op & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        fcntl.flock(fd, op)

    monkeypatch.setattr(storage.tempfile, "tempdir", str(tmp_path))
    proc, left = _holder(tmp_path)
    proc.kill()
    proc.wait()
    monkeypatch.setattr(storage, "fcntl", types.SimpleNamespace(**{**vars(fcntl), "flock": nfs_flock}))
    with storage.copies_folder("qa"):
        assert not left.exists() and not Path(f"{left}.lock").exists()


def test_a_hard_link_at_a_folders_lock_name_never_gets_a_live_folder_removed(tmp_path, monkeypatch):
    """A live task's folder without an owner lock (an older version's, kept while its process lives) and, planted
    at its lock's name, a hard link to a lock of ours nobody holds that an owner once wrote (a user of a shared
    TMPDIR where hard links to others' files are allowed): the link is a regular file of ours, written, free and
    still at that name, so the sweep took it for the folder's own and removed the live folder. A lock with another
    name (more than one link) is no folder's own."""
    from airflow_provider_vllm.core import storage

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(storage.tempfile, "tempdir", str(tmp))
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    try:
        folder = tmp / f"vllm-batch-qa-{live.pid}-older"
        folder.mkdir()
        (folder / "part.parquet").write_bytes(b"x" * 100)
        (tmp_path / "free.lock").write_bytes(b"owned\n")
        os.link(tmp_path / "free.lock", tmp / f"{folder.name}.lock")
        with storage.copies_folder("qa"):
            assert (folder / "part.parquet").read_bytes() == b"x" * 100
    finally:
        live.communicate(b"\n")


def test_a_file_planted_at_a_new_folders_lock_name_does_not_fail_the_task(tmp_path, monkeypatch, caplog):
    """Another user of a shared TMPDIR sees each new folder's name (the folder is listed) and plants a file or link
    at ``<folder>.lock`` before its owner creates it: the owner made another folder, each time, and after 100
    failed the task (FileExistsError). It now keeps its folder without an owner lock (the sweep's rule for a folder
    without one: its process gone and a day old), with a warning, and leaves the planted file alone."""
    import logging

    from airflow_provider_vllm.core import storage

    monkeypatch.setattr(storage.tempfile, "tempdir", str(tmp_path))
    real = storage.tempfile.mkdtemp

    def watched(*a, **k):
        path = real(*a, **k)
        os.symlink(tmp_path / "elsewhere", path + ".lock")  # the other user, a moment after the folder appeared
        return path

    monkeypatch.setattr(storage.tempfile, "mkdtemp", watched)
    with caplog.at_level(logging.WARNING), storage.copies_folder("qa") as mine:
        (Path(mine) / "part.parquet").write_bytes(b"x")
    assert not Path(mine).exists() and Path(f"{mine}.lock").is_symlink()
    assert f"{mine}.lock" in caplog.text
