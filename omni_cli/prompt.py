"""Conversation history and the chat template: turns in, prompt token ids out. CPU only. It knows no
model family: a conversation's default system prompt is the family's, given by the caller
(`Assistant.conversation()`, `read_transcript(data, default_system)`).

A `Conversation` is a list of chat messages (system, user, assistant) that can be saved as JSON and
loaded back. `build_ids` renders it with the checkpoint's own chat template and tokenizer. When the
history outgrows the context, `fit` drops the oldest user/assistant pairs and says how many it dropped.
Its cost is bounded by the context, not by what it is given (`Limits`, limits.py): a new message longer
than the context's tokens times `chars_per_token` is refused before anything is tokenized, the oldest
pairs that cannot fit by that char bound are dropped untokenized, and the rest is tokenized about once
(no re-rendering of the whole conversation per dropped pair).

The transcript format (what omni-chat's /save writes and /load reads, and `Conversation.to_json`):
a JSON object with `"format": 1`, `"system"` (the system prompt; "" = none) and `"turns"` (user and
assistant messages, in pairs); omni-chat adds `"context_from"` (where the model's history starts,
when older turns were dropped to fit the context), the model, the voice and where each reply's speech
is in the WAV beside it. Files without `"format"` (written before it existed) read as format 1.

Every text that goes to the tokenizer is checked by `check_text`: a str holding a lone surrogate (how
Python carries undecodable bytes: a non-UTF-8 argument, stdin or terminal input) is a usage error here
rather than a TypeError deep inside the tokenizer.

A user message may hold audio and image parts: the chat template renders one placeholder per clip or
image, which `expand_placeholders` repeats as many times as it has tokens (the family computes those
from its features). A conversation keeps a turn's clips and images with it (in memory, `"media"`), so
later turns hear and see them again; transcripts hold the text only (omni-chat saves the attachments
beside them). The encoders' inputs are not built here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UsageError
from .limits import DEFAULT, LimitError, Limits, read_regular_file

# The version of the transcript JSON this code writes; it reads this one and files without the field.
TRANSCRIPT_FORMAT = 1



@dataclass
class Conversation:
    # The system prompt ("" = none). It knows no model: the default a model's conversations get is its
    # family's (`Assistant.default_system`, `Assistant.conversation()`), given here by who makes one.
    system: str = ""
    # {"role": "user"|"assistant", "content": str}; a user turn may add "media": {"audio": [...], "images": [...]}
    turns: list[dict] = field(default_factory=list)

    def messages(self, pending_user: str | list | None = None) -> list[dict]:
        """The chat template's messages: a turn with media as parts (`user_parts`)."""
        msgs: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        msgs += [_message(t) for t in self.turns]
        if pending_user is not None:
            msgs.append({"role": "user", "content": pending_user})
        return msgs

    def add(self, user: str, assistant: str, media: dict | None = None) -> None:
        """A finished exchange; `media`: what the user said and showed with it ({"audio": [clips],
        "images": [images]}), which the next turns' prompts carry again."""
        turn: dict = {"role": "user", "content": user}
        if media and (media.get("audio") or media.get("images")):
            turn["media"] = {"audio": list(media.get("audio") or ()), "images": list(media.get("images") or ())}
        self.turns += [turn, {"role": "assistant", "content": assistant}]

    def media(self) -> tuple[list, list]:
        """(clips, images) of the turns, in prompt order."""
        clips, images = [], []
        for turn in self.turns:
            clips += turn.get("media", {}).get("audio", [])
            images += turn.get("media", {}).get("images", [])
        return clips, images

    def clear(self) -> None:
        self.turns.clear()

    def text_turns(self) -> list[dict]:
        """The turns as a transcript holds them: roles and text (their media stay in memory)."""
        return [{k: v for k, v in t.items() if k != "media"} for t in self.turns]

    def to_json(self) -> str:
        data = {"format": TRANSCRIPT_FORMAT, "system": self.system, "turns": self.text_turns()}
        return json.dumps(data, ensure_ascii=False, indent=2)

    @classmethod
    def from_json(cls, text: str, default_system: str = "") -> "Conversation":
        """A conversation from transcript JSON (ours or omni-chat's /save); UsageError if it is not one.
        `default_system`: the system prompt of a transcript that names none (the model's default)."""
        return cls.from_dict(parse_json(text), default_system)

    @classmethod
    def from_dict(cls, data: object, default_system: str = "") -> "Conversation":
        """The conversation in decoded transcript JSON, checked; the model's history (`context_from` on)."""
        system, turns, start = read_transcript(data, default_system)
        return cls(system=system, turns=turns[start:])

    def save(self, path: str | Path) -> None:
        """Write the transcript JSON to `path`, whole or not at all (atomic.atomic_write; an OutputError
        if it cannot be written)."""
        from .atomic import atomic_write

        atomic_write(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path, default_system: str = "", limits: Limits = DEFAULT) -> "Conversation":
        """The transcript at `path`: a regular file of at most `limits.transcript_bytes` (checked before
        it is read; a FIFO or device is refused), UTF-8 JSON of the transcript format."""
        try:
            raw = read_regular_file(Path(path).expanduser(), limits.transcript_bytes, "the transcript", str(path))
        except FileNotFoundError:
            raise UsageError(f"cannot load {path}: no such file") from None
        except OSError as exc:
            raise UsageError(f"cannot load {path}: {(exc.strerror or str(exc)).lower()}") from None
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise TranscriptError(f"{path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}), "
                                  "so not a transcript") from None
        return cls.from_json(text, default_system)


