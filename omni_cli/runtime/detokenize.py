"""Reply token ids → text deltas, as the ids arrive.

Ids → text is not per token (BPE pieces and UTF-8 characters span tokens). With a fast tokenizer (every
Qwen-Omni checkpoint's), `tokenizers`' own `DecodeStream` turns each new id into the text it completes,
reading a few ids of context rather than the whole reply: constant work a token, where decoding the reply
again at each token was quadratic in its length. A tokenizer without it (the tests' and the benchmark's
stand-ins) is decoded whole each time and only the new end handed on. Either way half a UTF-8 character
waits for the rest, and at the reply's end the deltas add up to `text(ids)`, the reply's text.

It knows the tokenizer's `decode` (and its backend) and nothing about models or threads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tokenizers.decoders import DecodeStream


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.sent = ""  # text already handed on
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # a tokenizers.Tokenizer, if fast
        self._stream: DecodeStream | None = None  # the DecodeStream of this reply (made at its first id)
        self._fed = 0  # ids given to it so far

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def delta(self, ids: list[int], final: bool) -> str:
        """The text `ids` (the reply so far) add to what was handed on ("" if nothing new, or half a
        character so far)."""
        if self._backend is not None and self._start_stream(ids):
            piece = self._stream_delta(ids)
            if final:
                piece += self._rest(ids, self.sent + piece)
            self.sent += piece
            return piece
        text = self.text(ids)
        if text.endswith("\ufffd") and not final:
            return ""  # half a UTF-8 character: wait for the rest
        if text.startswith(self.sent) and len(text) > len(self.sent):
            delta = text[len(self.sent):]
            self.sent = text
            return delta
        return ""

    def _start_stream(self, ids: list[int]) -> bool:
        if self._stream is None and self._fed == 0:
            try:
                from tokenizers.decoders import DecodeStream
            except ImportError:  # an older tokenizers: decode whole
                self._backend = None
                return False
            self._stream = DecodeStream(skip_special_tokens=True)
        return self._stream is not None

    def _stream_delta(self, ids: list[int]) -> str:
        assert self._stream is not None and self._backend is not None  # `delta` calls this where both exist
        out = []
        for token in ids[self._fed:]:
            piece = self._stream.step(self._backend, token)  # None: nothing complete yet
            if piece:
                out.append(piece)
        self._fed = len(ids)
        return "".join(out)

    def _rest(self, ids: list[int], streamed: str) -> str:
        """At the end: what the whole decode has beyond the streamed text (a trailing half character that
        decodes as U+FFFD), so that the deltas add up to the reply's text."""
        text = self.text(ids)
        return text[len(streamed):] if text.startswith(streamed) else ""
