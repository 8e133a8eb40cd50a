"""Exception classes and the worker's exit codes.

Terminal errors fail the same way on every retry (bad spec, bad dataset); transient ones
may succeed when retried (engine crash, storage hiccup, preemption). The runner maps exit
codes to fail-without-retry vs retry.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_TERMINAL = 2  # retrying cannot help
EXIT_TRANSIENT = 75  # EX_TEMPFAIL: retry the task


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


class VerificationError(VllmBatchError):
    """Merge found input ids missing from, or duplicated in, results + errors."""


class TransientError(VllmBatchError):
    """A failure that a retry may cure (engine death, storage error, preemption)."""

    terminal = False
    exit_code = EXIT_TRANSIENT


class EngineError(TransientError):
    """The inference engine failed as a whole (not a single row)."""
