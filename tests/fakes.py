"""Test doubles: a fake Assistant for the CLI and REPL tests (streams text deltas and audio into the
sink like the real one, in milliseconds, with no model), and `RecordingSink`, a sink that keeps what
it is given."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from omni_cli.audio.sinks import SinkBase, as_block
from omni_cli.errors import UsageError
from omni_cli.models.qwen2_5_omni import DEFAULT_SYSTEM


class FakeAssistant:
    """Streams like the real one: text deltas, then audio blocks into the sink, then Done.

    `fail` is raised halfway through the audio; `block_delay` seconds pass between blocks."""

    voices = ["Chelsie", "Ethan"]
    is_demo = False
    has_audio = True
    name = "fake"
    url = None
    sample_rate = 24_000

    def __init__(self, fail: BaseException | None = None, seconds: float = 0.5, blocks: int = 2,
                 block_delay: float = 0.0, stats: dict | None = None):
        self.fail = fail
        self.seconds = seconds
        self.blocks = blocks
        self.block_delay = block_delay
        self.stats = stats or {}
        self.calls = []
        self.startup = {}

    default_voice = "Chelsie"
    speaks_only_under_default_system = True
    default_system = DEFAULT_SYSTEM

    def stream(self, prompt, options=None, *, sink=None, conversation=None, **fields):
        from dataclasses import asdict

        from omni_cli.assistant import AudioBlock, Done, TextDelta, reply_options

        opts = reply_options(options, fields).check()  # the real API's argument handling and checks
        call = asdict(opts)
        call["voice"] = opts.voice or self.default_voice
        self.calls.append(dict(prompt=prompt, **call))
        text_only = opts.text_only
        if not prompt.strip():
            raise UsageError("empty prompt")
        started = time.perf_counter()
        audio = np.full(int(self.seconds * self.sample_rate), 0.25, dtype=np.float32)
        audio[::7] = -0.5
        if text_only:
            audio = audio[:0]
        yield TextDelta("Hi ")
        if sink is not None and not text_only:
            sink.start(self.sample_rate)
        ok = False
        try:
            for i, part in enumerate(np.array_split(audio, self.blocks)):
                if self.fail is not None and i == self.blocks // 2:
                    raise self.fail
                if i:
                    time.sleep(self.block_delay)
                if sink is not None and len(part):
                    sink.write(part)
                if len(part):
                    yield AudioBlock(part, self.sample_rate)
            yield TextDelta("there.")
            ok = True
        finally:
            if sink is not None and not text_only:
                sink.close() if ok else sink.abort()
        stats = {"started_at": started, "time_to_first_text": 0.01, "time_to_first_audio": 0.02,
                 "total_time": time.perf_counter() - started, "audio_seconds": len(audio) / self.sample_rate,
                 "text_tokens": 2, "codes": 3, **self.stats}
        reply = SimpleNamespace(text="Hi there.", text_ids=[], codes=[], audio=audio, sample_rate=self.sample_rate,
                                stats=stats)
        if conversation is not None:
            conversation.add(prompt, reply.text)
        yield Done(reply)

    @property
    def model_info(self):
        from omni_cli.interface import ModelInfo

        return ModelInfo(name=self.name, is_demo=self.is_demo, has_audio=self.has_audio, voices=tuple(self.voices),
                         default_voice=self.default_voice, default_system=self.default_system,
                         speaks_only_under_default_system=self.speaks_only_under_default_system,
                         sample_rate=self.sample_rate)

    speech_steps = ("codes", None)

    def say(self, prompt, options=None, **fields):
        from omni_cli.assistant import Done

        return next(e.reply for e in self.stream(prompt, options, **fields) if isinstance(e, Done))

    def interrupt(self):
        pass

    def close(self):
        pass

    def warm_up(self, background=False):
        return None

    def conversation(self, system=None):
        from omni_cli.assistant import Chat
        from omni_cli.prompt import Conversation

        return Chat(self, Conversation(system=self.default_system if system is None else system))


class RecordingSink(SinkBase):
    """Keeps every block (a copy) and the `time.perf_counter()` at which it arrived (a sink for tests; the package has none)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: list = []
        # perf_counter() of each write(), parallel to `blocks`.
        self.times: list[float] = []
        # perf_counter() of start(), close() and abort(); None until they happen.
        self.start_time: float | None = None
        self.end_time: float | None = None

    def start(self, sample_rate: int) -> None:
        self._check_start(sample_rate)
        self.start_time = time.perf_counter()

    def write(self, block: "np.ndarray") -> None:
        now = time.perf_counter()
        self._check_write()
        arr = as_block(block).copy()
        self.blocks.append(arr)
        self.times.append(now)
        self.samples += int(arr.shape[0])

    def close(self) -> None:
        if self.closed or self.aborted:
            return
        self.closed = True
        self.end_time = time.perf_counter()

    def abort(self) -> None:
        if self.closed or self.aborted:
            return
        self.aborted = True
        self.end_time = time.perf_counter()

    @property
    def audio(self) -> "np.ndarray":
        """All blocks joined (float32, empty if none)."""
        import numpy as np

        if not self.blocks:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate(self.blocks).astype(np.float32, copy=False)

    @property
    def first_block_time(self) -> float | None:
        return self.times[0] if self.times else None
