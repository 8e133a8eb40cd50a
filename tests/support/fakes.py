"""A fake engine for fast unit tests of the logic around vLLM (never the only test of a capability).

It takes what the real engine takes and refuses what the real engine refuses: each request's
sampling settings become a real ``vllm.SamplingParams`` (built by the worker's own
``engine.sampling_params``) when vLLM is importable, so the validation is vLLM's own and a
bad per-row override raises vLLM's ``VLLMValidationError`` here as it does on the real engine;
without vLLM, ``MirrorParams`` repeats vLLM 0.32's checks. The prompt checks of vLLM's input
processor (empty prompt, longer than ``max_model_len``) are repeated too. It honours the
settings the way vLLM does where the fake's output can show it: ``max_tokens`` (a cut answer,
``finish_reason='length'``), ``stop`` strings, and ``temperature``/``seed`` (greedy ignores
the seed; sampling without one differs from call to call). A LoRA adapter's answers depend on its
files (their identity as the plan takes it), not on its name: new weights under the same name answer
differently, as on the real engine.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import random

from airflow_provider_vllm.core.adapters import describe_adapters
from airflow_provider_vllm.worker.engine import Generated, sampling_kwargs, sampling_params
from airflow_provider_vllm.worker.isolation import refusal

try:
    from jinja2.exceptions import TemplateError  # what HF chat templates raise (raise_exception)
except ImportError:  # pragma: no cover

    class TemplateError(Exception):
        pass


SAMPLING_EPS = 1e-5  # vLLM's: below this temperature decoding is greedy
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
_PROBE_KEY = ("__fake_probe__",)


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


class VLLMValidationError(ValueError):
    """Stands in for vllm.exceptions.VLLMValidationError when vLLM is not importable (same name:
    the worker recognises vLLM's client errors by name)."""


def validation_error(real: bool) -> type[Exception]:
    if real:
        from vllm.exceptions import VLLMValidationError as Real

        return Real
    return VLLMValidationError


class FakeTokenizer:
    """One token per character (code point), a ChatML-like chat template.

    Like many real templates (Llama 2, Mistral, Gemma) the template refuses conversations whose
    roles do not alternate user/assistant/... after leading system messages, and roles it does not
    know, with jinja2's ``TemplateError`` (what ``raise_exception`` in an HF template raises).
    ``strict_roles=False`` accepts any order (like ChatML templates, e.g. SmolLM2's).
    """

    def __init__(self, strict_roles: bool = True):
        self.strict_roles = strict_roles

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) % 50000 + 3 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i - 3) for i in ids if i >= 3)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        for m in messages:
            if m["role"] not in ("system", "developer", "user", "assistant"):
                raise TemplateError(f"unknown role {m['role']!r}")
        if self.strict_roles:
            turns = list(messages)
            while turns and turns[0]["role"] in ("system", "developer"):
                turns.pop(0)
            for i, m in enumerate(turns):
                if m["role"] != ("user" if i % 2 == 0 else "assistant"):
                    raise TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")
        s = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return s + ("<assistant>" if add_generation_prompt else "")


