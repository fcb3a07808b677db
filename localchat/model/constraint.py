"""Structured output: a JSON Schema, regex or Lark grammar constraint on one turn's tokens.

What it is: ``parse_spec`` checks a constraint before any model work (``ConstraintSpec``);
``tokenizer_for`` is llguidance's view of the model's tokenizer (built once per tokenizer);
``Matcher`` is one turn's grammar state beside the sampler: masks (``allowed_mask``, ``masks``
for a verify pass, ``apply`` on MLX logits), ``consume``, ``forced`` (tokens the grammar
leaves no choice about: a free draft), ``validate`` (a draft's accepted prefix), ``rollback``
and ``describe`` (usage). The engine is llguidance (JSON Schema 2020-12 with its documented
departures, Rust regex, its Lark dialect) under explicit limits: schemas are untrusted input.
End tokens: the model's end ids are llguidance's EOS set, allowed only where the grammar
accepts, and alone once it is complete. They never reach llguidance's matcher: a stopped one
takes EOS without recording it, so its ``rollback`` then undoes a real token (seen on 1.9.1).

What it is not: the decode loop, sampler, CLI or server (they call this), or a JSON Schema
validator. Grammar state lives for one turn, never in the cache. Figures: bench_constraint.py.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from localchat.errors import LocalchatError

from .loops import looping
from .masks import apply_masks

if TYPE_CHECKING:
    import llguidance
    import mlx.core as mx

KINDS = ("json_object", "json_schema", "regex", "grammar")
FIELDS = {"json_object": "response_format", "json_schema": "schema", "regex": "regex",
          "grammar": "grammar"}  # what a message names when the caller names no field
MAX_SOURCE_BYTES = 256 * 1024  # llguidance takes 4 MB schemas; real ones (tools) are < 100 KB
MAX_DEPTH = 64  # JSON nesting of a schema (~32 schema levels); llguidance's own limit is 128
# llama.cpp's JSON whitespace: a space, or a line break and an indent. Unbounded whitespace
# lets a weak model pad a reply forever; this still pretty-prints ~10 levels deep.
WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})"
# llguidance's LLParserLimits, its defaults written out but one: 500k grammar symbols, ~20 ms
# of regex analysis to compile, bounded work per step, and 100k lexer states instead of 250k
# (1-2 kB each: at most ~200 MB for one turn).
LIMITS: dict[str, Any] = {"max_grammar_size": 500_000, "initial_lexer_fuel": 1_000_000,
                          "step_lexer_fuel": 200_000, "step_max_items": 50_000,
                          "max_lexer_states": 100_000, "verbose_errors": False}
# The JSON Schema keywords llguidance enforces (its docs/json_schema.md), by what they hold,
# and annotations (nothing to enforce; "discriminator" is OpenAPI's, which Pydantic sends
# beside the ``oneOf`` llguidance does enforce).
ONE_SCHEMA = {"items", "additionalProperties"}
SCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}
SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions"}
KNOWN = ONE_SCHEMA | SCHEMA_LISTS | SCHEMA_MAPS | {
    "type", "enum", "const", "$ref", "required", "minItems", "maxItems", "minProperties",
    "maxProperties", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "title", "description", "default",
    "examples", "$comment", "$schema", "$id", "$anchor", "deprecated", "readOnly", "writeOnly",
    "contentEncoding", "contentMediaType", "discriminator"}


class BadConstraint(LocalchatError):
    """A schema, regex or grammar that cannot constrain a reply; the message is one line that
    names the field and the reason (``schema: unsupported keyword 'foo' at /properties/x``)."""

    exit_code = 2  # bad input, as ``BadInput``


@dataclass(frozen=True)
class ConstraintSpec:
    """A checked constraint: what it is and llguidance's grammar for it."""

    kind: str  # one of KINDS
    source: str  # the schema as JSON text (property order kept), the regex or the Lark text
    name: str  # what usage calls it: "json_schema", "json_object", "regex", "grammar", …
    grammar: str = field(repr=False, compare=False)  # llguidance's grammar (checked)

    @property
    def schema(self) -> dict | bool | None:  # the JSON Schema; None for regex and grammar
        return json.loads(self.source) if self.kind in ("json_object", "json_schema") else None


