"""Quantized KV caches: quality against the float16 cache, and disk per token, side by side.

For each setting (8 and 4 bits, groups 32 and 64) on the default model (or -m MODEL):
- the quality gate's figures (``localchat/kvcache/quality.py``: teacher-forced over a fixed English
  and Korean conversation — top-1 agreement and mean |Δ log p| of the reference reply);
- greedy agreement of real turns: a fixed 4-turn script (English and Korean) run with the
  setting, every turn resumed from disk, against the same script with a float16 cache — the
  share of reply tokens equal position by position, and whether the first reply says Paris;
- disk: cache bytes per token (headers, scales and biases included) vs the float16 cache.
A setting that fails the gate is shown as refused (that is what ``--kv-bits`` does with it).

Usage: python scripts/bench_kvquant.py [--quick | --smoke] [-m MODEL]
``--quick``: 8 and 4 bits, group 32, replies of 24 tokens. ``--smoke``: the same settings,
replies of 8 tokens: every step in seconds on a tiny model whose head dimension a group of 32
divides (``tests/test_scripts.py`` runs it); its figures mean nothing.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402

SETTINGS = [(8, 32), (8, 64), (4, 32), (4, 64)]
TURNS = ["What is the capital of France?",
         "서울에서 부산까지 기차로 얼마나 걸리나요?",
         "Give me three tips for a first trip to Korea.",
         "고마워요. 마지막으로 한국 음식 하나를 추천해 주세요."]


def run_script(session, name: str, bits: int | None, group: int | None, max_tokens: int):
    """Replies (token ids) of the 4 turns, each from a fresh session (resumed from disk)."""
    from localchat.session.session import Session, TurnOptions

    conv = session.conversation(name, kv_bits=bits, kv_group=group)
    replies = []
    for prompt in TURNS:
        fresh = Session(session.store, session.engine, session.kv_root, session.locks_dir)
        done = list(fresh.turn(conv, prompt, TurnOptions(max_tokens=max_tokens)))[-1]
        replies.append((list(done.tokens), done.reply))
    return conv, replies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "2 settings, shorter replies")
    args = ap.parse_args()
    benchlib.scratch_home()
    import localchat.cpu.backend as backend
    import localchat.kvcache.quality as kvquality

    backend.prepare()
    import localchat.kvcache.kinds as ck
    from localchat.errors import BadInput
    from localchat.session.session import open_session

    session = open_session(args.model)
    max_tokens = benchlib.pick(args, 48, 24, 8)
    settings = benchlib.pick(args, SETTINGS, SETTINGS[::2], SETTINGS[::2])
    base_conv, base = run_script(session, "f16", 0, None, max_tokens)

    def disk_per_token(conv) -> float:
        man = session.cache_folder(conv).manifest()
        return sum(s.nbytes for s in man.segments) / len(man.tokens)

    base_bpt = disk_per_token(base_conv)
    rows, results = [], []
    for bits, group in settings:
        quality = kvquality.measure(session.engine, ck.KVQuant(bits, group))
        try:
            conv, got = run_script(session, f"q{bits}-{group}", bits, group, max_tokens)
        except BadInput as err:
            rows.append([f"{bits}-bit, group {group}", quality.agreement, quality.nll_delta,
                         "refused", "", "", ""])
            results.append({"bits": bits, "group": group, "gate_agreement": quality.agreement,
                            "gate_nll_delta": quality.nll_delta, "refused": True,
                            "why": str(err)})
            continue
        same = total = 0
        for (a, _), (b, _) in zip(base, got):
            total += max(len(a), len(b))
            same += sum(x == y for x, y in zip(a, b))
        bpt = disk_per_token(conv)
        paris = "Paris" in got[0][1]
        rows.append([f"{bits}-bit, group {group}", quality.agreement, quality.nll_delta,
                     f"{benchlib.ratio(same, total):.0%}", "yes" if paris else "no",
                     f"{bpt:,.0f}", f"{bpt / base_bpt:.3f}"])
        results.append({"bits": bits, "group": group, "gate_agreement": quality.agreement,
                        "gate_nll_delta": quality.nll_delta,
                        "greedy_agreement": benchlib.ratio(same, total),
                        "paris": paris, "disk_bytes_per_token": bpt,
                        "disk_vs_f16": bpt / base_bpt, "refused": False})
    print(f"# KV quantization · {session.engine.ref.name} · float16 cache "
          f"{base_bpt:,.0f} B/token on disk · {benchlib.machine()}")
    print(f"# gate: top-1 agreement ≥ {kvquality.GATE['agreement']:.0%} and mean |Δ log p| "
          f"≤ {kvquality.GATE['nll']}; first float16 reply: {base[0][1][:60]!r}")
    benchlib.print_table(["setting", "gate top-1 agree", "gate mean |Δ log p|",
                          "greedy tokens equal (4 turns)", "says Paris", "disk B/token",
                          "disk vs float16"], rows)
    for r in results:
        if r["refused"]:
            print(f"{r['bits']}-bit, group {r['group']} refused: {r['why']}")
    benchlib.print_json({"bench": "kvquant", "mode": benchlib.mode(args),
                         "model": session.engine.ref.name,
                         "machine": benchlib.machine(), "f16_bytes_per_token": base_bpt,
                         "settings": results})


if __name__ == "__main__":
    main()
