"""Where the test suite's CPU goes: every process on the machine, joined to the test that started it.

    .venv/bin/python scripts/suite_cpu.py [--json FILE] [--top N] -- make test

pytest's own figures (``--durations``, rusage of children) miss what it never waits for: airflow
standalone and its task processes, Chromium, vLLM's engine core processes, a worker a test leaves to
the kernel. This runs the command with ``VLLM_BATCH_TEST_TIMELINE`` set (tests/conftest.py then has
each test process append which test it ran from when to when), samples every process's CPU time from
``/proc`` twice a second while the command runs, and charges each process to a test:

- a test process's own CPU (pytest, an xdist worker) between two samples goes to the tests it ran
  meanwhile, split by time;
- any other process goes to the test named by the ``PYTEST_CURRENT_TEST`` it inherited, else (a test
  that gave it an environment of its own) to the test its nearest test-process ancestor was running when
  it started (its parent chain as first seen), else it stays unattributed (setup before pytest, lint,
  the machine's own daemons).

Before and after the command it times a fixed pure-Python loop (``reference_cpu_s``): the VMs this runs on
change speed by up to half within an hour (the same loop took 2.5 and 3.9 CPU-s an hour apart, idle both
times), so a suite's CPU-s are comparable only next to the loop's. It prints the machine's busy CPU
(``/proc/stat``) beside the sampled total: what a process used after
its last sample (at most one interval each) and processes that lived less than one are missed. Then
the CPU by tier, by file, by kind of process and the top tests. Linux only. The command's exit status is this script's.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

TICK = os.sysconf("SC_CLK_TCK")
INTERVAL = 0.5


def _boot_time() -> float:
    """When the machine booted, on the wall clock, to a jiffy (``btime`` in /proc/stat is whole seconds: a
    process would be charged to the test before the one that started it)."""
    with open("/proc/uptime") as f:
        return time.time() - float(f.read().split()[0])


def _busy_ticks() -> int:
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return user + nice + system + irq + softirq + steal


@dataclass
class Proc:
    ppid: int
    start: float  # wall clock
    cpu_first: float
    cpu_last: float
    cmd: str
    test_env: str | None
    samples: list[tuple[float, float]] = field(default_factory=list)  # (time, cpu) for test processes


def _read(pid: str, boot: float) -> tuple[tuple[int, int], int, float, float] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ppid, utime, stime, start = int(rest[1]), int(rest[11]), int(rest[12]), int(rest[19])
    return (int(pid), start), ppid, (utime + stime) / TICK, boot + start / TICK


def _first_sight(pid: int) -> tuple[str, str | None]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:400]
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return "", None
    test = next((e[20:].decode(errors="replace") for e in env if e.startswith(b"PYTEST_CURRENT_TEST=")), None)
    return cmd, test.rsplit(" (", 1)[0] if test else None


def sample(cmd: list[str], timeline: str) -> tuple[int, dict[tuple[int, int], Proc], int, float]:
    """Run ``cmd``; every process seen meanwhile, the machine's busy CPU-s and the wall time."""
    boot, me = _boot_time(), os.getpid()
    procs: dict[tuple[int, int], Proc] = {}
    t0, busy0 = time.time(), _busy_ticks()
    child = subprocess.Popen(cmd, env={**os.environ, "VLLM_BATCH_TEST_TIMELINE": timeline})
    test_pids = set()
    last_read = 0.0
    while True:
        done = child.poll() is not None
        now = time.time()
        if now - last_read > 5:  # which processes are test processes so far
            last_read = now
            test_pids = {line["pid"] for line in _timeline(timeline)}
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == me:
                continue
            got = _read(pid, boot)
            if got is None:
                continue
            key, ppid, cpu, start = got
            p = procs.get(key)
            if p is None:
                name, test = _first_sight(key[0])
                before = start < t0  # running before the command: only what it used since
                p = procs[key] = Proc(ppid, start, cpu if before else 0.0, cpu, name, test)
            p.cpu_last = max(p.cpu_last, cpu)
            if key[0] in test_pids or _is_test_process(p.cmd):
                p.samples.append((now, cpu))
        if done:
            break
        time.sleep(INTERVAL)
    return child.returncode, procs, _busy_ticks() - busy0, time.time() - t0