class MirrorParams:
    """vLLM 0.32's SamplingParams checks (``_verify_args``), for when vLLM is not importable."""

    def __init__(
        self,
        n=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        seed=None,
        stop=None,
        max_tokens=16,
        min_tokens=0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        logprobs=None,
    ):
        err = VLLMValidationError
        self.temperature, self.top_p, self.seed, self.max_tokens = temperature, top_p, seed, max_tokens
        self.logprobs = logprobs
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        if not isinstance(n, int) or n < 1:
            raise err(f"n must be at least 1, got {n}.")
        if not -2.0 <= presence_penalty <= 2.0:
            raise err(f"presence_penalty must be in [-2, 2], got {presence_penalty}.")
        if not -2.0 <= frequency_penalty <= 2.0:
            raise err(f"frequency_penalty must be in [-2, 2], got {frequency_penalty}.")
        if not math.isfinite(repetition_penalty) or repetition_penalty <= 0.0:
            raise err(f"repetition_penalty must be greater than zero, got {repetition_penalty}.")
        if not math.isfinite(temperature):
            raise err(f"temperature must be a finite number, got {temperature}.")
        if temperature < 0.0:
            raise err(f"temperature must be non-negative, got {temperature}.")
        if temperature > 2.0:
            raise err(f"temperature must be in [0, 2], got {temperature}.")
        if not 0.0 < top_p <= 1.0:
            raise err(f"top_p must be in (0, 1], got {top_p}.")
        if top_k < -1 or not isinstance(top_k, int):
            raise err(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
        if not 0.0 <= min_p <= 1.0:
            raise err(f"min_p must be in [0, 1], got {min_p}.")
        if max_tokens is not None and max_tokens < 1:
            raise err(f"max_tokens must be at least 1, got {max_tokens}.")
        if min_tokens < 0:
            raise err(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
        if max_tokens is not None and min_tokens > max_tokens:
            raise err(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
        if logprobs is not None and logprobs != -1 and logprobs < 0:
            raise err(f"logprobs must be non-negative or -1, got {logprobs}.")
        if any(not s for s in self.stop):
            raise err("stop cannot contain an empty string.")
        if logprobs is not None and logprobs > MAX_LOGPROBS:  # SamplingParams.verify, at add_request
            raise err(f"Requested sample logprobs of {logprobs}, which is greater than max allowed: {MAX_LOGPROBS}")
        if temperature < SAMPLING_EPS and n > 1:
            raise err(f"n must be 1 when using greedy sampling, got {n}.")


class EngineDeadError(Exception):
    """Named like vLLM's: the guard classifies engine death by this name."""


class FakeEngine:
    """Answers each prompt deterministically; optionally crashes after N finished rows.

    ``real_vllm``: build real ``vllm.SamplingParams`` for requests with per-row settings (default:
    when vLLM is importable; importing it takes ~10 s once per process). ``fail_on(token_ids)``:
    a step that runs such a request raises (a row that breaks the engine), like a detokenizer or
    output-processing failure in vLLM would.
    """

    version = "fake-0"
    start_seconds = 0.0

    def __init__(
        self, spec, max_model_len=None, crash_after=None, per_step=7, real_vllm=None, fail_on=None, strict_roles=True
    ):
        self.spec = spec
        self.tokenizer = FakeTokenizer(strict_roles=strict_roles)
        self.max_model_len = max_model_len or spec.model.max_model_len or 2048
        self.crash_after = crash_after
        self.per_step = per_step
        self.real_vllm = vllm_importable() if real_vllm is None else real_vllm
        self.fail_on = fail_on
        self.queue = []
        self.finished = 0
        self.submitted = 0
        self.pooled = 0  # prompts of pooling calls (embed, classify), as vLLM receives them
        self.refused = 0
        self.steps = 0
        self.probes = 0
        self.dead = False
        self.closed = False
        self.params_seen = []  # (key, params) of every accepted request
        self.adapters_seen = []  # (key, adapter) of every accepted request
        self._adapter = {}  # key -> adapter of the requests in the queue
        self.weights = adapter_weights(spec)  # read at engine start, as vLLM reads the adapters' files
        self._default = self._build(None)  # the job's own settings (Engine.__init__ builds these too)
        # vLLM's error class, resolved at engine start (importing vLLM takes seconds; the watchdog
        # does not count engine start, but it does count the steps where the first submit happens)
        self._err = validation_error(self.real_vllm)

    def warm_up(self):
        pass

    def _build(self, overrides):
        if overrides and self.real_vllm:
            return sampling_params(self.spec, overrides)  # the worker's own mapping, vLLM's own checks
        kw = sampling_kwargs(self.spec, overrides)
        return MirrorParams(**kw)

    def _check_prompt(self, ids):
        """vLLM's prompt checks at add_request (renderer and InputProcessor._validate_prompt_len)."""
        err = self._err
        if not ids:
            raise err("The decoder prompt cannot be empty")
        if len(ids) > self.max_model_len:  # the renderer's token length check (renderers/params.py)
            raise err(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"contains {len(ids)} input tokens, which exceeds this limit even without any output "
                "tokens. Please reduce the length of the input prompt."
            )
        if len(ids) == self.max_model_len:
            raise err(
                f"The decoder prompt (length {len(ids)}) plus the number of requested output tokens "
                f"(at least 1) is longer than the maximum model length of {self.max_model_len}."
            )

    def submit(self, key, token_ids, overrides=None, adapter=None):
        """Like Engine.submit: RequestRejected when the settings or the prompt are refused. ``adapter``: one of
        the spec's LoRA adapters (its answers differ from the base model's and from every other adapter's)."""
        if adapter is not None and adapter not in {a.name for a in self.spec.model.adapters}:
            raise KeyError(adapter)  # as Engine.submit: the prompt builder lets only the job's adapters through
        try:
            params = self._build(overrides) if overrides else self._default
        except Exception as e:
            rejected = refusal(e, "request's sampling settings")
            if rejected is None:
                raise
            self.refused += 1
            raise rejected from e
        try:
            self._check_prompt(token_ids)
        except Exception as e:
            rejected = refusal(e)
            if rejected is None or self.dead:
                raise
            self.refused += 1
            raise rejected from e
        top = overrides.get("logprobs") if overrides else None  # the row asked for token logprobs
        self.queue.append((key, token_ids, params, top))
        self.params_seen.append((key, params))
        self.adapters_seen.append((key, adapter))
        if adapter is not None:
            self._adapter[key] = adapter
        self.submitted += 1

    def pending(self):
        return len(self.queue)

    def limits(self):
        e = self.spec.engine
        return {"max_num_seqs": e.max_num_seqs or 256, "max_num_batched_tokens": e.max_num_batched_tokens or 8192}

    def abort_all(self):
        self.queue.clear()

    def alive(self):
        return not self.dead

    def kill_core(self):
        self.dead = True

    def shutdown(self):
        self.queue.clear()
        self.closed = True

    def step(self):
        if self.dead:
            raise EngineDeadError()
        self.steps += 1
        out, self.queue = self.queue[: self.per_step], self.queue[self.per_step :]
        if self.fail_on is not None and any(self.fail_on(ids) for _, ids, _, _ in out):
            self.queue = out + self.queue  # still in the engine, as in vLLM after a failed step
            raise ValueError("output processing failed (injected by fail_on)")
        res = []
        for key, ids, params, top in out:
            if self.crash_after is not None and self.finished >= self.crash_after:
                raise RuntimeError("engine died (injected)")
            self.finished += 1
            adapter = self._adapter.pop(key, None)
            res.append((key, generate(self.spec, ids, params, top, adapter, self.weights.get(adapter))))
        return res

    def probe(self):
        """Like Engine.probe: one known-good request through submit/step on the empty engine."""
        self.probes += 1
        ids = self.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)[:32]
        if self.spec.task in ("embed", "classify"):
            self.pool([ids])
            return
        if self.queue:
            raise RuntimeError("probe() needs an empty engine")
        self.submit(_PROBE_KEY, ids, {"max_tokens": 1})
        for _ in range(1000):
            if any(key == _PROBE_KEY for key, _ in self.step()):
                return
        raise RuntimeError("the probe request did not finish")

    def pool(self, prompts):
        err = self._err
        for p in prompts:  # vLLM validates each prompt of a pooling call (LLM.embed/classify)
            if not p:
                raise err("The decoder prompt cannot be empty")
            if len(p) > self.max_model_len:
                raise err(
                    f"The decoder prompt (length {len(p)}) is longer than the maximum model length of "
                    f"{self.max_model_len}."
                )
        if self.fail_on is not None and any(self.fail_on(p) for p in prompts):
            raise ValueError("pooling failed (injected by fail_on)")
        self.pooled += len(prompts)
        return [[float(len(p)), 1.0, 0.5] for p in prompts]


def adapter_weights(spec) -> dict[str, str]:
    """Each of the job's adapters by name -> what its answers depend on: the identity of its files (a sha256 of
    every byte of a local or object store folder, a hub adapter's commit)."""
    return {r.name: r.identity() for r in describe_adapters(spec)} if spec.model.adapters else {}


def answer(spec, ids, seed=None, adapter=None, weights=None):
    """The fake model's (whole) answer to a prompt (with a LoRA ``adapter``: that adapter's answer, which
    depends on its ``weights``, ``adapter_weights``): a label of the structured choice, or ``out-N``."""
    key = str(ids) if seed is None else f"{ids}/{seed}"
    if adapter is not None:
        key += f"@{adapter}#{weights}"
    h = int(hashlib.sha256(key.encode()).hexdigest(), 16)
    st = spec.sampling.structured
    if st is not None and st.choice:
        return st.choice[h % len(st.choice)]
    return f"out-{h % 1_000_000}"  # wide enough that two weights rarely give one answer by chance


def confidence_of(spec, ids) -> float:
    """The fake model's probability of its answer to a prompt, in [0.2, 0.99] (deterministic)."""
    h = int(hashlib.sha256(f"conf/{ids}".encode()).hexdigest(), 16)
    return 0.2 + 0.79 * (h % 1000) / 999


def _logprobs(spec, ids, params, text, n_tokens, top):
    """(cumulative_logprob, token_logprobs) as the real engine gives them: only when the request asked for
    logprobs; the answer's token carries all of the answer's logprob, the end of sequence none."""
    if getattr(params, "logprobs", None) is None:
        return None, None
    lp = math.log(confidence_of(spec, ids))
    if top is None:
        return lp, None
    steps = [(text, lp), ("<eos>", 0.0)][:n_tokens]
    content = [
        {
            "token": t,
            "logprob": v,
            "bytes": list(t.encode()),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}][:top]
            + [{"token": f"alt{j}", "logprob": v - 1 - j, "bytes": list(f"alt{j}".encode())} for j in range(top - 1)],
        }
        for t, v in steps
    ]
    return lp, content


