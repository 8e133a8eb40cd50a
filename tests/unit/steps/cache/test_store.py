"""The cache folder (steps/cache_store.py): sealed commits only, verified copies, compaction."""

from __future__ import annotations

import hashlib
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.steps.cache import store as store_module
from airflow_provider_vllm.steps.cache.result_cache import ENTRY_SCHEMA
from airflow_provider_vllm.steps.cache.store import COMMIT_MAX_BYTES, COMPACT_AFTER, CacheStore
from tests.support.security import counted_reads

KH = "a" * 64


def k(name: str) -> bytes:
    """A row key: 32 bytes, as ``key_sql`` makes them."""
    return hashlib.sha256(name.encode()).digest()


def entry_file(path, keys: list[str], label: str, at: str, hex_keys: bool = False) -> int:
    """An entry part holding ``keys`` (names, see ``k``); ``hex_keys``: as the previous version wrote them."""
    schema = ENTRY_SCHEMA.set(0, pa.field("key", pa.string(), nullable=False)) if hex_keys else ENTRY_SCHEMA
    cols = {f.name: pa.nulls(len(keys), f.type) for f in schema}
    cols.update(
        key=pa.array([k(x).hex() if hex_keys else k(x) for x in keys]),
        source_id=pa.array([f"id-{x}" for x in keys]),
        label=pa.array([label] * len(keys)),
        computed_at=pa.array([at] * len(keys)),
    )
    pq.write_table(pa.table(cols, schema=schema), path)
    return len(keys)


@pytest.fixture
def store(tmp_path):
    return CacheStore(str(tmp_path / "cache"), {}, Keyring.from_env())


def write(store, tmp_path, n: int, keys: list[str], label: str, hex_keys: bool = False, published=True) -> str:
    """Entry ``n`` as a merge writes it, then (``published``) vouched for as publish does."""
    eid = f"{n:032x}"
    local = tmp_path / f"e{n}.parquet"
    rows = entry_file(local, keys, label, f"2026-12-01T00:00:{n:02d}.000000+00:00", hex_keys)
    assert store.write(KH, eid, str(local), rows, {"output_uri": f"/runs/{n}"})
    if published:
        made = store.read_commit(KH, eid)
        store.vouch(KH, eid, made.seal.mac, "publish", f"/runs/{n}")
    return eid


def test_commits_live_per_key_config_and_a_rewrite_is_a_no_op(store, tmp_path):
    eid = write(store, tmp_path, 1, ["k1"], "a")
    assert [c.entry_id for c in store.committed(KH)] == [eid]
    assert store.committed("b" * 64) == []
    assert os.listdir(tmp_path / "cache" / "commits") == [KH[:32]]
    local = tmp_path / "again.parquet"
    entry_file(local, ["k1"], "other", "2026-12-01T00:00:01.000000+00:00")
    assert store.write(KH, eid, str(local), 1, {}) is False  # create-only: the first commit stays


def test_compaction_keeps_the_newest_answer_per_key_and_bounds_what_a_plan_reads(store, tmp_path):
    for n in range(COMPACT_AFTER):  # every other entry as the previous version wrote it (keys as hex text)
        write(store, tmp_path, n, [f"k{n}", "shared"], f"label{n}", hex_keys=n % 2 == 1)
    assert store.compact(KH, str(tmp_path / "w1")) is None  # not yet over the bound
    write(store, tmp_path, COMPACT_AFTER, [f"k{COMPACT_AFTER}", "shared"], "newest")
    eid = store.compact(KH, str(tmp_path / "w2"))
    assert eid is not None
    live = store.committed(KH)
    assert [c.entry_id for c in live] == [eid] and live[0].supersedes and len(live[0].supersedes) == COMPACT_AFTER + 1
    _, files = store.fetch(live, str(tmp_path / "read"))
    t = pq.read_table(files[0])
    assert t.schema.field("key").type == pa.binary()
    keys = t.column("key").to_pylist()
    assert keys == sorted(keys)  # one sorted run: what the plan's index reads without sorting
    got = dict(zip(keys, t.column("label").to_pylist()))
    assert len(got) == COMPACT_AFTER + 2 and got[k("shared")] == "newest"
    assert got[k("k3")] == "label3" and got[k("k4")] == "label4"  # from a hex entry and a binary one
    assert sorted(os.listdir(tmp_path / "cache" / "entries")) == [eid]  # superseded entries removed


