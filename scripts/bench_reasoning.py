"""What a reasoning model's turn re-prefills when its template drops earlier thinking.

For tiny random models of several cache kinds (``tests/families.py`` with ``<think>`` tokens and
a Qwen3-style template that renders an earlier reply without its thinking), four turns, each in
a fresh session so the cache comes from disk. The model is made to think for ``THINK`` tokens
and then answer (a sampler forces ``<think>`` and ``</think>``; greedy in between), like a
reasoning model. Per turn: the prompt, what came from the cache, what was prefilled, and how
much of the previous reply (its thinking and its answer) the cache could not keep; side by side,
the same conversation with thinking off (the template's empty block, dropped the same way).

What keeping earlier reasoning in the history (a pure append) would save is the previous
answer's re-prefill; what it would cost is every thought staying in the context: both are in
the table (``answer re-prefilled`` vs ``thinking dropped``). Turn 1 of the second mode may
start from the first mode's cache (the same first message: ``Sharing``).

Usage: python scripts/bench_reasoning.py [--quick | --smoke] [--family NAME ...]
``--smoke``: llama and qwen3_next, short thoughts — every step in seconds
(``tests/test_scripts.py`` runs it); its figures mean nothing. Prints a table, then one JSON
line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

import benchlib  # noqa: E402

TURNS = ["Hello there, how are you today? Tell me about Seoul.",
         "What is the capital of France?", "And Korea? 안녕하세요",
         "Thanks, tell me more about caches please."]
FAMILIES = ["llama", "gemma3_text", "qwen3_next", "lfm2", "mamba2"]
SMOKE_FAMILIES = ["llama", "qwen3_next"]


def force_thinking(think: int) -> dict:
    """Every decode: ``<think>``, ``think`` greedy tokens, ``</think>``, then the answer."""
    import mlx.core as mx
    import mlx_lm.sample_utils as su

    state = {"original": su.make_sampler}

    def make_sampler(temp, top_p=0.0, **_):
        step = iter(range(1 << 30))
        start, end, eos = state["ids"]

        def sample(logits):
            n = next(step)
            if n == 0:
                return mx.array([start])
            if n == think + 1:
                return mx.array([end])
            banned = [start, end, *eos] if n < think + 8 else [start, end]
            return mx.argmax(logits.at[..., banned].add(-1e9), axis=-1)
        return sample

    su.make_sampler = state["forced"] = make_sampler
    return state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "shorter thoughts", model=False)
    ap.add_argument("--family", nargs="*", default=None)
    args = ap.parse_args()
    think = benchlib.pick(args, 256, 96, 8)
    answer = benchlib.pick(args, 64, 32, 4)
    home = benchlib.scratch_home()
    import localchat.cpu.backend as backend

    backend.prepare()
    import mlx_lm.sample_utils as su
    from families import build_family

    from localchat.session.session import Session, TurnOptions, open_session

    state = force_thinking(think)
    rows, results = [], []
    for name in args.family or benchlib.pick(args, FAMILIES, FAMILIES, SMOKE_FAMILIES):
        folder = build_family(name, home / "models" / name, thinking="closed")
        for file, key in (("config.json", "max_position_embeddings"),
                          ("tokenizer_config.json", "model_max_length")):
            conf = json.loads((folder / file).read_text())
            conf[key] = 4096
            (folder / file).write_text(json.dumps(conf))
        session = open_session(str(folder))
        engine = session.engine
        vocab = engine.tokenizer.get_vocab()
        state["ids"] = (vocab["<think>"], vocab["</think>"], list(engine.eos_ids))
        per_mode = {}
        for mode, thinking in (("on", True), ("off", False)):
            conv = session.conversation(f"{mode}-{name}", thinking=thinking)
            turns, fed = [], 0
            for prompt in TURNS:
                fresh = Session(session.store, engine, session.kv_root, session.locks_dir)
                options = TurnOptions(max_tokens=think + 2 + answer if thinking else answer)
                # (a model told not to think answers at once: mlx-lm's own sampler)
                su.make_sampler = state["forced" if thinking else "original"]
                done = list(fresh.turn(conv, prompt, options))[-1]
                u = done.usage
                not_kept = max(0, fed - u.cached_tokens) if fed else 0
                # The history up to the end of the previous reply, as rendered now: what of it
                # the cache did not hold was fed again (the previous answer, mostly).
                history = session.conversations.history(conv)
                upto = [i for i, m in enumerate(history) if m["role"] == "assistant"][-2:]
                kept_history = len(engine.render(history[:upto[0] + 1], generation_prompt=False,
                                                 thinking=thinking)) if len(upto) == 2 else 0
                turns.append({"prompt": u.prompt_tokens, "cached": u.cached_tokens,
                              "prefilled": u.prefilled_tokens,
                              "reasoning_tokens": u.reasoning_tokens,
                              "previous_not_kept": not_kept,
                              # of which the previous answer (and the template's block), fed
                              # again; the rest was thinking, dropped for good
                              "answer_reprefilled": max(0, kept_history - u.cached_tokens),
                              "ttft_s": u.ttft_s, "miss_reason": u.miss_reason})
                fed = u.context_tokens
            per_mode[mode] = turns
        on, off = per_mode["on"], per_mode["off"]

        def mean(turns, key):
            return sum(t[key] for t in turns[1:]) / len(turns[1:])
        rows.append([name, engine.info().layer_mix,
                     " · ".join(f"{t['cached']}/{t['prefilled']}" for t in on),
                     " · ".join(f"{t['cached']}/{t['prefilled']}" for t in off),
                     f"{sum(t['reasoning_tokens'] for t in on[:-1]) / len(on[:-1]):.0f}",
                     f"{mean(on, 'answer_reprefilled'):.0f}",
                     f"{mean(off, 'answer_reprefilled'):.0f}"])
        results.append({"family": name, "layer_mix": engine.info().layer_mix,
                        "thinking_on": on, "thinking_off": off,
                        "thinking_dropped": sum(t["reasoning_tokens"] for t in on[:-1])
                        / len(on[:-1]),
                        "answer_reprefilled_on": mean(on, "answer_reprefilled"),
                        "answer_reprefilled_off": mean(off, "answer_reprefilled")})
        session.close()
    print(f"# reasoning templates · tiny random models · {think}-token thoughts, "
          f"{answer}-token answers · {benchlib.machine()}")
    benchlib.print_table(["family", "layers", "thinking on: turns 1-4 cached/prefilled",
                          "thinking off: cached/prefilled", "thinking dropped / turn",
                          "answer re-prefilled / turn (on)", "(off)"], rows)
    benchlib.print_json({"bench": "reasoning", "mode": benchlib.mode(args),
                         "model": "tiny random models (tests/families.py, thinking template)",
                         "machine": benchlib.machine(), "think_tokens": think,
                         "answer_tokens": answer, "families": results})


if __name__ == "__main__":
    main()