def generate(spec, ids, params, top=None, adapter=None, weights=None) -> Generated:
    """One finished request: the answer (one token) then end-of-sequence (two completion tokens),
    under the request's max_tokens, stop strings, temperature and seed; with logprobs asked for, the
    answer's probability (``confidence_of``) and, for ``top`` (a row's own top_logprobs), the token entries."""
    seed = None
    if params.temperature >= SAMPLING_EPS:  # sampling: the seed matters; none means a fresh draw
        seed = params.seed if params.seed is not None else random.getrandbits(64)
    text = answer(spec, ids, seed, adapter, weights)
    for s in params.stop or ():
        if s in text:
            cut = text[: text.index(s)]
            lp, tokens = _logprobs(spec, ids, params, cut, 1, top)
            return Generated(cut, "stop", len(ids), 1, cumulative_logprob=lp, token_logprobs=tokens)
    if params.max_tokens is not None and params.max_tokens < 2:  # the answer, but no room for the EOS
        lp, tokens = _logprobs(spec, ids, params, text, 1, top)
        return Generated(text, "length", len(ids), 1, cumulative_logprob=lp, token_logprobs=tokens)
    lp, tokens = _logprobs(spec, ids, params, text, 2, top)
    return Generated(text, "stop", len(ids), 2, cumulative_logprob=lp, token_logprobs=tokens)


def recording(base):
    """An engine factory like ``base`` whose engines record (decoded) every prompt sent to them in ``.prompts``."""
    prompts: list[str] = []

    def factory(spec, **kw):
        engine = base(spec, **kw)
        submit = engine.submit

        def recorded(key, token_ids, overrides=None):
            prompts.append(engine.tokenizer.decode(token_ids))
            return submit(key, token_ids, overrides)

        engine.submit = recorded
        return engine

    factory.made = getattr(base, "made", None)
    factory.prompts = prompts
    return factory
