"""``Storage.read_bytes`` reads a whole file only while it stays within a limit: a run folder's other writers
cannot exhaust a task's memory with a planted file of many GB where a record is read. (The same reads on S3 and
GCS: tests/s3/test_storage_s3.py and tests/s3/test_create_only_probe.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.storage import RECORD_MAX_BYTES, Storage
from tests.support import ROOT


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


def test_a_file_within_the_limit_is_read_whole_and_one_byte_more_is_refused_naming_it(tmp_path):
    check_capped_reads(Storage(str(tmp_path)))


def test_a_device_that_states_no_size_is_read_only_up_to_the_limit(tmp_path):
    """A symlink to /dev/zero where a record is read: fstat says 0 bytes, the reads never end; one byte past the
    limit is enough to refuse it."""
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    (tmp_path / "_SUCCESS.json").symlink_to("/dev/zero")
    with pytest.raises(CommitError, match="is larger than 4096 bytes"):
        Storage(str(tmp_path)).read_bytes("_SUCCESS.json", limit=4096)


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
