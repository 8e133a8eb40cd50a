"""The one module that imports vLLM (its API renames things between releases).

``Engine`` wraps ``vllm.LLM``: the worker submits token prompts into a deep queue
(``submit``) and collects finished rows as the engine produces them (``step``), so
continuous batching always has work, while chunks commit as soon as their rows finish.
Pooling tasks (embed, classify) go through ``pool``.

With ``qa.confidence`` (on by default for structured choice) every request asks for the chosen
tokens' logprobs (``logprobs=0``: vLLM's default ``raw_logprobs`` mode computes them after the
structured-output mask, so they are the constrained distribution's); a finished row carries
vLLM's ``cumulative_logprob`` (their sum), whose exp is the answer's probability. An OpenAI batch
request that asks for ``logprobs`` / ``top_logprobs`` also gets the per-token entries, built
as vLLM's OpenAI server builds ``choices[].logprobs.content``.

``submit`` builds each request's ``SamplingParams`` and hands it to vLLM's input processor
one request at a time, so a request vLLM refuses (its ``VLLMValidationError``, not a
``ValueError`` in vLLM 0.32) is known at once and by row: ``RequestRejected``, that row's
error record. ``probe`` runs one known-good request, to tell a row that breaks the engine
from an engine that is broken (``worker.guard``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from airflow_provider_vllm.core.adapters import CONFIG_FILE, engine_max_rank, lora_rank, max_loras
from airflow_provider_vllm.core.compat import VllmNotInstalledError, check_vllm_version, vllm_not_installed
from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.worker.isolation import RequestRejected, refusal

__all__ = [
    "Engine",
    "Generated",
    "RequestRejected",
    "adapter_ranks",
    "engine_kwargs",
    "lora_kwargs",
    "cpu_spare_lora_slot",
    "require_vllm",
    "sampling_kwargs",
    "sampling_params",
]
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. " * 4
_PROBE_KEY = ("__probe__",)


@dataclass
class Generated:
    """One finished generation."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cumulative_logprob: float | None = None  # sum of the chosen tokens' logprobs (when logprobs were asked for)
    token_logprobs: list[dict[str, Any]] | None = None  # OpenAI's choices[].logprobs.content (when a row asked)


def lora_kwargs(spec: JobSpec, ranks: list[int | None]) -> dict[str, Any]:
    """vllm.LLM(...) keyword arguments for the job's LoRA adapters (``ranks``: each adapter's rank); {} without."""
    if not spec.model.adapters:
        return {}
    n = max_loras(spec)
    # every adapter stays loaded in CPU memory: a row's adapter is never read from disk again mid-run
    return {
        "enable_lora": True,
        "max_lora_rank": engine_max_rank(spec, ranks),
        "max_loras": n,
        "max_cpu_loras": max(n, len(spec.model.adapters)),
    }


def cpu_spare_lora_slot(kw: dict[str, Any], adapters: int) -> dict[str, Any]:
    """``engine_kwargs`` for vLLM's CPU build with LoRA adapters: one adapter slot more than the job's adapters.

    vLLM's CPU LoRA ops (``vllm/lora/ops/torch_ops``) gather each row's slot as ``weights[index]``, and a row
    without an adapter has index -1: Python's last slot. In a batch that also holds adapter rows, a base-model
    row is then answered with whichever adapter sits in the last slot (vLLM 0.32; its own ``LLM.chat`` does it
    too). vLLM fills the first free slot and evicts only when every slot is taken, so with one spare slot the
    last one is never filled and its weights stay zero: a base-model row gets the base model's answer
    (``tests/vllm/test_lora_vllm.py`` holds it to that). SpecError when engine.max_loras is below the
    adapters (the spare slot would fill).
    """
    if kw["max_loras"] < adapters:
        raise SpecError(
            f"engine.max_loras {kw['max_loras']} is below the job's {adapters} adapters: on vLLM's CPU build every "
            "adapter must have a slot (its CPU LoRA ops would answer base-model rows with an adapter); unset it"
        )
    return {**kw, "max_loras": adapters + 1, "max_cpu_loras": max(kw["max_cpu_loras"], adapters + 1)}


def adapter_ranks(paths: dict[str, str]) -> list[int | None]:
    """The rank of each adapter folder (its adapter_config.json), for ``lora_kwargs``."""
    ranks: list[int | None] = []
    for name, path in paths.items():
        try:
            with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
                ranks.append(lora_rank(json.load(f)))
        except (OSError, ValueError) as e:
            raise SpecError(f"model.adapters[{name}]: {CONFIG_FILE} cannot be read: {e}") from None
    return ranks


