"""A fake engine for fast unit tests of the logic around vLLM (never the only test of a capability)."""

from __future__ import annotations

import hashlib

from airflow_provider_vllm.worker.engine import Generated


class FakeTokenizer:
    """One token per character (code point), a ChatML-like chat template."""

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) % 50000 + 3 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i - 3) for i in ids if i >= 3)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        s = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return s + ("<assistant>" if add_generation_prompt else "")


class EngineDeadError(Exception):
    """Named like vLLM's: the guard classifies engine death by this name."""


class FakeEngine:
    """Answers each prompt deterministically; optionally crashes after N finished rows."""

    version = "fake-0"
    start_seconds = 0.0

    def __init__(self, spec, max_model_len=None, crash_after=None, per_step=7):
        self.spec = spec
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len or spec.model.max_model_len or 2048
        self.crash_after = crash_after
        self.per_step = per_step
        self.queue = []
        self.finished = 0
        self.submitted = 0
        self.dead = False
        self.closed = False

    def warm_up(self):
        pass

    def submit(self, key, token_ids, overrides=None):
        if len(token_ids) > self.max_model_len:
            raise ValueError("prompt too long for the engine")
        self.queue.append((key, token_ids))
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
        out, self.queue = self.queue[: self.per_step], self.queue[self.per_step:]
        res = []
        for key, ids in out:
            if self.crash_after is not None and self.finished >= self.crash_after:
                raise RuntimeError("engine died (injected)")
            self.finished += 1
            res.append((key, Generated(text=answer(self.spec, ids), finish_reason="stop",
                                       prompt_tokens=len(ids), completion_tokens=2)))
        return res

    def pool(self, prompts):
        return [[float(len(p)), 1.0, 0.5] for p in prompts]


def answer(spec, ids):
    h = int(hashlib.sha256(str(ids).encode()).hexdigest(), 16)
    st = spec.sampling.structured
    if st is not None and st.choice:
        return st.choice[h % len(st.choice)]
    return f"out-{h % 1000}"
