"""A local worker's life is bound to the task process that started it (stdlib only, Linux).

The local runner starts the worker in its own session (it leads its process group, vLLM's
engine core processes join it) and sets ``VLLM_BATCH_PARENT_PID`` to its own pid. With
that variable set (never in a pod: there the kubelet owns the process tree):

* ``bind_to_parent()`` asks the kernel for SIGTERM when the parent dies
  (``prctl(PR_SET_PDEATHSIG)``), then checks that the parent did not die before that call
  (the parent pid would already have changed). SIGTERM takes the normal stop path
  (``Preempted``: exit 75, engine processes killed). A thread also polls the parent pid: if
  the main thread is stuck in native code where no Python signal handler runs, it kills the
  worker's descendants and group members and ends the process (``os._exit(75)``) itself. The
  parent-death signal follows the *thread* that forked the worker: the local runner starts
  and waits for the worker in one thread, so that thread outlives it.
* ``ShardLock`` is a host-local lock per shard (``fcntl.flock`` on a file under
  ``$VLLM_BATCH_LOCK_DIR``, default ``<tmp>/vllm-batch-locks-<uid>``, keyed by the run's output
  prefix and the shard id), taken before anything else of the shard runs and held for the
  process's life (the kernel drops it when the last process holding it ends; engine
  processes forked by vLLM inherit it, so an orphaned engine core still holds it). The file
  records the holder: pid, process group, parent (the Airflow task process) and their start
  times. A new attempt that finds it held:

  - kills the recorded process group when the earlier attempt is stale (its task process is
    gone, or the worker is gone and only its group's leftovers hold the lock), then takes
    the lock;
  - otherwise (the earlier attempt and its task process are both alive) waits for it, up to
    ``$VLLM_BATCH_LOCK_WAIT_S`` (default 600 s), then gives up with a transient error
    (exit 75), so two attempts of one shard never run side by side on one host.

  An attempt that takes a free lock also kills the group the previous holder recorded if
  that worker is gone and its task process too but the group still has members (engine
  processes started with ``spawn`` do not inherit the lock).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping

from airflow_provider_vllm.core import envs
from airflow_provider_vllm.core.errors import TransientError

LOCK_DIR_ENV = envs.LOCK_DIR.name
LOCK_WAIT_ENV = envs.LOCK_WAIT_S.name
STALE_KILL_WAIT_S = 60.0
PR_SET_PDEATHSIG = 1

log = logging.getLogger("airflow_provider_vllm.worker")


def expected_parent(env: Mapping[str, str] | None = None) -> int | None:
    raw = envs.PARENT_PID.get(env)
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def set_parent_death_signal(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``; False where unavailable (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def bind_to_parent(
    env: Mapping[str, str] | None = None, poll_s: float = 0.25, on_orphan: Callable[[], None] | None = None
) -> bool:
    """Bind this process's life to ``$VLLM_BATCH_PARENT_PID`` (see the module docstring).

    Returns False when the parent is already gone (the caller exits at once); True when bound
    or when the variable is unset (nothing to do).
    """
    parent = expected_parent(env)
    if parent is None:
        return True
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # it died before prctl took effect: no signal will come
        return False
    on_orphan = on_orphan or _default_on_orphan

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        on_orphan()

    threading.Thread(target=watch, name="vllm-batch-parent-watch", daemon=True).start()
    return True


def _default_on_orphan() -> None:
    from airflow_provider_vllm.worker.exits import orphaned

    orphaned()


# ---- /proc ---------------------------------------------------------------------------
def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot, /proc/PID/stat field 22); None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        if fields[0] == b"Z":  # a zombie has ended; it only waits to be reaped
            return None
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def alive(pid: int | None, started: int | None) -> bool:
    """The process ``pid`` runs and is the one that started at ``started`` (not a reused pid)."""
    if not pid or started is None:
        return False
    return start_time(int(pid)) == started


def group_has_members(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# ---- the per-shard lock ----------------------------------------------------------------
def lock_dir(env: Mapping[str, str] | None = None) -> str:
    path = envs.LOCK_DIR.get(env) or os.path.join(tempfile.gettempdir(), f"vllm-batch-locks-{os.getuid()}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise TransientError(f"cannot use the shard lock folder {path} ({e}); set {LOCK_DIR_ENV}") from e
    if st.st_uid != os.getuid() or not os.path.isdir(path) or os.path.islink(path):
        raise TransientError(f"lock folder {path} is not a folder owned by this user; set {LOCK_DIR_ENV}")
    return path


def lock_path(output_uri: str, shard_id: str, env: Mapping[str, str] | None = None) -> str:
    key = hashlib.sha256(f"{output_uri}\n{shard_id}".encode()).hexdigest()[:32]
    return os.path.join(lock_dir(env), f"{shard_id}-{key}.lock")


class ShardLock:
    """The host-local lock of one shard (see the module docstring)."""

    def __init__(self, path: str, shard_id: str, parent: int | None):
        self.path = path
        self.shard_id = shard_id
        self.parent = parent
        self.fd: int | None = None
        self.killed: list[int] = []  # process groups of stale attempts this one killed

    def record(self) -> dict:
        me = os.getpid()
        return {
            "shard_id": self.shard_id,
            "pid": me,
            "pid_start": start_time(me),
            "pgid": os.getpgrp(),
            "parent_pid": self.parent,
            "parent_start": start_time(self.parent) if self.parent else None,
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    def read(self) -> dict | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                doc = json.loads(f.read() or "null")
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def _try(self) -> bool:
        assert self.fd is not None, "the lock file is opened before it is tried"
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise

    def acquire(self, wait_s: float, poll_s: float = 0.2) -> None:
        """Take the lock (see the module docstring); TransientError when a live attempt keeps it."""
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + wait_s
        waited = False
        while not self._try():
            holder = self.read()
            if holder is not None and stale(holder):
                self._kill(
                    holder,
                    "its Airflow task process is gone"
                    if not alive(holder.get("parent_pid"), holder.get("parent_start"))
                    else "its worker is gone",
                )
                deadline = max(deadline, time.monotonic() + STALE_KILL_WAIT_S)
            elif not waited:
                waited = True
                log.warning(
                    "shard %s: an earlier attempt still runs on this host (%s); waiting up to %.0f s for it to end",
                    self.shard_id,
                    _describe(holder),
                    wait_s,
                )
            if time.monotonic() >= deadline:
                os.close(self.fd)
                self.fd = None
                raise TransientError(
                    f"shard {self.shard_id}: an earlier attempt still runs on this host ({_describe(self.read())}) "
                    f"after {wait_s:.0f} s; not starting a second one next to it (lock {self.path})"
                )
            time.sleep(poll_s)
        previous = self.read()
        if previous is not None and previous.get("pid") != os.getpid():
            self._reap_leftovers(previous)
        assert self.fd is not None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(self.record(), sort_keys=True).encode(), 0)

    def _kill(self, holder: dict, why: str) -> None:
        pid, pgid = holder.get("pid"), holder.get("pgid")
        if pgid and pgid in self.killed:
            return
        log.warning("shard %s: killing stale attempt %s: %s", self.shard_id, _describe(holder), why)
        st = start_time(pid) if pid else None
        if pgid and pgid == pid and pgid != os.getpgrp() and (st is None or st == holder.get("pid_start")):
            # the worker led its group; a pid is never reused while a group of that id has members,
            # so the group is the earlier attempt's (its worker, or what is left of it)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        elif pid and alive(pid, holder.get("pid_start")):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(pid), signal.SIGKILL)
        who = pgid or pid
        if who:
            self.killed.append(int(who))

    def _reap_leftovers(self, previous: dict) -> None:
        """The lock was free; if the previous holder's worker and task are gone but its group lives, kill it."""
        pid, pgid = previous.get("pid"), previous.get("pgid")
        if not pgid or pgid != pid or pgid == os.getpgrp():
            return
        if alive(previous.get("parent_pid"), previous.get("parent_start")):
            return  # its task process still runs and reaps its own group
        if start_time(pid) is not None and start_time(pid) != previous.get("pid_start"):
            return  # the pid was reused: a group of that id is a new process's
        if group_has_members(pgid):
            self._kill(previous, "its worker and task process are gone but its engine processes remain")


def stale(holder: dict) -> bool:
    """An earlier attempt that must not be waited for: its task process or its worker is gone."""
    if not alive(holder.get("parent_pid"), holder.get("parent_start")) and holder.get("parent_pid"):
        return True
    return not alive(holder.get("pid"), holder.get("pid_start"))


def _describe(holder: dict | None) -> str:
    if not holder:
        return "holder not recorded yet"
    return (
        f"worker pid {holder.get('pid')}, process group {holder.get('pgid')}, "
        f"task process pid {holder.get('parent_pid')}, since {holder.get('at')}"
    )


_HELD: list[ShardLock] = []  # kept for the process's life: closing the fd would release the lock


def hold_shard_lock(output_uri: str, shard_id: str, env: Mapping[str, str] | None = None) -> ShardLock | None:
    """Take the shard's host-local lock when this worker was started by the local runner; else None."""
    parent = expected_parent(env)
    if parent is None:
        return None
    lock = ShardLock(lock_path(output_uri, shard_id, env), shard_id, parent)
    lock.acquire(float(envs.LOCK_WAIT_S.value(env)))
    _HELD.append(lock)
    return lock
