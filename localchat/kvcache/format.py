"""The KV cache's on-disk format (version 4): what a manifest holds, how it is read and
checked, and the safetensors reader. ``folder.py`` writes and reads conversation folders in
this format (its docstring describes the folder); this module does no I/O of its own.

A manifest is trusted only after three checks, all before any array is read:

1. its own checksum: the file is ``{"checksum":"HEX",`` followed by the canonical JSON
   (sorted keys, no spaces) of every other field without its opening brace, and HEX is the
   SHA-256 of that JSON (``seal``): one changed byte anywhere is "damaged manifest". Hashing
   the bytes as read costs ~0.03 ms for a 4k-token manifest; re-serializing them would
   cost ~0.7 ms;
2. its schema: every field present, of its exact type (ints are ints: no bools, floats or
   NaN), in range, file names plain ``seg-NNNNNN.safetensors`` / ``ckpt-NNNNNN.safetensors``
   (never a path: a manifest cannot make localchat read or delete outside its folder),
   segments tiling [0, len(tokens)), checkpoints at increasing positions in [1, len(tokens)];
3. its layout (``Layout``, the model's): every checkpoint holds one state per bounded leaf
   with exactly that leaf kind's fields, consistent with its position (a sliding window's
   offset is the position, its write index within the window, …) and with the leaf's shapes.

Loading a segment or checkpoint checks its size and checksum, then every array's name, shape
and dtype against the layout. The checksum is XXH3-64 (``xxhash``, ~15 GB/s on one core here)
since version 4; version 3 used zlib's CRC-32 (~2 GB/s, most of a 4k-token load). A version-3
manifest is still read, its files checked by their CRC-32; the next write makes it version 4,
its older entries keeping their ``crc32`` beside the new ones' ``xxh3``. Each file also says
what it was computed from, and that must be what the manifest says: a segment holds its
positions' token ids (``TOKENS``), a checkpoint its manifest entry (position, fields, dtypes)
and the CRC-32 of the token ids before it (``ENTRY``). Where a recurrent state was taken,
where a window writes next, or which ids made some K/V cannot be told from the arrays
themselves, and the renderer trusts the manifest's ids wherever they decode to the
conversation's text (``Engine.render``): two byte tokens of a broken UTF-8 sequence both
decode to "�". Anything off raises ``CacheInvalid`` with a short reason; the caller rebuilds.

Version 2 manifests (no checksum, looser checks) are not read: "cache rebuilt: cache format
version 2 (this localchat reads 3 and 4)", then a full prefill writes version 4. It costs one
prefill; a version-2 file could not prove it was undamaged.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from array import array
from dataclasses import dataclass, field

from ..files import xxh3
from .kinds import BOUNDED, KVQuant, LeafSpec, kind_named

FORMAT = "localchat-kv"
VERSION = 4
READS = (3, 4)  # the versions read (3: files checked by CRC-32 only)
SUMS = {"xxh3": 2**64 - 1, "crc32": 2**32 - 1}  # a file's checksum kind -> its largest value
MANIFEST = "manifest.json"
ENTRY = "entry"  # a checkpoint file's copy of its manifest entry (UTF-8 JSON, uint8)
TOKENS = "tokens"  # a segment file's token ids (int32)
DTYPES = ("float16", "bfloat16", "float32")  # K/V and states, in memory and stored
MAX_TOKEN = 2**31  # no vocabulary is larger; token ids go to MLX as int32
_FIELDS = {"format", "version", "checksum", "fingerprint", "dtype", "kv_bits", "kv_group",
           "leaves", "segments", "checkpoints", "tokens"}
_SEGMENT = {"file", "start", "end", "nbytes"}  # and one checksum key of SUMS
_CHECKPOINT = {"file", "pos", "nbytes", "meta", "arrays"}  # (the same)
_NAME = {"seg": re.compile(r"seg-[0-9]{6,9}\.safetensors"),
         "ckpt": re.compile(r"ckpt-[0-9]{6,9}\.safetensors")}
# Each bounded leaf kind's non-array fields (``kvcache.kinds.capture``) and array names.
_META = {"RotatingKVCache": {"offset", "keep", "max_size", "idx"},
         "ChunkedKVCache": {"offset", "chunk_size", "start_position"},
         "ArraysCache": {"size"}}


class CacheInvalid(Exception):
    """The stored cache cannot be used; ``str()`` is the reason shown to the user.

    ``usable``: how many leading positions are still sound (a damaged segment spoils only
    its own positions and what follows; 0 when nothing can be trusted)."""

    def __init__(self, reason: str, usable: int = 0):
        super().__init__(reason)
        self.usable = usable


def checksum(obj) -> str:
    """SHA-256 (hex) of ``obj``'s canonical JSON: sorted keys, no spaces, ASCII."""
    return hashlib.sha256(canonical(obj)).hexdigest()


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Layout:
    """What a cache must match to be reused: the model and settings, and every leaf."""

    fingerprint: str  # model files digest + cache settings (see Engine.cache_fingerprint)
    dtype: str  # storage dtype of growing K/V ("float16" on the CPU path)
    leaves: tuple[LeafSpec, ...]
    kv_bits: int = 0  # 8 or 4: growing K/V stored quantized (cachekinds.KVQuant); 0: not
    kv_group: int = 0
    # Token ids must be below this (the model's vocabulary; 0: unknown, MAX_TOKEN applies).
    # Not stored: the fingerprint already names the model.
    vocab: int = field(default=0, compare=False)

    @property
    def quant(self) -> KVQuant | None:
        return KVQuant(self.kv_bits, self.kv_group) if self.kv_bits else None

    @property
    def growing(self) -> list[LeafSpec]:
        return [s for s in self.leaves if s.kind == "growing"]

    @property
    def bounded(self) -> list[LeafSpec]:
        return [s for s in self.leaves if s.kind == BOUNDED]

    @property
    def has_bounded(self) -> bool:
        return any(s.kind == BOUNDED for s in self.leaves)


