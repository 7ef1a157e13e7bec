"""Conversation history and the chat template: turns in, prompt token ids out. CPU only.

A `Conversation` is a list of chat messages (system, user, assistant) that can be saved as JSON and
loaded back. `build_ids` renders it with the checkpoint's own chat template and tokenizer. When the
history outgrows the context, `fit` drops the oldest user/assistant pairs and says how many it dropped.

It knows text turns only: audio, image and video parts (the processor's job) are not built here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UsageError

# Qwen2.5-Omni speaks only under this system prompt (the model card asks for it for audio output).
DEFAULT_SYSTEM = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
    "auditory and visual inputs, as well as generating text and speech."
)


@dataclass
class Conversation:
    system: str = DEFAULT_SYSTEM
    turns: list[dict] = field(default_factory=list)  # {"role": "user"|"assistant", "content": str}

    def messages(self, pending_user: str | None = None) -> list[dict]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        msgs += [dict(t) for t in self.turns]
        if pending_user is not None:
            msgs.append({"role": "user", "content": pending_user})
        return msgs

    def add(self, user: str, assistant: str) -> None:
        self.turns += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]

    def clear(self) -> None:
        self.turns.clear()

    def to_json(self) -> str:
        return json.dumps({"system": self.system, "turns": self.turns}, ensure_ascii=False, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Conversation":
        data = json.loads(text)
        return cls(system=data.get("system", DEFAULT_SYSTEM), turns=list(data.get("turns", [])))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "Conversation":
        return cls.from_json(Path(path).read_text(encoding="utf-8"))


def check_prompt(prompt: str) -> str:
    if prompt is None or not str(prompt).strip():
        raise UsageError("empty prompt: say something, e.g. omni-say \"Hello\"")
    return str(prompt)


def build_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered with the chat template, ending with the assistant's turn opener."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def fit(tokenizer, conv: Conversation, user: str, budget: int) -> tuple[list[int], int]:
    """Prompt ids for `conv` + `user` within `budget` tokens, dropping the oldest turns if needed.

    Returns (ids, number of dropped user/assistant pairs). Raises UsageError if even the newest
    message alone does not fit.
    """
    dropped = 0
    while True:
        ids = build_ids(tokenizer, conv.messages(user))
        if len(ids) <= budget:
            return ids, dropped
        if not conv.turns:
            raise UsageError(f"prompt is {len(ids)} tokens but the context holds {budget}: shorten it")
        del conv.turns[:2]
        dropped += 1
