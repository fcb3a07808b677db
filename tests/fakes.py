"""A scripted engine for UI tests: the tiny real model, with replies taken from a queue.

Decoding feeds each scripted token through the real model, so the KV cache, the disk store and
the usage figures are all real; only the choice of tokens is scripted (readable Markdown).
"""

from __future__ import annotations

import time

from localchat.model.engine import PREFILL_CHUNK, Engine


class ScriptedEngine(Engine):
    def __init__(self, base: Engine, replies: list[str] | None = None, delay: float = 0.0):
        super().__init__(base.model, base.tokenizer, base.ref, base.config)
        self.replies = list(replies or [])
        self.delay = delay
        self.prefill_delay = 0.0  # seconds after each prefill chunk (a slow machine)
        self.sampled_with: list[dict] = []  # each decode's sampling settings

    def prefill(self, tokens, cache, chunk=PREFILL_CHUNK, **_stepped):
        # (under a scheduler it runs its chunks itself, as its decode does)
        steps = super().prefill(tokens, cache, chunk)
        while True:
            try:
                progress = next(steps)
            except StopIteration as fin:
                return fin.value
            if self.prefill_delay:
                time.sleep(self.prefill_delay)
            yield progress

    def decode(self, cache, logits, max_tokens, temp=0.0, seed=None, top_p=1.0, **_sampling):
        import mlx.core as mx

        self.sampled_with.append({"temp": temp, "top_p": top_p, **_sampling})
        text = self.replies.pop(0) if self.replies else "ok"
        eos = next(iter(self.eos_ids))
        tokens = self.encode(text) + [eos]
        for n, tok in enumerate(tokens[:max_tokens]):
            if self.delay:
                time.sleep(self.delay)
            if tok == eos:
                yield tok
                return
            if n < max_tokens - 1:  # Engine.decode feeds a token before yielding it...
                mx.eval(self.model(mx.array([[tok]]), cache=cache))
            yield tok
            if n == max_tokens - 1:  # ...and the last allowed one after, as here
                mx.eval(self.model(mx.array([[tok]]), cache=cache))
                return
