"""Vision-language models through mlx-vlm, with image tokens keyed by their image's content.

What it is: ``VisionEngine`` — an ``Engine`` whose conversations may hold images. It loads a
folder whose config has a ``vision_config`` with ``mlx_vlm.load`` (Qwen2-VL / Qwen2.5-VL,
SmolVLM / Idefics3 and Gemma 3: ``FAMILIES``; any other vision family is refused in one line)
and runs the language model itself, so that the session's cache machinery (prefix match,
segments on disk, checkpoints) works as for a text model.

The cache keys (why a resumed turn equals a cold one): ``render`` returns *keys*, not ids.
A text token's key is its id; the j-th placeholder token of an image is keyed by a hash of
(the model's processor config, the image's content hash, j), put above the vocabulary
(``image_key``). The content hash covers the pixels and the size (``store/images.py``), and
the processor config and the size fix the image's grid, so:
- the longest common prefix of a stored and a rendered key list stops at the first token of
  a changed image even when the token ids agree (a same-size swap; a transposed image whose
  ids agree but whose M-RoPE positions differ);
- ``resume_at`` moves a prefix that ends inside an image back to the image's first token,
  so no turn resumes with half an image's K/V.
The keys are what the cache stores and the prefix index hashes; ``prefill`` maps them back
to the image token id and puts the image's feature rows at those positions.

Features are memoised per image (``VisionEngine.features``, an LRU of ``MEMO_IMAGES``): each
image is run through the processor and vision tower alone, once, and its rows are read from
the merged embeddings at its placeholder positions, which is what mlx-vlm's own
``get_input_embeddings`` puts there (the three families merge row by row). Chunks may split
an image anywhere: every position gets its own row and its own position id, and attention is
causal in all three families.

Qwen2-VL's M-RoPE: text after an image is shifted by (the image's largest grid side − its
token count). The shift is recomputed from the keys before a prefill (``before``) and kept
on the cache (``VisionCache.delta``) for the decode steps.

What it is not: image files and their checks (``store/images.py``), the CPU path's weight
tuning (a vision model runs MLX's own kernels), or a scheduler's batched steps (a vision
model's turns run one at a time, making their own model calls: ``unstepped``; ``stepped``
is refused).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import BadInput, ModelBroken
from ..files import xxh3
from ..kvcache import kinds as ck
from ..kvcache.folder import common_prefix
from .engine import PREFILL_CHUNK, Engine
from .resolve import ModelRef

# model_type -> (the placeholder the chat template writes for an image, M-RoPE or not)
FAMILIES = {"qwen2_vl": ("<|image_pad|>", True), "qwen2_5_vl": ("<|image_pad|>", True),
            "smolvlm": ("<image>", False), "idefics3": ("<image>", False),
            "gemma3": ("<start_of_image>", False)}
MEMO_IMAGES = 32  # images whose features are kept in memory
SCALED_NOTE = 0.5  # say so when the model sees less than this share of an image's pixels
KEY_TOP = 2**31  # keys stay int32 (``kvcache/format.py``'s MAX_TOKEN)
INSTALL = 'pip install "localchat[vision]"'  # (scripts/setup.sh installs it)


def vision_config(path: Path) -> dict | None:
    """The model folder's config when it describes a vision model, else None (no import)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) and config.get("vision_config") else None


def image_key(salt: bytes, digest: str, j: int, vocab: int) -> int:
    """The cache key of the j-th placeholder token of image ``digest`` (see the docstring)."""
    return vocab + xxh3(salt + f"{digest}:{j}".encode()) % (KEY_TOP - vocab)


class VisionCache(list):
    """A model's per-layer cache list that also knows its M-RoPE shift (``delta``)."""

    delta = 0


class Image:
    """One image as this model sees it: its expansion in the prompt and, once asked, its
    feature rows (memoised per content hash)."""

    def __init__(self, digest: str, expansion: str, count: int, grid: tuple[int, int, int],
                 inputs: dict, size: tuple[int, int] = (0, 0), seen: int = 0):
        self.digest = digest
        self.size = size  # (width, height) of the image as given
        self.seen = seen  # pixels the model's processor makes of it (after its resize)
        self.expansion = expansion  # the text the processor puts where the placeholder was
        self.count = count  # placeholder tokens (feature rows)
        self.grid = grid  # (t, h, w) after the spatial merge (Qwen); (1, 1, count) else
        self.inputs = inputs  # the processor's arrays for this image alone
        self.rows = None  # (count, hidden) features, computed by the first prefill


