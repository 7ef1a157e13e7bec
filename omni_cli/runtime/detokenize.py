"""Reply token ids → text deltas, as the ids arrive.

The whole reply so far is decoded again at each token (ids → text is not per-token: BPE pieces and
UTF-8 characters span tokens) and only the new end is handed on; half a UTF-8 character at the end
waits for the rest. It knows the tokenizer's `decode` and nothing about models or threads.
"""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.sent = ""  # text already handed on

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def delta(self, ids: list[int], final: bool) -> str:
        """The text `ids` add to what was handed on ("" if nothing new, or half a character so far)."""
        text = self.text(ids)
        if text.endswith("\ufffd") and not final:
            return ""  # half a UTF-8 character: wait for the rest
        if text.startswith(self.sent) and len(text) > len(self.sent):
            delta = text[len(self.sent):]
            self.sent = text
            return delta
        return ""