def test_an_entry_removed_after_the_listing_is_skipped_not_fatal(store, tmp_path, caplog):
    a = write(store, tmp_path, 1, ["k1"], "a")
    b = write(store, tmp_path, 2, ["k2"], "b")
    commits = store.committed(KH)
    os.remove(tmp_path / "cache" / "entries" / a / "part-00000.parquet")  # a compaction elsewhere
    kept, files = store.fetch(commits, str(tmp_path / "read"))
    assert [c.entry_id for c in kept] == [b] and len(files) == 1
    assert "skipping entry" in caplog.text


def test_planted_commits_are_read_no_further_than_a_commit_this_provider_writes(store, tmp_path, monkeypatch, caplog):
    """An unsealed commit is parsed before its seal is checked: one larger than ``COMMIT_MAX_BYTES`` is skipped
    unread, and a folder holding more than ``MAX_COMMITS`` commits is not read at all (a warning names it). The code
    before read and parsed any number of them, each up to 256 MiB."""
    eid = write(store, tmp_path, 1, ["k1"], "a")
    folder = tmp_path / "cache" / "commits" / KH[:32]
    assert (folder / f"{eid}.json").stat().st_size < COMMIT_MAX_BYTES // 100  # a genuine one
    planted = folder / f"{'f' * 32}.json"
    planted.write_bytes(b'{"entry_id": "' + b" " * (COMMIT_MAX_BYTES + 1) + b'"}')
    (tmp_path / "cache" / "published" / KH[:32] / f"{'f' * 32}.json").write_text("{}")  # or it is not even read
    read = counted_reads(monkeypatch)
    assert [c.entry_id for c in store.committed(KH)] == [eid]
    assert sum(read) < COMMIT_MAX_BYTES // 100 and f"skipping {planted}" in caplog.text

    monkeypatch.setattr(store_module, "MAX_COMMITS", 3)
    for n in range(2):  # with a vouch record each: commits without one are never read, and not counted
        (folder / f"{n + 0xE0:032x}.json").write_text("{}")
        (tmp_path / "cache" / "published" / KH[:32] / f"{n + 0xE0:032x}.json").write_text("{}")
    read.clear()
    assert store.committed(KH) == []
    assert read == [] and f"skipping every entry of {folder}: it holds 4 commits, more than the 3" in caplog.text


def test_entries_of_runs_not_published_yet_neither_hide_the_published_ones_nor_escape_the_sweep(
    store, tmp_path, monkeypatch
):
    """Entries no publish vouched for (yet) are kept ``UNPUBLISHED_KEEP`` and never compacted: more of them than
    ``MAX_COMMITS`` made every plan skip every entry of the key config (the published ones too), and the sweep, which
    read the same refused listing, removed none of them, so the folder never came back under the bound."""
    from datetime import UTC, datetime

    monkeypatch.setattr(store_module, "MAX_COMMITS", 3)
    published = write(store, tmp_path, 1, ["k1"], "a")
    pending = sorted(write(store, tmp_path, n, [f"k{n}"], "b", published=False) for n in range(2, 7))
    assert [c.entry_id for c in store.committed(KH)] == [published]  # the five pending ones are not read
    later = datetime.now(UTC) + store_module.UNPUBLISHED_KEEP + store_module.timedelta(days=1)
    assert store.sweep(KH, keep="", at=later) == pending[:2]  # 3 read (the first by name), the published one kept
    assert store.sweep(KH, keep="", at=later) == pending[2:4]  # each merge's sweep shrinks the folder
    assert store.sweep(KH, keep="", at=later) == pending[4:]
    assert store.sweep(KH, keep="", at=later) == []
    assert sorted(os.listdir(tmp_path / "cache" / "entries")) == [published]
    assert [c.entry_id for c in store.committed(KH)] == [published]


def test_a_commit_folder_flooded_with_other_files_is_listed_no_further_than_its_bound(
    store, tmp_path, monkeypatch, caplog
):
    """Files that are no commit (any name) count too: a key config's folder holding more than ``COMMITS_LISTED``
    entries is skipped with a warning naming it and the bound, its listing stopped there. The code before listed
    the whole folder (millions of planted objects: minutes and GiBs) before it filtered and counted commits."""
    eid = write(store, tmp_path, 1, ["k1"], "a")
    folder = tmp_path / "cache" / "commits" / KH[:32]
    monkeypatch.setattr(store_module, "COMMITS_LISTED", 5, raising=False)
    for n in range(5):
        (folder / f"junk-{n}").write_text("")
    with caplog.at_level("WARNING"):
        assert store.committed(KH) == []
    assert f"skipping every entry of {folder}: {folder} holds more than 5 entries" in caplog.text
    (folder / "junk-0").unlink()
    assert [c.entry_id for c in store.committed(KH)] == [eid]


