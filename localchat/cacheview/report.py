"""What a conversation's cache holds and what each turn saved: the figures the cache view
(``tui/cachescreen.py``) and ``localchat inspect -c NAME`` show.

What it is: ``report(session, conv)`` → ``CacheReport``, read from the manifest (tokens,
segments, checkpoints), the model's layout (each kind of layer and what it costs), the stored
messages (where each starts in the token list) and the turns recorded in the database (cached
vs prefilled, TTFT). Time a turn saved is estimated: what a full prefill of its prompt would
take by this machine's measured prefill model (``prefillmodel.py``: fitted from the
conversation's own long-enough turns, else from a calibration of the model on this machine)
less the turn's measured time to first token; the report says which source and that it is an
estimate. What it is not: drawing (the front ends).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..fmt import human_bytes
from ..kvcache.folder import CacheInvalid
from ..kvcache.kinds import BOUNDED, GROWING
from ..session import window
from . import prefillfit, prefillmodel
from .prefillfit import PrefillModel


@dataclass(frozen=True)
class LayerKind:
    """One kind of layer in the model: how many, and what its cache costs."""

    name: str  # "growing (KVCache)", "sliding window 512 (RotatingKVCache)", …
    layers: int
    bytes_per_token: int  # growing: each token adds this on disk; bounded: 0
    checkpoint_bytes: int  # bounded: one checkpoint of these layers; growing: 0
    disk_bytes: int  # growing: this kind's share of the segments on disk


@dataclass(frozen=True)
class TurnView:
    prompt_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    draft_tokens: int
    completion_tokens: int
    ttft_s: float
    full_prefill_s: float  # estimated: the whole prompt prefilled (0: no estimate)
    saved_s: float  # estimated: full_prefill_s less the measured TTFT, at least 0


@dataclass(frozen=True)
class ImageSpan:
    """An image's placeholder tokens in the cache: positions [start, end)."""

    start: int
    end: int
    digest: str  # its content hash (``store/images.py``)
    width: int = 0  # its size in pixels (0: its stored file is gone)
    height: int = 0

    def label(self, name: str = "") -> str:
        """``[image NAME W×H: N tokens]`` (NAME: the file name, else the short hash)."""
        size = f" {self.width}×{self.height}" if self.width else ""
        return f"[image {name or self.digest[:12]}{size}: {self.end - self.start} tokens]"


@dataclass(frozen=True)
class CacheReport:
    name: str
    model: str
    tokens: int  # the cache's token list
    context_length: int
    boundaries: list[int]  # token position where each stored message starts
    segments: list[tuple[int, int, int]]  # (start, end, bytes)
    checkpoints: list[tuple[int, int]]  # (position, bytes)
    kinds: list[LayerKind]
    disk_bytes: int
    turns: list[TurnView] = field(default_factory=list)
    prefill_model: PrefillModel | None = None  # what the estimates come from (None: none)
    characters: int = 0  # of the conversation's messages
    note: str = ""  # why there is no cache (damaged, none yet)
    no_estimate: str = ""  # why there is no prefill model, when there is none
    images: list[ImageSpan] = field(default_factory=list)  # where the images' tokens are

    @property
    def saved_s(self) -> float:
        return sum(t.saved_s for t in self.turns)

    @property
    def tokens_per_character(self) -> float:
        return self.tokens / self.characters if self.characters else 0.0


