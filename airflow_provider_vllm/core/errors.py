"""Exception classes, each carrying the worker's exit code for it.

Terminal errors fail the same way on every retry (bad spec, bad dataset); transient ones
may succeed when retried (engine crash, storage hiccup, preemption). The runners map exit
codes to fail-without-retry vs retry through one table, ``core/exit_codes.py``.
"""

from __future__ import annotations

from airflow_provider_vllm.core.exit_codes import ExitCode

# Aliases of ExitCode members (older imports)
EXIT_OK = ExitCode.OK
EXIT_TERMINAL = ExitCode.TERMINAL  # retrying cannot help
EXIT_TRANSIENT = ExitCode.TRANSIENT  # EX_TEMPFAIL: retry the task


class VllmBatchError(Exception):
    """Base class of this provider's errors."""

    terminal = True
    exit_code = EXIT_TERMINAL


class SpecError(VllmBatchError, ValueError):
    """The job spec or a DAG param is invalid; the message names the field."""


class DatasetError(VllmBatchError, ValueError):
    """The input dataset cannot be processed (missing id column, duplicate ids, bad schema)."""


class InputChangedError(VllmBatchError):
    """The input no longer matches the plan's fingerprint."""


class CommitError(VllmBatchError):
    """The commit protocol found state it cannot reconcile (e.g. a corrupt marker)."""


class SealError(CommitError):
    """A record the pipeline must trust carries no valid seal of this deployment's key, or no key is set."""


class ListingTooLarge(CommitError):
    """A folder holds more entries than the most listed there (``uri``, ``limit``); listing stopped at the bound."""

    def __init__(self, message: str, uri: str = "", limit: int = 0) -> None:
        super().__init__(message)
        self.uri, self.limit = uri, limit


class LinkRefused(CommitError):
    """A path below a folder the pipeline writes is, or passes through, a symbolic link: refused unopened."""


class VerificationError(VllmBatchError):
    """Merge found input ids missing from, or duplicated in, results + errors."""


class TransientError(VllmBatchError):
    """A failure that a retry may cure (engine death, storage error, preemption)."""

    terminal = False
    exit_code = EXIT_TRANSIENT


class EngineError(TransientError):
    """The inference engine failed as a whole (not a single row)."""