def file_sum(data, kind: str = "xxh3") -> int:
    """The checksum of a file's bytes (any buffer), of ``kind`` (a key of ``SUMS``)."""
    return xxh3(data) if kind == "xxh3" else zlib.crc32(data)


@dataclass(frozen=True)
class Segment:
    file: str
    start: int
    end: int
    sum: int  # the file's checksum, of kind ``sum_kind``
    nbytes: int
    sum_kind: str = "xxh3"

    def to_json(self) -> dict:
        return {"file": self.file, "start": self.start, "end": self.end,
                self.sum_kind: self.sum, "nbytes": self.nbytes}


@dataclass(frozen=True)
class Checkpoint:
    file: str
    pos: int
    sum: int  # the file's checksum, of kind ``sum_kind``
    nbytes: int
    meta: tuple[dict, ...]  # per bounded leaf: its non-array fields
    arrays: tuple[dict, ...]  # per bounded leaf: array name -> in-memory dtype
    # Not in the manifest, derived from it: the CRC-32 of the token ids before ``pos``
    # (``ids_crc``), and the layout its arrays' shapes and dtypes are checked against.
    ids: int = field(default=0, compare=False, repr=False)
    layout: Layout | None = field(default=None, compare=False, repr=False)
    sum_kind: str = "xxh3"

    def to_json(self) -> dict:
        return {"file": self.file, "pos": self.pos, self.sum_kind: self.sum,
                "nbytes": self.nbytes, "meta": list(self.meta), "arrays": list(self.arrays)}

    def entry(self) -> bytes:
        """What the checkpoint file holds as ``ENTRY``."""
        return entry_bytes(self.pos, self.meta, self.arrays, self.ids)

    def shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """Per bounded leaf, array name -> the shape it must have (needs ``layout``)."""
        return [_shapes(spec, meta) for spec, meta in zip(self.layout.bounded, self.meta)]


@dataclass(frozen=True)
class Manifest:
    layout: Layout
    tokens: list[int]
    segments: list[Segment]
    checkpoints: list[Checkpoint]

    def to_json(self) -> str:
        lay = self.layout
        body = {
            "format": FORMAT,
            "version": VERSION,
            "fingerprint": lay.fingerprint,
            "dtype": lay.dtype,
            "kv_bits": lay.kv_bits,
            "kv_group": lay.kv_group,
            "leaves": [s.to_json() for s in lay.leaves],
            "segments": [s.to_json() for s in self.segments],
            "checkpoints": [c.to_json() for c in self.checkpoints],
            "tokens": self.tokens,
        }
        return seal(body)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse and check a manifest (checksum, schema, consistency with its own layout).

        Raises:
            CacheInvalid: with the first thing found wrong.
        """
        try:
            d = json.loads(text, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            raise CacheInvalid("damaged manifest (not JSON)") from None
        if type(d) is not dict or d.get("format") != FORMAT:
            raise CacheInvalid("not a localchat cache")
        version = d.get("version")
        if version not in READS or type(version) is not int:
            shown = version if type(version) is int else "unknown"
            raise CacheInvalid(f"cache format version {shown} (this localchat reads 3 and 4)")
        if not _sealed(text):
            raise CacheInvalid("damaged manifest (checksum)")
        if d.keys() != _FIELDS:
            raise CacheInvalid("damaged manifest (fields)")
        try:
            return _parse(d, ("crc32",) if version == 3 else tuple(SUMS))
        except (ValueError, TypeError) as err:
            raise CacheInvalid(f"damaged manifest ({err})") from None

    def checkpoint_at_most(self, k: int) -> Checkpoint | None:
        """The latest checkpoint at a position ≤ k."""
        fits = [c for c in self.checkpoints if c.pos <= k]
        return max(fits, key=lambda c: c.pos) if fits else None


def entry_bytes(pos: int, meta, arrays, ids: int) -> bytes:
    """A checkpoint's position, fields, dtypes and token ids' CRC-32 as its file holds them
    (``ENTRY``)."""
    return canonical({"pos": pos, "meta": list(meta), "arrays": list(arrays), "ids": ids})


def ids_crc(tokens: list[int], crc: int = 0) -> int:
    """CRC-32 of token ids as int32 (``crc``: of the ids before them)."""
    return zlib.crc32(array("i", tokens).tobytes(), crc)


_HEAD = '{"checksum":"'


def seal(body: dict) -> str:
    """``body`` (no ``checksum``) as manifest text: its checksum first, then the rest."""
    rest = canonical(body)
    return f'{_HEAD}{hashlib.sha256(rest).hexdigest()}",{rest[1:].decode()}'


def _sealed(text: str) -> bool:
    """Whether ``text`` is ``seal``'s output: the checksum matches the bytes after it."""
    n = len(_HEAD)
    if not text.startswith(_HEAD) or text[n + 64 : n + 66] != '",':
        return False
    rest = ("{" + text[n + 66 :]).encode()
    return hashlib.sha256(rest).hexdigest() == text[n : n + 64]


