"""The warm-up reply: one short reply nobody hears, so that the next one pays no first-time costs.

A process's first reply pays one-time costs: the chat template's first use, graphs captured the first
time a reply reaches them, and on a GPU each kernel's first launch (CUDA loads kernels lazily: on an
H200 the first sampled reply's first token took 134 ms where the next took 45). Without it omni-serve's
first request had its first audio 0.2 s after the next ones'. The reply samples, as replies do by
default (a greedy warm-up left the sampling kernels to the first real reply), and a second of quiet
noise is said with its prompt, so that the audio encoder's first run is the warm-up's too (issue 31 found a
first spoken turn after a text-only warm-up 2.15 s to its first audio, 824 ms of it the encoder's first run,
against 0.53-0.76 s for the next turns; H200, 7B; the encoder's fixes since took most of that away
before the clip came: on an H100 it takes a first spoken turn from 350 to 340 ms). What stays: a prompt
of a length not seen before takes ~25 ms more to its first token; the vision encoder is not warmed (it
waits in host memory until the first image: runtime/vision_place.py).

`WarmsUp` gives a local `Assistant` and a served model's `RemoteAssistant` the same warm-up: the remote
one is for a server that made none before it served (a keep-alive's background server starts with
`--no-warm-up`, so that the command that started it is answered sooner; H200, 7B: its turn to the first
audio 0.61 s against 0.36 s for the next).

It knows only what both assistants have (`say`, `speech_steps`, `has_audio`) and imports no torch.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

log = logging.getLogger(__name__)


class WarmsUp:
    """`warm_up()`, for a class with `say(prompt, **fields)`, `speech_steps` and `has_audio`; its replies
    call `_after_warm_up()` before they start."""

    _warming: threading.Thread | None = None  # `warm_up(background=True)`'s thread, until the next reply

    if TYPE_CHECKING:  # what the class it is mixed into has (interface.OmniAssistant)
        @property
        def speech_steps(self) -> tuple[str, float | None]: ...

        @property
        def has_audio(self) -> bool: ...

        def say(self, prompt: str, **fields: Any) -> Any: ...

    def warm_up(self, background: bool = False) -> None:
        """One short reply that nobody hears. `background`: on a thread (omni-chat, while the person
        types); the next reply waits for it, and a failure there is only logged (that reply meets it
        again)."""
        if not background:
            self._warm_up_reply()
            return

        def run():
            try:
                self._warm_up_reply()
            except Exception as exc:  # noqa: BLE001 - the next real reply reports what is wrong
                log.debug("warm-up failed: %s", exc)

        self._warming = threading.Thread(target=run, name="omni-warm-up", daemon=True)
        self._warming.start()

    def _warm_up_reply(self) -> None:
        _, per_second = self.speech_steps
        if per_second is None:
            raise ValueError("cannot size the warm-up reply: the model does not say how many talker steps make "
                             "a second of audio")
        self.say("Hello.", seed=0, max_text_tokens=8, max_codes=max(1, round(1.5 * per_second)),
                 text_only=not self.has_audio, audio=[warm_up_clip()])

    def _after_warm_up(self) -> None:
        """Wait for a background warm-up: one reply at a time (one engine, or one connection), the
        warm-up's first. Its own reply does not wait for itself."""
        warming = self._warming
        if warming is not None and warming is not threading.current_thread():
            warming.join()
            self._warming = None


def warm_up_clip():
    """What the warm-up says with its prompt: one second of quiet noise at the encoders' rate (the same
    every time: a seeded generator)."""
    import numpy as np

    from .media import ENCODER_RATE, AudioClip

    pcm = (np.random.default_rng(0).standard_normal(ENCODER_RATE) * 0.01).astype(np.float32)
    return AudioClip(pcm, ENCODER_RATE, source="warm-up")