def _seen(got: dict, patch: int) -> int:
    """The pixels the processor's output holds of one image: Qwen's grid of ``patch``-pixel
    patches, else its tiles (SmolVLM's global view, a copy of the rest, not counted)."""
    if "image_grid_thw" in got:
        _, h, w = (int(v) for v in got["image_grid_thw"].tolist()[0])
        return h * w * patch * patch
    shape = getattr(got.get("pixel_values"), "shape", None)  # (…, tiles, channels, H, W)
    if shape is None or len(shape) < 3:
        return 0
    tiles = 1
    for n in shape[:-3]:
        tiles *= int(n)
    return int(shape[-1]) * int(shape[-2]) * (tiles - 1 if tiles > 1 else 1)


class TextModel:
    """The language model as ``Engine`` calls it (``model(ids[None], cache=)`` → logits), with
    the M-RoPE positions of a vision conversation."""

    def __init__(self, vlm, mrope: bool):
        self.vlm = vlm
        self.lm = vlm.language_model
        self.mrope = mrope

    @property
    def layers(self):
        return self.lm.layers

    def make_cache(self) -> VisionCache:
        """mlx-lm's cache classes (what ``kvcache/kinds.py`` knows), in mlx-vlm's layout."""
        from mlx_lm.models import cache as lmc

        theirs = self.lm.make_cache() if hasattr(self.lm, "make_cache") else \
            [None] * len(self.lm.layers)
        out = VisionCache()
        for c in theirs:
            if type(c).__name__ == "RotatingKVCache":
                out.append(lmc.RotatingKVCache(max_size=c.max_size, keep=c.keep))
            elif c is None or type(c).__name__ == "KVCache":
                out.append(lmc.KVCache())
            else:
                out.append(c)  # (a kind localchat does not keep: ``info().unknown`` says so)
        return out

    def embed(self, ids):
        return self.vlm.get_input_embeddings(ids, None).inputs_embeds

    def __call__(self, ids, cache, embeds=None, positions=None):
        import mlx.core as mx

        if embeds is None:
            embeds = self.embed(ids)
        extra = {}
        if self.mrope:
            if positions is None:  # text after everything the cache holds
                start = ck.position(cache) + getattr(cache, "delta", 0)
                p = mx.arange(start, start + ids.shape[1])[None]
                positions = mx.broadcast_to(p[None], (3, 1, ids.shape[1]))
            extra["position_ids"] = positions
        out = self.lm(ids, inputs_embeds=embeds, cache=cache, **extra)
        return getattr(out, "logits", out)