def parse_spec(kind: str, source: str | dict | bool | None = None, *, field: str | None = None,
               name: str | None = None,
               tokenizer: llguidance.LLTokenizer | None = None) -> ConstraintSpec:
    """Check a constraint before any model work (~1 ms for an ordinary schema).

    Args: ``kind`` "json_object" (any object; no ``source``), "json_schema" (``source`` a dict,
    a bool or JSON text), "regex" or "grammar" (Lark text, llguidance's dialect); ``field``,
    what messages name (default FIELDS[kind]); ``name``, what usage calls it (default kind);
    ``tokenizer``, the model's (``tokenizer_for``) for a grammar that names its special tokens
    (default: checked against bytes alone).
    Raises: BadConstraint (too large or deep, not JSON, not a schema, an unsupported keyword,
    an invalid regex or grammar, or one that admits nothing).
    """
    where = field or FIELDS.get(kind, "constraint")
    if kind not in KINDS:
        raise BadConstraint(f"{where}: unknown kind {kind!r} (one of {', '.join(KINDS)})")
    if kind == "json_object":
        text = '{"type": "object"}'
    elif kind == "json_schema":
        text = _schema_text(source, where)
    elif isinstance(source, str):
        text = _check_size(source, where)
    else:
        raise BadConstraint(f"{where}: expected text, not {_json_type(source)}")
    import llguidance as llg

    grammar = (llg.LLMatcher.grammar_from_regex(text) if kind == "regex" else
               llg.LLMatcher.grammar_from_lark(text) if kind == "grammar" else
               llg.LLMatcher.grammar_from_json_schema(text, overrides={
                   "whitespace_pattern": WHITESPACE, "lenient": False, "coerce_one_of": False}))
    # Compiled against a 257-token byte tokenizer: every check llguidance makes, and a first
    # mask (where an empty language shows), in about a millisecond and without the model.
    matcher = _compile(tokenizer or _byte_tokenizer(), grammar)
    if matcher.is_error() or (matcher.compute_bitmask() and matcher.is_error()):
        raise BadConstraint(f"{where}: {_why(matcher, kind)}")
    return ConstraintSpec(kind, text, name or kind, grammar)


def _check_size(text: str, where: str) -> str:
    if (size := len(text.encode("utf-8", "surrogatepass"))) > MAX_SOURCE_BYTES:
        raise BadConstraint(f"{where}: too large ({size:,} bytes; at most {MAX_SOURCE_BYTES:,})")
    return text


def _schema_text(source: str | dict | bool | None, where: str) -> str:
    """The schema as JSON text, checked for size, depth and keywords."""
    schema: Any = source
    if isinstance(source, str):
        try:
            schema = json.loads(_check_size(source, where), parse_constant=_no_constant)
        except RecursionError:
            raise BadConstraint(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
        except ValueError as err:
            raise BadConstraint(f"{where}: not JSON ({err})") from None
    if not isinstance(schema, (dict, bool)):
        raise BadConstraint(f"{where}: a schema is an object or a boolean, not "
                            f"{_json_type(schema)}")
    if isinstance(schema, bool):  # llguidance's options apply to an object schema only
        if not schema:
            raise BadConstraint(f"{where}: admits nothing (the schema is false)")
        return "{}"  # the same schema: anything
    # Depth first, bounded: a program's dict may share sub-dicts (json.dumps expands them).
    _check_depth(schema, where)
    _check_keywords(schema, "", where)
    if isinstance(source, str):
        return source
    try:
        return _check_size(json.dumps(schema, ensure_ascii=False, allow_nan=False), where)
    except (ValueError, TypeError) as err:
        raise BadConstraint(f"{where}: not JSON ({err})") from None


def _no_constant(name: str) -> float:  # NaN, Infinity: Python's json takes them
    raise ValueError(f"{name} is not JSON")


def _json_type(value: object) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int:
            "a number", float: "a number", type(None): "null"}.get(type(value), "not JSON")


def _check_depth(value: object, where: str) -> None:
    """Refuse JSON deeper than MAX_DEPTH or of more values than its byte bound holds."""
    stack, seen = [(value, 1)], 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if depth > MAX_DEPTH:
            raise BadConstraint(f"{where}: nested deeper than {MAX_DEPTH} levels")
        if seen > MAX_SOURCE_BYTES // 2:  # a JSON value takes at least ~2 bytes
            raise BadConstraint(f"{where}: too large (over {seen - 1:,} values)")
        if isinstance(item, (dict, list)):
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict)
                                                  else item))


