"""The core guarantee: a turn resumed from the disk cache decodes exactly like a full prefill."""

import json

from twins import full_prefill, run_turn

from localchat import paths
from localchat.kvcache.folder import common_prefix
from localchat.session.session import Session, TurnOptions


def run(session, conv, prompt, **kw):
    return run_turn(session, conv, prompt, **kw)


def restart(store, engine):
    """A new Session: nothing in memory, the cache must come from disk."""
    return Session(store, engine, paths.kv_root(), paths.locks_dir())


def full_prefill_reply(store, engine, conv, prompt, messages=None, **kw):
    """The same turn on a twin of ``conv`` (its messages or ``messages``), uncached."""
    return full_prefill(store, engine, conv, prompt, messages, **kw)


def test_resume_from_disk_equals_full_prefill(store, engine, session):
    conv = store.create("trip", engine.ref.name)
    first, _ = run(session, conv, "Hello, how are you today?")
    second, _ = run(session, conv, "What is the capital of France?")
    assert second.usage.cached_tokens >= first.usage.prompt_tokens

    stored = session.cache_folder(conv).manifest().tokens
    assert len(stored) == second.usage.context_tokens
    history = [{"role": m.role, "content": m.content} for m in store.messages(conv)]
    new = [{"role": "user", "content": "안녕하세요. 서울은 어때요?"}]
    rendered = engine.render(history + new, prior=stored)
    canonical = engine.render(history + new)
    resumed, notes = run(restart(store, engine), conv, "안녕하세요. 서울은 어때요?")
    assert notes == []
    u = resumed.usage
    assert u.prompt_tokens == u.cached_tokens + u.prefilled_tokens == len(rendered)
    # The whole stored cache is reused: the replies' generated ids are kept even where their
    # text would tokenize differently (random weights emit such pieces; real models too).
    assert u.cached_tokens == len(stored) and u.miss_reason == ""
    assert rendered[: len(stored)] == stored and common_prefix(canonical, stored) < len(stored)
    before = store.messages(conv)[:-2]
    reference = full_prefill_reply(store, engine, conv, "안녕하세요. 서울은 어때요?", before)
    assert reference.usage.cached_tokens == 0 and len(resumed.tokens) == 12
    assert resumed.tokens == reference.tokens
    assert resumed.reply == reference.reply


def test_second_turn_prefills_only_the_new_message(store, engine, session):
    conv = store.create("short", engine.ref.name)
    run(session, conv, "Hello")
    # A reply that round-trips through the tokenizer, as a real model's does.
    msgs = store.messages(conv)
    store.db.execute("UPDATE messages SET content = ? WHERE id = ?", ("Paris.", msgs[-1].id))
    run(restart(store, engine), conv, "What is the capital of France?")  # re-aligns the cache
    second, _ = run(restart(store, engine), conv, "Paris?", max_tokens=1)
    store.db.execute("UPDATE messages SET content = ? WHERE id = ?",
                     ("Seoul.", store.messages(conv)[-1].id))
    third, _ = run(restart(store, engine), conv, "Korea?")
    new_msg = engine.encode(
        "<|im_end|>\n<|im_start|>user\nKorea?<|im_end|>\n<|im_start|>assistant\n")
    # max_tokens=1: the single reply token was not fed, so it is prefilled with the message.
    assert third.usage.cached_tokens == second.usage.prompt_tokens
    assert third.usage.prefilled_tokens == len(engine.encode("Seoul.")) + len(new_msg)


def test_edit_trims_the_cache_and_matches_full_prefill(store, engine, session):
    conv = store.create("edit", engine.ref.name)
    first, _ = run(session, conv, "The capital of France is")
    run(session, conv, "And Korea?")
    last_user = [m for m in store.messages(conv) if m.role == "user"][-1]
    events = list(restart(store, engine).edit_last(conv, "And Seoul?", TurnOptions(12)))
    edited = events[-1]
    assert edited.usage.miss_reason == "edited"
    # Everything before the edited message is reused (the first turn's prompt and reply).
    assert edited.usage.cached_tokens >= first.usage.context_tokens
    assert [m.content for m in store.messages(conv)][-2] == "And Seoul?"
    store.delete_messages_from(conv, last_user.seq)
    reference = full_prefill_reply(store, engine, conv, "And Seoul?")
    assert len(reference.tokens) >= 4 and edited.tokens == reference.tokens


