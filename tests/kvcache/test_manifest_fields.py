"""A damaged manifest never changes a reply: every field of it, changed one at a time.

For a growing-only model (llama: KVCache), a sliding-window one (gemma3_text: RotatingKVCache
and KVCache) and a hybrid one (qwen3_next: ArraysCache and KVCache), three turns are stored;
then every node of the manifest's JSON (every key, every list element and its every key, a
sample of the token ids, the checksum) is changed one at a time: a digit, +1 / -1, another
type, removed, emptied, a path instead of a file name. Each change runs the fourth turn from
a copy of the cache folder, in two modes:

- ``damaged``: the checksum left as it was (what one flipped digit on disk does);
- ``resealed``: the checksum made right again (what a buggy writer would produce): the field
  checks themselves must catch it, or the cache must still be right.

Every case must give the reply that the same turn gives with ``--no-cache`` on the same copy
(a full prefill of the very token ids the turn renders). Unless the change is to the token ids
alone (the conversation's own record of its tokenization, which ``--no-cache`` renders with
too), that reply must be the undamaged conversation's, or the turn must say "cache rebuilt" /
"cache partly rebuilt". The cache the turn leaves must load whole. Counts per model and mode
are printed (``pytest -s``) as one JSON line each.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from families import build_family
from hypothesis import given, settings
from hypothesis import strategies as st
from twins import run_turn

from localchat.kvcache.folder import CacheFolder, CacheInvalid
from localchat.kvcache.format import MANIFEST, canonical, file_sum, seal
from localchat.model.engine import Engine
from localchat.session.session import Session
from localchat.store.database import Store

HISTORY = ["Hello there, how are you today? Tell me about Seoul.",
           "What is the capital of France?", "And Korea? 안녕하세요"]
NEXT = "Thanks, tell me more about caches please."
MODELS = ["llama", "gemma3_text", "qwen3_next"]
REBUILT = ("cache rebuilt", "cache partly rebuilt")


@dataclass
class World:
    """One model's stored conversation, its pristine cache folder and reference replies."""

    engine: Engine
    store: Store
    home: Path
    conv: object
    next_seq: int  # seq of the message the case's turn adds first
    pristine: Path  # a copy of the cache folder after the history
    body: dict  # the pristine manifest without its checksum
    checksum: str
    ok: tuple  # --no-cache reply of the undamaged copy
    fresh: tuple  # --no-cache reply with no token list at all (what a rejected manifest gives)

    @property
    def folder(self) -> Path:
        return self.home / "kv" / str(self.conv.id)

    def session(self) -> Session:
        return Session(self.store, self.engine, self.home / "kv", self.home / "locks")

    def no_cache(self, manifest: str | None) -> tuple:
        """The next turn's reply on a twin holding ``manifest`` (None: none), fully prefilled."""
        twin = self.store.create(f"twin-{len(self.store.list())}", self.conv.model)
        for m in self.store.messages(self.conv):
            self.store.add_message(twin, m.role, m.content, m.partial)
        folder = self.home / "kv" / str(twin.id)
        if manifest is not None:
            folder.mkdir(parents=True)
            (folder / MANIFEST).write_text(manifest)
        done, _ = run_turn(self.session(), twin, NEXT, max_tokens=8, no_cache=True)
        self.store.delete(twin)
        shutil.rmtree(folder, ignore_errors=True)  # no donor for the cases' rebuilds
        return done.tokens


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    made: dict[str, World] = {}
    patch = pytest.MonkeyPatch()

    def get(name: str) -> World:
        if name in made:
            return made[name]
        home = tmp_path_factory.mktemp(f"home-{name}")
        patch.setenv("LOCALCHAT_HOME", str(home))
        engine = Engine.load(str(build_family(name, tmp_path_factory.mktemp(name) / name)))
        store = Store.open(home / "localchat.db")
        conv = store.create("c", engine.ref.name)
        w = World(engine, store, home, conv, 0, home / "pristine", {}, "", (), ())
        for prompt in HISTORY:
            run_turn(w.session(), conv, prompt, max_tokens=12)
        w.next_seq = len(store.messages(conv)) + 1
        shutil.copytree(w.folder, w.pristine)
        text = (w.folder / MANIFEST).read_text()
        w.body = json.loads(text)
        w.checksum = w.body.pop("checksum")
        w.ok, w.fresh = w.no_cache(text), w.no_cache(None)
        assert len(w.ok) >= 4  # an EOS-only reply would prove nothing
        made[name] = w
        return w

    yield get
    for w in made.values():
        w.store.close()
    patch.undo()