def _timeline(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def _is_test_process(cmd: str) -> bool:
    """pytest itself or an xdist worker (execnet starts it with ``-c "import sys;exec(eval(...))"``)."""
    return " -m pytest" in cmd or "exec(eval(sys.stdin" in cmd


def kind(cmd: str) -> str:
    if "-m airflow_provider_vllm.worker" in cmd:
        return "vllm worker"
    if "spawn_main" in cmd:
        return "multiprocessing child (vLLM engine core)"
    if "chrom" in cmd:
        return "chromium"
    if "tests.support.shard_server" in cmd:
        return "shared shard server"
    m = re.search(r"bin/airflow (\S+)", cmd)
    if m:
        return f"airflow {m.group(1)}"
    if _is_test_process(cmd):
        return "test process (pytest, xdist)"
    if "pip" in cmd.split()[:4] or " -m pip " in cmd:
        return "pip"
    argv = cmd.split()
    if not argv:
        return "(unnamed)"
    program = argv[0].rsplit("/", 1)[-1]
    if program.startswith("python") and len(argv) > 1:  # python -c / -m module / script.py
        return f"python {argv[1]}" if argv[1] == "-c" else f"python {' '.join(argv[1:3]).rsplit('/', 1)[-1]}"
    return program


BETWEEN = "(test process between tests: start, collection)"


def _shares(
    spans: list[tuple[float, float, str]], starts: list[float], t0: float, t1: float
) -> list[tuple[str, float]]:
    """The tests that ran in [t0, t1], each with its share of that time (the rest: ``BETWEEN``)."""
    if t1 <= t0:
        return [(BETWEEN, 1.0)]
    got, covered = [], 0.0
    i = max(bisect.bisect_right(starts, t0) - 1, 0)
    while i < len(spans) and spans[i][0] < t1:
        overlap = min(spans[i][1], t1) - max(spans[i][0], t0)
        if overlap > 0:
            got.append((spans[i][2], overlap / (t1 - t0)))
            covered += overlap
        i += 1
    if covered < t1 - t0:
        got.append((BETWEEN, 1 - covered / (t1 - t0)))
    return got


def attribute(procs: dict[tuple[int, int], Proc], timeline: list[dict]) -> dict[str, collections.Counter]:
    """CPU-s per test (``""``: unattributed), by kind of process."""
    runs = collections.defaultdict(list)
    for line in timeline:
        runs[line["pid"]].append((line["start"], line["end"], line["nodeid"]))
    for spans in runs.values():
        spans.sort()

    starts = {pid: [s[0] for s in spans] for pid, spans in runs.items()}

    def running(pid: int, when: float) -> str | None:
        i = bisect.bisect_right(starts.get(pid, []), when) - 1
        if i >= 0 and runs[pid][i][1] >= when:
            return runs[pid][i][2]
        return None

    by_pid = {key[0]: p for key, p in procs.items()}
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for key, p in procs.items():
        if key[0] in runs:  # a test process: its CPU between two samples goes to the tests it ran meanwhile
            prev_t, prev = p.start, p.cpu_first
            for when, cpu in p.samples:
                for nodeid, share in _shares(runs[key[0]], starts[key[0]], prev_t, when):
                    out[nodeid][kind(p.cmd)] += (cpu - prev) * share
                prev_t, prev = when, cpu
            continue
        # the test named in the environment it inherited is exact; a start time is only as good as two clocks
        # read to 10 ms (a process that a test starts at once could fall in the test before)
        test, seen, parent = p.test_env, set(), p.ppid
        while parent in by_pid and parent not in seen and test is None:
            if by_pid[parent].start > p.start:  # the pid was reused by a later process
                break
            seen.add(parent)
            if parent in runs:
                test = running(parent, p.start)
            parent = by_pid[parent].ppid
        out[test or ""][kind(p.cmd)] += p.cpu_last - p.cpu_first
    return out


def tier(nodeid: str) -> str:
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "(not a test)"


def report(out: dict[str, collections.Counter], busy_s: float, wall: float, top: int) -> dict:
    total = sum(sum(c.values()) for c in out.values())
    tests = {t: sum(c.values()) for t, c in out.items() if t.startswith("tests/")}
    by_tier, by_file, by_kind = collections.Counter(), collections.Counter(), collections.Counter()
    for t, c in out.items():
        by_tier[tier(t) if t.startswith("tests/") else "(unattributed)"] += sum(c.values())
        if t.startswith("tests/"):
            by_file[t.split("::", 1)[0]] += sum(c.values())
        by_kind.update(c)
    print(
        f"wall {wall:.0f} s; machine busy {busy_s:.0f} CPU-s; sampled {total:.0f}; in tests {sum(tests.values()):.0f}"
    )
    for title, counter, n in (("tier", by_tier, 20), ("file", by_file, 20), ("kind of process", by_kind, 15)):
        print(f"\nCPU-s by {title}:")
        for name, cpu in counter.most_common(n):
            print(f"{cpu:9.1f}  {name}")
    print(f"\nthe {top} tests that used the most CPU (each with what its processes were):")
    for t, cpu in sorted(tests.items(), key=lambda x: -x[1])[:top]:
        kinds = ", ".join(f"{k} {v:.0f}" for k, v in out[t].most_common(3))
        print(f"{cpu:9.1f}  {t}\n           {kinds}")
    return {
        "wall_s": wall,
        "machine_busy_cpu_s": busy_s,
        "sampled_cpu_s": total,
        "tests": {t: dict(c) for t, c in out.items()},
    }


REFERENCE = "\n".join(
    ["import time", "t = time.process_time()", "s = 0", "for i in range(10_000_000):", "    s += i"]
    + ["print(time.process_time() - t)"]
)


def reference_cpu_s() -> float:
    """CPU-s of a fixed pure-Python loop (10M additions) in a fresh interpreter: the machine's speed right now."""
    p = subprocess.run([sys.executable, "-c", REFERENCE], capture_output=True, text=True, check=True, timeout=600)
    return float(p.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the per-test figures here")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command, e.g. -- make test")
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("name the command after --, e.g. -- make test")
    if not os.path.isdir("/proc/self"):
        ap.error("needs Linux's /proc")
    before = reference_cpu_s()
    with tempfile.TemporaryDirectory() as d:
        timeline = os.path.join(d, "timeline.jsonl")
        rc, procs, busy, wall = sample(cmd, timeline)
        figures = report(attribute(procs, _timeline(timeline)), busy / TICK, wall, args.top)
    after = reference_cpu_s()
    print(f"\nmachine speed: the reference loop took {before:.2f} CPU-s before and {after:.2f} after (more: slower)")
    figures["reference_loop_cpu_s"] = [before, after]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
