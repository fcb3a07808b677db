"""``localchat inspect``: what the KV cache costs for a model, or what one conversation's
cache holds.

What it is: ``cmd_inspect`` — without -c, the model's layer mix, KV bytes per token, bounded
state, context, the caches on disk (this model's and all), the tokenizer path, where a reply
ends and the sampling defaults, as aligned rows or one JSON object; with -c NAME, the
conversation's cache report (``cacheview/report.py``). What it is not: the parser (``main.py``
builds every subcommand's, so that ``--help`` lists them in one place).
"""

from __future__ import annotations

import json

from .. import paths
from ..fmt import human_bytes, say
from .data import open_store
from .start import session_for


def cmd_inspect(args) -> int:
    """What the KV cache costs for a model: layer mix, bytes per token, state, bytes on disk.
    With -c NAME: what that conversation's cache holds and what each turn saved."""
    if args.conversation:
        from ..cacheview.report import as_json, as_lines, report

        store = open_store()
        conv = store.get(args.conversation)
        store.close()
        session = session_for(args.model or conv.model, args)
        found = report(session, session.store.get(conv.name), progress=say)
        print(json.dumps(as_json(found), ensure_ascii=False) if args.json
              else "\n".join(as_lines(found)))
        return 0
    from ..cpu import backend, threads
    from ..kvcache import budget
    from ..kvcache.folder import CacheFolder, CacheInvalid
    from ..model.loading import load_engine

    engine = load_engine(args.model, progress=say)
    for text in engine.notices:
        say(text)
    info = engine.info()
    blas = backend.describe()
    mine = total = tokens = 0
    root = paths.kv_root()
    if root.is_dir():
        for folder in (f for f in root.iterdir() if f.is_dir()):
            kv = CacheFolder(folder)
            size = kv.disk_bytes()
            total += size
            try:
                man = kv.manifest()
            except CacheInvalid:
                continue
            if man and man.layout.fingerprint == engine.cache_fingerprint:
                mine += size
                tokens += len(man.tokens)
    layout = engine.layout()
    sampling, ends = engine.sampling(), engine.end_tokens()
    out = {**info.__dict__, "unknown": list(info.unknown),
           "growing_layers": len(layout.growing),
           "bounded_layers": len(layout.leaves) - len(layout.growing),
           "cache_tokens_on_disk": tokens, "cache_bytes_on_disk": mine,
           "all_caches_bytes_on_disk": budget.disk_use(root)[0],
           "cache_limit_bytes": budget.cache_limit(root), "blas": blas,
           "blas_threads": threads.summary(),
           # What the app and serve sample with when left unset, and where each came from.
           "sampling_defaults": {name: {"value": getattr(sampling, name),
                                        "source": sampling.sources[name]}
                                 for name in sampling.sources},
           "end_tokens": sorted(ends.ends)}
    if args.json:
        print(json.dumps(out))
        return 0
    widths = sorted({(s.k_shape, s.v_shape) for s in layout.growing})
    shapes = ", ".join(f"K {k[0]}x{k[1]} + V {v[0]}x{v[1]}" for k, v in widths)
    rows = [
        ("model", info.name), ("layers", info.layer_mix), ("heads", info.heads),
        ("kv_heads", info.kv_heads), ("head_dim", info.head_dim), ("kv_dtype", info.kv_dtype),
        ("kv_bytes_per_token", f"{info.kv_bytes_per_token:,} B (growing layers"
         + (f": {shapes}" if shapes else "") + ")"),
        ("state_bytes", f"{info.state_bytes:,} B per checkpoint (bounded layers; "
         "independent of the history)" if info.state_bytes else "0 (every layer grows)"),
        ("context_length", f"{info.context_length:,} tokens "
         f"= {human_bytes(info.context_length * info.kv_bytes_per_token)} of growing KV"),
        ("cache on disk", f"{human_bytes(mine)} for {tokens:,} tokens of this model"
         + (f" ({mine / tokens:,.0f} B/token)" if tokens else "")),
        ("all caches", f"{human_bytes(budget.disk_use(root)[0])} of "
         f"{human_bytes(budget.cache_limit(root))} (LOCALCHAT_CACHE_LIMIT)"),
        ("matmuls", blas),
        ("BLAS threads", threads.describe()),
        ("tokenizer", info.tokenizer),
        ("reply ends at", ", ".join(repr(engine.decode_text([t])) for t in sorted(ends.ends))
         + f" ({', '.join(ends.sources)})"),
        ("sampling (app, serve)", "; ".join(sampling.describe())),
    ]
    if info.unknown:
        rows.append(("not kept", f"cache classes {', '.join(info.unknown)}: full prefill "
                     "every turn"))
    for k, v in rows:
        print(f"{k:<20} {v}")
    return 0
