"""Which object-store errors are worth retrying, and the retry loop with backoff.

Below this layer botocore retries some errors itself and s3fs retries a few more, then
s3fs translates what is left: HTTP 404 -> FileNotFoundError, 403 -> PermissionError,
412 on ``If-None-Match`` -> FileExistsError, 500 -> OSError(EREMOTEIO), 503 -> OSError(EBUSY),
400/405/416 -> OSError(EINVAL/EPERM), anything else -> OSError(EIO), each with the botocore
``ClientError`` as ``__cause__``. Connection failures arrive untranslated as botocore
``EndpointConnectionError``/``ConnectionClosedError``/``ReadTimeoutError`` (some of which are
not OSErrors), or as aiohttp/asyncio errors. ``is_transient`` sorts all of these:
throttling, 5xx, timeouts and dropped connections are transient; missing objects, denied
access, failed preconditions and malformed requests are not (a retry would fail the same way,
or, for a create-only write, must not be repeated as if nothing happened).
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from airflow_provider_vllm.core import envs
from airflow_provider_vllm.core.errors import TransientError

T = TypeVar("T")
ATTEMPTS_ENV = envs.STORAGE_ATTEMPTS.name
log = logging.getLogger(__name__)

RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "ConditionalRequestConflict",
        "OperationAborted",
        "BadDigest",
        "IncompleteBody",
        "XAmzContentSHA256Mismatch",
    }
)
_PERMANENT_OS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
_PERMANENT_ERRNO = {
    errno.EINVAL,
    errno.EPERM,
    errno.ENOSYS,
    errno.EACCES,
    errno.ENOENT,
    errno.EEXIST,
    getattr(errno, "EREMCHG", -1),
}
_TRANSIENT_ERRNO = {
    errno.EIO,
    errno.EBUSY,
    getattr(errno, "EREMOTEIO", -1),
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EPIPE,
    errno.EAGAIN,
    errno.ENETUNREACH,
    errno.EHOSTUNREACH,
}


def _client_error_transient(e: BaseException) -> bool | None:
    """For a botocore ClientError (or anything with its ``response``): status/code decide."""
    resp = getattr(e, "response", None)
    if not isinstance(resp, dict):
        return None
    code = (resp.get("Error") or {}).get("Code")
    status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    if code in RETRYABLE_CODES:
        return True
    if status is None:
        return None
    try:
        return int(status) >= 500 or int(status) == 429
    except (TypeError, ValueError):
        return None


def is_transient(e: BaseException) -> bool:
    """True when retrying the same storage call may succeed."""
    if isinstance(e, _PERMANENT_OS):
        return False
    for err in (e, e.__cause__):
        if err is None:
            continue
        verdict = _client_error_transient(err)
        if verdict is not None:
            return verdict
    if isinstance(e, (TimeoutError, ConnectionError)):
        return True
    mod = type(e).__module__
    if mod.startswith("botocore"):
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError, IncompleteReadError

        return isinstance(e, (HTTPClientError, BotoConnectionError, IncompleteReadError))
    if mod.startswith("aiohttp"):
        import aiohttp

        return isinstance(e, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ServerTimeoutError))
    if type(e).__name__ == "FSTimeoutError":
        return True
    if isinstance(e, OSError):
        if e.errno in _PERMANENT_ERRNO:
            return False
        return e.errno is None or e.errno in _TRANSIENT_ERRNO
    return False


def retrying(
    fn: Callable[[], T],
    what: str = "storage operation",
    attempts: int | None = None,
    base_s: float = 0.2,
    cap_s: float = 10.0,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run ``fn``; on a transient error wait (exponential backoff, full jitter) and run it again.

    Permanent errors propagate unchanged at once; after ``attempts`` (default
    ``$VLLM_BATCH_STORAGE_ATTEMPTS`` or 6) transient failures a ``TransientError`` is raised
    (the worker exits 75 and Airflow retries the task).
    """
    attempts = attempts or int(envs.STORAGE_ATTEMPTS.value())
    for i in range(attempts):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - sorted by is_transient below
            if not is_transient(e):
                raise
            if i == attempts - 1:
                raise TransientError(f"{what} failed after {attempts} attempts: {type(e).__name__}: {e}") from e
            delay = random.uniform(0, min(cap_s, base_s * 2**i))
            log.warning(
                "%s: transient %s (%s); retry %d/%d in %.2f s",
                what,
                type(e).__name__,
                str(e)[:200],
                i + 1,
                attempts - 1,
                delay,
            )
            sleep(delay)
    raise AssertionError("unreachable")