def test_retokenized_reply_is_absorbed_by_the_prefix_match(store, engine, session):
    conv = store.create("retok", engine.ref.name)
    run(session, conv, "Hello, how are you today?")
    # Rewrite the stored reply so that it re-renders to different tokens than were generated.
    msgs = store.messages(conv)
    store.db.execute("UPDATE messages SET content = ? WHERE id = ?",
                     (msgs[-1].content + " (edited)", msgs[-1].id))
    resumed, _ = run(restart(store, engine), conv, "Thank you.")
    assert 0 < resumed.usage.cached_tokens < resumed.usage.prompt_tokens
    store.delete_messages_from(conv, msgs[-1].seq + 1)
    reference = full_prefill_reply(store, engine, conv, "Thank you.")
    assert resumed.tokens == reference.tokens


def _files(folder):
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.name != "manifest.json"}


def test_a_turn_leaves_bytes_on_disk_untouched(store, engine, session):
    conv = store.create("append", engine.ref.name)
    # max_tokens=1: the one reply token is not fed, so the cache is a prefix of the next
    # rendering whatever the random model says (its replies may not re-tokenize the same).
    run(session, conv, "Hello", max_tokens=1)
    folder = session.cache_folder(conv).folder
    before = _files(folder)
    run(restart(store, engine), conv, "Tell me more about caches.")
    after = _files(folder)
    assert before and all(after[name] == data for name, data in before.items())
    assert len(after) == len(before) + 1


def test_disk_size_is_close_to_theory(store, engine, session):
    conv = store.create("size", engine.ref.name)
    run(session, conv, "Hello, how are you today? " * 8, max_tokens=20)
    run(session, conv, "Let us talk about caches. " * 8, max_tokens=20)
    man = session.cache_folder(conv).manifest()
    per_token = engine.info().kv_bytes_per_token
    kv_bytes = sum(s.nbytes for s in man.segments)
    assert kv_bytes <= 1.05 * len(man.tokens) * per_token + 512 * len(man.segments)


def _corrupt_manifest_fingerprint(folder):
    """Another model's manifest: its checksum is right (kvformat.seal)."""
    from localchat.kvcache.format import seal

    man = json.loads((folder / "manifest.json").read_text())
    del man["checksum"]
    man["fingerprint"] = "0" * 32 + "-float32-kv0"
    (folder / "manifest.json").write_text(seal(man))


def _flip_a_byte(folder):
    seg = sorted(folder.glob("seg-*.safetensors"))[0]
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF
    seg.write_bytes(bytes(data))


def test_damaged_cache_is_rebuilt_with_the_same_reply(store, engine, session):
    for damage, reason in [(_corrupt_manifest_fingerprint, "model changed"),
                           (_flip_a_byte, "checksum")]:
        conv = store.create(f"damaged-{reason}", engine.ref.name)
        run(session, conv, "Hello")
        damage(session.cache_folder(conv).folder)
        rebuilt, notes = run(restart(store, engine), conv, "What is the capital of Korea?")
        assert len(notes) == 1 and notes[0].startswith("cache rebuilt") and reason in notes[0]
        assert rebuilt.usage.cached_tokens == 0
        store.delete_messages_from(conv, store.messages(conv)[-2].seq)
        reference = full_prefill_reply(store, engine, conv, "What is the capital of Korea?")
        assert rebuilt.tokens == reference.tokens
        # The rebuilt cache is good again: the next turn hits it.
        again, notes = run(restart(store, engine), conv, "Thanks")
        assert notes == [] and again.usage.cached_tokens > 0


