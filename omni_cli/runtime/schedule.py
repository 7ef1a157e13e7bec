"""The decode schedule: which step runs next on the engine thread, thinker and talker interleaved.

The thinker prefills the prompt and samples reply token 0. Thinker step j feeds token j-1 (giving its
text entry R[j-1]) and samples token j. Talker step k needs R[k], so it runs right after thinker step
k+1, or right after thinker step k where the family makes R[k] from token k alone (`token_vector`:
Qwen3-Omni; the fewest thinker tokens the reference's data dependency allows): codes, and so audio,
exist long before the text is finished. Once the text has ended, the talker
is fed the text-EOS entry once, then text-pad, until it samples a stop code.

On a GPU the talker's steps are issued on a stream of their own (`_talker_side`): talker step k waits
on the device for the thinker work issued before it, and thinker step j+1, issued after it, runs beside
it instead of after it (the two share the GPU's bandwidth; at batch 1 neither fills it).

Every sampled id goes to the async output boundary (`boundary.py`) at once; the schedule never reads a
device value. What it knows of the host side (the text's end, the speech's end) it reads from the
`TurnState` the producer thread keeps, with a lag of at most `max_lag` steps: until the host knows,
the choice between R[k], text-EOS and text-pad is made on the device (`_reply_vector`).

It knows no model family (it calls `ModelSteps`, models/base.py) and no thread but its own.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .boundary import AsyncOutput
from .events import TurnRequest
from .sampling import mark_seen, select
from .stats import StepClock, TurnState

if TYPE_CHECKING:  # the interface the family's steps meet (models/base.py: Protocols, no family)
    from ..models.base import ModelSteps, TalkerTurn, ThinkerOutput

TALKER_SEED_OFFSET = 1  # the talker's generator is seeded with the turn's seed + this
FIRST_AUDIO_HOLD = 1.0  # longest the engine thread waits for the first audio on a CPU (seconds)


@dataclass
class _Decode:
    """Device tensors of one turn's decode loop (the engine thread's alone)."""

    ids: torch.Tensor  # [1, L] prompt ids
    gen: torch.Generator  # the thinker's sampling randomness (seeded)
    eos: torch.Tensor  # text EOS ids
    seen_text: torch.Tensor  # repetition-penalty mask
    no_eos: torch.Tensor | None = None  # forced lengths: text EOS banned
    talker: "TalkerTurn | None" = None  # the family's TalkerTurn
    first: "ThinkerOutput | None" = None  # the thinker prefill's output (the prompt, for the talker prefill)
    toks: list = field(default_factory=list)  # reply token k, on the device
    replies: list = field(default_factory=list)  # R[k]: the talker's text entry for reply token k
    ended_before: list = field(default_factory=list)  # [k]: a text EOS was sampled before token k
    early: bool = False  # R[k] from token k alone (`token_vector`), not from the step that feeds it


class Schedule:
    """The engine thread's loop for one turn."""

    def __init__(self, steps: ModelSteps, req: TurnRequest, *, eos_ids: list[int], all_eos_ids: list[int], n_max: int,
                 audio: bool, boundary: AsyncOutput, state: TurnState, stop: threading.Event,
                 clock: StepClock, talker_stream: torch.cuda.Stream | None = None) -> None:
        self.steps = steps
        self.req = req
        self.eos_ids = eos_ids  # ids that end the text ([] with forced lengths)
        self.all_eos_ids = all_eos_ids  # the model's EOS ids (banned with forced lengths)
        self.n_max = n_max
        self.audio = audio
        self.out = boundary
        self.state = state
        self.stop = stop
        self.clock = clock
        self.talker_stream = talker_stream  # None: the talker's steps go on the thinker's stream
        # On a CPU the engine and vocoder threads share the same cores, so steps the talker makes
        # beyond what the first chunk needs only slow that chunk down (one core, built-in model:
        # first audio ~225 -> ~165 ms). The engine thread therefore waits, once, at `hold_at` talker
        # steps (set by the vocoder thread on a CPU) until the first audio exists. On an accelerator
        # the steps are only issued by the CPU and the vocoder has its own stream: no hold, unless the
        # vocoder asks for one (`quiet_first_chunk`: its first chunk runs eagerly, issued from Python,
        # and slows down a lot beside the talker's graphs).
        self.first_audio = threading.Event()
        self.hold_at: int | None = None

    def run(self) -> None:
        d = self._setup()
        mark = self.clock.start()
        first = self.steps.prefill(d.ids, self.req.media) if self.req.media else self.steps.prefill(d.ids)
        tok = select(first.logits, self.req.thinker, d.seen_text, d.no_eos, d.gen)
        mark_seen(d.seen_text, tok)
        self.out.push("text", 0, tok)
        self.clock.end("thinker_prefill", mark)
        self.state.times["prefill_issued"] = time.perf_counter()
        d.first, d.toks = first, [tok]
        self._early_vector(d, tok)
        with _sync_debug(self.req.sync_debug and self.steps.device.type == "cuda"):
            try:
                self._steps(d)
            finally:
                # What this stream does next (the next turn, or freeing this turn's tensors, whose memory it
                # may then reuse) comes after the talker's last steps, overshoot included.
                if self.talker_stream is not None:
                    torch.cuda.current_stream(self.steps.device).wait_stream(self.talker_stream)

    def _setup(self) -> _Decode:
        """Per-turn device state, made before the first step (the only host→device copies of the turn)."""
        s, req = self.steps, self.req
        dev = s.device
        d = _Decode(ids=torch.tensor([req.input_ids], device=dev), gen=torch.Generator(device=dev), eos=torch.tensor(self.eos_ids or [-1], device=dev),
                    seen_text=torch.zeros(1, s.text_vocab, dtype=torch.bool, device=dev))
        d.gen.manual_seed(req.seed)
        d.seen_text[0, d.ids[0]] = True  # the penalty counts the prompt, as transformers' does
        if req.force_lengths:  # like transformers' min_new_tokens: EOS cannot be picked before the end
            d.no_eos = torch.zeros_like(d.seen_text)
            d.no_eos[0, [i for i in self.all_eos_ids if i < s.text_vocab]] = True
        d.ended_before = [torch.zeros(1, dtype=torch.bool, device=dev)]
        if self.audio:
            # The talker draws from a generator of its own: the thinker may take a few steps past its EOS
            # before the host knows of it (a number that depends on timing), and their draws, taken from
            # a shared generator, would change every later pick of the speech (same seed, other audio).
            talker_gen = torch.Generator(device=dev)
            talker_gen.manual_seed((req.seed + TALKER_SEED_OFFSET) % 2**63)
            d.talker = s.talker_turn(list(req.input_ids), req.voice, req.talker, talker_gen, req.force_lengths)
            d.early = s.vector_from_token
        return d

    def _steps(self, d: _Decode) -> None:
        """The hot loop: talker step k as soon as its text entry exists, then thinker step j."""
        s, req, st, out = self.steps, self.req, self.state, self.out
        j, k = 1, 0
        ids = None
        t_thinker = t_talker = 0.0
        while not self.stop.is_set():
            if self.hold_at is not None and k >= self.hold_at:
                self.first_audio.wait(FIRST_AUDIO_HOLD)  # bounded: a chunk that never comes costs little
                self.hold_at = None
            if not self._talker_finished(k) and self._vector_ready(k, d):  # else the thinker goes first
                out.wait_for("code", k, self.stop)
                assert d.talker is not None and d.first is not None  # set wherever `self.audio` (_setup, run)
                t = time.perf_counter()
                with self._talker_side():
                    mark = self.clock.start()
                    vec = self._reply_vector(k, d)
                    ids = d.talker.prefill(d.first, vec) if k == 0 else d.talker.step(ids, vec)
                    out.push("code", k, ids)
                    self.clock.end("talker" if k else "talker_prefill", mark)
                k += 1
                t_talker += time.perf_counter() - t
                st.times["talker_last_step"] = time.perf_counter()
            text_end = st.text_end
            if j < self.n_max and (text_end is None or j < text_end):
                out.wait_for("text", j, self.stop)
                t = time.perf_counter()
                mark = self.clock.start()
                o = s.decode_one(d.toks[j - 1])
                if not d.early:
                    d.replies.append(s.reply_vector(o))
                d.ended_before.append(d.ended_before[-1] | torch.isin(d.toks[j - 1], d.eos))
                tok = select(o.logits, req.thinker, d.seen_text, d.no_eos, d.gen)
                mark_seen(d.seen_text, tok)
                out.push("text", j, tok)
                self.clock.end("thinker", mark)
                d.toks.append(tok)
                self._early_vector(d, tok)
                j += 1
                t_thinker += time.perf_counter() - t
            thinker_finished = j >= self.n_max or (st.text_end is not None and j >= st.text_end)
            if thinker_finished and self._talker_finished(k):
                break
        st.times.update(thinker_steps=j - 1, talker_steps=k, thinker_time=t_thinker, talker_time=t_talker)

    def _talker_finished(self, k: int) -> bool:
        return not self.audio or self.state.codes_end is not None or k >= self.req.max_codes

    def _early_vector(self, d: _Decode, tok: torch.Tensor) -> None:
        """R[k] as soon as token k is sampled, where the family's text entry needs the token alone."""
        if self.audio and d.early:
            d.replies.append(self.steps.token_vector(tok))

    def _talker_side(self):
        """Where the talker's step is issued: its own stream, after all the thinker has issued so far (the
        step's text entry comes from the last thinker step). The thinker's next step, issued after it,
        then runs beside it on the GPU. A device-side wait: the host does not block."""
        if self.talker_stream is None:
            return contextlib.nullcontext()
        self.talker_stream.wait_stream(torch.cuda.current_stream(self.steps.device))
        return torch.cuda.stream(self.talker_stream)

    def _vector_ready(self, k: int, d: _Decode) -> bool:
        """Whether talker text entry k can be made now (host facts only)."""
        end = self.state.text_end
        return (end is not None and k >= end - 1) or k >= self.n_max - 1 or k < len(d.replies)

    def _reply_vector(self, k: int, d: _Decode):
        """Talker text entry k (`_vector_ready`): R[k], text-EOS for the text's last token, text-pad after it."""
        s, end = self.steps, self.state.text_end
        if (end is not None and k >= end) or k >= self.n_max:
            return s.text_pad_vec
        if end is not None and k == end - 1:
            return s.text_eos_vec
        if k == self.n_max - 1:
            # The length limit's last token gets text-EOS, unless the text already ended on the device by an
            # EOS the host has not read yet: then that EOS had it, and this entry is text-pad (one text-EOS
            # a reply, as the reference feeds it). Step k-1's facts exist: it needed R[k-1].
            if k == 0:
                return s.text_eos_vec
            ended = (d.ended_before[k - 1] | torch.isin(d.toks[k - 1], d.eos)).view(1, 1, 1)
            return torch.where(ended, s.text_pad_vec, s.text_eos_vec)
        # Host does not know yet whether the text ended: decide on the device.
        is_last = torch.isin(d.toks[k], d.eos).view(1, 1, 1)
        ended = d.ended_before[k].view(1, 1, 1)
        return torch.where(ended, s.text_pad_vec, torch.where(is_last, s.text_eos_vec, d.replies[k]))


@contextlib.contextmanager
def _sync_debug(enabled: bool):
    """Tests: any host sync inside the hot loop raises (`torch.cuda.set_sync_debug_mode("error")`)."""
    if not enabled:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
