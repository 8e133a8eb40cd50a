"""For scripts/suite_cpu.py: with ``VLLM_BATCH_TEST_TIMELINE`` set, each test process appends one line per test to
that file (which process ran which test, from when to when), so the sampler can charge the CPU of every process on
the machine, including those pytest never waits for, to the test that started it. Off otherwise."""

from __future__ import annotations

import json
import os
import time

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.time()
    try:
        return (yield)
    finally:
        line = {"pid": os.getpid(), "nodeid": item.nodeid, "start": start, "end": time.time()}
        with open(os.environ["VLLM_BATCH_TEST_TIMELINE"], "a") as f:  # O_APPEND: one short line, whole
            f.write(json.dumps(line) + "\n")
