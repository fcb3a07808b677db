"""The KV cache's on-disk format (version 2): what a manifest holds, how it is read and
checked, and the safetensors reader. ``kvstore.py`` writes and reads conversation folders in
this format (its docstring describes the folder); this module does no I/O of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .cachekinds import KVQuant, LeafSpec

FORMAT = "localchat-kv"
VERSION = 2
MANIFEST = "manifest.json"


class CacheInvalid(Exception):
    """The stored cache cannot be used; ``str()`` is the reason shown to the user.

    ``usable``: how many leading positions are still sound (a damaged segment spoils only
    its own positions and what follows; 0 when nothing can be trusted)."""

    def __init__(self, reason: str, usable: int = 0):
        super().__init__(reason)
        self.usable = usable


@dataclass(frozen=True)
class Layout:
    """What a cache must match to be reused: the model and settings, and every leaf."""

    fingerprint: str  # model files digest + cache settings (see Engine.cache_fingerprint)
    dtype: str  # storage dtype of growing K/V ("float16" on the CPU path)
    leaves: tuple[LeafSpec, ...]
    kv_bits: int = 0  # 8 or 4: growing K/V stored quantized (cachekinds.KVQuant); 0: not
    kv_group: int = 0

    @property
    def quant(self) -> KVQuant | None:
        return KVQuant(self.kv_bits, self.kv_group) if self.kv_bits else None

    @property
    def growing(self) -> list[LeafSpec]:
        return [s for s in self.leaves if s.kind == "growing"]

    @property
    def has_bounded(self) -> bool:
        return any(s.kind == "bounded" for s in self.leaves)


@dataclass(frozen=True)
class Segment:
    file: str
    start: int
    end: int
    crc32: int
    nbytes: int


@dataclass(frozen=True)
class Checkpoint:
    file: str
    pos: int
    crc32: int
    nbytes: int
    meta: tuple[dict, ...]  # per bounded leaf: its non-array fields
    arrays: tuple[dict, ...]  # per bounded leaf: array name -> in-memory dtype

    def to_json(self) -> dict:
        return {"file": self.file, "pos": self.pos, "crc32": self.crc32, "nbytes": self.nbytes,
                "meta": list(self.meta), "arrays": list(self.arrays)}

    @classmethod
    def from_json(cls, d: dict) -> Checkpoint:
        return cls(str(d["file"]), int(d["pos"]), int(d["crc32"]), int(d["nbytes"]),
                   tuple(dict(m) for m in d["meta"]), tuple(dict(a) for a in d["arrays"]))


@dataclass(frozen=True)
class Manifest:
    layout: Layout
    tokens: list[int]
    segments: list[Segment]
    checkpoints: list[Checkpoint]

    def to_json(self) -> str:
        lay = self.layout
        return json.dumps({
            "format": FORMAT,
            "version": VERSION,
            "fingerprint": lay.fingerprint,
            "dtype": lay.dtype,
            "kv_bits": lay.kv_bits,
            "kv_group": lay.kv_group,
            "leaves": [s.to_json() for s in lay.leaves],
            "segments": [s.__dict__ for s in self.segments],
            "checkpoints": [c.to_json() for c in self.checkpoints],
            "tokens": self.tokens,
        })

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            d = json.loads(text)
            if d.get("format") != FORMAT:
                raise CacheInvalid("not a localchat cache")
            if d.get("version") != VERSION:
                raise CacheInvalid(f"cache format version {d.get('version')} is not {VERSION}")
            layout = Layout(str(d["fingerprint"]), str(d["dtype"]),
                            tuple(LeafSpec.from_json(v) for v in d["leaves"]),
                            int(d["kv_bits"]), int(d["kv_group"]))
            segs = [Segment(**s) for s in d["segments"]]
            ckpts = [Checkpoint.from_json(c) for c in d["checkpoints"]]
            tokens = [int(t) for t in d["tokens"]]
        except CacheInvalid:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CacheInvalid(f"damaged manifest ({type(err).__name__})") from None
        pos = 0
        for s in segs:
            if s.start != pos or s.end <= s.start:
                raise CacheInvalid("damaged manifest (segments do not tile)")
            pos = s.end
        if layout.growing and pos != len(tokens):
            raise CacheInvalid("damaged manifest (token count differs from segments)")
        if any(not 0 < c.pos <= len(tokens) for c in ckpts):
            raise CacheInvalid("damaged manifest (checkpoint past the tokens)")
        return cls(layout, tokens, segs, ckpts)

    def checkpoint_at_most(self, k: int) -> Checkpoint | None:
        """The latest checkpoint at a position ≤ k."""
        fits = [c for c in self.checkpoints if c.pos <= k]
        return max(fits, key=lambda c: c.pos) if fits else None


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
    """Every tensor of a safetensors file's bytes as a numpy view (no second read)."""
    import struct

    import numpy as np

    try:
        (hlen,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + hlen])
        out = {}
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            ours, np_dtype = _ST_DTYPES[meta["dtype"]]
            start, end = meta["data_offsets"]
            shape = tuple(meta["shape"])
            arr = np.frombuffer(data, dtype=np_dtype, count=(end - start) // np.dtype(
                np_dtype).itemsize, offset=8 + hlen + start).reshape(shape)
            out[key] = _Stored(arr, ours, shape)
        return out
    except (ValueError, KeyError, TypeError, struct.error):
        raise CacheInvalid(f"{name} unreadable") from None


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
