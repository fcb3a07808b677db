"""Streaming detokenization: a reply's text piece by piece as its tokens come, exactly the
text of the whole decode, never half a character.

What it is: ``StreamDetokenizer``, with the interface of mlx-lm's streaming detokenizers
(``reset``, ``add_token``, ``finalize``, ``text``, ``tokens``, ``last_segment``), over any
``decode(ids) -> str``. It keeps two marks in the token list, as text-generation servers do:
``prefix`` (where the window being decoded starts) and ``read`` (the tokens whose text is
out). A new token's text is ``decode(window)`` minus ``decode(window up to read)``; it goes out
only when it does not end in U+FFFD (a character cut across tokens: byte-level pieces of
Hangul, byte-fallback ``<0xEC>`` tokens). Decoding from a mark where a character starts gives
the same text as the whole decode from there on, including decoders that treat the first
token apart (SentencePiece's leading space): both decodes of a window start at the same
token. So the pieces joined are ``decode(all)``, special tokens included and no space
clean-up, which is what ``Engine.decode_text`` stores. ``finalize`` sends what is held (a
reply cut mid-character ends in U+FFFD there, as the whole decode does).

What it is not: mlx-lm's detokenizers, which trim a reply's leading space; this one keeps
it, so the streamed reply is the stored one. Byte-fallback tokens (``hold``) wait for the
end of their run, because SentencePiece's decoder turns a whole invalid run into U+FFFD.
Property tests: tests/model/test_fast_tokenizer.py.
"""

from __future__ import annotations

from collections.abc import Callable


class StreamDetokenizer:
    """Text out of tokens as they come (see the module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str], hold: frozenset[int] = frozenset()):
        """``hold``: byte-fallback tokens (``<0x80>``): SentencePiece decodes a run of them
        as one, and a run that is not valid UTF-8 turns every byte of it into U+FFFD,
        earlier ones included; so nothing of a run goes out before it ends."""
        self._decode = decode
        self._hold = hold
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.text = ""  # everything sent so far
        self.offset = 0  # of ``text``, what ``last_segment`` handed out
        self._prefix = 0
        self._read = 0
        self._read_text = ""  # decode(tokens[prefix:read])

    def add_token(self, token: int) -> None:
        self.tokens.append(int(token))
        if token in self._hold:
            return
        window = self._decode(self.tokens[self._prefix:])
        if window.endswith("\ufffd") or len(window) < len(self._read_text) or \
                not window.startswith(self._read_text):
            return  # a character not complete yet (or text a later token will settle)
        self.text += window[len(self._read_text):]
        self._prefix, self._read = self._read, len(self.tokens)
        self._read_text = self._decode(self.tokens[self._prefix:self._read])

    def finalize(self) -> None:
        """Send what is held back, complete or not."""
        if self._read < len(self.tokens):
            window = self._decode(self.tokens[self._prefix:])
            self.text += window[len(self._read_text):] if window.startswith(
                self._read_text) else window
            self._prefix = self._read = len(self.tokens)
            self._read_text = ""

    @property
    def last_segment(self) -> str:
        """The text sent since the last time this was read."""
        segment = self.text[self.offset:]
        self.offset = len(self.text)
        return segment