class VisionEngine(Engine):
    """An ``Engine`` for a vision-language model (see the module docstring)."""

    @classmethod
    def load_ref(cls, ref: ModelRef, config: dict,
                 images: Callable[[str], object] | None = None) -> VisionEngine:
        """Load ``ref`` (a vision model folder) through mlx-vlm.

        ``images``: digest -> decoded image (``store.images.ImageStore.open``).

        Raises:
            ModelBroken: mlx-vlm is not installed, the family is not one localchat keeps an
                exact cache for, or the files do not load.
        """
        family = config.get("model_type", "?")
        if family not in FAMILIES:
            raise ModelBroken(f"{ref.name}: vision model family {family!r} is not supported "
                              f"(localchat runs {', '.join(sorted(FAMILIES))})")
        try:
            import mlx_vlm  # noqa: F401
        except ImportError:
            raise ModelBroken(f"{ref.name} is a vision model, and mlx-vlm is not installed: "
                              f"{INSTALL}") from None
        from .preload import quiet_transformers
        from .tokenizer import load_tokenizer

        try:
            from mlx_vlm import load

            vlm, processor = load(str(ref.path))
            tokenizer, plan = load_tokenizer(ref.path, eos_token_ids=config.get("eos_token_id"))
        except Exception as err:  # noqa: BLE001 - mlx-vlm and transformers raise many kinds
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ModelBroken(f"cannot load model {ref.name}: {reason}") from None
        quiet_transformers()
        placeholder, mrope = FAMILIES[family]
        engine = cls(TextModel(vlm, mrope), tokenizer, ref, config)
        engine.vlm, engine.processor, engine.placeholder = vlm, processor, placeholder
        engine.image_token = int(getattr(vlm.config, "image_token_index", None)
                                 or vlm.config.image_token_id)
        engine.open_image = images
        engine.tokenizer_plan = plan.describe()
        salt = hashlib.sha256()
        for name in ("preprocessor_config.json", "processor_config.json"):
            f = ref.path / name
            salt.update(name.encode() + b"\0" + (f.read_bytes() if f.is_file() else b""))
        engine.salt = salt.digest()
        engine.memo = OrderedDict()  # digest -> Image
        engine.keys = {}  # key -> (Image, j) for every image rendered
        engine.end_tokens()
        engine.notices.extend(engine.sampling().notices)
        return engine

    def takes_images(self) -> bool:
        return True

    def unstepped(self) -> str:
        return ("a vision model's turns make their own model calls: its prefill places image "
                "rows and M-RoPE positions, which a batched step does not")

    def can_verify(self) -> bool:
        """No prompt-lookup drafts yet: a vision model decodes plain (its verify passes
        would need the M-RoPE positions of several tokens at once; left for later)."""
        return False

    def layout(self, quant=None):
        """The text model's layout, without the vocabulary bound: an image token's key is
        above the vocabulary (it is never fed as an id: ``prefill`` maps it)."""
        import dataclasses

        return dataclasses.replace(super().layout(quant), vocab=0)

    @property
    def vocab(self) -> int:
        text = self.config.get("text_config") or {}
        return int(self.config.get("vocab_size") or text.get("vocab_size") or 0) or \
            self.vlm.language_model.model.embed_tokens.weight.shape[0]

    # -- images ----------------------------------------------------------------------------

    def see(self, digest: str, picture) -> None:
        self.image(digest, picture)

    def image(self, digest: str, picture=None) -> Image:
        """The memo's ``Image`` for ``digest``, processed now if it is not there (from
        ``picture``, the decoded image, when given; else from the image store)."""
        if digest in self.memo:
            self.memo.move_to_end(digest)
            return self.memo[digest]
        if picture is None and self.open_image is None:
            raise BadInput("this session has no image store")
        picture = (picture if picture is not None else self.open_image(digest)).convert("RGB")
        with self._tokenizer_lock:
            try:
                got = self.processor(text=[self.placeholder], images=[picture],
                                     add_special_tokens=False)
            except Exception as err:  # noqa: BLE001 - the processor's own errors, one line
                why = str(err).splitlines()[0] if str(err) else type(err).__name__
                raise BadInput(f"image {digest[:12]}: the model's processor refuses it "
                               f"({why})") from None
        ids = [int(t) for t in got["input_ids"].tolist()[0]]
        expansion = self.tokenizer.decode(ids, skip_special_tokens=False,
                                          clean_up_tokenization_spaces=False)
        count = sum(t == self.image_token for t in ids)
        grid = (1, 1, count)
        if "image_grid_thw" in got:
            t, h, w = (int(v) for v in got["image_grid_thw"].tolist()[0])
            m = self.vlm.config.vision_config.spatial_merge_size
            grid = (t, h // m, w // m)
        inputs = {k: v for k, v in got.items() if k not in ("input_ids", "attention_mask")}
        inputs["input_ids"] = got["input_ids"]
        if "attention_mask" in got:
            inputs["mask"] = got["attention_mask"]  # (Gemma 3 merges with it)
        entry = Image(digest, expansion, count, grid, inputs, picture.size,
                      _seen(got, self.vlm.config.vision_config.patch_size))
        self.memo[digest] = entry
        while len(self.memo) > MEMO_IMAGES:
            self.memo.popitem(last=False)
        return entry

    def image_note(self, digest: str) -> str:
        """Said when the processor scales the image down to under ``SCALED_NOTE`` of its
        pixels (a huge photo or screenshot: its fine print may be lost)."""
        entry = self.image(digest)
        (w, h), seen = entry.size, entry.seen
        if not seen or seen >= SCALED_NOTE * w * h:
            return ""
        scale = (seen / (w * h)) ** 0.5
        return (f"image {digest[:12]} {w}×{h}: the model's processor scales it down to about "
                f"{round(w * scale)}×{round(h * scale)} ({100 * seen / (w * h):.0f}% of its "
                "pixels); fine detail may be lost")

    def image_spans(self, tokens: list[int], digests: list[str]) -> list[tuple[int, int, str]]:
        """Each of the images ``digests`` whose placeholder tokens ``tokens`` holds, from its
        first to its last (SmolVLM's row markers between its tiles inside): ``(start, end,
        digest)``. An image missing from the data folder is left out."""
        known = {}
        for digest in dict.fromkeys(digests):
            try:
                count = self.image(digest).count
            except BadInput:
                continue
            for j in range(count):
                known[image_key(self.salt, digest, j, self.vocab)] = (digest, j, count)
        spans, start = [], None
        for i, key in enumerate(tokens):
            if key in known:
                digest, j, count = known[key]
                start = i if j == 0 else start
                if j == count - 1 and start is not None:
                    spans.append((start, i + 1, digest))
                    start = None
        return spans

    def rows(self, entry: Image):
        """The feature rows of ``entry`` (the vision tower runs once per image)."""
        import mlx.core as mx

        if entry.rows is None:
            inputs = dict(entry.inputs)
            ids = inputs.pop("input_ids")
            pixels = inputs.pop("pixel_values")
            merged = self.vlm.get_input_embeddings(ids, pixels, **inputs).inputs_embeds
            where = [i for i, t in enumerate(ids.tolist()[0]) if t == self.image_token]
            entry.rows = merged[0, mx.array(where)]
            mx.eval(entry.rows)
            entry.inputs = {"input_ids": ids}  # (the pixels are no longer needed)
        return entry.rows

    # -- text ------------------------------------------------------------------------------

    def render(self, messages: list[dict], prior: list[int] | None = None,
               generation_prompt: bool = True, tools: list[dict] | None = None,
               thinking: bool | None = None) -> list[int]:
        """The keys of the conversation (see the module docstring): ids, with each image's
        placeholder tokens keyed by the image. A message's ``images`` (content hashes)
        come before its text. ``prior`` (the cache's keys) is kept where its text and its
        images are the rendered ones, as ``Engine.render`` keeps a reply's generated ids."""
        shown, order = [], []
        for m in messages:
            digests = m.get("images") or ()
            if digests:
                parts = [{"type": "image"} for _ in digests]
                if m.get("content"):
                    parts.append({"type": "text", "text": m["content"]})
                m = {**{k: v for k, v in m.items() if k != "images"}, "content": parts}
                order.extend(digests)
            shown.append(m)
        entries = [self.image(d) for d in order]
        from jinja2 import TemplateError

        with self._tokenizer_lock:
            try:
                text = self.tokenizer.apply_chat_template(
                    shown, add_generation_prompt=generation_prompt, tokenize=False,
                    **({"tools": tools} if tools else {}),
                    **({"enable_thinking": thinking} if thinking is not None else {}))
            except TemplateError as err:
                raise BadInput(f"the model's chat template refuses these messages: {err}"
                               ) from None
            pieces = text.split(self.placeholder)
            if len(pieces) - 1 != len(entries):
                raise BadInput(f"the chat template wrote {len(pieces) - 1} image places for "
                               f"{len(entries)} images")
            expanded = pieces[0] + "".join(e.expansion + p for e, p in zip(entries, pieces[1:]))
            queue = [(e, j) for e in entries for j in range(e.count)]
            canonical = self._keyed(self._encode(expanded), queue, 0)
            if not prior or common_prefix(prior, canonical) == len(prior):
                return canonical
            # The longest prefix of ``prior`` whose text is the rendered text's start and
            # whose images are the rendered ones, in order (text alone cannot tell them).
            shown_ids = [self.image_token if k >= self.vocab else k for k in prior]
            j, prefix_text = self._aligned_prefix(shown_ids, expanded)
            ours = [k for k in canonical if k >= self.vocab]
            seen = 0
            for i in range(j):
                if prior[i] >= self.vocab:
                    if seen >= len(ours) or prior[i] != ours[seen]:
                        j, prefix_text = self._aligned_prefix(shown_ids[:i], expanded)
                        break
                    seen += 1
            seen = sum(k >= self.vocab for k in prior[:j])
            if j <= common_prefix(prior, canonical):
                return canonical
            rest = self._encode(expanded[len(prefix_text):])
            return list(prior[:j]) + self._keyed(rest, queue, seen)

    def _keyed(self, ids: list[int], queue: list[tuple[Image, int]], at: int) -> list[int]:
        """``ids`` with each image token replaced by the key of ``queue[at]``, ``at + 1``, …"""
        keys, vocab = [], self.vocab
        for t in ids:
            if t == self.image_token:
                if at >= len(queue):
                    raise BadInput("more image tokens than the images make")
                entry, j = queue[at]
                at += 1
                key = image_key(self.salt, entry.digest, j, vocab)
                self.keys[key] = (entry, j)
                keys.append(key)
            else:
                keys.append(t)
        if at != len(queue):
            raise BadInput("fewer image tokens than the images make")
        return keys

    def resume_at(self, tokens: Sequence[int], k: int) -> int:
        """``k``, or the first token of the image whose tokens ``k`` would cut."""
        if 0 < k < len(tokens) and tokens[k] >= self.vocab and tokens[k] in self.keys:
            _, j = self.keys[tokens[k]]
            if j > 0:
                # (SmolVLM puts row markers between an image's tiles: walk back to j = 0)
                while k > 0 and not (tokens[k] in self.keys and self.keys[tokens[k]][1] == 0):
                    k -= 1
        return k

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text)) if text else 0

    # -- compute ---------------------------------------------------------------------------

    def _delta(self, keys: Sequence[int]) -> int:
        """The M-RoPE shift after ``keys`` (whole images only: ``resume_at``)."""
        d = 0
        for key in keys:
            if key >= self.vocab and key in self.keys:
                entry, j = self.keys[key]
                if j == entry.count - 1:
                    d += max(entry.grid) - entry.count
        return d

    def prefill(self, tokens: list[int], cache: list,
                chunk: int | Callable[[], int] = PREFILL_CHUNK, stepped: bool = False,
                before: Sequence[int] | None = None):
        """``Engine.prefill`` for keys: each image token gets its image's feature row, each
        position its M-RoPE position. ``before``: the keys the cache holds (None: the
        cache's own shift stands)."""
        import mlx.core as mx

        assert tokens, "prefill needs at least one token"
        if stepped:
            raise BadInput("a vision model runs one turn at a time (no batched turns yet)")
        model: TextModel = self.model
        offset = ck.position(cache)
        delta = self._delta(before) if before is not None else getattr(cache, "delta", 0)
        vocab, done, total = self.vocab, 0, len(tokens)
        size = chunk if callable(chunk) else (lambda: chunk)
        logits = None
        while done < total:
            n = max(1, min(size(), total - done))
            piece = tokens[done:done + n]
            ids = [self.image_token if t >= vocab else t for t in piece]
            x = mx.array(ids)[None]
            embeds = model.embed(x)
            where, rows = [], []
            pos = []
            for i, t in enumerate(piece):
                at = offset + done + i
                if t >= vocab:
                    if t not in self.keys:
                        raise BadInput("an image token of an image this model has not seen")
                    entry, j = self.keys[t]
                    where.append(i)
                    rows.append(self.rows(entry)[j])
                    if model.mrope:
                        gt, gh, gw = entry.grid
                        st = at - j + delta
                        pos.append((st + j // (gh * gw), st + (j // gw) % gh, st + j % gw))
                        if j == entry.count - 1:
                            delta += max(entry.grid) - entry.count
                elif model.mrope:
                    pos.append((at + delta,) * 3)
            if where:
                idx = mx.array(where)
                embeds[0, idx] = mx.stack(rows).astype(embeds.dtype)
            positions = None
            if model.mrope:
                positions = mx.array(pos, dtype=mx.int32).T[:, None, :]
            out = model(x, cache, embeds=embeds, positions=positions)
            logits = out[:, -1, :]
            mx.eval(ck.state_arrays(cache), logits)
            done += n
            if isinstance(cache, VisionCache):
                cache.delta = delta
            if done < total:
                yield done, total
        return logits
