"""Cache reuse for every mlx-lm cache family: per-turn hits, bytes written, resume vs prefill.

For each family of ``tests/families.py`` (tiny random models, one per cache class mix:
KVCache, MLA, sliding windows, chunked attention, linear attention / conv / SSM state,
CacheLists), side by side in one run:
- four turns (English and Korean), each in a fresh session so the cache comes from disk:
  cached / prefilled tokens and bytes the turn wrote;
- at a ~2k-token history: time to first token resumed from disk vs a full prefill
  (``--no-cache`` on a copy), median of several trials.
The models are tiny, so times are small; the ratios and the byte counts are the point.
``scripts/bench_resume.py -m FOLDER`` measures a real model of any family the same way.

Usage: python scripts/bench_families.py [--quick | --smoke] [--family NAME ...]
``--quick``: 2 trials. ``--smoke``: llama (growing K/V only) and qwen3_next (linear attention:
checkpoints) unless --family says otherwise, a ~128-token history, 1 trial — every step in
seconds (``tests/test_scripts.py`` runs it); its figures mean nothing.
Prints a table, then one JSON line.
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
CONTEXT = 4096
SMOKE_FAMILIES = ["llama", "qwen3_next"]


def build(name: str, root: Path) -> Path:
    """The family's tiny model with a context long enough for a 2k-token history."""
    from families import build_family

    folder = build_family(name, root / name)
    for file, key in (("config.json", "max_position_embeddings"),
                      ("tokenizer_config.json", "model_max_length")):
        conf = json.loads((folder / file).read_text())
        conf[key] = CONTEXT
        (folder / file).write_text(json.dumps(conf))
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "2 trials", model=False)  # the models are the families'
    ap.add_argument("--family", nargs="*", default=None)
    args = ap.parse_args()
    trials = benchlib.pick(args, 3, 2, 1)
    history_tokens = benchlib.pick(args, 2048, 2048, 128)
    max_tokens = benchlib.pick(args, 16, 16, 4)
    home = benchlib.scratch_home()
    import localchat.cpu.backend as backend

    backend.prepare()
    from families import FAMILIES

    from localchat.model.engine import Engine, now
    from localchat.session.session import Session, TurnOptions, open_session

    root = home / "families"
    rows, results = [], []
    for name in args.family or benchlib.pick(args, list(FAMILIES), list(FAMILIES),
                                             SMOKE_FAMILIES):
        folder = build(name, root)
        session = open_session(str(folder))
        engine: Engine = session.engine
        info = engine.info()

        def fresh(session=session) -> Session:
            return Session(session.store, session.engine, session.kv_root, session.locks_dir)

        conv = session.conversation(f"turns-{name}")
        per_turn = []
        for prompt in TURNS:
            done = list(fresh().turn(conv, prompt, TurnOptions(max_tokens=max_tokens)))[-1]
            u = done.usage
            per_turn.append((u.cached_tokens, u.prefilled_tokens, u.bytes_written))
        # A ~2k-token history, then one short message: resumed vs full prefill.
        long = session.conversation(f"long-{name}")
        for m in benchlib.filler_messages(engine, history_tokens):
            session.store.add_message(long, m["role"], m["content"])
        list(fresh().turn(long, "Noted?", TurnOptions(max_tokens=1)))  # writes the cache
        history = session.store.messages(long)
        resumed, full = [], []
        for i in range(trials):
            twin = session.conversation(f"twin-{name}-{i}")
            for m in history:
                session.store.add_message(twin, m.role, m.content)
            for target, out, no_cache in ((long, resumed, False), (twin, full, True)):
                t0 = now()
                done = list(fresh().turn(target, "And then?",
                                         TurnOptions(max_tokens=1, no_cache=no_cache)))[-1]
                out.append(done.usage.ttft_s if done.usage.ttft_s else now() - t0)
                session.store.delete_messages_from(target, len(history) + 1)
        r, f = benchlib.median(resumed), benchlib.median(full)
        turns = " · ".join(f"{c}/{p}" for c, p, _ in per_turn)
        written = " · ".join(f"{w / 1024:.1f}" for _, _, w in per_turn)
        rows.append([name, info.layer_mix, f"{info.kv_bytes_per_token:,}",
                     f"{info.state_bytes:,}", turns, written, f"{r * 1000:.1f}",
                     f"{f * 1000:.1f}", f"{benchlib.ratio(f, r):.1f}x"])
        results.append({"family": name, "layer_mix": info.layer_mix,
                        "kv_bytes_per_token": info.kv_bytes_per_token,
                        "state_bytes": info.state_bytes,
                        "turns": [{"cached": c, "prefilled": p, "bytes_written": w}
                                  for c, p, w in per_turn],
                        "resumed_ttft_s": r, "full_prefill_ttft_s": f})
        session.close()
    print(f"# cache families · tiny random models · ~{history_tokens}-token history · "
          f"{benchlib.machine()} · median of {trials}")
    benchlib.print_table(["family", "layers", "growing B/token", "checkpoint B",
                          "turns 1-4 cached/prefilled", "KB written per turn",
                          "resumed TTFT ms", "full prefill ms", "ratio"], rows)
    benchlib.print_json({"bench": "families", "mode": benchlib.mode(args),
                         "model": "tiny random models (tests/families.py)",
                         "machine": benchlib.machine(), "history_tokens": history_tokens,
                         "families": results})


if __name__ == "__main__":
    main()