def report(session, conv, *, calibrate: bool = True, progress=None,
           stopped=lambda: False) -> CacheReport:
    """The cache of ``conv`` as ``session``'s model sees it.

    ``calibrate``: when the conversation's turns cannot say what a full prefill costs and
    this model was never calibrated on this machine, measure it now (seconds, on the model's
    thread; once per model and machine; ``progress`` is told). Otherwise the estimates are
    left out. ``stopped()``: asked before each run of a calibration; it then raises
    ``prefillmodel.Stopped`` (the app is closing).
    """
    engine = session.engine
    info = engine.info()
    layout = session.cache.layout(conv)
    kv = session.cache_folder(conv)
    note = ""
    try:
        man = kv.checked_manifest(layout)
    except CacheInvalid as err:
        man, note = None, f"not usable ({err}): the next turn rebuilds it"
    if man is None and not note:
        note = "no cache on disk yet" if not info.unknown else "this model's cache is not kept"
    messages = window.visible(window.with_summary(
        session.conversations.history(conv),
        window.summary_in_force(conv, conv.context_overflow or window.DEFAULT)), conv.window_from)
    tokens = man.tokens if man else []
    boundaries = _boundaries(engine, messages, tokens)
    segments = [(s.start, s.end, s.nbytes) for s in man.segments] if man else []
    checkpoints = [(c.pos, c.nbytes) for c in man.checkpoints] if man else []
    kinds = _kinds(layout, sum(b for _, _, b in segments),
                   checkpoints[-1][1] if checkpoints else 0)
    turns = session.store.turns(conv)
    # Split over ranks, a calibration would run the model on this rank alone while the others
    # wait for the next turn: it would never end. The turns' own figures still count.
    split = engine.group.size > 1
    model = prefillmodel.for_conversation(engine, turns, calibrate_now=calibrate and not split,
                                          progress=progress, stopped=stopped) if turns else None
    no_estimate = "" if model else (
        f"a model split over {engine.group.size} ranks is not calibrated; its own turns give "
        f"one once {prefillfit.MIN_SAMPLES} of {prefillmodel.MIN_TOKENS}+ tokens differ in "
        f"length" if split else "no measurements yet")
    views = []
    for t in turns:
        full = model.full(t.prompt_tokens) if model else 0.0
        views.append(TurnView(t.prompt_tokens, t.cached_tokens, t.prefilled_tokens,
                              t.draft_tokens, t.completion_tokens, t.ttft_s, full,
                              max(0.0, full - t.ttft_s) if t.cached_tokens else 0.0))
    return CacheReport(conv.name, info.name, len(tokens), info.context_length, boundaries,
                       segments, checkpoints, kinds, kv.disk_bytes(), views, model,
                       sum(len(m["content"]) for m in messages), note, no_estimate,
                       _images(engine, messages, tokens))


def _boundaries(engine, messages: list[dict], tokens: list[int]) -> list[int]:
    """Where each message starts in ``tokens`` (renderings of the growing history, aligned
    with the cached ids)."""
    out = []
    for i in range(len(messages)):
        if messages[i]["role"] == "system":
            continue
        start = len(engine.render(messages[:i], tokens, generation_prompt=False)) if i else 0
        out.append(min(start, len(tokens)))
    return out


def _images(engine, messages: list[dict], tokens: list[int]) -> list[ImageSpan]:
    """The spans of the messages' images in ``tokens``, each with its size in pixels."""
    digests = [d for m in messages for d in m.get("images") or () if isinstance(d, str)]
    if not digests or not tokens:
        return []
    from .. import paths
    from ..store.images import ImageStore

    store = ImageStore(paths.images_dir())
    out = []
    for start, end, digest in engine.image_spans(tokens, digests):
        info = store.header(digest)
        out.append(ImageSpan(start, end, digest, info.width if info else 0,
                             info.height if info else 0))
    return out


def _kinds(layout, segment_bytes: int, checkpoint_bytes: int) -> list[LayerKind]:
    """The layers grouped by what their cache is: growing (plain, MLA, quantized) or
    bounded (sliding window, chunked, recurrent). The segments' and the newest checkpoint's
    bytes on disk are shared out by what each kind holds."""
    groups: dict[str, list] = {}
    for leaf in layout.leaves:
        if leaf.kind == GROWING:
            mla = leaf.k_shape[1] != leaf.v_shape[1]
            name = ("growing, MLA" if mla else "growing") + (
                f", {layout.kv_bits}-bit" if layout.kv_bits else "") + f" ({leaf.cls})"
        elif leaf.cls == "RotatingKVCache":
            name = f"sliding window {leaf.window} ({leaf.cls})"
        elif leaf.cls == "ChunkedKVCache":
            name = f"chunked {leaf.window} ({leaf.cls})"
        else:
            name = f"recurrent state ({leaf.cls})"
        groups.setdefault(name, []).append(leaf)
    width = 2 if layout.dtype in ("float16", "bfloat16") else 4
    growing = sum(_per_token(leaf, layout, width) for leaf in layout.leaves
                  if leaf.kind == GROWING)
    bounded = sum(_state_bytes(leaf, width) for leaf in layout.leaves if leaf.kind == BOUNDED)
    out = []
    for name, leaves in groups.items():
        per = sum(_per_token(leaf, layout, width) for leaf in leaves
                  if leaf.kind == GROWING)
        state = sum(_state_bytes(leaf, width) for leaf in leaves if leaf.kind == BOUNDED)
        if checkpoint_bytes and bounded:  # the newest checkpoint's size, shared out
            state = round(checkpoint_bytes * state / bounded)
        share = round(segment_bytes * per / growing) if growing else 0
        out.append(LayerKind(name, len(leaves), per, state, share))
    return out