def test_an_append_writes_nothing_through_a_link_planted_in_the_cache_folder(store, tmp_path):
    """A writer of the cache folder plants ``entries -> another tenant's folder`` or ``commits/<key> -> elsewhere``:
    the result cache's append refuses it naming the link (``LinkRefused``), and nothing lands where it points
    (before, the entry's part, then its commit, were written there)."""
    from airflow_provider_vllm.core.errors import LinkRefused

    other = tmp_path / "other"
    other.mkdir()
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "entries").symlink_to(other)
    with pytest.raises(LinkRefused, match="entries is a symbolic link"):
        write(store, tmp_path, 1, ["k1"], "a")
    (tmp_path / "cache" / "entries").unlink()
    (tmp_path / "cache" / "commits").mkdir()
    (tmp_path / "cache" / "commits" / KH[:32]).symlink_to(other)
    with pytest.raises(LinkRefused, match=f"{KH[:32]} is a symbolic link"):
        write(store, tmp_path, 2, ["k2"], "b")
    assert os.listdir(other) == []


def test_only_vouched_entries_are_read_and_a_planted_record_is_read_no_further_than_its_bound(
    store, tmp_path, monkeypatch, caplog
):
    """An entry whose run was not published (no vouch record) is not read, nor compacted; a record larger than
    ``VOUCH_MAX_BYTES`` is refused unread (its entry skipped, with a warning)."""
    monkeypatch.setattr(store_module, "COMPACT_AFTER", 1)
    a = write(store, tmp_path, 1, ["k1"], "a", published=False)
    assert store.committed(KH) == [] and [c.entry_id for c in store.committed(KH, vouched=False)] == [a]
    assert store.compact(KH, str(tmp_path / "w")) is None  # nothing vouched: nothing to fold
    b = write(store, tmp_path, 2, ["k2"], "b")
    assert [c.entry_id for c in store.committed(KH)] == [b]
    planted = tmp_path / "cache" / "published" / KH[:32] / f"{a}.json"
    planted.write_bytes(b'{"entry_id": "' + b" " * store_module.VOUCH_MAX_BYTES + b'"}')
    read = counted_reads(monkeypatch)
    assert [c.entry_id for c in store.committed(KH)] == [b]
    assert sum(read) < store_module.VOUCH_MAX_BYTES // 10 and f"cache: entry {a} is not read" in caplog.text


def test_a_vouch_record_written_as_the_sweep_removes_its_commit_is_removed_not_left_for_good(store, tmp_path):
    """Publish read the entry's commit (there), then a merge's sweep of entries not published within
    ``UNPUBLISHED_KEEP`` removed it (commit, part, and the record: none yet), then publish wrote its record: a
    record for no commit, vouching for nothing, that nothing removed and every plan's bounded listing counted. The
    record is now read back against the commit and removed; a commit written again meanwhile is not vouched for
    either. Nothing serves in either case, and the folder of records is left as it was."""
    eid = write(store, tmp_path, 1, ["k1"], "a", published=False)
    read_by_publish = store.read_commit(KH, eid)
    store.drop(KH, [eid])  # the sweep, between publish's read and its write
    assert store.vouch(KH, eid, read_by_publish.seal.mac, "publish", "/runs/1") is False
    assert not (tmp_path / "cache" / "published" / KH[:32]).exists() or not os.listdir(
        tmp_path / "cache" / "published" / KH[:32]
    )
    again = write(store, tmp_path, 2, ["k2"], "b", published=False)
    stale_mac = "0" * 64  # what publish read before the commit was written again
    assert store.vouch(KH, again, stale_mac, "publish", "/runs/2") is False
    assert os.listdir(tmp_path / "cache" / "published" / KH[:32]) == []
    assert store.committed(KH) == []
    made = store.read_commit(KH, again)
    assert store.vouch(KH, again, made.seal.mac, "publish", "/runs/2") is True  # the undisturbed case
    assert [c.entry_id for c in store.committed(KH)] == [again]
