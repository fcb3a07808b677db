"""The commands that need no model: ``list``, ``show``, ``export``, ``rm``, ``fork``,
``cache prune``, ``models``. Registered by ``cli.build_parser``; each docstring is its help.
"""

from __future__ import annotations

import json
import sys

from .. import paths
from ..errors import BadInput
from ..fmt import human_bytes, snippet, visible
from ..model.names import DEFAULT_MODEL


def open_store():
    from ..store.database import Store

    return Store.open(paths.database_path())


def cmd_list(args) -> int:
    """List conversations, most recent first: name, model, messages, tokens, cache size (on
    this machine: its own cache and the shards of split runs)."""
    from ..kvcache import budget
    from ..kvcache.folder import CacheFolder

    store = open_store()
    roots = budget.cache_roots(paths.kv_root())
    rows = []
    for conv in store.list():
        rows.append({
            "name": conv.name,
            "model": conv.model,
            "messages": len(store.messages(conv)),
            "tokens": conv.tokens,
            "cache_bytes": sum(CacheFolder(root / str(conv.id)).disk_bytes() for root in roots),
        })
    if args.json:
        print(json.dumps(rows, ensure_ascii=False))
        return 0
    if not rows:
        print("no conversations yet; start one with: localchat ask -c NAME 'hello'")
        return 0
    used, _ = budget.disk_use(paths.kv_root())
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name']:<{width}}  {r['messages']:>4} msgs  {r['tokens']:>6} tokens  "
              f"{human_bytes(r['cache_bytes']):>9}  {r['model']}")
    limit = budget.cache_limit(paths.kv_root())
    print(f"caches on disk: {human_bytes(used)} of {human_bytes(limit)} "
          "(LOCALCHAT_CACHE_LIMIT; shared files counted once)")
    return 0


def _messages_json(store, conv, thinking: bool = True) -> dict:
    """The conversation as chat messages; a reply's thinking is its ``reasoning_content``
    (left out when not ``thinking``)."""
    return {
        "name": conv.name,
        "model": conv.model,
        "system": conv.system,
        "messages": [
            {"role": m.role, "content": m.content,
             **{k: v for k, v in (m.extra or {}).items()
                if thinking or k not in REASONING},
             **({"partial": True} if m.partial else {})}
            for m in store.messages(conv)
        ],
        **({"window": {"from": conv.window_from, "summary": _summary(conv)}}
           if _summary(conv) else {}),
    }


REASONING = ("reasoning_content", "reasoning_tokens", "thinking_seconds")


def _thought(m) -> str:
    value = (m.extra or {}).get("reasoning_content")
    return value if isinstance(value, str) else ""


def _calls(m) -> list[str]:
    """A reply's tool calls as ``name {arguments}`` lines (``tools/turns.py``)."""
    out = []
    for c in (m.extra or {}).get("tool_calls") or []:
        f = c.get("function", {}) if isinstance(c, dict) else {}
        out.append(f"{f.get('name')} {json.dumps(f.get('arguments'), ensure_ascii=False)}")
    return out


def _images(m) -> list[tuple[str, object]]:
    """A message's images: (hash, W×H and size, or why not; the stored file or None)."""
    digests = m.images
    if not digests:
        return []
    from ..store.images import ImageStore

    store = ImageStore(paths.images_dir())
    return [store.describe(d) for d in digests]


def _role(m) -> str:
    """``tool · NAME`` for a tool result, else the role."""
    name = (m.extra or {}).get("name") if m.role == "tool" else None
    return f"tool · {name}" if isinstance(name, str) else m.role


def cmd_show(args) -> int:
    """Print a conversation's messages."""
    store = open_store()
    conv = store.get(args.name)
    if args.json:
        print(json.dumps(_messages_json(store, conv), ensure_ascii=False))
        return 0
    # On a terminal, control characters (a reply's ESC) are shown, not obeyed.
    shown = visible if sys.stdout.isatty() else str
    if conv.system:
        print(f"[system] {shown(conv.system)}\n")
    for i, m in enumerate(store.messages(conv)):
        if i == conv.window_from and i:
            print(f"── the model sees from here on: {i} earlier messages "
                  + ("summarized ──" if _summary(conv) else "left out ──") + "\n")
            if _summary(conv):
                print(f"[summary] {shown(_summary(conv))}\n")
        mark = " (stopped)" if m.partial else ""
        for chip, _ in _images(m):
            print(f"[{m.role} · image] {shown(chip)}\n")
        if args.show_thinking and _thought(m):
            print(f"[{m.role} · thinking] {shown(_thought(m))}\n")
        if m.content or not _calls(m):
            print(f"[{shown(_role(m))}]{mark} {shown(m.content)}\n")
        for call in _calls(m):
            print(f"[{m.role} · tool call] {shown(call)}\n")
    return 0


def _summary(conv) -> str | None:
    """The summary that stands for the messages before the window (``session/window.py``), if
    any."""
    from ..session.window import summary_in_force

    return summary_in_force(conv, "summarize") if conv.context_overflow == "summarize" \
        else None