# -- the changes ----------------------------------------------------------------------------

_GONE = object()  # a removed key


def variants(path: tuple, v, files: list[str]) -> list[tuple[str, object]]:
    """A handful of changes of one JSON value: (label, new value or _GONE). ``files``: the
    manifest's file names (a file field may point at another of them)."""
    out: list[tuple[str, object]] = []
    if path and isinstance(path[-1], str):
        out.append(("removed", _GONE))
    if type(v) is int:
        digit = int(str(v)[:-1] + str((v % 10 + 5) % 10))
        out += [("+1", v + 1), ("-1", v - 1), ("float", float(v)), ("bool", v == 0)]
        out += [("digit", digit)] if digit not in (v, v + 1, v - 1) else []
        out += [("past the vocabulary", 10**6), ("past int32", 2**31)] \
            if path[0] == "tokens" else [("str", str(v))]
    elif type(v) is str:
        out += [("char", v[:-1] + chr(ord(v[-1]) ^ 1) if v else "x"), ("int", 0)]
        if path[-1] == "file":
            out += [("parent", f"../{v}"), ("absolute", f"/tmp/{v}"), ("subfolder", f"x/{v}")]
            out += [("another file", f) for f in files[:1] if f != v]
        else:
            out.append(("emptied", ""))
    elif type(v) is list:
        out += [("emptied", []), ("object", {})]
        if v:
            out += [("last dropped", v[:-1]), ("last twice", v + v[-1:])]
    elif type(v) is dict:
        out += [("emptied", {}), ("extra key", {**v, "extra": 0}), ("list", [])]
    return out


def nodes(v, sample: list[int], path: tuple = ()):
    """Every (path, value) of a JSON value; of the token ids, those at ``sample``."""
    if path:
        yield path, v
    if type(v) is dict:
        for k, x in v.items():
            yield from nodes(x, sample, path + (k,))
    elif type(v) is list:
        for i in sample if path == ("tokens",) else range(len(v)):
            yield from nodes(v[i], sample, path + (i,))