def engine_kwargs(spec: JobSpec, adapters: dict[str, str] | None = None) -> dict[str, Any]:
    """vllm.LLM(...) keyword arguments for a job spec (also used by benchmarks and tests for the baseline);
    ``adapters``: the adapters' local folders by name (``worker/adapters.py``), for their ranks."""
    m, e = spec.model, spec.engine
    kw: dict[str, Any] = {
        "model": m.name,
        "revision": m.revision,
        "tokenizer": m.tokenizer,
        "tokenizer_revision": m.tokenizer_revision,
        "dtype": m.dtype,
        "quantization": m.quantization,
        "max_model_len": m.max_model_len,
        "trust_remote_code": m.trust_remote_code,
        "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens,
        "gpu_memory_utilization": e.gpu_memory_utilization,
        "tensor_parallel_size": e.tensor_parallel_size,
        "enable_prefix_caching": e.enable_prefix_caching,
        "enforce_eager": e.enforce_eager,
        "seed": e.seed,
        **e.engine_kwargs,
        **lora_kwargs(spec, adapter_ranks(adapters or {})),
    }
    if spec.task in ("embed", "classify"):
        kw["runner"] = "pooling"  # classify expects a *ForSequenceClassification model
    return {k: v for k, v in kw.items() if v is not None}


def sampling_kwargs(spec: JobSpec, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """vllm.SamplingParams keyword arguments for the spec with per-row overrides, without the
    structured-output constraint (the fake engine of the unit tests builds from these too)."""
    s = spec.sampling
    kw: dict[str, Any] = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "max_tokens": s.max_tokens,
        "seed": s.seed,
        "stop": list(s.stop) or None,
    }
    if spec.confidence_from_logprobs:
        kw["logprobs"] = 0  # the chosen tokens' logprobs only (a row's own request may ask for more)
    kw.update(overrides or {})
    return kw


