"""The engine behind OOM back-off, engine-death detection and the engine fault hook.

``GuardedEngine`` offers what the chunk runner uses (``submit``, ``pending``, ``step``,
``pool``, ``warm_up``, ``tokenizer``, ``max_model_len``, ``version``, ...) over an engine
made by a factory (``worker.engine.Engine``, or a fake in tests):

* Out of memory (``torch.OutOfMemoryError``, ``MemoryError``, a ``RuntimeError`` saying "out
  of memory", anything caused by one): the requests in flight are aborted,
  ``max_num_seqs`` and ``max_num_batched_tokens`` are halved (down to the floors in
  ``spec.worker``), the engine is rebuilt with them and the unfinished rows run again. From
  the first OOM on, at most ``max_num_seqs`` requests are in the engine at once, so the
  requests in flight are the ones running. At the floors, the rows that were in flight run
  one at a time; a row that runs out of memory alone becomes an ``ENGINE_OOM`` error row.
* Engine death (vLLM's ``EngineDeadError``, the engine core process gone):
  ``EngineError`` (exit 75); the chunks committed so far stay for the retry.
* A request the engine refuses at submit (``RequestRejected``: vLLM's validation of its
  settings or prompt): that row's ``RowFailure`` at the next ``step``; nothing else changes.
* Any other failure of a step (or a pooling call) with the engine alive: it may be one row's
  doing. The requests in flight are aborted and run again in halves (bisection: at most half
  as many in the engine at once after each failure) until the failure comes with one request
  alone, twice; then a known-good probe request runs (``engine.probe``). If the probe passes, the row
  was the cause: an ``ENGINE_ERROR`` row, and the others go on at full width. If it fails,
  the engine is broken as a whole: ``EngineError`` (exit 75). A failure that does not come
  back costs only the re-run. Good rows are never batched less than ``max_num_seqs`` wide
  except while a failure is being bisected.

``step`` returns ``(key, Generated)`` for finished rows and ``(key, RowFailure)`` for rows
that cannot be done; ``pool`` returns a vector or a ``RowFailure`` per prompt.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from airflow_provider_vllm.core import faults
from airflow_provider_vllm.core.errors import EngineError
from airflow_provider_vllm.core.rows import ENGINE_ERROR, ENGINE_OOM
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.worker.isolation import RequestRejected, describe, row_caused
from airflow_provider_vllm.worker.redact import redact

# Step failures bisected in one attempt before the engine is called broken whatever the probes
# say (each halves the requests in flight, so a row is found in ~log2(queue depth) failures).
MAX_STEP_FAILURES = 200

log = logging.getLogger("airflow_provider_vllm.worker")


@dataclass(frozen=True)
class RowFailure:
    """A row the engine could not do: its error code and message."""

    code: str
    message: str


def classify(exc: BaseException) -> str | None:
    """'oom' when an out-of-memory error is in the exception chain, 'dead' for vLLM's
    EngineDeadError, else None."""
    seen: set[int] = set()
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and id(e) not in seen and len(chain) < 16:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
            return "oom"
        if isinstance(e, RuntimeError) and "out of memory" in str(e).lower():
            return "oom"
    if any(type(e).__name__ == "EngineDeadError" for e in chain):
        return "dead"
    return None


class GuardedEngine:
    """An engine that survives OOM by backing off; see the module docstring."""

    def __init__(
        self,
        spec: JobSpec,
        factory: Callable[[JobSpec], Any],
        watchdog=None,
        label: Callable[[Hashable], str] = str,
        on_lowered: Callable[[dict[str, int]], None] | None = None,
    ):
        self.spec = spec
        self.on_lowered = on_lowered  # told the limits after each OOM rebuild (carried to retries)
        self.factory = factory
        self.watchdog = watchdog
        self.label = label
        self.oom_events = 0
        self.rebuilds = 0
        self.oom_rows = 0
        self._req: dict[Hashable, tuple[list[int], dict | None, str | None]] = {}
        self._held: collections.deque = collections.deque()  # submitted, not yet in the engine
        self._sent: dict[Hashable, None] = {}  # in the engine, in submission order
        self._ready: list[tuple[Hashable, Any]] = []  # failures to hand out at the next step
        self.window: int | None = None  # most requests in the engine at once (None: no bound)
        self._suspects: set[Hashable] = set()  # in flight at an OOM at the floors: run alone
        self._isolating = False
        self._split: int | None = None  # most requests in the engine while a step failure is bisected
        self._split_suspects: set[Hashable] = set()  # in flight at the last step failure, not yet done
        self.step_failures = 0
        self.failed_rows = 0  # rows that failed the engine alone while a probe passed (ENGINE_ERROR)
        self._failed_alone: set[Hashable] = set()  # failed once alone: a second time alone blames the row
        self.engine = self._build(spec)
        self.start_seconds = getattr(self.engine, "start_seconds", 0.0)
        self.limits = self._read_limits()

    # ---- what the runner reads ------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def version(self) -> str:
        return self.engine.version

    @property
    def class_labels(self) -> list[str]:
        return getattr(self.engine, "class_labels", None) or []

    def warm_up(self) -> None:
        self.engine.warm_up()

    def stats(self) -> dict[str, Any]:
        return {
            "oom_events": self.oom_events,
            "engine_rebuilds": self.rebuilds,
            "oom_error_rows": self.oom_rows,
            "step_failures": self.step_failures,
            "engine_error_rows": self.failed_rows,
            "engine_limits": dict(self.limits),
        }

    # ---- generation -----------------------------------------------------------------
    def submit(
        self, key: Hashable, token_ids: list[int], overrides: dict[str, Any] | None = None, adapter: str | None = None
    ) -> None:
        """Queue a request (``adapter``: the LoRA adapter it runs with, None: the base model). One the engine
        refuses comes back as a RowFailure from the next ``step``."""
        if self._cap() is None and not self._held:
            try:
                self._submit(key, token_ids, overrides, adapter)
            except RequestRejected as e:
                self._ready.append((key, RowFailure(e.code, e.message)))
                return
            self._req[key] = (token_ids, overrides, adapter)
            self._sent[key] = None
            return
        self._req[key] = (token_ids, overrides, adapter)
        self._held.append(key)

    def _submit(self, key: Hashable, ids: list[int], overrides: dict[str, Any] | None, adapter: str | None) -> None:
        if adapter is None:  # engines without adapters take the three arguments only
            self.engine.submit(key, ids, overrides)
        else:
            self.engine.submit(key, ids, overrides, adapter=adapter)

    def _cap(self) -> int | None:
        """Most requests in the engine at once (None: no bound)."""
        caps = [c for c in (self.window, self._split) if c is not None]
        return min(caps) if caps else None

    def pending(self) -> int:
        return len(self._req) + len(self._ready)

    def step(self) -> list[tuple[Hashable, Any]]:
        out, self._ready = self._ready, []
        self._feed(out)
        if not self._sent:
            return out
        try:
            action = faults.hit("engine.step", self._running(), handles=("oom", "dead")) if faults.active() else None
            if action == "oom":
                raise faults.out_of_memory("injected at engine.step")
            if action == "dead":
                self.engine.kill_core()
            done = self.engine.step()
        except Exception as e:
            kind = classify(e)
            if kind == "oom":
                return out + self._after_oom(e)
            if kind == "dead" or not self._alive():
                raise self._died(e, len(self._sent)) from e
            if not row_caused(e):
                raise
            return out + self._after_step_failure(e)
        for key, result in done:
            self._req.pop(key, None)
            self._sent.pop(key, None)
            self._suspects.discard(key)
            self._split_suspects.discard(key)
            out.append((key, result))
        if self._isolating and not self._suspects:
            self._end_isolation()
        if self._split is not None and not self._split_suspects:
            self._split = None  # every request that was in flight at the failure got through
        self._beat()
        return out

    def _feed(self, out: list) -> None:
        while self._held and ((cap := self._cap()) is None or len(self._sent) < cap):
            key = self._held.popleft()
            ids, overrides, adapter = self._req[key]
            try:
                self._submit(key, ids, overrides, adapter)
            except RequestRejected as e:  # refused (also when resubmitted): an error row, as at first submit
                del self._req[key]
                self._suspects.discard(key)
                self._split_suspects.discard(key)
                out.append((key, RowFailure(e.code, e.message)))
                continue
            self._sent[key] = None

    # ---- a step failure that may be one row's -----------------------------------------
    def _after_step_failure(self, exc: BaseException) -> list[tuple[Hashable, Any]]:
        """Bisect the requests in flight at a failed step down to the one that fails alone."""
        self.step_failures += 1
        in_flight = list(self._sent)
        self._abort()
        self._sent.clear()
        if self.step_failures > MAX_STEP_FAILURES:
            raise EngineError(
                f"{self.step_failures} engine steps failed in this attempt (last: {describe(exc)}); "
                "committed chunks are kept and a retry resumes from them"
            ) from exc
        if len(in_flight) == 1 and in_flight[0] not in self._failed_alone:
            # alone, but maybe by chance (the last request, a one-off failure): once more alone first
            self._failed_alone.add(in_flight[0])
            self._held.appendleft(in_flight[0])
            self._split_suspects.add(in_flight[0])
            self._split = 1
            return []
        if len(in_flight) == 1:
            (key,) = in_flight
            self._probe(exc)
            del self._req[key]
            self._split_suspects.discard(key)
            self._suspects.discard(key)
            self.failed_rows += 1
            if not self._split_suspects:
                self._split = None
            log.error(
                "row %s fails the engine alone (%s) while a probe request runs fine: an %s error row",
                self.label(key),
                describe(exc, 200),
                ENGINE_ERROR,
            )
            if self._isolating and not self._suspects:
                self._end_isolation()
            self._beat()
            return [
                (
                    key,
                    RowFailure(
                        ENGINE_ERROR,
                        f"the engine failed on this row alone ({describe(exc)}); a probe request ran fine right after",
                    ),
                )
            ]
        self._held.extendleft(reversed(in_flight))
        self._split_suspects = set(in_flight)
        self._split = max(1, len(in_flight) // 2)
        log.warning(
            "an engine step failed with %d request(s) in flight (%s); running them again, at most %d "
            "at once, to find a row that causes it",
            len(in_flight),
            describe(exc, 200),
            self._split,
        )
        return []

    def _probe(self, cause: BaseException) -> None:
        """A known-good request on the otherwise empty engine: EngineError when even that fails."""
        probe = getattr(self.engine, "probe", None)
        if probe is None:
            return
        try:
            probe()
        except Exception as e:
            if classify(e) == "dead" or not self._alive():
                raise self._died(e, 1) from e
            raise EngineError(
                f"an engine step failed with one request in flight ({describe(cause)}) and a "
                f"known-good probe request failed after it ({describe(e)}): the engine fails as a "
                "whole; committed chunks are kept and a retry resumes from them"
            ) from e

    def _running(self) -> set[str]:
        """Labels of the requests the FCFS scheduler runs now: the oldest max_num_seqs in flight."""
        n = self.limits["max_num_seqs"]
        return {self.label(k) for k, _ in zip(self._sent, range(n))}

    def _after_oom(self, exc: BaseException) -> list[tuple[Hashable, Any]]:
        self.oom_events += 1
        in_flight = list(self._sent)
        self._abort()
        self._sent.clear()
        self._held.extendleft(reversed(in_flight))
        lim = self.limits
        if self._isolating and len(in_flight) == 1:
            key = self._held.popleft()
            del self._req[key]
            self._suspects.discard(key)
            self.oom_rows += 1
            log.error(
                "out of memory with row %s alone in the engine at %s: an %s error row",
                self.label(key),
                _fmt(lim),
                ENGINE_OOM,
            )
            if not self._alive():
                self._rebuild(lim)
            if not self._suspects:
                self._end_isolation()
            return [
                (
                    key,
                    RowFailure(
                        ENGINE_OOM,
                        f"out of memory with this row alone in the engine at "
                        f"{_fmt(lim)} (the floors): {redact(str(exc))[:300]}",
                    ),
                )
            ]
        lower = self._lowered(lim)
        if lower != lim:
            log.warning(
                "out of memory at %s (%s); %d request(s) in flight run again after a rebuild at %s",
                _fmt(lim),
                redact(str(exc))[:200],
                len(in_flight),
                _fmt(lower),
            )
            self._rebuild(lower)
            self.window = self.limits["max_num_seqs"]
            return []
        log.warning(
            "out of memory at the floors %s; running the %d request(s) that were in flight one at a time",
            _fmt(lim),
            len(in_flight),
        )
        self._isolating = True
        self._suspects = set(in_flight)
        self.window = 1
        if not self._alive():
            self._rebuild(lim)
        return []

    def _end_isolation(self) -> None:
        self._isolating = False
        self.window = self.limits["max_num_seqs"]

    # ---- pooling --------------------------------------------------------------------
    def pool(self, prompts: Sequence[list[int]], keys: Sequence[Hashable] | None = None) -> list[Any]:
        """One vector (or RowFailure) per prompt; OOM backs off, then runs prompts one at a time;
        any other failure is bisected down to the prompt that fails alone (see the module doc)."""
        keys = list(keys) if keys is not None else list(range(len(prompts)))
        results: list[Any] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        alone = False
        split: int | None = None
        while todo:
            batch = todo[:1] if alone else todo[:split] if split else todo
            try:
                if faults.active():
                    action = faults.hit("engine.step", {self.label(keys[i]) for i in batch}, handles=("oom", "dead"))
                    if action == "oom":
                        raise faults.out_of_memory("injected at engine.step")
                    if action == "dead":
                        self.engine.kill_core()
                vectors = self.engine.pool([prompts[i] for i in batch])
            except Exception as e:
                kind = classify(e)
                if kind == "dead" or (kind is None and not self._alive()):
                    raise self._died(e, len(batch)) from e
                if kind != "oom":
                    if not row_caused(e):
                        raise
                    self.step_failures += 1
                    if self.step_failures > MAX_STEP_FAILURES:
                        raise EngineError(
                            f"{self.step_failures} engine calls failed in this attempt (last: "
                            f"{describe(e)}); committed chunks are kept and a retry resumes "
                            "from them"
                        ) from e
                    if len(batch) > 1 or keys[batch[0]] not in self._failed_alone:
                        if len(batch) == 1:  # alone, maybe by chance: once more alone first
                            self._failed_alone.add(keys[batch[0]])
                        split = max(1, len(batch) // 2)
                        log.warning(
                            "a pooling call of %d prompts failed (%s); running them again, at most %d "
                            "at once, to find a row that causes it",
                            len(batch),
                            describe(e, 200),
                            split,
                        )
                        continue
                    self._probe(e)
                    self.failed_rows += 1
                    log.error(
                        "row %s fails the engine alone (%s) while a probe request runs fine: an %s error row",
                        self.label(keys[batch[0]]),
                        describe(e, 200),
                        ENGINE_ERROR,
                    )
                    results[batch[0]] = RowFailure(
                        ENGINE_ERROR,
                        f"the engine failed on this row alone ({describe(e)}); a probe request ran fine right after",
                    )
                    todo = todo[1:]
                    split = None
                    self._beat()
                    continue
                self.oom_events += 1
                lim = self.limits
                if alone:
                    self.oom_rows += 1
                    results[batch[0]] = RowFailure(
                        ENGINE_OOM, f"out of memory with this row alone at {_fmt(lim)}: {redact(str(e))[:300]}"
                    )
                    todo = todo[1:]
                    if not self._alive():
                        self._rebuild(lim)
                    continue
                lower = self._lowered(lim)
                if lower != lim:
                    self._rebuild(lower)
                else:
                    alone = True
                    if not self._alive():
                        self._rebuild(lim)
                continue
            for i, v in zip(batch, vectors):
                results[i] = v
            todo = todo[len(batch) :]
            self._beat()
        return results

    # ---- engine lifecycle -----------------------------------------------------------
    def _died(self, exc: BaseException, in_flight: int) -> EngineError:
        """The engine core process is gone: the worker exits 75 and Airflow retries.

        vLLM runs the model in its engine-core process, so a CUDA out-of-memory there (or the
        kernel's OOM killer) reaches this process only as EngineDeadError, without the cause.
        A death with requests in flight therefore lowers the limits carried to the retry (as
        an OOM back-off would), so a retry does not die the same way; the cost of a death that
        was not about memory is a retry at half the batch.
        """
        lower = self._lowered(self.limits)
        if in_flight and lower != self.limits:
            self._record(lower)
            hint = f"; the retry starts at {_fmt(lower)} (an out-of-memory error in the engine core looks like this)"
        else:
            hint = ""
        return EngineError(
            f"the engine died ({type(exc).__name__}: {exc}) with {in_flight} request(s) in flight "
            f"at {_fmt(self.limits)}; committed chunks are kept and a retry resumes from them{hint}"
        )

    def _build(self, spec: JobSpec):
        if self.watchdog is None:
            return self.factory(spec)
        with self.watchdog.paused():  # engine start is not a stall
            return self.factory(spec)

    def _read_limits(self) -> dict[str, int]:
        read = getattr(self.engine, "limits", None)
        if callable(read):
            return dict(read())
        e = self.spec.engine
        return {"max_num_seqs": e.max_num_seqs or 256, "max_num_batched_tokens": e.max_num_batched_tokens or 8192}

    def _lowered(self, lim: dict[str, int]) -> dict[str, int]:
        w = self.spec.worker
        seqs = min(lim["max_num_seqs"], max(w.oom_min_num_seqs, lim["max_num_seqs"] // 2))
        toks = min(
            lim["max_num_batched_tokens"], max(w.oom_min_batched_tokens, lim["max_num_batched_tokens"] // 2, seqs)
        )
        return {"max_num_seqs": seqs, "max_num_batched_tokens": toks}

    def _rebuild(self, lim: dict[str, int]) -> None:
        if self.rebuilds >= self.spec.worker.oom_max_rebuilds:
            if lim != self.limits:
                self._record(lim)  # the retry starts where this attempt would have gone next
            raise EngineError(
                f"out of memory again after {self.rebuilds} engine rebuild(s) (now {_fmt(self.limits)}); "
                "committed chunks are kept and a retry resumes from them"
            )
        self.rebuilds += 1
        old, self.engine = self.engine, None
        try:
            old.shutdown()
        except Exception as e:  # a dead engine may fail to shut down cleanly; its memory goes with it
            log.warning("engine shutdown before rebuild: %s", e)
        del old
        spec = self.spec.model_copy(update={"engine": self.spec.engine.model_copy(update=lim)})
        self.engine = self._build(spec)
        self.limits = self._read_limits()
        log.warning("engine rebuilt (%d) at %s", self.rebuilds, _fmt(self.limits))
        self._record(self.limits)

    def _record(self, lim: dict[str, int]) -> None:
        if self.on_lowered is not None:
            try:
                self.on_lowered(dict(lim))
            except Exception as e:  # a hint for retries; failing to keep it must not fail the shard
                log.warning("could not record the lowered engine limits: %s", e)

    def close(self) -> None:
        """Shut the engine down while the interpreter is whole (teardown at exit can abort the process)."""
        engine, self.engine = self.engine, None
        if engine is None or not hasattr(engine, "shutdown"):
            return
        try:
            engine.shutdown()
        except Exception as e:  # results are already durable; a failed shutdown only leaks until exit
            log.warning("engine shutdown: %s", e)

    def _abort(self) -> None:
        try:
            self.engine.abort_all()
        except Exception as e:  # the engine may be gone; the rebuild replaces it
            log.warning("abort after OOM: %s", e)

    def _alive(self) -> bool:
        alive = getattr(self.engine, "alive", None)
        return alive() if callable(alive) else True

    def _beat(self) -> None:
        if self.watchdog is not None:
            self.watchdog.beat()


def _fmt(lim: dict[str, int]) -> str:
    return f"max_num_seqs={lim['max_num_seqs']}, max_num_batched_tokens={lim['max_num_batched_tokens']}"