def token_sample(body: dict) -> list[int]:
    """The ends, the middle, and each side of every segment's and checkpoint's boundary."""
    n = len(body["tokens"])
    at = {0, 1, n // 2, n - 2, n - 1}
    for s in body["segments"]:
        at |= {s["start"], s["end"] - 1}
    for c in body["checkpoints"]:
        at |= {c["pos"] - 1, min(c["pos"], n - 1)}
    return sorted(i for i in at if 0 <= i < n)


def changed(body: dict, path: tuple, new) -> dict:
    out = copy.deepcopy(body)
    node = out
    for key in path[:-1]:
        node = node[key]
    if new is _GONE:
        del node[path[-1]]
    else:
        node[path[-1]] = new
    return out


def stale(body: dict, checksum: str) -> str:
    """``body`` written as ``seal`` writes it, but with ``checksum`` (an old one)."""
    return f'{{"checksum":"{checksum}",{canonical(body)[1:].decode()}'


def cases(w: World):
    """(mode, path, label, manifest text) of every change."""
    whole, old = seal(w.body), w.checksum
    for label, text in [("empty file", ""), ("null", "null"), ("list", "[]"),
                        ("half", whole[: len(whole) // 2]),
                        ("no checksum", canonical(w.body).decode()),
                        ("checksum char", stale(w.body, old[:-1] + chr(ord(old[-1]) ^ 1)))]:
        yield "damaged", ("file",), label, text
    files = [e["file"] for e in w.body["segments"] + w.body["checkpoints"]]
    for path, v in nodes(w.body, token_sample(w.body)):
        for label, new in variants(path, v, files):
            body = changed(w.body, path, new)
            if body != w.body:
                yield "damaged", path, label, stale(body, w.checksum)
                yield "resealed", path, label, seal(body)


# -- one case --------------------------------------------------------------------------------


def run_case(w: World, text: str, turn: bool) -> tuple[str, tuple | None, tuple, list[str]]:
    """(how the cache took it, the reply, the expected reply, notices) of the next turn from
    the pristine folder with ``text`` as its manifest; then the conversation as it was.

    ``turn``: run the turn even when reading the manifest rejects it (that turn is then a
    rebuild from nothing, the same for every such case; see the test)."""
    shutil.rmtree(w.folder)
    shutil.copytree(w.pristine, w.folder)
    (w.folder / MANIFEST).write_text(text)
    layout = w.engine.layout()
    try:
        man = CacheFolder(w.folder).checked_manifest(layout)
    except CacheInvalid as err:
        man, why = None, str(err)
        assert why and "\n" not in why and len(why) < 80
        if not turn:
            return f"rejected: {why}", None, w.fresh, []
    if man is None:
        expected = w.fresh
    elif man.tokens == w.body["tokens"]:
        expected = w.ok
    else:  # other token ids: --no-cache renders the conversation with them too
        expected = w.no_cache(text)
    done, notices = run_turn(w.session(), w.conv, NEXT, max_tokens=8)
    rebuilt = [n for n in notices if n.startswith(REBUILT)]
    how = f"rejected: {why}" if man is None else "notice at load" if rebuilt else "used"
    if man is None:
        assert rebuilt == [f"cache rebuilt: {why}"]
    # The cache it leaves is whole: a valid manifest, every file loads, no stray file.
    kv = CacheFolder(w.folder)
    left = kv.checked_manifest(layout)
    assert left is not None and len(left.tokens) > len(w.body["tokens"]) // 2
    kv.load_growing(left, len(left.tokens))
    for c in left.checkpoints:
        kv.load_checkpoint(c)
    assert {p.name for p in w.folder.iterdir()} == {MANIFEST} | {
        s.file for s in left.segments} | {c.file for c in left.checkpoints}
    w.store.delete_messages_from(w.conv, w.next_seq)
    return how, done.tokens, expected, notices


@pytest.mark.parametrize("family", MODELS)
def test_every_manifest_field_changed_never_changes_a_reply(worlds, family):
    """Every case whose manifest is read as valid runs the turn. A manifest that reading
    rejects makes the turn a rebuild from nothing (``cache rebuilt: REASON``, then the reply
    of a conversation with no cache): that turn runs for the first change of every field
    (resealed) and for one change in ten (damaged); the rest check the rejection only."""
    w = worlds(family)
    # Token ids past the vocabulary would reach the model (garbage, or a crash for large ids).
    assert w.engine.layout().vocab == 498, "Engine.layout must say the model's vocabulary"
    counts: Counter = Counter()
    wrong, seen, damaged = [], set(), 0
    for mode, path, label, text in cases(w):
        turn = (mode, path) not in seen if mode == "resealed" else damaged % 10 == 0
        seen.add((mode, path))
        damaged += mode == "damaged"
        how, reply, expected, notices = run_case(w, text, turn)
        if mode == "damaged" and how not in (
                "rejected: damaged manifest (checksum)", "rejected: damaged manifest (not JSON)",
                "rejected: not a localchat cache") and "version" not in how:
            wrong.append((mode, path, label, how, notices))
        tokens_only = path[0] == "tokens" and not how.startswith("rejected")
        if reply is not None and reply != expected:
            wrong.append((mode, path, label, how, notices))
        elif reply is not None and reply != w.ok and not tokens_only and not any(
                n.startswith(REBUILT) for n in notices):
            wrong.append((mode, path, label, "silent", notices))
        outcome = ("rejected at read" + (", turn run" if reply else "")
                   if how.startswith("rejected") else how if how != "used" else
                   "equal reply" if reply == w.ok else "equal to --no-cache, same token ids")
        counts[f"{mode}: {outcome}"] += 1
    print(json.dumps({"model": family, "cases": sum(counts.values()), **counts}))
    assert wrong == []


# -- negative controls ----------------------------------------------------------------------


def negated(data: bytes, skip: str = "entry") -> bytes:
    """A safetensors file's bytes with every float negated (sign bits flipped), its header and
    ``skip`` tensor as they were."""
    hlen = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + hlen])
    out = bytearray(data)
    for name, meta in header.items():
        if name in ("__metadata__", skip) or meta["dtype"] not in ("F16", "F32", "BF16"):
            continue
        width = 4 if meta["dtype"] == "F32" else 2
        start, end = (8 + hlen + x for x in meta["data_offsets"])
        for i in range(start + width - 1, end, width):
            out[i] ^= 0x80
    return bytes(out)


@pytest.mark.parametrize("family", MODELS)
def test_negative_control_a_forged_state_changes_the_reply(worlds, family):
    """The comparison can tell replies apart: K/V or recurrent state negated behind every
    check (its checksum in a resealed manifest) is used without a notice and changes the reply."""
    w = worlds(family)
    body = copy.deepcopy(w.body)
    entries = body["checkpoints"] or body["segments"]
    entry = entries[-1]
    data = negated((w.pristine / entry["file"]).read_bytes())
    shutil.rmtree(w.folder)
    shutil.copytree(w.pristine, w.folder)
    (w.folder / entry["file"]).write_bytes(data)
    entry["xxh3"] = file_sum(data)
    (w.folder / MANIFEST).write_text(seal(body))
    done, notices = run_turn(w.session(), w.conv, NEXT, max_tokens=8)
    w.store.delete_messages_from(w.conv, w.next_seq)
    assert notices == [] and done.usage.cached_tokens > 0  # it was used
    assert done.tokens != w.ok and len(w.ok) >= 4


# -- the reader alone: any value in any field ------------------------------------------------


def synthetic() -> dict:
    """A valid manifest body of a sliding window, a recurrent state and a global layer."""
    from localchat.kvcache.format import Checkpoint, Layout, Manifest, Segment
    from localchat.kvcache.kinds import LeafSpec

    leaves = (LeafSpec("0", "RotatingKVCache", "bounded", (2, 16), (2, 16), 16),
              LeafSpec("1", "ArraysCache", "bounded", state=((1, 3, 96), (1, 2, 16, 16))),
              LeafSpec("2", "KVCache", "growing", (2, 16), (2, 16)))
    layout = Layout("f" * 32 + "-float16", "float16", leaves)
    ckpts = [Checkpoint(f"ckpt-00000{i + 1}.safetensors", p, 7, 99, (
        {"offset": p, "keep": 0, "max_size": 16, "idx": min(p, 16)}, {"size": 2}), (
        {"keys": "float32", "values": "float32"}, {"0": "float32", "1": "float32"}))
        for i, p in enumerate((12, 40))]
    segs = [Segment("seg-000001.safetensors", 0, 25, 5, 100),
            Segment("seg-000002.safetensors", 25, 40, 6, 80)]
    man = Manifest(layout, list(range(3, 43)), segs, ckpts)
    body = json.loads(man.to_json())
    del body["checksum"]
    return body


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats()
                    | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_any_value_in_any_field_is_read_or_refused_in_one_line(data):
    from localchat.kvcache.format import Manifest

    body = synthetic()
    assert Manifest.from_json(seal(body)).tokens == body["tokens"]  # the control
    spots = list(nodes(body, list(range(len(body["tokens"])))))
    path, _ = data.draw(st.sampled_from(spots))
    new = data.draw(JSON | st.just(_GONE) if isinstance(path[-1], str) else JSON)
    try:
        man = Manifest.from_json(seal(changed(body, path, new)))
    except CacheInvalid as err:
        assert str(err) and "\n" not in str(err) and len(str(err)) < 80
        return
    names = [s.file for s in man.segments] + [c.file for c in man.checkpoints]
    assert all("/" not in f and ".." not in f for f in names)
    assert all(type(t) is int and 0 <= t < 2**31 for t in man.tokens)


@pytest.mark.parametrize("name", ["../seg-000001.safetensors", "/etc/passwd", "x/y",
                                  "seg-000001.safetensors/..", "manifest.json", "",
                                  "seg-1.safetensors", ".tmp-seg-000001.safetensors"])
def test_a_file_name_is_a_plain_name_in_the_folder(name):
    from localchat.kvcache.format import Manifest

    body = synthetic()
    body["segments"][1]["file"] = name
    with pytest.raises(CacheInvalid, match="damaged manifest"):
        Manifest.from_json(seal(body))


def test_token_ids_past_the_vocabulary_and_old_versions_are_refused(tmp_path):
    import dataclasses

    from localchat.kvcache.format import Manifest

    body = synthetic()
    kv = CacheFolder(tmp_path)
    (tmp_path / MANIFEST).write_text(seal(body))
    layout = kv.manifest().layout
    assert kv.checked_manifest(dataclasses.replace(layout, vocab=43)) is not None
    with pytest.raises(CacheInvalid, match="vocabulary"):
        kv.checked_manifest(dataclasses.replace(layout, vocab=42))
    old = {k: v for k, v in body.items()}
    old["version"] = 2
    with pytest.raises(CacheInvalid,
                       match=r"^cache format version 2 \(this localchat reads 3 and 4\)$"):
        Manifest.from_json(seal(old))


def test_each_file_has_one_checksum_of_a_kind_its_version_knows():
    """Version 4 entries carry ``xxh3`` or (kept from version 3) ``crc32``, one of them;
    version 3 entries only ``crc32``; a value past its kind's range is refused."""
    from localchat.kvcache.format import Manifest

    def with_sums(version: int, sums: dict[str, object]) -> str:
        body = synthetic()
        body["version"] = version
        for e in body["segments"] + body["checkpoints"]:
            del e["xxh3"]
            e.update(sums)
        return seal(body)

    man = Manifest.from_json(seal(synthetic()))
    assert {(e.sum_kind, e.sum) for e in man.segments} == {("xxh3", 5), ("xxh3", 6)}
    for version, sums, ok in [(4, {"xxh3": 2**64 - 1}, True), (4, {"crc32": 2**32 - 1}, True),
                              (3, {"crc32": 7}, True), (3, {"xxh3": 7}, False),
                              (4, {"xxh3": 7, "crc32": 7}, False), (4, {}, False),
                              (4, {"crc32": 2**32}, False), (4, {"xxh3": 2**64}, False),
                              (4, {"xxh3": -1}, False), (4, {"xxh3": 7.0}, False)]:
        if ok:
            got = Manifest.from_json(with_sums(version, sums))
            (kind, value), = sums.items()
            assert all((e.sum_kind, e.sum) == (kind, value)
                       for e in got.segments + got.checkpoints)
            # Written back, each entry keeps its own kind (a version-3 file is never rehashed).
            again = json.loads(got.to_json())
            assert again["version"] == 4 and again["segments"][0][kind] == value
        else:
            with pytest.raises(CacheInvalid, match="damaged manifest"):
                Manifest.from_json(with_sums(version, sums))