def _check_keywords(schema: object, path: str, where: str) -> None:
    """Every keyword of every subschema is one llguidance enforces or an annotation: one it
    ignores (a typo, ``additionalItems``, OpenAPI's ``nullable``) would go unenforced."""
    at = path or "the root"
    if not isinstance(schema, (dict, bool)):
        raise BadConstraint(f"{where}: a schema is an object or a boolean, not "
                            f"{_json_type(schema)} at {at}")
    for key, value in schema.items() if isinstance(schema, dict) else ():
        here = f"{path}/{_pointer(key)}"
        if key == "items" and isinstance(value, list):
            raise BadConstraint(f"{where}: 'items' as an array (draft 7 tuples) at {at}: "
                                "use 'prefixItems'")
        if key.startswith("x-") and key != "x-guidance":
            continue  # vendor annotations (x-order, …); x-guidance would change our options
        if key not in KNOWN:
            raise BadConstraint(f"{where}: unsupported keyword {key!r} at {at}")
        if key in ONE_SCHEMA:
            _check_keywords(value, here, where)
        elif key in SCHEMA_LISTS or key in SCHEMA_MAPS:
            holds = list if key in SCHEMA_LISTS else dict
            if not isinstance(value, holds):
                raise BadConstraint(f"{where}: '{key}' must be an "
                                    f"{'array' if holds is list else 'object'} at {here}")
            for name, sub in (enumerate(value) if holds is list else value.items()):
                _check_keywords(sub, f"{here}/{_pointer(str(name))}", where)


def _pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _why(matcher: llguidance.LLMatcher, kind: str) -> str:
    empty = matcher.get_error().startswith("NoExtension")  # no first byte, not accepting
    return "admits nothing (no text matches it)" if empty else _one_line(matcher.get_error(), kind)


def _one_line(message: str, kind: str) -> str:
    """llguidance's message in one line: no echoed source, carets, or place in a regex's wrap."""
    text = " ".join(s for s in map(str.strip, message.splitlines())
                    if s and set(s) - {"^", " "} and not re.match(r"\d+ \|", s))
    text = re.sub(r"regex parse error: .*? error: ", "", text)
    text = text.replace("Unsatisfiable schema: ", "admits nothing: ").replace(" (in regex)", "")
    if kind == "regex":
        text = re.sub(r"^at \d+\(\d+\): ", "", text)
    text = re.sub(r"^(?:at )?(\d+)\((\d+)\):", r"line \1, column \2:", text)
    return text if len(text) <= 300 else text[:297] + "..."


