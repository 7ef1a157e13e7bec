"""Scripted test doubles for the runtime: a `ModelSteps` (thinker, talker, vocoder) that follows a script,
so the real `Engine` (threads, channels, the async output boundary, the schedule) runs a turn in
milliseconds on tiny CPU tensors, and what comes out can be checked exactly.

- The thinker emits `text` (a list of ids) one per step: the prefill samples text[0], decode step j
  samples text[j]; past the script's end it emits `OVERSHOOT_TEXT + j`. A text EOS in the script ends the
  reply there: what follows it is overshoot the runtime must discard.
- The talker emits `codes` (ints, or the codebook-0 ids of frames when `frame_width > 1`) one per step;
  past the script's end `OVERSHOOT_CODE + k`. A stop code in the script ends the speech there.
- The vocoder turns each code into `BLOCK` samples at the level `level(code)` (exact in float32), in
  chunks of `chunk` codes, the rest at `finish()`: `expected_audio(codes)` is the reply's audio exactly.
- Everything the fakes are given is recorded (tokens fed back, talker entries, vocoder pushes), and every
  call can be hooked (`steps.hooks[name] = fn(call_index)`: raise, block, sleep) to inject failures.

`LaggingOutput` is an `AsyncOutput` whose host side is as late as the lag allows (the producer handles
pushed item n only once the engine has pushed item n + max_lag - 1, or stopped): monkeypatched into
runtime/turn.py, it makes the engine run on past every stop by as much as the boundary lets it.

Text entries: a talker vector is [1, 1, 3] = (kind, token id, source): kind REPLY_KIND for R[k] (source
0 = `reply_vector` of the thinker step that fed token k, 1 = `token_vector`), EOS_KIND and PAD_KIND for
`text_eos_vec` / `text_pad_vec`; `entry(vec)` reads one back as (kind, id).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from omni_cli.config import SamplingOptions
from omni_cli.runtime.boundary import AsyncOutput
from omni_cli.runtime.engine import Engine
from omni_cli.runtime.events import AudioBlock, Done, TextDelta, TurnRequest

TEXT_VOCAB = 128
EOS_IDS = (100, 101)  # two text EOS ids, as Qwen-Omni has (<|im_end|>, <|endoftext|>)
OVERSHOOT_TEXT = 60  # ids the thinker emits past its script (never part of a reply)
STOP_CODES = (99, 98)
AUDIO_LIMIT = 80  # codebook-0 ids at or above are kept in the reply but not voiced
NON_AUDIO = 85
OVERSHOOT_CODE = 40
BLOCK = 4  # samples of PCM per code
SAMPLE_RATE = 200
REPLY_KIND, EOS_KIND, PAD_KIND = 0, 1, 2
PROMPT = [3, 1, 4, 1, 5]


def words(n: int) -> list[int]:
    """n distinct ordinary text ids (1..n)."""
    return list(range(1, n + 1))


def text_script(n: int, eos_at: int | None, eos: int = EOS_IDS[0]) -> list[int]:
    """n ids, with a text EOS replacing index `eos_at` (None: no EOS, the text stops by length)."""
    ids = words(n)
    if eos_at is not None:
        ids[eos_at] = eos
    return ids


def code_script(m: int, stop_at: int | None, stop: int = STOP_CODES[0]) -> list[int]:
    """m distinct audio codes (10..10+m-1), with a stop code replacing index `stop_at` (None: never)."""
    codes = list(range(10, 10 + m))
    if stop_at is not None:
        codes[stop_at] = stop
    return codes


def level(code: int) -> float:
    return code / 128.0  # exact in float32


def frame(code: int, width: int) -> list[int] | int:
    """A talker step's ids as the reply keeps them: the code itself (width 1) or a frame led by it."""
    return code if width == 1 else [code] + [code * 10 + i for i in range(1, width)]


def expected_audio(codes) -> np.ndarray:
    """The PCM the fake vocoder makes of a reply's codes (ints or frames): BLOCK samples per audio code."""
    heads = [c[0] if isinstance(c, list) else c for c in codes]
    blocks = [np.full(BLOCK, level(c), dtype=np.float32) for c in heads if c < AUDIO_LIMIT]
    return np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.float32)


def entry(vec: torch.Tensor) -> tuple[int, int]:
    """A talker text entry read back: (kind, token id) (id -1 for text-EOS and text-pad)."""
    v = vec.reshape(-1)
    return int(v[0]), int(v[1])


class FakeTokenizer:
    """decode: 'w<id>' per id, space-separated; EOS ids are special (dropped with skip_special_tokens)."""

    eos_token_id = EOS_IDS[0]

    def __init__(self, steps: FakeSteps | None = None) -> None:
        self.steps = steps  # for the "tokenizer.decode" hook

    def decode(self, ids, skip_special_tokens=True):
        if self.steps is not None:
            self.steps._hook("tokenizer.decode")
        return " ".join(f"w{i}" for i in ids if not (skip_special_tokens and i in EOS_IDS))


