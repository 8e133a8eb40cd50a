"""The local weights fingerprint (steps/cache/key.weights_fingerprint) and its memo (steps/cache/fingerprint_memo.py).

Every byte counts (an edit in the middle of a big file, same size, mtime put back, changes the
key); the memo saves the reading only for a file whose stat is exactly the one it was hashed at,
and a memo edited by hand, corrupt, of another format, or writable by others is ignored.
Symbolic links are followed and keyed by content. Files written in these tests are seconds old,
so most tests use ``racy_ns=0`` (the production margin, ``RACY_NS``, has its own test).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from pathlib import Path

import pytest

from airflow_provider_vllm.core.errors import SpecError, TransientError
from airflow_provider_vllm.steps.cache import fingerprint_memo
from airflow_provider_vllm.steps.cache import key as cache_key
from airflow_provider_vllm.steps.cache.fingerprint_memo import FileStat, FingerprintMemo, MemoFile
from airflow_provider_vllm.steps.cache.key import weights_fingerprint
from tests.support.data import make_spec

MIB = 1 << 20


@pytest.fixture
def reads(monkeypatch):
    """The files whose bytes were hashed (hashlib.file_digest calls), in order."""
    seen: list[str] = []
    real = hashlib.file_digest

    def counting(f, digest):
        seen.append(os.path.basename(f.name))
        return real(f, digest)

    monkeypatch.setattr(hashlib, "file_digest", counting)
    return seen


def model_folder(root: Path, big: int = 6 * MIB) -> Path:
    m = root / "model"
    m.mkdir()
    (m / "config.json").write_text('{"a": 1}')
    (m / "model.safetensors").write_bytes(os.urandom(big))
    return m


def memo(tmp_path: Path) -> FingerprintMemo:
    return FingerprintMemo(str(tmp_path / "memo" / "weights-fingerprints.json"), racy_ns=0)


def rewrite_middle_keeping_mtime(path: Path, offset: int, size: int) -> os.stat_result:
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(os.urandom(size))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    return before


# ---- every byte ---------------------------------------------------------------------------------
def test_a_same_size_edit_in_the_middle_with_mtime_put_back_changes_the_key(tmp_path, reads):
    m = model_folder(tmp_path)
    mm = memo(tmp_path)
    first = weights_fingerprint(str(m), mm)
    assert weights_fingerprint(str(m), memo(tmp_path)) == first  # memoised (another process: a new memo)
    before = rewrite_middle_keeping_mtime(m / "model.safetensors", 2 * MIB, 2 * MIB)  # 2 MiB of 6, in the middle
    assert (m / "model.safetensors").stat().st_ctime_ns != before.st_ctime_ns  # what no user can put back
    reads.clear()
    edited = weights_fingerprint(str(m), memo(tmp_path))
    assert edited != first and reads == ["model.safetensors"]  # the edited file read again, the other memoised
    assert edited == weights_fingerprint(str(m), FingerprintMemo(None))  # = no memo at all


def test_one_flipped_bit_anywhere_changes_the_key(tmp_path):
    m = model_folder(tmp_path)
    first = weights_fingerprint(str(m), FingerprintMemo(None))
    data = bytearray((m / "model.safetensors").read_bytes())
    for offset in (0, 3 * MIB + 12345, len(data) - 1):
        data[offset] ^= 1
        (m / "model.safetensors").write_bytes(bytes(data))
        assert weights_fingerprint(str(m), FingerprintMemo(None)) != first
        data[offset] ^= 1
    (m / "model.safetensors").write_bytes(bytes(data))
    assert weights_fingerprint(str(m), FingerprintMemo(None)) == first


def test_names_sizes_and_small_files_count(tmp_path):
    m = model_folder(tmp_path, big=MIB)
    first = weights_fingerprint(str(m), FingerprintMemo(None))
    (m / "config.json").write_text('{"a": 2}')
    second = weights_fingerprint(str(m), FingerprintMemo(None))
    (m / "extra.txt").write_bytes(b"")
    third = weights_fingerprint(str(m), FingerprintMemo(None))
    (m / "extra.txt").rename(m / "other.txt")
    assert len({first, second, third, weights_fingerprint(str(m), FingerprintMemo(None))}) == 4


def test_the_key_config_fingerprints_every_byte_of_a_local_model(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_FINGERPRINT_MEMO", str(tmp_path / "memo.json"))
    m = model_folder(tmp_path)
    spec = make_spec(tmp_path / "in", tmp_path / "out", model={"name": str(m)}, cache={"uri": str(tmp_path / "c")})
    first = cache_key.key_hash(cache_key.key_config(spec, "e"))
    rewrite_middle_keeping_mtime(m / "model.safetensors", 3 * MIB, 4096)
    assert cache_key.key_hash(cache_key.key_config(spec, "e")) != first


# ---- the memo -------------------------------------------------------------------------------------
def test_the_memo_saves_reading_unchanged_files(tmp_path, reads):
    m = model_folder(tmp_path)
    first = weights_fingerprint(str(m), memo(tmp_path))
    assert sorted(reads) == ["config.json", "model.safetensors"]
    reads.clear()
    assert weights_fingerprint(str(m), memo(tmp_path)) == first and reads == []
    doc = MemoFile.model_validate_json((tmp_path / "memo" / "weights-fingerprints.json").read_bytes())
    assert {Path(e.path).name for e in doc.entries} == {"config.json", "model.safetensors"}
    assert all(e.path == os.path.realpath(e.path) for e in doc.entries)


def test_files_changed_within_the_racy_margin_are_not_memoised(tmp_path, reads):
    m = model_folder(tmp_path, big=MIB)
    path = str(tmp_path / "memo.json")
    first = weights_fingerprint(str(m), FingerprintMemo(path))  # default margin: these files are seconds old
    reads.clear()
    assert weights_fingerprint(str(m), FingerprintMemo(path)) == first
    assert sorted(reads) == ["config.json", "model.safetensors"]  # read again: nothing was memoised
    assert not os.path.exists(path)
    st = FileStat.of(str(m / "config.json"))
    mm = FingerprintMemo(path)
    mm.put(st, "0" * 64, st.ctime_ns + fingerprint_memo.RACY_NS)  # changed exactly RACY_NS before: not yet
    mm.put(st, "1" * 64, st.ctime_ns + fingerprint_memo.RACY_NS + 1)
    assert mm.get(st) == "1" * 64


def test_a_hand_edited_memo_cannot_keep_a_changed_files_old_hash(tmp_path, reads, caplog):
    m = model_folder(tmp_path)
    first = weights_fingerprint(str(m), memo(tmp_path))
    path = tmp_path / "memo" / "weights-fingerprints.json"
    rewrite_middle_keeping_mtime(m / "model.safetensors", 2 * MIB, MIB)
    now = FileStat.of(str(m / "model.safetensors"))
    doc = json.loads(path.read_text())
    for e in doc["entries"]:  # the hand edit: the entry claims the new stat, with the old hash
        if e["path"] == now.path:
            e.update(mtime_ns=now.mtime_ns, ctime_ns=now.ctime_ns, size=now.size, inode=now.inode, device=now.device)
    path.write_text(json.dumps(doc))
    reads.clear()
    with caplog.at_level(logging.WARNING):
        edited = weights_fingerprint(str(m), memo(tmp_path))
    assert sorted(reads) == ["config.json", "model.safetensors"]  # the whole memo was ignored
    assert edited != first and edited == weights_fingerprint(str(m), FingerprintMemo(None))
    assert "checksum does not match" in caplog.text
    assert MemoFile.model_validate_json(path.read_bytes()).checksum  # and rewritten whole
    reads.clear()
    assert weights_fingerprint(str(m), memo(tmp_path)) == edited and reads == []


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"\x00garbage{", "not a memo of this version"),
        (b'{"format": "someone-else/1", "entries": [], "checksum": ""}', "not a memo of this version"),
        (b"[]", "not a memo of this version"),
        (
            b'{"format": "airflow-provider-vllm/weights-fingerprints/1", "entries": [{"path": "/x"}], "checksum": ""}',
            "not a memo",
        ),
    ],
)
def test_a_corrupt_or_foreign_memo_is_ignored_and_replaced(tmp_path, reads, caplog, content, why):
    m = model_folder(tmp_path, big=MIB)
    path = tmp_path / "memo" / "weights-fingerprints.json"
    path.parent.mkdir()
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING):
        fp = weights_fingerprint(str(m), memo(tmp_path))
    assert why in caplog.text and len(reads) == 2
    assert fp == weights_fingerprint(str(m), FingerprintMemo(None))
    MemoFile.model_validate_json(path.read_bytes())


def test_a_memo_others_can_write_is_not_trusted(tmp_path, reads, caplog):
    m = model_folder(tmp_path, big=MIB)
    weights_fingerprint(str(m), memo(tmp_path))
    path = tmp_path / "memo" / "weights-fingerprints.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    os.chmod(path, 0o666)
    reads.clear()
    with caplog.at_level(logging.WARNING):
        weights_fingerprint(str(m), memo(tmp_path))
    assert len(reads) == 2 and "writable by others" in caplog.text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # replaced by this user's own
    if os.getuid() == 0:  # root can hand the file to another user
        os.chown(path, 12345, -1)
        reads.clear()
        weights_fingerprint(str(m), memo(tmp_path))
        assert len(reads) == 2


def test_an_oversized_memo_is_ignored(tmp_path, reads, monkeypatch):
    m = model_folder(tmp_path, big=MIB)
    weights_fingerprint(str(m), memo(tmp_path))
    monkeypatch.setattr(fingerprint_memo, "MAX_BYTES", 100)
    reads.clear()
    weights_fingerprint(str(m), memo(tmp_path))
    assert len(reads) == 2


def test_entries_of_deleted_or_changed_files_are_dropped(tmp_path):
    m = model_folder(tmp_path, big=MIB)
    weights_fingerprint(str(m), memo(tmp_path))
    (m / "config.json").unlink()
    (m / "new.json").write_text("{}")
    weights_fingerprint(str(m), memo(tmp_path))
    doc = MemoFile.model_validate_json((tmp_path / "memo" / "weights-fingerprints.json").read_bytes())
    assert sorted(Path(e.path).name for e in doc.entries) == ["model.safetensors", "new.json"]


def test_a_memo_that_cannot_be_written_is_skipped(tmp_path, caplog):
    m = model_folder(tmp_path, big=MIB)
    (tmp_path / "a-file").write_text("x")
    with caplog.at_level(logging.WARNING):
        fp = weights_fingerprint(str(m), FingerprintMemo(str(tmp_path / "a-file" / "memo.json"), racy_ns=0))
    assert (
        fp == weights_fingerprint(str(m), FingerprintMemo(None))
        and "could not write the fingerprint memo" in caplog.text
    )
    assert sorted(os.listdir(tmp_path)) == ["a-file", "model"]  # no temp file left behind


def test_where_the_memo_lives(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_FINGERPRINT_MEMO", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert fingerprint_memo.default_path() == str(
        tmp_path / "xdg" / "airflow-provider-vllm" / "weights-fingerprints.json"
    )
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert fingerprint_memo.default_path() == str(
        tmp_path / "home" / ".cache" / "airflow-provider-vllm" / "weights-fingerprints.json"
    )
    monkeypatch.setenv("VLLM_BATCH_FINGERPRINT_MEMO", "OFF")
    assert fingerprint_memo.default_path() is None
    m = model_folder(tmp_path, big=MIB)
    weights_fingerprint(str(m))
    assert not (tmp_path / "home").exists()  # off: nothing written
    monkeypatch.setenv("VLLM_BATCH_FINGERPRINT_MEMO", str(tmp_path / "mine.json"))
    assert FingerprintMemo.default().path == str(tmp_path / "mine.json")


def test_a_file_that_keeps_changing_while_hashed_is_a_transient_error(tmp_path, monkeypatch):
    m = model_folder(tmp_path, big=MIB)
    real = hashlib.file_digest

    def appending(f, digest):
        with open(f.name, "ab") as w:
            w.write(b"x")  # a download still writing
        return real(f, digest)

    monkeypatch.setattr(hashlib, "file_digest", appending)
    with pytest.raises(TransientError, match="kept changing"):
        weights_fingerprint(str(m), memo(tmp_path))


# ---- symbolic links and odd files -----------------------------------------------------------------
def test_symlinked_files_and_folders_are_followed_and_keyed_by_content(tmp_path):
    outside = tmp_path / "blobs"
    outside.mkdir()
    (outside / "abc123").write_bytes(b"weights v1")
    (outside / "shared").mkdir()
    (outside / "shared" / "tokenizer.json").write_text("{}")
    plain = tmp_path / "plain"
    (plain / "sub").mkdir(parents=True)
    (plain / "model.safetensors").write_bytes(b"weights v1")
    (plain / "sub" / "tokenizer.json").write_text("{}")
    linked = tmp_path / "linked"  # a hub-cache snapshot: links to blobs
    linked.mkdir()
    (linked / "model.safetensors").symlink_to(outside / "abc123")
    (linked / "sub").symlink_to(outside / "shared", target_is_directory=True)
    mm = memo(tmp_path)
    assert weights_fingerprint(str(linked), mm) == weights_fingerprint(str(plain), mm)
    (outside / "abc123").write_bytes(b"weights v2")  # the target changes, not the link
    assert weights_fingerprint(str(linked), memo(tmp_path)) != weights_fingerprint(str(plain), memo(tmp_path))
    (outside / "shared" / "tokenizer.json").write_text('{"x": 1}')
    (plain / "model.safetensors").write_bytes(b"weights v2")
    assert weights_fingerprint(str(linked), memo(tmp_path)) != weights_fingerprint(str(plain), memo(tmp_path))


def test_a_link_loop_is_read_once_and_two_links_to_one_folder_count_twice(tmp_path):
    m = model_folder(tmp_path, big=MIB)
    (m / "sub").mkdir()
    (m / "sub" / "up").symlink_to(m, target_is_directory=True)  # a loop two levels down
    (m / "loop").symlink_to(m, target_is_directory=True)
    with_loops = weights_fingerprint(str(m), FingerprintMemo(None))
    (m / "loop").unlink()
    (m / "sub" / "up").unlink()
    assert with_loops == weights_fingerprint(str(m), FingerprintMemo(None))  # the loops add no file
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "vocab.txt").write_text("a b c")
    (m / "a").symlink_to(shared, target_is_directory=True)
    (m / "b").symlink_to(shared, target_is_directory=True)
    both = weights_fingerprint(str(m), FingerprintMemo(None))
    (m / "b").unlink()  # what vLLM finds under b/ is gone: another key
    assert weights_fingerprint(str(m), FingerprintMemo(None)) != both


def test_broken_links_and_special_files_are_refused_by_name(tmp_path):
    m = model_folder(tmp_path, big=MIB)
    (m / "gone.safetensors").symlink_to(tmp_path / "nowhere")
    with pytest.raises(SpecError, match="gone.safetensors is a broken symbolic link"):
        weights_fingerprint(str(m), FingerprintMemo(None))
    (m / "gone.safetensors").unlink()
    os.mkfifo(m / "pipe")  # open() would block forever
    with pytest.raises(SpecError, match="cannot read pipe: .*not a regular file"):
        weights_fingerprint(str(m), FingerprintMemo(None))