def cmd_summary(args) -> int:
    """Print a conversation's summary (``--context-overflow summarize``: the model's summary
    of the messages before the window), or replace it with ``--set TEXT``."""
    from ..session.conversations import Conversations

    store = open_store()
    conv = store.get(args.name)
    if args.set is None:
        text = _summary(conv)
        if text is None:
            raise BadInput(f"{conv.name} has no summary in force (its context has not filled "
                           "under --context-overflow summarize)")
        print(text)
        return 0
    text = (sys.stdin.read() if args.set == "-" else args.set).strip()
    if not text:
        raise BadInput("an empty summary: to drop it, switch the conversation to "
                       "--context-overflow truncate")
    if _summary(conv) is None:
        raise BadInput(f"{conv.name} has no summary to replace (its context has not filled "
                       "under --context-overflow summarize)")
    with Conversations.at_home(store).lock(conv):
        store.update(conv, summary=text)
    print(f"summary of {conv.name} replaced; its next turn renders it", file=sys.stderr)
    return 0


def cmd_search(args) -> int:
    """Find messages by what they say, across every conversation (any script: three
    characters or more through the full-text index, shorter by a scan); most recent first."""
    if not args.query.strip():
        raise BadInput("empty search")
    if args.limit < 1:
        raise BadInput("--limit must be at least 1")
    store = open_store()
    found = store.search(args.query, args.limit)
    if args.json:
        print(json.dumps([{"conversation": c.name, "seq": m.seq, "role": m.role,
                           "content": m.content} for c, m in found], ensure_ascii=False))
        return 0
    shown = visible if sys.stdout.isatty() else str
    for conv, m in found:
        print(f"{shown(conv.name)}  #{m.seq} [{m.role}]  {shown(snippet(m.content, args.query))}")
    if not found:
        print(f"nothing found for {args.query!r}", file=sys.stderr)
    return 0


def cmd_export(args) -> int:
    """Write a conversation as Markdown (default) or JSON to stdout; a reasoning model's
    thinking is included (folded in Markdown) unless --no-thinking."""
    store = open_store()
    conv = store.get(args.name)
    if args.format == "json":
        print(json.dumps(_messages_json(store, conv, not args.no_thinking), ensure_ascii=False,
                         indent=2))
        return 0
    print(f"# {conv.name}\n\n_model: {conv.model}_\n")
    if conv.system:
        print(f"**System:** {conv.system}\n")
    for m in store.messages(conv):
        who = {"user": "You", "assistant": "Assistant", "system": "System",
               "tool": "Tool result"}[m.role]
        mark = " _(stopped)_" if m.partial else ""
        print(f"## {who}{mark}\n")
        if _thought(m) and not args.no_thinking:  # folded, as Markdown viewers show <details>
            print(f"<details><summary>Thinking</summary>\n\n{_thought(m)}\n\n</details>\n")
        if m.role == "tool" and (m.extra or {}).get("name"):
            print(f"_{m.extra['name']}_\n")
        for chip, path in _images(m):  # (the stored copy: the original may have moved)
            print(f"![{chip}]({path.as_uri()})\n" if path else f"_image {chip}_\n")
        print(f"{m.content}\n")
        for call in _calls(m):
            print(f"**Tool call:** `{call}`\n")
    return 0


def cmd_rm(args) -> int:
    """Delete a conversation, its messages and its KV cache."""
    from ..session.conversations import Conversations

    store = open_store()
    conv = store.get(args.name)
    Conversations.at_home(store).delete(conv)
    print(f"deleted {conv.name}", file=sys.stderr)
    return 0


def cmd_fork(args) -> int:
    """Branch a conversation: NEW gets NAME's first N messages and shares its cache files.

    No model is loaded and no K/V is copied: the cache files are hard links, so forking
    writes only a manifest, and NEW's next turn prefills only its new message.
    """
    from ..session.conversations import Conversations

    store = open_store()
    conv = store.get(args.name)
    new, written = Conversations.at_home(store).fork(conv, args.new, args.at)
    n = len(store.messages(new))
    print(f"forked {conv.name} -> {new.name} ({n} messages, {human_bytes(written)} written)",
          file=sys.stderr)
    return 0


def cmd_cache(args) -> int:
    """Manage the KV caches on disk: `prune` frees space now (least recently used first)."""
    from ..kvcache import budget

    root = paths.kv_root()
    limit = budget.parse_size(args.to) if args.to else budget.cache_limit(root)
    before, _ = budget.disk_use(root)
    cleared = budget.enforce(root, paths.locks_dir(), limit)
    after, _ = budget.disk_use(root)
    print(f"caches: {human_bytes(before)} -> {human_bytes(after)} (limit "
          f"{human_bytes(limit)}); cleared {len(cleared)} conversation caches; messages kept",
          file=sys.stderr)
    return 0


def cmd_models(args) -> int:
    """List models usable offline: the embedded default and the local Hugging Face cache."""
    from ..model.resolve import list_local

    refs = list_local()
    if not any(r.name == DEFAULT_MODEL for r in refs):
        print(f"{DEFAULT_MODEL}  (embedded default; set up on first use)")
    for r in refs:
        print(f"{r.name}  ({r.source}: {r.path})")
    return 0