def _no_constant(name: str):
    raise ValueError(f"{name} in JSON")


def _int(v, what: str, lo: int = 0, hi: int | None = None) -> int:
    """``v`` if it is an int (not a bool) in [lo, hi]; else ValueError naming ``what``."""
    if type(v) is not int or v < lo or (hi is not None and v > hi):
        raise ValueError(what)
    return v


def _parse(d: dict, sums: tuple[str, ...]) -> Manifest:
    """The manifest of a dict that passed its checksum, every field checked (``sums``: the
    checksum kinds its entries may have, one each).

    Raises ValueError naming the field that is wrong."""
    if type(d["fingerprint"]) is not str or not d["fingerprint"]:
        raise ValueError("fingerprint")
    if d["dtype"] not in DTYPES:
        raise ValueError("dtype")
    bits, group = d["kv_bits"], d["kv_group"]
    if type(bits) is not int or type(group) is not int or (bits, group) != (0, 0) and (
            bits not in (4, 8) or group not in (32, 64, 128)):
        raise ValueError("kv_bits")
    if type(d["leaves"]) is not list or not d["leaves"]:
        raise ValueError("leaves")
    leaves = tuple(LeafSpec.from_json(v) for v in d["leaves"])
    if len({s.path for s in leaves}) != len(leaves) or any(
            kind_named(s.cls) != s.kind for s in leaves):
        raise ValueError("leaves")
    layout = Layout(d["fingerprint"], d["dtype"], leaves, bits, group)

    tokens = d["tokens"]
    if type(tokens) is not list or set(map(type, tokens)) - {int} or (
            tokens and not 0 <= min(tokens) <= max(tokens) < MAX_TOKEN):
        raise ValueError("tokens")
    n = len(tokens)

    segs, pos = [], 0
    for s, kind in _entries(d["segments"], _SEGMENT, sums, "segments"):
        if _int(s["start"], "segments") != pos:
            raise ValueError("segments do not tile")
        _int(s["end"], "segments do not tile", pos + 1, n)
        segs.append(Segment(_name(s["file"], "seg"), pos, s["end"],
                            _int(s[kind], kind, 0, SUMS[kind]),
                            _int(s["nbytes"], "nbytes", 1), kind))
        pos = s["end"]
    if pos != (n if layout.growing else 0):
        raise ValueError("segments do not cover the tokens")

    ckpts, last, ids = [], 0, 0
    for c, kind in _entries(d["checkpoints"], _CHECKPOINT, sums, "checkpoints"):
        p = _int(c["pos"], "checkpoint position", last + 1, n)
        ids = ids_crc(tokens[last:p], ids)
        meta, arrays = c["meta"], c["arrays"]
        bounded = layout.bounded
        if type(meta) is not list or type(arrays) is not list or \
                not len(meta) == len(arrays) == len(bounded) or not bounded:
            raise ValueError("checkpoint leaves")
        for spec, m, a in zip(bounded, meta, arrays):
            _check_state(spec, m, a, p, layout.dtype)
        ckpts.append(Checkpoint(_name(c["file"], "ckpt"), p, _int(c[kind], kind, 0, SUMS[kind]),
                                _int(c["nbytes"], "nbytes", 1), tuple(meta), tuple(arrays),
                                ids, layout, kind))
        last = p
    files = [s.file for s in segs] + [c.file for c in ckpts]
    if len(set(files)) != len(files):
        raise ValueError("a file named twice")
    return Manifest(layout, tokens, segs, ckpts)


