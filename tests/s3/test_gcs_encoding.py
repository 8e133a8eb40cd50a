"""Objects stored with ``Content-Encoding: gzip`` on GCS: the checked readers (``Storage.read_bytes``, ``sha256``,
``fetch_verified``) must hash the bytes the bucket holds, and refuse such an object unread.

GCS serves a gzip-encoded object as stored to a client whose request says ``Accept-Encoding: gzip`` (aiohttp does, so
gcsfs) and decompressed to one that does not. aiohttp's default then decompressed it for gcsfs: a writer of the bucket
could store a gzip stream whose first bytes decompress to a sealed file, of exactly its size, followed by forged
lines. The checked readers saw the sealed size and sha256; other readers got the forged lines too, and a stream of
a few hundred KB decompressed to GBs in the reading process. ``tests.support.loopback.TranscodingGCS`` serves what
GCS serves; the emulator of the other GCS tests keeps an object's ``contentEncoding`` but serves every object as
stored."""

from __future__ import annotations

import gzip
import hashlib
import os
import struct
import zlib

import fsspec
import pytest

from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.storage import CheckedCopies, Storage
from tests.support.ledger import record_malicious
from tests.support.loopback import TranscodingGCS

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # see tests/s3/test_create_only_probe.py

GENUINE = b"".join(b'{"custom_id": "r%03d", "answer": "genuine answer %d"}\n' % (i, i) for i in range(200))
FORGED = b"".join(b'{"custom_id": "r%03d", "answer": "FORGED"}\n' % i for i in range(200))


def gzip_of_size(content: bytes, size: int) -> bytes:
    """A gzip member that decompresses to ``content``, padded to exactly ``size`` bytes in its comment field."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    deflate = c.compress(content) + c.flush()
    pad = size - (10 + 1 + len(deflate) + 8)
    assert pad >= 0
    return (
        b"\x1f\x8b\x08\x10\0\0\0\0\x02\xff"
        + b"A" * pad
        + b"\0"
        + deflate
        + struct.pack("<II", zlib.crc32(content), len(content) & 0xFFFFFFFF)
    )


def checked_reads(st: Storage, rel: str, size: int, sha: str, tmp_path) -> list:
    return [
        lambda: st.read_bytes(rel, limit=size),
        lambda: st.sha256(rel),
        lambda: CheckedCopies(st, str(tmp_path)).get(rel, size, sha),
    ]


@pytest.mark.parametrize("state_encoding", [True, False], ids=["encoding_stated", "object_replaced_after_stat"])
def test_a_gzip_stream_that_decompresses_to_a_sealed_file_and_more_is_never_taken_for_it(tmp_path, state_encoding):
    """The stored object decompresses to the genuine file followed by 200 forged lines, and is exactly the genuine
    file's size. Its metadata names its encoding: refused unread, naming it. It does not (replaced right after the
    metadata was read): the readers get the stored bytes, whose sha256 is not the sealed one. The code before read
    the genuine file's size and sha256 in both cases."""
    rel, size, sha = "run/openai/output.jsonl", len(GENUINE), hashlib.sha256(GENUINE).hexdigest()
    stored = gzip_of_size(GENUINE + FORGED, size)
    assert gzip.decompress(stored).count(b"FORGED") == 200  # what a reader that lets GCS decompress gets
    with TranscodingGCS({rel: stored}, state_encoding=state_encoding) as gcs:
        st = Storage("gs://b", gcs.options)
        assert st.size(rel) == size
        if state_encoding:
            for read in checked_reads(st, rel, size, sha, tmp_path):
                with pytest.raises(CommitError, match=r"gs://b/run/openai/output.jsonl is stored with Content-Enc"):
                    read()
        else:
            assert st.read_bytes(rel, limit=size) == stored
            assert st.sha256(rel) == hashlib.sha256(stored).hexdigest() != sha
            with pytest.raises(CommitError):
                CheckedCopies(st, str(tmp_path)).get(rel, size, sha)
    record_malicious("gcs_gzip_stream_posing_as_a_sealed_file", 1, 1)


def test_a_small_gzip_bomb_is_not_decompressed_into_memory(tmp_path):
    """About 500 KB stored that decompress to 512 MiB: refused unread (the code before decompressed it all in the
    task's memory, about 1,000 times the size the store states)."""
    bomb = gzip.compress(b"\0" * (512 << 20), compresslevel=9)
    with TranscodingGCS({"run/_MERGED.json": bomb}) as gcs:
        with pytest.raises(CommitError, match="is stored with Content-Encoding 'gzip'"):
            Storage("gs://b/run", gcs.options).read_bytes("_MERGED.json")


def test_an_object_the_emulator_keeps_with_a_content_encoding_is_refused_unread(tmp_path):
    """The GCS emulator of the other tests keeps the encoding an object was uploaded with (and serves it as
    stored): the checked readers refuse it from its metadata, naming it."""
    from gcp_storage_emulator.server import create_server

    from tests.support.s3server import free_port

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="gbucket")
    server.start()
    try:
        opts = {"endpoint_url": f"http://127.0.0.1:{port}", "token": "anon", "project": "test"}
        body = gzip.compress(GENUINE)
        fsspec.filesystem("gs", skip_instance_cache=True, **opts).pipe_file(
            "gbucket/enc/_SUCCESS.json", body, fixed_key_metadata={"content_encoding": "gzip"}
        )
        st = Storage("gs://gbucket/enc", opts)
        for read in checked_reads(st, "_SUCCESS.json", len(body), hashlib.sha256(body).hexdigest(), tmp_path):
            with pytest.raises(CommitError, match=r"gs://gbucket/enc/_SUCCESS.json is stored with Content-Encoding"):
                read()
        st.write_atomic("plain.json", b"{}")  # what this provider writes has no encoding: read as ever
        assert st.read_bytes("plain.json") == b"{}"
    finally:
        server.stop()