def test_negative_controls_the_equivalence_tests_can_fail(store, engine, session):
    """The tiny model's greedy reply depends on its context, so "equals a full prefill" is
    a real check: two histories give two replies, and a cache with wrong K/V (damage that
    slips past the checksums because we fix them up) gives another reply."""
    from localchat.kvcache.format import file_sum, seal

    a, b = store.create("ctl-a", engine.ref.name), store.create("ctl-b", engine.ref.name)
    run(session, a, "Hello, how are you today?")
    run(session, b, "The capital of France is Paris.")
    ra, _ = run(restart(store, engine), a, "Tell me more.")
    rb, _ = run(restart(store, engine), b, "Tell me more.")
    assert len(ra.tokens) >= 8 and len(rb.tokens) >= 8 and ra.tokens != rb.tokens

    conv = store.create("ctl-damaged", engine.ref.name)
    run(session, conv, "Hello, how are you today?")
    before = store.messages(conv)
    folder = session.cache_folder(conv).folder
    man = json.loads((folder / "manifest.json").read_text())
    seg = folder / man["segments"][0]["file"]
    data = bytearray(seg.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    ids = json.loads(data[8:header])["tokens"]["data_offsets"]  # the token ids stay right
    for i in range(header, len(data), 7):  # scramble the stored K/V, keep the header valid
        if not ids[0] <= i - header < ids[1]:
            data[i] ^= 0x5A
    seg.write_bytes(bytes(data))
    man["segments"][0]["xxh3"] = file_sum(bytes(data))
    del man["checksum"]
    (folder / "manifest.json").write_text(seal(man))
    wrong, notes = run(restart(store, engine), conv, "Tell me more.")
    assert notes == [] and wrong.usage.cached_tokens > 0  # it was used
    reference = full_prefill_reply(store, engine, conv, "Tell me more.", before)
    assert wrong.tokens != reference.tokens


def test_a_cancel_set_before_the_turn_starts_stops_it(store, engine, session):
    from localchat.events import TurnFinished
    from localchat.session.session import Cancel

    conv = store.create("early-stop", engine.ref.name)
    cancel = Cancel()
    cancel.set()
    events = list(session.turn(conv, "Hello", TurnOptions(max_tokens=50), cancel))
    done = events[-1]
    assert isinstance(done, TurnFinished) and done.stopped and done.tokens == ()
    assert [m.content for m in store.messages(conv)] == ["Hello"]


def test_a_version_3_cache_is_read_then_grows_as_version_4(store, engine, session):
    """A cache written before version 4 (its files checked by CRC-32) resumes exactly; the
    next turn writes a version-4 manifest whose older entries keep their CRC-32. A flipped
    byte in a version-3 file is still caught."""
    import zlib

    from localchat.kvcache.format import seal

    conv = store.create("v3", engine.ref.name)
    run(session, conv, "Hello, how are you today?")
    run(session, conv, "What is the capital of France?")
    folder = session.cache_folder(conv).folder

    def as_version_3() -> dict:
        man = json.loads((folder / "manifest.json").read_text())
        del man["checksum"]
        man["version"] = 3
        for e in man["segments"] + man["checkpoints"]:
            e.pop("xxh3", None)
            e["crc32"] = zlib.crc32((folder / e["file"]).read_bytes())
        (folder / "manifest.json").write_text(seal(man))
        return man

    old = as_version_3()
    before = store.messages(conv)
    resumed, notes = run(restart(store, engine), conv, "Tell me more.")
    assert notes == [] and resumed.usage.cached_tokens >= len(old["tokens"]) - 1
    reference = full_prefill_reply(store, engine, conv, "Tell me more.", before)
    assert resumed.tokens == reference.tokens
    new = json.loads((folder / "manifest.json").read_text())
    assert new["version"] == 4
    kinds = {e["file"]: ("crc32" in e, "xxh3" in e) for e in new["segments"]}
    kept = [e["file"] for e in old["segments"] if e["file"] in kinds]
    assert kept and all(kinds[f] == (True, False) for f in kept)
    assert any(kinds[f] == (False, True) for f in kinds if f not in kept)

    # Damage behind a version-3 manifest: caught by its CRC-32, the turn rebuilds.
    old = as_version_3()
    seg = folder / old["segments"][0]["file"]
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0x01
    seg.write_bytes(bytes(data))
    _, notes = run(restart(store, engine), conv, "And then?")
    assert any("checksum" in n for n in notes), notes


def test_a_capped_reply_leaves_its_last_token_to_the_next_turn(store, engine, session):
    """A reply cut by its cap does not feed its last token (a decode step for one token the
    next turn prefills in its chunk), except where the cache would then end inside a
    character; the next turn resumes everything cached, and equals a full prefill."""
    from localchat.session.generation import ends_mid_character

    split = engine.encode("서")  # byte-level: one character over several tokens
    assert len(split) > 1 and ends_mid_character(engine, split)
    assert not ends_mid_character(engine, [*split, *engine.encode("a")])  # (the control)
    conv = store.create("capped", engine.ref.name)
    first, _ = run(session, conv, "Hello, how are you today?", max_tokens=8)
    assert first.finish == "length" and len(first.tokens) == 8
    fed = len(session.cache_folder(conv).manifest().tokens)
    mid = ends_mid_character(engine, list(first.tokens))
    assert fed == first.usage.prompt_tokens + 8 - (0 if mid else 1)
    second, _ = run(restart(store, engine), conv, "And tomorrow?")
    assert second.usage.cached_tokens == fed and second.usage.miss_reason == ""
    reference = full_prefill_reply(store, engine, conv, "And tomorrow?",
                                   store.messages(conv)[:-2])
    assert second.tokens == reference.tokens