def expected_text(text_ids) -> str:
    return FakeTokenizer().decode(text_ids)


@dataclass
class _Out:
    embeds: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor


class FakeTalkerTurn:
    def __init__(self, steps: FakeSteps, args: dict) -> None:
        self.s = steps
        self.args = args
        self.prompt = None

    def prefill(self, prompt, first_vec):
        self.s._hook("talker.prefill")
        self.prompt = prompt
        return self._emit(first_vec)

    def step(self, ids, vec):
        self.s._hook("talker.step")
        self.s.talker_fed_ids.append(ids.tolist())
        return self._emit(vec)

    def _emit(self, vec):
        s = self.s
        k = len(s.talker_entries)
        s.talker_entries.append(entry(vec))
        s.talker_sources.append(int(vec.reshape(-1)[2]))
        gen = self.args["generator"]
        s.talker_draws.append(float(torch.rand((), generator=gen)))  # the talker's randomness, recorded
        code = s.codes[k] if k < len(s.codes) else OVERSHOOT_CODE + k
        ids = frame(code, s.frame_width)
        out = torch.tensor([ids] if s.frame_width == 1 else ids, dtype=torch.long)
        s.talker_emitted.append(out.tolist())
        return out


class FakeVocoder:
    """Codes in, BLOCK samples at `level(code)` per audio code out, in chunks of `chunk` codes."""

    device = torch.device("cpu")
    log_units_per_code = 1

    def __init__(self, steps: FakeSteps, chunk: int, codes_for_first_audio: int) -> None:
        self.s = steps
        self.chunk = chunk
        self.codes_for_first_audio = codes_for_first_audio
        self.chunk_log: list = []
        self.pending: list = []
        self.pushes: list = []  # this vocoder's own (a lingering one of an earlier turn keeps its own)
        self.finished = 0
        self.quiet_first_chunk = False

    def push(self, codes):
        self.s._hook("vocoder.push")
        self.pushes.append(list(codes))
        self.pending.extend(codes)
        if len(self.pending) < self.chunk:
            return []
        return self._decode()

    def finish(self):
        self.s._hook("vocoder.finish")
        self.finished += 1
        return self._decode() if self.pending else []

    def _decode(self):
        done, self.pending = self.pending, []
        self.chunk_log.append((len(done), 0.001))
        return [expected_audio(done)]


class FakeSteps:
    """A scripted `ModelSteps` (models/base.py) on the CPU."""

    device = torch.device("cpu")
    text_vocab = TEXT_VOCAB
    stop_codes = STOP_CODES
    audio_limit = AUDIO_LIMIT
    sample_rate = SAMPLE_RATE
    codes_per_second = SAMPLE_RATE / BLOCK

    def __init__(self, text: list[int], codes: list[int] | None = None, *, has_talker: bool = True,
                 frame_width: int = 1, vector_from_token: bool = False, chunk: int = 1,
                 codes_for_first_audio: int = 10**9, max_context: int = 256, max_codes: int = 256) -> None:
        """`codes_for_first_audio`: the vocoder's; a CPU engine holds once at that many talker steps until
        the first audio exists (schedule.py), so the default (never) keeps the engine from waiting."""
        self.text = list(text)
        self.codes = list(codes or [])
        self.has_talker = has_talker
        self.frame_width = frame_width
        self.vector_from_token = vector_from_token
        self.chunk = chunk
        self.codes_for_first_audio = codes_for_first_audio
        self.max_context = max_context
        self.max_codes = max_codes
        self.text_eos_vec = torch.tensor([[[EOS_KIND, -1, 0]]], dtype=torch.float32)
        self.text_pad_vec = torch.tensor([[[PAD_KIND, -1, 0]]], dtype=torch.float32)
        self.hooks: dict = {}
        self.reset()

    def reset(self) -> None:
        """Forget what the last turn recorded (the script stays)."""
        self.calls: dict[str, int] = {}
        self.prefill_ids: list = []
        self.thinker_emitted: list[int] = []
        self.thinker_fed: list[int] = []
        self.talker_entries: list[tuple[int, int]] = []
        self.talker_sources: list[int] = []
        self.talker_fed_ids: list = []
        self.talker_emitted: list = []
        self.talker_draws: list[float] = []
        self.talker_turns: list[FakeTalkerTurn] = []
        self.vocoders: list[FakeVocoder] = []
        self.vocoder_args: list = []
        self.first_out = None

    @property
    def vocoder_pushes(self) -> list:
        """What this turn's vocoder was pushed (one list of codes a call)."""
        return [p for v in self.vocoders for p in v.pushes]

    @property
    def vocoder_finished(self) -> int:
        return sum(v.finished for v in self.vocoders)

    def _hook(self, name: str) -> None:
        i = self.calls.get(name, 0)
        self.calls[name] = i + 1
        fn = self.hooks.get(name)
        if fn is not None:
            fn(i)

    # -- thinker --------------------------------------------------------------------------------
    def _thinker_out(self, fed: list[int]) -> _Out:
        j = len(self.thinker_emitted)
        nxt = self.text[j] if j < len(self.text) else OVERSHOOT_TEXT + j
        self.thinker_emitted.append(nxt)
        logits = torch.zeros(1, TEXT_VOCAB)
        logits[0, nxt] = 1e4  # greedy picks it; sampled, it has probability 1
        n = len(fed)
        hidden = torch.tensor([[[REPLY_KIND, t, 0] for t in fed]], dtype=torch.float32).view(1, n, 3)
        return _Out(embeds=hidden.clone(), hidden=hidden, logits=logits)

    def prefill(self, input_ids, media=None):
        self._hook("thinker.prefill")
        self.prefill_ids.append(input_ids.tolist())
        out = self._thinker_out(input_ids[0].tolist())
        self.first_out = out
        return out

    def decode_one(self, token):
        self._hook("thinker.decode_one")
        tok = int(token.reshape(-1)[0])
        self.thinker_fed.append(tok)
        return self._thinker_out([tok])

    def kept_context(self):
        return {"found": 0, "held": 0, "bytes": 0}  # a fresh prefill each turn

    def reply_vector(self, out):
        self._hook("reply_vector")
        return out.hidden[:, -1:, :]

    def token_vector(self, token):
        self._hook("token_vector")
        return torch.tensor([[[REPLY_KIND, 0, 1]]], dtype=torch.float32) + \
            torch.nn.functional.pad(token.view(1, 1, 1).float(), (1, 1))

    # -- talker and vocoder ---------------------------------------------------------------------
    def talker_turn(self, prompt_ids, voice, sampling, generator, force_audio):
        self._hook("talker_turn")
        turn = FakeTalkerTurn(self, {"prompt_ids": prompt_ids, "voice": voice, "sampling": sampling,
                                         "generator": generator, "force_audio": force_audio})
        self.talker_turns.append(turn)
        return turn

    def vocoder(self, voice, seed, max_codes):
        self._hook("vocoder")
        self.vocoder_args.append((voice, seed, max_codes))
        voc = FakeVocoder(self, self.chunk, self.codes_for_first_audio)
        self.vocoders.append(voc)
        return voc

    def warmup(self):
        return None