def sampling_params(spec: JobSpec, overrides: dict[str, Any] | None = None):
    """vllm.SamplingParams for the spec, with per-row overrides (OpenAI batch bodies)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    s = spec.sampling
    kw = sampling_kwargs(spec, overrides)
    if s.structured is not None:
        st = s.structured
        kw["structured_outputs"] = StructuredOutputsParams(choice=st.choice, json=st.json_schema, regex=st.regex)
    params = SamplingParams(**kw)
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


def require_vllm() -> None:
    """VllmNotInstalledError (terminal) when this Python cannot import vLLM; imports nothing."""
    if importlib.util.find_spec("vllm") is None:
        raise VllmNotInstalledError(vllm_not_installed(sys.executable))


def check_batch_invariance(version: str) -> None:
    """SpecError (terminal) where this vLLM does not offer batch-invariant execution.

    vLLM 0.32's CPU build has the switch but not the kernels: with VLLM_BATCH_INVARIANT=1 it overrides
    torch's mean/softmax/bmm with Triton GPU kernels, and the first forward pass fails in the engine core
    (checked: ``TypeError: 'function' object is not subscriptable`` in ``mean_batch_invariant``).
    """
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        raise SpecError(
            f"engine.batch_invariant: vLLM {version}'s CPU build does not offer batch-invariant execution "
            "(its batch-invariant kernels are Triton GPU kernels); unset it, or run the shards on NVIDIA GPUs"
        )


class Engine:
    """A vLLM engine for one job. Construct once per process."""

    def __init__(self, spec: JobSpec, adapters: dict[str, str] | None = None):
        """``adapters``: the local folder of each of the job's LoRA adapters, by name (``worker/adapters.py``)."""
        adapters = adapters or {}
        missing = sorted({a.name for a in spec.model.adapters} - set(adapters))
        if missing:
            raise SpecError(f"model.adapters {missing}: no local folder was prepared for them")
        if spec.engine.cpu_kvcache_space_gb is not None:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.engine.cpu_kvcache_space_gb))
        t0 = time.monotonic()  # engine start includes `import vllm` (15-25 s on a GPU image)
        if spec.engine.batch_invariant:
            os.environ["VLLM_BATCH_INVARIANT"] = "1"  # read by vLLM (and its engine core process) at start
        try:
            import vllm
        except ModuleNotFoundError as e:  # vLLM itself, not one of its dependencies: no retry can help
            if e.name != "vllm":
                raise
            raise VllmNotInstalledError(vllm_not_installed(sys.executable)) from None

        check_vllm_version(vllm.__version__)
        if spec.engine.batch_invariant:
            check_batch_invariance(vllm.__version__)
        self.spec = spec
        self.version = vllm.__version__
        kw = engine_kwargs(spec, adapters)
        if kw.get("enable_lora"):
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                kw = cpu_spare_lora_slot(kw, len(spec.model.adapters))
        self.llm = vllm.LLM(**kw)
        from vllm.lora.request import LoRARequest

        # ids from 1 (0 is no adapter), in the spec's order: the same adapter has the same id in every shard
        self._lora = {a.name: LoRARequest(a.name, i + 1, adapters[a.name]) for i, a in enumerate(spec.model.adapters)}
        self.start_seconds = time.monotonic() - t0
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self._engine = self.llm.llm_engine
        self._params = None
        if spec.task in ("chat", "generate"):
            try:
                self._params = sampling_params(spec)
            except Exception as e:  # the job's own settings: every row and every retry would fail
                if refusal(e) is None:
                    raise
                raise SpecError(f"vLLM refuses the job's sampling settings: {type(e).__name__}: {e}") from e
        self._keys: dict[str, Any] = {}  # vLLM request id -> caller's key
        self._top: dict[str, int] = {}  # vLLM request id -> top_logprobs, for rows that asked for token logprobs
        self._counter = 0
        id2label = getattr(self.llm.llm_engine.model_config.hf_config, "id2label", None) or {}
        self.class_labels = [id2label.get(i, id2label.get(str(i), str(i))) for i in range(len(id2label))]
        self._closing = False
        self._watch_core_death()

    # ---- health ---------------------------------------------------------------------
    def limits(self) -> dict[str, int]:
        """The scheduler's effective ``max_num_seqs`` and ``max_num_batched_tokens``."""
        sc = self._engine.vllm_config.scheduler_config
        return {"max_num_seqs": int(sc.max_num_seqs), "max_num_batched_tokens": int(sc.max_num_batched_tokens)}

    def _core_processes(self) -> list:
        manager = getattr(getattr(self._engine.engine_core, "resources", None), "engine_manager", None)
        return list(getattr(manager, "processes", None) or [])

    def alive(self) -> bool:
        resources = getattr(self._engine.engine_core, "resources", None)
        if resources is not None and resources.engine_dead:
            return False
        return all(p.is_alive() for p in self._core_processes())

    def _watch_core_death(self) -> None:
        """Wake a blocked ``step`` with EngineDeadError when an engine core process dies.

        vLLM 0.32's sync client marks itself dead and closes its sockets, but a ``step``
        already waiting on the output queue then waits forever (the watchdog would be the
        only way out); this puts the error into that queue instead.
        """
        import threading
        from multiprocessing import connection

        procs = self._core_processes()
        outputs = getattr(self._engine.engine_core, "outputs_queue", None)
        if not procs or outputs is None:
            return

        def watch():
            connection.wait([p.sentinel for p in procs])
            if not self._closing:
                from vllm.v1.engine.exceptions import EngineDeadError

                outputs.put_nowait(EngineDeadError())

        threading.Thread(target=watch, name="vllm-batch-core-death", daemon=True).start()

    def kill_core(self) -> None:
        """SIGKILL the engine core process(es): the ``dead`` fault (a crashed or OOM-killed core)."""
        import signal

        for p in self._core_processes():
            os.kill(p.pid, signal.SIGKILL)

    def shutdown(self) -> None:
        """Stop the engine and free its memory (before a rebuild)."""
        self._closing = True
        try:
            self.abort_all()
        except Exception:  # a dead engine refuses aborts; shutting down is what matters
            self._keys.clear()
        self._engine.engine_core.shutdown()

    # ---- generation -----------------------------------------------------------------
    def submit(
        self, key: Any, token_ids: list[int], overrides: dict[str, Any] | None = None, adapter: str | None = None
    ) -> None:
        """Queue one request (``adapter``: one of the job's LoRA adapters, None: the base model); RequestRejected
        when vLLM refuses it (its settings or its prompt)."""
        from vllm.inputs import TokensPrompt

        try:
            params = sampling_params(self.spec, overrides) if overrides else self._params
        except Exception as e:
            rejected = refusal(e, "request's sampling settings")
            if rejected is None:
                raise
            raise rejected from e
        if params is None:  # submit() is for chat/generate, whose params are built at start
            raise SpecError(f"submit() needs a chat or generate job, not task {self.spec.task!r}")
        self._counter += 1
        rid = f"r{self._counter}"  # outputs carry this id (vLLM adds a suffix only internally)
        lora = None if adapter is None else self._lora[adapter]  # KeyError: the prompt builder let a name through
        try:
            self._engine.add_request(rid, TokensPrompt(prompt_token_ids=token_ids), params, lora_request=lora)
        except Exception as e:
            rejected = refusal(e)
            if rejected is None or not self.alive():  # a dead engine refuses everything: not the row's fault
                raise
            raise rejected from e
        self._keys[rid] = key
        if overrides and overrides.get("logprobs") is not None:
            self._top[rid] = int(overrides["logprobs"])

    def pending(self) -> int:
        return len(self._keys)

    def step(self) -> list[tuple[Any, Generated]]:
        """Run one engine step; returns the rows that finished in it."""
        done = []
        for out in self._engine.step():
            if not out.finished:
                continue
            key = self._keys.pop(out.request_id, None)
            if key is None:  # a request aborted after an error (its output arrived anyway)
                continue
            c = out.outputs[0]  # type: ignore[index]  # a generate engine's step() yields RequestOutput
            top = self._top.pop(out.request_id, None)
            done.append(
                (
                    key,
                    Generated(
                        text=c.text,
                        finish_reason=c.finish_reason,
                        prompt_tokens=len(out.prompt_token_ids or ()),
                        completion_tokens=len(c.token_ids),
                        cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                        token_logprobs=None if top is None else self._openai_logprobs(c.token_ids, c.logprobs, top),
                    ),
                )
            )
        return done

    def _openai_logprobs(self, token_ids, logprobs, top: int) -> list[dict[str, Any]]:
        """``choices[].logprobs.content`` as vLLM 0.32's OpenAI server makes it (``_create_chat_logprobs``):
        per generated token its text, logprob (floored at -9999), UTF-8 bytes, and the first ``top`` entries
        of that position's logprobs (vLLM puts the chosen token first, then the top ones by rank)."""

        def text(lp, tid: int) -> str:
            return lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([tid])

        content = []
        for i, tid in enumerate(token_ids):
            step = logprobs[i] if logprobs is not None and i < len(logprobs) else None
            if step is None or step.get(tid) is None:
                token = self.tokenizer.decode(tid)
                content.append({"token": token, "logprob": -9999.0, "bytes": list(token.encode("utf-8", "replace"))})
                content[-1]["top_logprobs"] = []
                continue
            chosen = step[tid]
            content.append(
                {
                    "token": text(chosen, tid),
                    "logprob": max(chosen.logprob, -9999.0),
                    "bytes": None
                    if chosen.decoded_token is None
                    else list(chosen.decoded_token.encode("utf-8", "replace")),
                    "top_logprobs": [
                        {
                            "token": (t := text(lp, other)),
                            "logprob": max(lp.logprob, -9999.0),
                            "bytes": list(t.encode("utf-8", "replace")),
                        }
                        for j, (other, lp) in enumerate(step.items())
                        if j < top
                    ],
                }
            )
        return content

    def abort_all(self) -> None:
        if self._keys:
            self._engine.abort_request(list(self._keys))
            self._keys.clear()
        self._top.clear()

    # ---- pooling --------------------------------------------------------------------
    def pool(self, prompts: list[list[int]]) -> list[list[float]]:
        """Embedding vectors (embed) or class probabilities (classify), one per prompt."""
        from vllm.inputs import TokensPrompt

        tp = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        if self.spec.task == "embed":
            return [o.outputs.embedding for o in self.llm.embed(tp, use_tqdm=False)]
        return [o.outputs.probs for o in self.llm.classify(tp, use_tqdm=False)]

    def probe(self) -> None:
        """Run one known-good request through ``submit``/``step`` (or ``pool``) with nothing else
        in the engine; raises when the engine cannot do even that."""
        ids = self.tokenizer.encode(PROBE_TEXT)[:32]
        if self.spec.task in ("embed", "classify"):
            self.pool([ids])
            return
        if self._keys:
            raise RuntimeError("probe() needs an empty engine")
        self.submit(_PROBE_KEY, ids, {"max_tokens": 1})
        for _ in range(1000):
            if any(key == _PROBE_KEY for key, _ in self.step()):
                return
        self.abort_all()
        raise RuntimeError("the probe request did not finish in 1000 engine steps")

    def warm_up(self) -> None:
        """One tiny request so that lazy initialisation is not timed as throughput."""
        # 16+ tokens: on some CPUs vLLM's CPU build dies with SIGILL on bf16 prompts of <= 4 tokens
        ids = self.tokenizer.encode(PROBE_TEXT)[:32]
        if self.spec.task in ("embed", "classify"):
            self.pool([ids])
            return
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1), use_tqdm=False)