def user_parts(text: str, images: int = 0, clips: int = 0) -> list[dict]:
    """A user message's content with media, in the order the families' processors expect: the images,
    the audio, then the text."""
    return ([{"type": "image"} for _ in range(images)] + [{"type": "audio"} for _ in range(clips)]
            + ([{"type": "text", "text": text}] if text else []))


def _message(turn: dict) -> dict:
    media = turn.get("media")
    if not media:
        return {"role": turn["role"], "content": turn["content"]}
    return {"role": turn["role"],
            "content": user_parts(turn["content"], len(media["images"]), len(media["audio"]))}


class TranscriptError(UsageError):
    """A file that is not a transcript this code can read (not JSON, another shape, a newer format)."""


def parse_json(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TranscriptError(f"it is not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from exc


def read_transcript(data: object, default_system: str = "") -> tuple[str, list[dict], int]:
    """(system prompt, every turn, index of the first turn in the model's history) of decoded transcript
    JSON. Checked here, so that a hand-edited or foreign file is one clear error at loading instead of a
    failure inside the chat template at the next turn. `default_system`: the system prompt of a transcript
    that names none (files written before the field existed: the model's default, its family's)."""
    if not isinstance(data, dict):
        raise TranscriptError(f"it is JSON but not a transcript (a {_json_type(data)}, not an object with \"turns\")")
    version = data.get("format", TRANSCRIPT_FORMAT)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise TranscriptError(f"its \"format\" is {json.dumps(version)}, not a version number")
    if version > TRANSCRIPT_FORMAT:
        raise TranscriptError(f"it was written in transcript format {version} by a newer omni-cli; this one reads "
                              f"format {TRANSCRIPT_FORMAT}: upgrade omni-cli")
    if "turns" not in data:
        raise TranscriptError("it is JSON but not a transcript (no \"turns\")")
    turns = data["turns"]
    if not isinstance(turns, list):
        raise TranscriptError(f"its \"turns\" is a {_json_type(turns)}, not a list")
    clean = []
    for i, turn in enumerate(turns):
        want = "user" if i % 2 == 0 else "assistant"  # the transcript holds whole exchanges, user first
        if not isinstance(turn, dict) or turn.get("role") != want or not isinstance(turn.get("content"), str):
            raise TranscriptError(f"turn {i + 1} is not a {want} message ({{\"role\": \"{want}\", \"content\": \"...\"}})")
        clean.append({"role": want, "content": check_text(turn["content"], f"turn {i + 1}")})
    if len(clean) % 2:
        raise TranscriptError(f"its last turn ({len(clean)}) is a user message without the assistant's reply")
    system = data.get("system", default_system)
    if system is None:
        system = ""
    if not isinstance(system, str):
        raise TranscriptError(f"its \"system\" is a {_json_type(system)}, not text")
    start = data.get("context_from", 0)
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(clean) or start % 2:
        raise TranscriptError(f"its \"context_from\" ({json.dumps(start)}) is not the start of an exchange")
    return check_text(system, "the system prompt"), clean, start


def _json_type(value: object) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def check_text(text: str, what: str = "the prompt") -> str:
    """`text`, or a UsageError if it cannot be encoded as UTF-8.

    Python turns bytes that are not UTF-8 into lone surrogates (U+DC80-U+DCFF, the "surrogateescape"
    handler its stdin, argv and prompt_toolkit use), and JSON may spell one as "\\ud800". Such a str
    reaches the tokenizer, whose Rust side cannot take it and raises "TypeError: TextEncodeInput must
    be ...": a bug report instead of a message. So it is caught here, with the place and a cure."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        line = text.count("\n", 0, exc.start) + 1
        column = exc.start - (text.rfind("\n", 0, exc.start) + 1) + 1
        where = f"character {column}" + (f" of line {line}" if line > 1 else "")
        if 0xDC80 <= code <= 0xDCFF:  # an undecodable byte, carried by surrogateescape
            raise UsageError(f"{what} is not UTF-8 text (byte 0x{code - 0xDC00:02x} at {where}): convert it first, "
                             "e.g. iconv -f latin1 -t utf-8, or set the terminal to UTF-8") from None
        raise UsageError(f"{what} holds a lone surrogate U+{code:04X} at {where}, which is not text") from None
    return text


def check_prompt(prompt: str) -> str:
    if prompt is None or not str(prompt).strip():
        raise UsageError("empty prompt: say something, e.g. omni-say \"Hello\"")
    return check_text(str(prompt))


def build_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered with the chat template, ending with the assistant's turn opener.
    A message's content is text, or a list of parts (`{"type": "audio"}` and `{"type": "text", ...}`)
    whose audio placeholder the caller expands (`expand_placeholders`)."""
    markers = media_markers(tokenizer)
    messages = [_checked(message, markers) for message in messages]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


class MarkerError(UsageError):
    """Text holding a media marker (`_checked`)."""


def media_markers(tokenizer) -> list[str]:
    """The tokenizer's special tokens that mark where a clip, an image or a video goes (Qwen2.5-Omni's
    `<|AUDIO|>`, `<|vision_bos|>`, ...; Qwen3-Omni's `<|audio_pad|>`, `<|vision_start|>`, ...): found by
    name among its added special tokens, so neither family's list is written out here."""
    words = ("audio", "image", "video", "vision")
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return [t.content for t in added.values()
            if getattr(t, "special", False) and any(w in t.content.lower() for w in words)]


def _checked(message: dict, markers: list[str]) -> dict:
    """`message` with its text checked (`check_text`). A media marker in the text would be tokenized as the
    marker itself (a tokenizer reads special tokens in text): a clip's or an image's place with no clip
    or image of its own, which the prompt's media then no longer match (the expansion ran out of clips;
    on a GPU the placeholder scatter is a device-side assert that ends the process, a server's with it).
    So a user's or the system's text holding one is refused; a reply's (the model may spell one out in
    ordinary tokens, which the next prompt would read as the marker) is kept as text by a zero-width
    space after its "<"."""
    what = "the system prompt" if message["role"] == "system" else f"a {message['role']} message"
    content = message["content"]

    def check(text: str) -> str:
        check_text(text, what)
        for marker in markers:
            if marker in text:
                if message["role"] == "assistant":
                    text = text.replace(marker, "<\u200b" + marker[1:])
                    continue
                raise MarkerError(f"{what} holds {marker}, the model's marker for a clip's or an image's place: "
                                  "attach audio or an image as such (--audio, --image, a message part), not "
                                  "its marker")
        return text

    if isinstance(content, str):
        return {**message, "content": check(content)}
    return {**message, "content": [{**part, "text": check(part["text"])} if "text" in part else part
                                   for part in content]}


def expand_placeholders(ids: list[int], token: int, counts: list[int]) -> list[int]:
    """`ids` with the i-th `token` repeated counts[i] times (what a processor does to `<|AUDIO|>`). Fewer
    placeholders than counts: the oldest turns were dropped (`fit`), so the last counts are theirs."""
    found = ids.count(token)
    if found < len(counts):
        counts = counts[len(counts) - found:]
    out, left = [], iter(counts)
    for i in ids:
        out.extend([i] * next(left) if i == token else [i])
    return out


def fit(tokenizer, conv: Conversation, user, budget: int, expand=None,
        limits: Limits = DEFAULT) -> tuple[list[int], int]:
    """Prompt ids for `conv` + `user` (text, or a list of parts) within `budget` tokens, dropping the
    oldest turns if needed; `expand`: what makes the final ids of the rendered ones (audio placeholders).

    Returns (ids, number of dropped user/assistant pairs): the ids of the conversation without the
    fewest oldest pairs that fits, as the chat template renders it. Raises a `LimitError` before any
    tokenizing when `user` is longer than `limits.prompt_chars(budget)`, and a UsageError if even the
    newest message alone does not fit.

    The cost is linear in the conversation, not quadratic: the oldest pairs that cannot fit by the char
    bound (a token holds at most `limits.chars_per_token` characters) are dropped without tokenizing;
    when the rest does not fit, each of its turns is tokenized once to estimate how many pairs to drop,
    and the template's ids are checked for the estimate and its neighbour (a few renders, each bounded
    by the char bound), so the result is the one dropping pair after pair would give.
    """
    if budget < 1:
        raise LimitError(f"no room for the prompt: {budget} tokens of the context are left for it",
                         param="max_text_tokens")
    check_length(user, conv.system, budget, limits)
    dropped = _drop_by_chars(conv, user, limits.prompt_chars(budget))

    def render(k: int) -> list[int]:
        ids = build_ids(tokenizer, Conversation(conv.system, conv.turns[2 * k:]).messages(user))
        return expand(ids) if expand is not None else ids

    ids = render(0)
    if len(ids) <= budget:
        return ids, dropped
    pairs = len(conv.turns) // 2
    if not pairs:
        raise UsageError(f"prompt is {len(ids)} tokens but the context holds {budget}: shorten it")
    costs = _pair_costs(tokenizer, conv)
    found: dict[int, list[int]] = {0: ids}  # k -> the ids without the oldest k pairs, as rendered
    lo, hi = 0, None  # the most pairs known to be too few to drop, the fewest known to be enough
    k, stepped = _enough(costs, 0, len(ids) - budget), False
    while True:
        if k not in found:
            found[k] = render(k)
        if len(found[k]) <= budget:
            hi = k
        elif k == pairs:
            raise UsageError(f"prompt is {len(found[k])} tokens but the context holds {budget}: shorten it")
        else:
            lo = k
        if hi is not None and hi - lo == 1:
            break
        if hi is None:  # still too long: drop as many more as the estimate says the excess needs
            k = _enough(costs, lo, len(found[lo]) - budget)
        elif not stepped:  # the estimate's pair fits: the one before it most likely does not
            k, stepped = hi - 1, True
        else:  # the estimate was off: halve what is left between the bounds
            k = (lo + hi) // 2
    del conv.turns[:2 * hi]
    return found[hi], dropped + hi


def check_length(user, system: str, budget: int, limits: Limits = DEFAULT) -> None:
    """A `LimitError` (before any tokenizing) when the new message, or it with the system prompt, has
    more characters than `budget` tokens can hold (`limits.prompt_chars`): it could not fit whatever it
    tokenizes to."""
    most = limits.prompt_chars(budget)
    chars = _chars(user)
    if chars > most:
        raise LimitError(f"the prompt is {chars} characters, more than the {most} that fit the {budget} tokens "
                         f"left in the context (at most {limits.chars_per_token} characters a token): shorten it",
                         param="messages")
    if chars + len(system) > most:
        raise LimitError(f"the system prompt ({len(system)} characters) and the prompt ({chars}) are more than the "
                         f"{most} characters that fit the {budget} tokens left in the context: shorten them",
                         param="messages")


def _chars(content) -> int:
    """A message's characters: its text, or its text parts' (media placeholders are tokens, not text)."""
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    return sum(len(part.get("text", "")) for part in content if isinstance(part, dict))


def _text_of(content) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content if isinstance(p, dict))


def _drop_by_chars(conv: Conversation, user, most: int) -> int:
    """Drop (in place) the oldest pairs that cannot fit by characters alone: the newest pairs are kept
    while the system prompt, they and the new message hold at most `most` characters. Returns the count."""
    total = len(conv.system) + _chars(user)
    keep = 0
    for i in range(len(conv.turns) - 2, -1, -2):
        total += _chars(conv.turns[i]["content"]) + _chars(conv.turns[i + 1]["content"])
        if total > most:
            break
        keep += 1
    dropped = len(conv.turns) // 2 - keep
    del conv.turns[:2 * dropped]
    return dropped


def _pair_costs(tokenizer, conv: Conversation) -> list[int]:
    """An estimate of the tokens each pair of `conv.turns` adds to the prompt: its two texts tokenized
    (once each) plus what the template adds around a pair, measured on a one-character pair. Only an
    estimate (the template may tokenize across a boundary, media placeholders are left out): `fit`
    checks the rendered ids."""
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0

    one = [{"role": "user", "content": "a"}]
    around = (len(build_ids(tokenizer, one + [{"role": "assistant", "content": "a"}] + one))
              - len(build_ids(tokenizer, one)) - 2 * count("a"))
    texts = [_text_of(turn["content"]) for turn in conv.turns]
    return [max(0, around) + count(texts[i]) + count(texts[i + 1]) for i in range(0, len(texts) - 1, 2)]


def _enough(costs: list[int], start: int, excess: int) -> int:
    """The number of oldest pairs to drop (at least `start` + 1) whose estimated costs from `start` on
    save `excess` tokens; all of them when none do."""
    saved, k = 0, start
    while k < len(costs):
        saved += costs[k]
        k += 1
        if saved >= excess:
            break
    return max(k, start + 1)


class Chat:
    """A conversation bound to an assistant (a local `Assistant` or a `RemoteAssistant`): `say` and
    `stream` keep the history between turns."""

    def __init__(self, assistant, conversation: Conversation) -> None:
        self.assistant = assistant
        self.history = conversation

    def say(self, prompt: str, options=None, **kwargs):
        return self.assistant.say(prompt, options, conversation=self.history, **kwargs)

    def stream(self, prompt: str, options=None, **kwargs):
        return self.assistant.stream(prompt, options, conversation=self.history, **kwargs)

    def clear(self) -> None:
        self.history.clear()