def make_engine(steps: FakeSteps, max_lag: int = 4) -> Engine:
    """An Engine as `Assistant` builds one: the steps, a tokenizer, the text EOS ids."""
    return Engine(steps, FakeTokenizer(steps), eos_ids=list(EOS_IDS), max_lag=max_lag)


GREEDY = SamplingOptions(do_sample=False)
SAMPLED = SamplingOptions()


def request(max_text_tokens: int = 64, max_codes: int = 64, *, sink=None, text_only: bool = False,
            seed: int = 7, thinker: SamplingOptions = GREEDY, talker: SamplingOptions = SAMPLED,
            **kw) -> TurnRequest:
    return TurnRequest(input_ids=list(PROMPT), voice="Chelsie", thinker=thinker, talker=talker,
                       max_text_tokens=max_text_tokens, max_codes=max_codes, seed=seed, text_only=text_only,
                       sink=sink, **kw)


def run_turn(engine: Engine, req: TurnRequest):
    """All events of one turn: (text deltas, audio blocks, the Reply)."""
    deltas, blocks, reply = [], [], None
    for ev in engine.stream(req):
        if isinstance(ev, TextDelta):
            deltas.append(ev.text)
        elif isinstance(ev, AudioBlock):
            blocks.append(ev)
        elif isinstance(ev, Done):
            reply = ev.reply
    return SimpleNamespace(deltas=deltas, blocks=blocks, reply=reply)


GATE_TIMEOUT = 5.0


class LaggingOutput(AsyncOutput):
    """The boundary with the latest host the lag allows: the producer handles pushed item n (either kind)
    only once the engine has pushed item n + max_lag - 1, or has stopped pushing. Deadlock-free: an engine
    waiting for kind K up to index i - max_lag waits for an item at least max_lag items back."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._gate = threading.Condition()
        self._pushed = 0
        self._ended = False

    def push(self, kind, index, value) -> None:
        super().push(kind, index, value)
        with self._gate:
            self._pushed += 1
            self._gate.notify_all()

    def _end(self) -> None:
        with self._gate:
            self._ended = True
            self._gate.notify_all()

    def finish(self) -> None:
        super().finish()
        self._end()

    def cancel(self) -> None:
        super().cancel()
        self._end()

    def drain(self, handle) -> None:
        count = itertools.count()

        def late(kind, index, value):
            n = next(count)
            with self._gate:
                if not self._gate.wait_for(lambda: self._ended or self._pushed >= n + self.max_lag, GATE_TIMEOUT):
                    raise AssertionError(f"the lagging host waited {GATE_TIMEOUT} s for item {n + self.max_lag - 1}")
            handle(kind, index, value)

        super().drain(late)