def _per_token(leaf, layout, width: int) -> int:
    elements = leaf.k_shape[0] * leaf.k_shape[1] + leaf.v_shape[0] * leaf.v_shape[1]
    if layout.kv_bits:  # packed values, plus a float16 scale and bias per group
        groups = elements // layout.kv_group
        return elements * layout.kv_bits // 8 + groups * 4
    return elements * width


def _state_bytes(leaf, width: int) -> int:
    if leaf.state:
        total = 0
        for shape in leaf.state:
            n = 1
            for d in shape:
                n *= d
            total += n * 4
        return total
    return (leaf.k_shape[0] * leaf.k_shape[1] + leaf.v_shape[0] * leaf.v_shape[1]) * width * \
        max(leaf.window, 1)


def as_json(r: CacheReport) -> dict:
    """The report as ``inspect -c NAME --json`` prints it."""
    return {**dataclasses.asdict(r), "saved_s": r.saved_s,
            "tokens_per_character": r.tokens_per_character}


def as_lines(r: CacheReport) -> list[str]:
    """The report as text (``inspect -c NAME``)."""
    out = [f"conversation        {r.name} ({r.model})",
           f"cache               {r.tokens:,} tokens of {r.context_length:,}; "
           f"{human_bytes(r.disk_bytes)} on disk" + (f"; {r.note}" if r.note else ""),
           f"messages start at   {', '.join(map(str, r.boundaries)) or '-'}",
           *(["images              " + ", ".join(f"{i.label()} at {i.start}-{i.end}"
                                                 for i in r.images)] if r.images else []),
           "segments            " + (", ".join(f"[{a}, {b}) {human_bytes(n)}"
                                              for a, b, n in r.segments) or "-"),
           "checkpoints         " + (", ".join(f"at {p} {human_bytes(n)}"
                                              for p, n in r.checkpoints) or "-"),
           f"tokens/character    {r.tokens_per_character:.2f} ({r.characters:,} characters)",
           "layers:"]
    for k in r.kinds:
        cost = (f"{k.bytes_per_token:,} B/token, {human_bytes(k.disk_bytes)} on disk"
                if k.bytes_per_token else f"checkpoint {human_bytes(k.checkpoint_bytes)}")
        out.append(f"  {k.layers:>3} × {k.name}: {cost}")
    m = r.prefill_model
    out.append("turns (full prefill " + (f"estimated {m.describe()}):"
                                       if m else f"not estimated: {r.no_estimate}):"))
    for i, t in enumerate(r.turns, 1):
        full = f" · full ~{t.full_prefill_s:.2f} s (estimated)" if t.full_prefill_s else ""
        out.append(f"  {i:>3}. cached {t.cached_tokens:,} / prefilled {t.prefilled_tokens:,}"
                   + (f" (draft {t.draft_tokens})" if t.draft_tokens else "")
                   + f" · gen {t.completion_tokens} · TTFT {t.ttft_s:.2f} s{full}")
    if m:
        out.append(f"prefill model       {m.fixed_s * 1e3:.1f} ms + {m.per_token_s * 1e3:.2f} "
                   f"ms/token + {m.attention_s * 1e6:.3f} µs/token/position attended")
        if m.points:
            out.append(f"                    (a full prefill read off {len(m.points)} measured "
                       f"lengths, {m.points[0][0]}-{m.points[-1][0]} tokens)")
        out.append(f"time saved          ~{r.turns[-1].saved_s if r.turns else 0:.2f} s last "
                   f"turn, ~{r.saved_s:.2f} s in this conversation (estimated)")
    return out
