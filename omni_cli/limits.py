"""What one input may cost: the caps every face and the server check *before* the expensive step
(parsing a body, tokenizing a prompt, decoding audio or an image, reading a file), so that no input,
hostile or careless, can hold the one engine for long or take the machine's memory.

`Limits` is frozen and has a documented default for each cap; omni-serve's flags and the commands' flags
build one (faces/options.py), and the server, the prompt builder and the media readers are given it. A
refusal is a `LimitError` (a UsageError: a one-line error and exit 2 in a face, a 400 or 413 through the
API), said in words a user can act on.

It knows nothing of models, terminals or HTTP, and imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UsageError

MiB = 1 << 20


class LimitError(UsageError):
    """An input over one of the caps; `status` is the HTTP status the API answers with (413: the body)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True)
class Limits:
    """The caps, each with the reason for its default."""

    # A request body's bytes, read before any parsing (base64 media included: a 5-minute WAV at 24 kHz
    # PCM16 is 14 MB, 19 MB in base64). Over it: 413.
    body_bytes: int = 64 * MiB
    # How deeply a request's JSON may nest (OpenAI's bodies nest 5 levels; Python's parser recurses).
    json_depth: int = 32
    # A prompt longer than the context (tokens) times this many characters cannot fit whatever it
    # tokenizes to, so it is refused (and older turns dropped) without tokenizing it; no tokenizer of
    # these models makes a token of more than this many characters of ordinary text.
    chars_per_token: int = 16
    # One audio clip's length, read from its header before decoding (the encoders take 30 s windows;
    # a 10-minute clip is ~20 windows).
    audio_seconds: float = 600.0
    # One image's pixels, read from its header before decoding (the processor shrinks any image to
    # ~1 MP anyway; 40 MP is a large phone photo).
    image_pixels: int = 40_000_000
    # A transcript file (`/load`, `--load`) and a prompt file (`-f`): text, not a dump.
    transcript_bytes: int = 16 * MiB
    prompt_file_bytes: int = 16 * MiB
    # One attachment file (`--image`, `--audio`, `/image`, `/audio`) before it is decoded.
    attachment_bytes: int = 256 * MiB
    # omni-serve's connections (api/connections.py, api/server.py): a client that has not sent a whole
    # request head this long after connecting (or after its last reply) is dropped, so idle sockets cannot
    # pile up; a body may pause this long between two pieces, and take this long in all (64 MiB at the
    # default cap is ~0.5 MB/s), else a 408.
    header_seconds: float = 10.0
    body_stall_seconds: float = 10.0
    body_seconds: float = 120.0
    # Connections open at once; a new one beyond it closes the oldest idle one (no request under way), so
    # that idle sockets can never lock out the user's own commands nor use up the process's open files.
    connections: int = 64

    def prompt_chars(self, context_tokens: int) -> int:
        """The most characters a prompt may have when `context_tokens` tokens are left for it."""
        return max(0, int(context_tokens)) * self.chars_per_token


DEFAULT = Limits()
