#!/usr/bin/env python
"""Local weights fingerprint (the result cache key's): first fingerprint vs memoised, on a folder of random weights.

    .venv/bin/python benchmarks/bench_fingerprint.py [--size-gb 16] [--files 4] [--workdir DIR] [--keep]

1. Writes ``--files`` files of random bytes (``--size-gb`` GB in all, 10^9 bytes each) plus a
   config.json into ``<workdir>/weights`` (once; reused while the sizes match), fsyncs them and
   waits until the newest is older than the memo's racy margin (``RACY_NS``).
2. first: ``weights_fingerprint`` with an empty memo, after evicting the files from the page cache
   (``posix_fadvise(DONTNEED)`` on these files only): every byte read from disk and hashed.
   first_warm: the same with the memo off right after (whatever of the files the page cache kept).
3. memoised: a new ``FingerprintMemo`` over the memo file step 2 wrote (as the next plan would):
   one stat per file, nothing read.

Prints the three times and memoised / first; appends one JSON line to benchmarks/results.jsonl.
Deletes the folder at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import bench_dataplane as dp  # noqa: E402

from airflow_provider_vllm.steps.cache import fingerprint_memo  # noqa: E402
from airflow_provider_vllm.steps.cache.fingerprint_memo import FingerprintMemo  # noqa: E402
from airflow_provider_vllm.steps.cache.key import weights_fingerprint  # noqa: E402

BLOCK = 64 << 20


def make_weights(folder: Path, size_gb: float, files: int) -> None:
    each = int(size_gb * 1e9) // files
    want = {f"model-{i:05d}-of-{files:05d}.safetensors": each for i in range(files)}
    have = {p.name: p.stat().st_size for p in folder.glob("*.safetensors")} if folder.exists() else {}
    if have == want and (folder / "config.json").exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096}))
    for name, size in want.items():
        with open(folder / name, "wb") as f:
            left = size
            while left:
                n = min(BLOCK, left)
                f.write(os.urandom(n))
                left -= n
            f.flush()
            os.fsync(f.fileno())
        print(f"  wrote {name} ({size / 1e9:.2f} GB)", flush=True)


def evict(folder: Path) -> None:
    for p in folder.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn) -> tuple[float, str]:
    t0 = time.perf_counter()
    fp = fn()
    return time.perf_counter() - t0, fp


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=16.0)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--workdir", type=Path, default=Path(".cache/bench/fingerprint"))
    ap.add_argument("--keep", action="store_true", help="keep the weights folder")
    a = ap.parse_args()
    folder, memo_path = a.workdir / "weights", a.workdir / "weights-fingerprints.json"
    print(f"weights: {a.size_gb} GB in {a.files} files under {folder}", flush=True)
    make_weights(folder, a.size_gb, a.files)
    newest = max(p.stat().st_ctime_ns for p in folder.iterdir())
    wait = (newest + fingerprint_memo.RACY_NS - time.time_ns()) / 1e9
    if wait > 0:  # a file changed within the racy margin is (rightly) not memoised
        time.sleep(wait + 0.1)
    memo_path.unlink(missing_ok=True)
    try:
        evict(folder)
        first_s, fp = timed(lambda: weights_fingerprint(str(folder), FingerprintMemo(str(memo_path))))
        warm_s, fp_warm = timed(lambda: weights_fingerprint(str(folder), FingerprintMemo(None)))
        memo_s, fp_memo = timed(lambda: weights_fingerprint(str(folder), FingerprintMemo(str(memo_path))))
        assert fp == fp_warm == fp_memo, "the three fingerprints differ"
        ratio = memo_s / first_s
        print(f"first (page cache evicted): {first_s:.2f} s ({a.size_gb / first_s:.2f} GB/s)")
        print(f"first, warm (memo off)    : {warm_s:.2f} s ({a.size_gb / warm_s:.2f} GB/s)")
        print(f"memoised                  : {memo_s * 1000:.2f} ms")
        print(f"ratio memoised / first    : {ratio:.6f}")
        line = {
            "bench": "fingerprint",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            **dp.environment(),
            "size_gb": a.size_gb,
            "files": a.files,
            "first_s": round(first_s, 3),
            "first_warm_s": round(warm_s, 3),
            "memoised_s": round(memo_s, 6),
            "ratio": round(ratio, 8),
            "loadavg": os.getloadavg(),
        }
        with open(dp.RESULTS_FILE, "a") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")
    finally:
        if not a.keep:
            shutil.rmtree(folder, ignore_errors=True)
            memo_path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
