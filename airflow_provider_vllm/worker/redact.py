"""Keep secrets out of the worker's logs.

The worker gets credentials only through its environment (``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``
...; never through the job spec, see ``spec_guard``). ``install()`` adds a logging filter
that replaces the value of every such variable with ``***`` in each record, whoever logs it
(this package, vLLM, botocore, a traceback), and the credentials of any URL it shows (``redact_urls``:
``https://user:pass@host``, ``?X-Amz-Signature=...``), whichever variable, setting or library the URL came from.

vLLM configures its own ``vllm`` logger tree (its own handler, ``propagate=False``), so a filter
on the root logger's handlers never sees its records; ``install()`` therefore also wraps the
log record factory, which every logger of the process uses (vLLM wraps it in turn), and which
engine processes forked by vLLM inherit. What no Python logging of this process sees (engine
processes started with ``spawn``, native code printing to stdout/stderr, a plain ``print``)
is caught at the file-descriptor level: ``guard_streams()`` points fds 1 and 2 at pipes read by
a thread that redacts each line and writes it to the original stream; child processes inherit
fds 1 and 2, so their output passes through it too. ``drain()`` lets it finish before exit.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from urllib.parse import quote

from airflow_provider_vllm.core import envs
from airflow_provider_vllm.core.allow_list import CREDENTIAL_QUERY_NAMES

SECRET_ENV = envs.SECRET_NAME
# Shorter values are not masked: a 3-letter token, or "secret", would turn every such word of every log line, and
# of the JSON manifest on stdout, into *** (install() warns, naming the variable, never the value)
MIN_SECRET_CHARS = 8
# Credentials written into a URL, whatever variable or library it came from (a push gateway, a proxy, a catalog):
# the userinfo (user:pass@; one that holds a '/' too, as AWS secret keys do) and credential query parameters.
# Neither crosses whitespace or a quote, so a JSON line (the manifest on stdout) keeps its shape.
_URL_USERINFO = re.compile(
    r"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]*://)(?:[^/\s'\"@<>]*@|[^/\s'\"@<>:]*:[^\s'\"@<>]*@)"
)
_URL_QUERY_CREDENTIAL = re.compile(
    r"([?&;][A-Za-z0-9_.-]*(?:" + "|".join(CREDENTIAL_QUERY_NAMES) + r")[A-Za-z0-9_.-]*=)[^&;#\s'\"]+", re.I
)


def redact_urls(text: str) -> str:
    """``text`` with the credentials of every URL in it (``https://user:pass@host``, ``?X-Amz-Signature=...``)
    replaced by ``***``."""
    if "://" not in text and "=" not in text:
        return text
    return _URL_QUERY_CREDENTIAL.sub(r"\1***", _URL_USERINFO.sub(r"\1***@", text))


def secret_values(env: Mapping[str, str] | None = None) -> list[str]:
    """What to mask, longest first: the values of the variables that hold secrets (``envs.secret_names``: by their
    names, or listed by the deployment in ``VLLM_BATCH_MASKED_ENV``) of at least ``MIN_SECRET_CHARS`` characters;
    each line of a multi-line value (a PEM key printed line by line); each item of a list (``VLLM_BATCH_WORKER_KEY``
    ="new,old"); and each of these as JSON, ``repr`` and a URL escape them (a value with quotes, backslashes,
    control or non-ASCII characters in a JSON line, in an error message's ``{value!r}``, in a URL)."""
    e = envs.environ(env)
    vals = {e[k] for k in envs.secret_names(e)}
    parts = set(vals)
    for v in vals:
        # lines: real ones, and a JSON credential's escaped ones (the PEM key inside a service account key file)
        parts |= {line.strip() for line in re.split(r"\r\n|[\r\n]|\\n", v)}
        # list items, but no bits of JSON (a credential file's '"type":'), which could match the manifest's own syntax
        parts |= {p for p in re.split(r"[\s,]+", v) if not _JSON_SYNTAX.search(p)}
    parts = {p for p in parts if len(p) >= MIN_SECRET_CHARS}
    shown = set(parts)
    for p in parts:
        shown |= {json.dumps(p)[1:-1], json.dumps(p, ensure_ascii=False)[1:-1], repr(p)[1:-1], quote(p, safe="")}
    return sorted((v for v in shown if len(v) >= MIN_SECRET_CHARS), key=lambda v: (-len(v), v))


_JSON_SYNTAX = re.compile(r'["{}\[\]:]')


def too_short(env: Mapping[str, str] | None = None) -> list[str]:
    """Names of secret variables whose non-empty values are too short to mask (``MIN_SECRET_CHARS``)."""
    e = envs.environ(env)
    return sorted(k for k in envs.secret_names(e) if 0 < len(e[k].strip()) < MIN_SECRET_CHARS)


class RedactSecrets(logging.Filter):
    """Replaces known secret values, and credentials in URLs, in a record's message (after %-formatting) and
    traceback."""

    def __init__(self, secrets: list[str]):
        super().__init__()
        self.secrets = secrets

    def redact(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, "***")
        return redact_urls(text)

    def filter(self, record: logging.LogRecord) -> bool:
        # always: with no secret in the environment, a URL's credentials are still masked
        record.msg = self.redact(record.getMessage())
        record.args = None
        if record.exc_info:
            record.exc_text = self.redact(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


def install(env: dict[str, str] | None = None) -> RedactSecrets:
    """Add the filter to every handler of the root logger, and redact every record at creation; ``redact``
    uses it from then on (it holds the signing key, which leaves the environment after the worker reads it)."""
    global _INSTALLED
    f = RedactSecrets(secret_values(env))
    for h in logging.getLogger().handlers:
        h.addFilter(f)
    logging.setLogRecordFactory(_RedactingFactory(logging.getLogRecordFactory(), f))
    _INSTALLED = f
    short = too_short(env)
    if short:
        logging.getLogger(__name__).warning(
            "secret variables %s hold fewer than %d characters: their values are not masked in the worker's output "
            "(masking them would mask ordinary words); give them longer values",
            short,
            MIN_SECRET_CHARS,
        )
    return f


_INSTALLED: RedactSecrets | None = None


def redactor() -> RedactSecrets:
    """The filter ``install`` set up, else one made from the environment now: for what the worker writes other than
    log lines (error rows, the manifest)."""
    return _INSTALLED or RedactSecrets(secret_values())


def redact(text: str) -> str:
    """``text`` with the secrets of the worker's environment and the credentials of URLs masked (``redactor``)."""
    return redactor().redact(text)


class _RedactingFactory:
    """Wraps the record factory: each record leaves it redacted, whichever logger and handler take it."""

    def __init__(self, factory, redactor: RedactSecrets):
        self.factory = factory
        self.redactor = redactor

    def __call__(self, *args, **kwargs) -> logging.LogRecord:
        record = self.factory(*args, **kwargs)
        try:
            self.redactor.filter(record)
        except Exception:  # a record whose arguments do not format: leave it to the handler
            pass
        return record


# ---- file-descriptor level ----------------------------------------------------------------
_PUMPS: list[_Pump] = []
_MAX_PENDING = 1 << 16  # a line longer than this is passed on in pieces
# settle()'s marker: written into the pipe (one write, atomic), never passed on; once the pump reaches
# it, everything written before it has been passed on (a pipe keeps order)
_SETTLE = b"\x00\x1evllm-batch-settle\x1e\x00"


class _Pump:
    """fd ``fd`` now writes into a pipe; a thread redacts what comes out and writes it to the old target."""

    def __init__(self, fd: int, secrets: list[bytes]):
        self.fd = fd
        self.secrets = secrets
        self.target = os.dup(fd)
        r, w = os.pipe()
        os.dup2(w, fd)  # inheritable: child processes write into the pipe too
        os.close(w)
        self.r = r
        self.busy = False
        self.reached = threading.Event()  # the pump passed a settle marker
        self.thread = threading.Thread(target=self._run, name=f"vllm-batch-redact-fd{fd}", daemon=True)
        self.thread.start()

    def redact(self, data: bytes) -> bytes:
        for s in self.secrets:
            data = data.replace(s, b"***")
        if b"://" in data or b"=" in data:
            data = redact_urls(data.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")
        return data

    def _write(self, data: bytes) -> None:
        while data:
            try:
                n = os.write(self.target, data)
            except OSError:  # the reader is gone (broken pipe): nothing more to deliver
                return
            data = data[n:]

    def _run(self) -> None:
        pending = b""
        while True:
            try:
                data = os.read(self.r, 1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            self.busy = True
            pending += data
            if _SETTLE in pending:  # pass on all before it (a partial line too), drop it, signal
                before, _, pending = pending.rpartition(_SETTLE)
                self._write(self.redact(before.replace(_SETTLE, b"")))
                self.reached.set()
            cut = max(pending.rfind(b"\n"), pending.rfind(b"\r"))
            if cut < 0 and len(pending) < _MAX_PENDING:
                self.busy = False
                continue
            cut = cut if cut >= 0 else len(pending) - 1
            out, pending = pending[: cut + 1], pending[cut + 1 :]
            self._write(self.redact(out))
            self.busy = False
        self._write(self.redact(pending))

    def settle(self, timeout: float) -> bool:
        """Write a marker into the pipe and wait (bounded) until the pump has passed on everything before it.

        (An empty pipe is not enough: the pump may have read the last bytes and not yet written them.)
        """
        self.reached.clear()
        try:
            os.write(self.fd, _SETTLE)
        except OSError:
            return True
        return self.reached.wait(timeout)

    def close(self, timeout: float) -> None:
        """Stop writing into the pipe (fd -> /dev/null) and let the thread pass on what is left."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self.fd)
        os.close(devnull)
        self.thread.join(timeout)


def guard_streams(secrets: list[str] | None = None) -> bool:
    """Redact fds 1 and 2 of this process and its children (see the module docstring).

    Only in the worker's own process (``python -m airflow_provider_vllm.worker``), and only
    when there is something to redact. Returns True when installed.
    """
    secrets = secret_values() if secrets is None else secrets
    if not secrets or _PUMPS:
        return False
    raw = [s.encode("utf-8", "surrogateescape") for s in secrets]
    for fd in (1, 2):
        _PUMPS.append(_Pump(fd, raw))
    return True


def settle(timeout: float = 10.0) -> None:
    """Wait (bounded) until what was written so far has been passed on: before a deliberate SIGKILL
    of this process (the fault harness), which would lose what still sits in the pipes. Returns as soon
    as each pump has passed its settle marker; the bound is generous for a loaded machine, where the
    pump thread waits for the GIL behind the engine's threads."""
    deadline = time.monotonic() + timeout
    for p in _PUMPS:
        p.settle(max(0.0, deadline - time.monotonic()))


def drain(timeout: float = 5.0) -> None:
    """Pass on what is left in the pipes (call after child processes are gone, before ``os._exit``).

    A child still holding the pipe keeps it open: then this returns after ``timeout``.
    """
    while _PUMPS:
        _PUMPS.pop().close(timeout)