def _entries(v, keys: set[str], sums: tuple[str, ...], what: str) -> list[tuple[dict, str]]:
    """Each entry of the list ``v`` with its checksum kind: its keys must be ``keys`` and
    one of ``sums``."""
    if type(v) is not list or not all(type(e) is dict for e in v):
        raise ValueError(what)
    out = []
    for e in v:
        kind = next((k for k in sums if e.keys() == keys | {k}), None)
        if kind is None:
            raise ValueError(what)
        out.append((e, kind))
    return out


def _name(v, prefix: str) -> str:
    """A file name as commit writes it: plain, no separator, no '..'."""
    if type(v) is not str or not _NAME[prefix].fullmatch(v):
        raise ValueError(f"{prefix} file name")
    return v


def _check_state(spec: LeafSpec, meta, arrays, pos: int, dtype: str) -> None:
    """One bounded leaf's checkpoint fields, as ``kvcache.kinds.capture`` writes them at ``pos``.

    Raises ValueError."""
    why = f"checkpoint of leaf {spec.path}"
    if type(meta) is not dict or meta.keys() != _META.get(spec.cls, {None}):
        raise ValueError(why)
    m = {k: _int(v, why) for k, v in meta.items()}
    if spec.cls == "RotatingKVCache":
        # Until the window fills, it writes at the end (idx == offset); after, anywhere in it.
        size = m["max_size"]
        if m["offset"] != pos or size != spec.window or m["keep"] != spec.keep or \
                not (m["idx"] == pos if pos < size else spec.keep <= m["idx"] <= size):
            raise ValueError(why)
    elif spec.cls == "ChunkedKVCache":
        if m["offset"] != pos or m["chunk_size"] != spec.window or \
                not 0 <= pos - m["start_position"] <= spec.window:
            raise ValueError(why)
    elif m["size"] != len(spec.state):
        raise ValueError(why)
    if type(arrays) is not dict or arrays.keys() != _shapes(spec, m).keys():
        raise ValueError(why)
    for name, kind in arrays.items():
        # K/V are stored in the layout's dtype; float32 in memory where that is float16.
        ok = (dtype, "float32") if name in ("keys", "values") and dtype == "float16" else \
            (dtype,) if name in ("keys", "values") else DTYPES
        if kind not in ok:
            raise ValueError(why)


def _shapes(spec: LeafSpec, meta: dict) -> dict[str, tuple[int, ...]]:
    """Array name -> shape of a bounded leaf's state (batch 1), from its layout and fields."""
    if spec.cls == "ArraysCache":
        return {str(i): s for i, s in enumerate(spec.state) if s}
    if spec.cls == "RotatingKVCache":
        n = min(meta["offset"], meta["max_size"])
    else:  # ChunkedKVCache: positions [start_position, offset)
        n = meta["offset"] - meta["start_position"]
    return {"keys": (1, spec.k_shape[0], n, spec.k_shape[1]),
            "values": (1, spec.v_shape[0], n, spec.v_shape[1])}


@dataclass(frozen=True)
class _Stored:
    array: object  # numpy view of the file's bytes
    dtype_name: str
    shape: tuple


# safetensors dtype -> (our dtype name, numpy dtype to read it as). numpy has no bfloat16:
# its bits are read as uint16 and viewed as bfloat16 once in MLX.
_ST_DTYPES = {"F16": ("float16", "float16"), "F32": ("float32", "float32"),
              "BF16": ("bfloat16", "uint16"), "U32": ("uint32", "uint32"),
              "I32": ("int32", "int32"), "U8": ("uint8", "uint8")}


def read_safetensors(data: bytes, name: str) -> dict[str, _Stored]:
    """Every tensor of a safetensors file's bytes as a numpy view (no second read).

    Raises ``CacheInvalid`` unless the header describes tensors that lie inside the data."""
    import struct

    import numpy as np

    try:
        (hlen,) = struct.unpack("<Q", data[:8])
        if hlen > len(data) - 8:
            raise ValueError
        header = json.loads(data[8 : 8 + hlen])
        body = len(data) - 8 - hlen
        out = {}
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            ours, np_dtype = _ST_DTYPES[meta["dtype"]]
            start, end = meta["data_offsets"]
            shape = tuple(_int(x, "shape") for x in meta["shape"])
            if not 0 <= _int(start, "offset") <= _int(end, "offset") <= body or \
                    end - start != int(np.prod(shape)) * np.dtype(np_dtype).itemsize:
                raise ValueError
            arr = np.frombuffer(data, dtype=np_dtype, count=int(np.prod(shape)),
                                offset=8 + hlen + start).reshape(shape)
            out[key] = _Stored(arr, ours, shape)
        return out
    except (ValueError, KeyError, TypeError, AttributeError, struct.error):
        raise CacheInvalid(f"{name} unreadable") from None


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
