"""What one row can break, and what only the engine as a whole can.

A row's own content is used in rendering, the chat template, tokenising, its sampling
settings and the engine's request validation. A failure there is that row's error record;
a failure of the engine as a whole (out of memory, engine death, preemption, our own
run-level errors) is not a row's to carry and goes on up (a retry, exit 75).

No vLLM import: vLLM's exception classes are recognised by name, so this also holds for the
fake engine of the unit tests (which raises vLLM's own classes when vLLM is importable).
"""

from __future__ import annotations

from airflow_provider_vllm.core.errors import VllmBatchError
from airflow_provider_vllm.core.rows import ENGINE_ERROR, INVALID_REQUEST
from airflow_provider_vllm.worker.redact import redact

# Never a row's fault: memory, a dead engine, SIGTERM (worker.__main__.Preempted).
_RUN_LEVEL = frozenset({"OutOfMemoryError", "EngineDeadError", "Preempted"})
# vLLM's classes for "the request is bad" (vllm.exceptions: 4xx in vLLM's own server).
_CLIENT_ERRORS = frozenset({"VLLMClientError", "VLLMValidationError"})


class RequestRejected(Exception):
    """The engine refused one request when it was submitted; the row gets ``code``."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _names(exc: BaseException) -> set[str]:
    return {c.__name__ for c in type(exc).__mro__}


def row_caused(exc: BaseException) -> bool:
    """False for failures that are never one row's (memory, engine death, preemption, our
    run-level errors, anything not an ``Exception``); True otherwise."""
    if not isinstance(exc, Exception) or isinstance(exc, (MemoryError, VllmBatchError)):
        return False
    e: BaseException | None = exc
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if _names(e) & _RUN_LEVEL or isinstance(e, MemoryError):
            return False
        if isinstance(e, RuntimeError) and "out of memory" in str(e).lower():
            return False
        e = e.__cause__ or e.__context__
    return True


def refusal(exc: BaseException, what: str = "request") -> RequestRejected | None:
    """The RequestRejected for an exception the engine raised on submitting one request, or
    None when it is not the request's fault.

    vLLM's validation errors (``VLLMValidationError``, a ``VLLMClientError``: not a
    ``ValueError`` in vLLM 0.32) are ``INVALID_REQUEST``; a ``ValueError``/``TypeError`` from
    the engine on one request is ``ENGINE_ERROR``.
    """
    if not row_caused(exc):
        return None
    if _names(exc) & _CLIENT_ERRORS:
        return RequestRejected(INVALID_REQUEST, redact(f"vLLM refused the {what}: {exc}")[:500])
    if isinstance(exc, (ValueError, TypeError)):
        return RequestRejected(
            ENGINE_ERROR, redact(f"the engine refused the {what}: {type(exc).__name__}: {exc}")[:500]
        )
    return None


def describe(exc: BaseException, limit: int = 300) -> str:
    """``Type: message``, secrets masked (before the cut, which could leave half a secret behind), cut to ``limit``
    characters."""
    text = redact(f"{type(exc).__name__}: {exc}")
    return text if len(text) <= limit else text[: limit - 3] + "..."