def _compile(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    import llguidance as llg  # the matcher never raises: see is_error() (its .pyi says so)

    return llg.LLMatcher(tokenizer, grammar, log_level=0, limits=llg.LLParserLimits(**LIMITS))


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    """A tokenizer of the 256 bytes and one end token: what ``parse_spec`` compiles against."""
    import llguidance as llg
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|end|>"])
    return llg.LLTokenizer(tok.to_str(), eos_token=len(alphabet))


# -- the model's tokenizer ----------------------------------------------------------------------


def build_tokenizer(tokenizer: Any, ends: Iterable[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer (uncached: ~0.3 s for a 49k vocabulary) for ``tokenizer``:
    anything with a ``backend_tokenizer`` (mlx-lm's wrapper, ``FastTokenizer``) or a
    ``tokenizers.Tokenizer``; ``ends``: the model's end ids (``end_tokens(...).ends``).
    BadConstraint without a ``tokenizers`` pipeline (SentencePiece only) or an end."""
    import llguidance as llg

    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "to_str") or not (ids := sorted(set(ends))):
        raise BadConstraint("constraint: this model's tokenizer has no tokenizer.json or no "
                            "end token (structured output reads its vocabulary from one)")
    # As llguidance.hf.from_tokenizer passes it (that imports transformers): no truncation.
    backend = copy.copy(backend)
    backend.no_truncation()
    backend.no_padding()
    return llg.LLTokenizer(backend.to_str(), eos_token=ids)


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenizer_for(tokenizer: Any, ends: Iterable[int]) -> llguidance.LLTokenizer:
    """``build_tokenizer``, kept while ``tokenizer`` lives (one per loaded model)."""
    key = tuple(sorted(set(ends)))
    try:
        per = _TOKENIZERS.setdefault(tokenizer, {})
    except TypeError:  # not weakly referable (a bare tokenizers.Tokenizer): built each time
        return build_tokenizer(tokenizer, key)
    return per[key] if key in per else per.setdefault(key, build_tokenizer(tokenizer, key))


# -- one turn -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConstraintUsage:  # what a constrained turn adds to its usage record
    constrained: str  # the spec's name, e.g. "json_schema"
    forced_tokens: int  # tokens consumed as ``forced`` offered them
    complete: bool  # the text so far satisfies the grammar (False: cut short, e.g. by a cap)


class Matcher:
    """One turn's grammar state: mask before sampling, ``consume`` each kept token. Ids past
    the tokenizer's vocabulary (a padded embedding) are refused. A refused token never reaches
    llguidance (it would leave the matcher in error for good): ``consume`` checks first.

    A reply that loops (``loops.looping`` on the tokens consumed: the default model writes one
    Korean phrase inside a JSON string over and over) would run to its cap and end invalid; so
    from the token where the loop shows, the mask keeps only the tokens that close something
    (``"``, ``}``, ``]`` and their runs) and the ends, wherever the grammar allows any of them:
    the reply finishes its shape, valid, in a few tokens. ``closing`` says so. The state is a
    function of the tokens consumed (rolled back with them), so a verify pass's rows
    (``masks``) are the masks plain decoding would use, token for token."""

    def __init__(self, spec: ConstraintSpec, tokenizer: llguidance.LLTokenizer):
        self.spec = spec
        self.vocab, self.words = tokenizer.vocab_size, (tokenizer.vocab_size + 31) // 32
        self.ends = frozenset(tokenizer.eos_tokens)
        self._m = _compile(tokenizer, spec.grammar)
        if self._m.is_error():  # a limit met with this vocabulary
            raise BadConstraint(f"{FIELDS[spec.kind]}: {_why(self._m, spec.kind)}")
        # An end consumed (kept out of llguidance: see above); the tokens llguidance holds.
        self._ended, self._fed = False, 0
        self._offered: list[int] = []  # what ``forced`` offered and is not consumed yet
        self.forced_count = 0
        self._tokens: list[int] = []  # consumed (an end included), for the loop check
        self._closing_at: int | None = None  # len(_tokens) where a loop showed
        self._tokenizer = tokenizer

    @property
    def closing(self) -> bool:  # the reply looped: it is being steered to close its shape
        return self._closing_at is not None

    @property
    def accepting(self) -> bool:  # an end is allowed now: the text so far is complete
        return not self._ended and not self._m.is_error() and self._m.is_accepting()

    @property
    def stopped(self) -> bool:  # no more text allowed: only an end (or one was consumed)
        return self._ended or (self._m.is_stopped() and not self._m.is_error())

    @property
    def finished(self) -> bool:  # an end token was consumed
        return self._ended

    @property
    def error(self) -> str | None:  # llguidance's, once a limit is met mid-turn (turn ends)
        return _one_line(self._m.get_error(), self.spec.kind) if self._m.is_error() else None

    def allowed_mask(self, out: np.ndarray | None = None) -> np.ndarray:
        """This step's mask, int32 [words] (into ``out`` if given): bit ``t % 32`` of word
        ``t // 32`` is set where token t is allowed. After an end, only the ends are.
        BadConstraint where llguidance met a limit (now or before): the turn ends there."""
        row = np.zeros(self.words, dtype=np.int32) if out is None else out
        if self._ended:
            row[:] = 0
            for t in self.ends:
                row.view(np.uint32)[t // 32] |= np.uint32(1 << (t % 32))
            return row
        if not self._m.is_error():
            self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self._raise_error()
        if self._closing_at is not None:
            closing = row & closers(self._tokenizer, self.words)
            if closing.any():
                row[:] = closing
        return row

    def _raise_error(self) -> None:  # a limit met on the way (refusals never reach llguidance)
        if self._m.is_error():
            raise BadConstraint(f"{FIELDS[self.spec.kind]}: {self.error}")

    def masks(self, draft: Sequence[int]) -> np.ndarray:
        """A verify pass's masks, int32 [len(draft) + 1, words]: row i is the mask after
        ``draft[:i]``; the matcher is left where it was. ValueError where the grammar refuses
        a draft token (``validate`` first)."""
        if self.validate(draft) < len(draft):
            raise ValueError("a draft token the grammar refuses: validate the draft first")
        rows = np.empty((len(draft) + 1, self.words), dtype=np.int32)
        for i, tok in enumerate(draft):
            self.allowed_mask(rows[i])
            self._advance(tok)
        self.allowed_mask(rows[len(draft)])
        self._undo(len(draft))
        return rows

    def apply(self, logits: mx.array, masks: np.ndarray | None = None) -> mx.array:
        """``logits`` [vocab] or [rows, vocab] with refused tokens at -inf: ``masks`` [rows,
        words] from ``masks``, or this step's mask on every row."""
        return apply_masks(logits, self.allowed_mask() if masks is None else masks)

    def consume(self, token: int) -> None:
        """Advance by a kept token (sampled from masked logits, or an accepted draft token);
        ValueError, the matcher unchanged, where the grammar refuses it."""
        self._raise_error()
        if self.validate([token]) != 1:
            raise ValueError(f"token {token} is refused by the grammar here")
        offered = self._offered[:1] == [token]
        self.forced_count += offered
        self._offered = self._offered[1:] if offered else []
        self._advance(token)

    def _advance(self, token: int) -> None:
        if token in self.ends:
            self._ended = True
        elif self._m.consume_token(token):
            self._fed += 1
        self._raise_error()
        self._tokens.append(token)
        if self._closing_at is None and looping(self._tokens):
            self._closing_at = len(self._tokens)

    def forced(self) -> list[int]:
        """The tokens the grammar forces next, as the tokenizer would write them (field names,
        quotes, braces): a draft no model call has to propose. Empty where there is a choice
        and once the grammar is complete (only an end is left: the reply is done)."""
        if self.stopped or self._m.is_error():
            return []
        self._offered = [t for t in self._m.compute_ff_tokens() if t < self.vocab]
        return list(self._offered)

    def validate(self, draft: Sequence[int]) -> int:
        """How many leading tokens of ``draft`` the grammar accepts, consuming nothing: up to the
        first refused token, or to an end included where the text before it is complete."""
        if self._ended or self._m.is_error():
            return 0
        # Up to the first end, or id past the vocabulary (refused: llguidance would raise).
        k = next((i for i, t in enumerate(draft) if t in self.ends or not 0 <= t < self.vocab),
                 len(draft))
        body = [int(t) for t in draft[:k]]
        n = self._m.validate_tokens(body) if body else 0
        if n < k or k == len(draft) or draft[k] not in self.ends:
            return n
        self._m.consume_tokens(body)  # all valid: llguidance stays sound, undone below
        ends_here = self._m.is_accepting()
        self._m.rollback(len(body))
        return k + 1 if ends_here else k

    def rollback(self, n: int) -> None:  # undo the last n consumed tokens (an end is one)
        self._undo(n)
        self._offered = []

    def _undo(self, n: int) -> None:
        total = n
        if n > 0 and self._ended:
            self._ended, n = False, n - 1
        if n > self._fed or (n > 0 and not self._m.rollback(n)):
            raise ValueError(f"cannot roll back {n} tokens ({self._fed} consumed)")
        self._fed -= max(n, 0)
        if total > 0:
            del self._tokens[-total:]
        if self._closing_at is not None and len(self._tokens) < self._closing_at:
            self._closing_at = None

    def describe(self) -> ConstraintUsage:  # for the turn's usage record
        return ConstraintUsage(self.spec.name, self.forced_count, self.stopped or self.accepting)


_CLOSERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def closers(tokenizer: llguidance.LLTokenizer, words: int) -> np.ndarray:
    """The mask, int32 [words], of the tokens that close something: text of ``"``, ``}`` and
    ``]`` only (with spaces around), and the ends (built once per tokenizer: ~50 ms)."""
    try:
        return _CLOSERS[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referable: built each time (only once a reply loops)
        return _closers(tokenizer, words)
    return _CLOSERS.setdefault(tokenizer, _closers(tokenizer, words))


def _closers(tokenizer: llguidance.LLTokenizer, words: int) -> np.ndarray:
    mask = np.zeros(words, dtype=np.uint32)
    for t in range(tokenizer.vocab_size):
        text = tokenizer.decode_bytes([t]).strip()
        if text and not text.strip(b'"}]') and not tokenizer.is_special_token(t):
            mask[t // 32] |= np.uint32(1 << (t % 32))
    for t in tokenizer.eos_tokens:
        mask[t // 32] |= np.uint32(1 << (t % 32))
    return mask.view(np.int32)
