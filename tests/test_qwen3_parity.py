"""Qwen3-Omni through the real runtime (`Assistant.say` -> `Engine` -> turn threads -> schedule) against
transformers' own `Qwen3OmniMoeForConditionalGeneration.generate`, greedy:

- the reply's text ids and all 16 codebooks of every frame identical (0 mismatches), on the built-in tiny
  checkpoint and the two extra configs of qwen3_reference.py (other widths, depths, expert counts, a
  shared expert in every talker layer), every voice, replies whose text ends by EOS and by length,
  speech that ends by the codec EOS and by `max_codes`, and the second turn of a conversation;
- the prompt ids come from our prompt builder (`omni_cli.prompt.build_ids`), the reference gets the same;
- the streamed audio: `reply.audio` and what the sink received have the whole decode's length
  (1920 * F - 555 samples) and are within `AUDIO_BOUND` of generate's waveform and of `code2wav(codes)`;
  the first block reaches the sink while the talker is still generating.

Step-level checks the runtime path cannot see (layer inputs bit for bit, the thinker's `accepted`
state, seeded sampling) are in test_qwen3_steps.py.
"""

from __future__ import annotations

import functools
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import qwen3_reference as ref  # noqa: E402  (tests/ is on sys.path)

from omni_cli.assistant import Assistant  # noqa: E402
from omni_cli.config import RuntimeOptions  # noqa: E402
from omni_cli.models import qwen3_omni  # noqa: E402
from omni_cli.prompt import Conversation, build_ids  # noqa: E402

# Streamed audio vs the reference's whole-utterance decode (float32, CPU). Measured over every reply here:
# at most 2.4e-7 on the built-in model (80 frames) and 5.4e-7 on "wide"; code2wav.py's docstring gives
# <= 3.1e-7 for the built-in one. Samples peak near 0.6, so this is rounding, not a seam or an offset.
AUDIO_BOUND = 1e-6
SAMPLES_PER_FRAME, SEAM_LAG = 1920, 555
N_TEXT, N_CODES = 16, 24
LONG = "Hello there! What is the weather like today?"


@functools.lru_cache(maxsize=None)
def assistant(name: str) -> Assistant:
    """"builtin": the committed checkpoint through the loader; else a qwen3_reference config in an Assistant."""
    if name == "builtin":
        return Assistant.load(str(ref.ASSET), device="cpu")  # assets/tiny-qwen3-omni
    from transformers import GenerationConfig

    model = ref.model(name)
    voices = {str(n).capitalize(): int(i) for n, i in model.config.talker_config.speaker_id.items()}
    loaded = SimpleNamespace(
        model=model, tokenizer=ref.tokenizer(), speakers=voices, is_demo=True, name=f"tiny-qwen3-{name}",
        generation_config=GenerationConfig.from_pretrained(ref.ASSET), family=qwen3_omni,
    )
    return Assistant(loaded, RuntimeOptions(max_context=512, max_codes=128))


def reference(a: Assistant, ids: list[int], voice: str, n_text: int, n_codes: int):
    """(text ids, frames as lists, waveform) from generate, with our thinker's EOS ids and repetition penalty."""
    text, codes, wav = ref.reference_generate(
        a.loaded.model, ids, voice=voice, frames=n_codes, text_tokens=n_text, eos=a.engine.eos_ids,
        repetition_penalty=a.thinker_sampling.repetition_penalty, with_wav=True,
    )
    return text, codes.tolist(), wav


def check_reply(a: Assistant, reply, ids: list[int], voice: str, n_text: int, n_codes: int):
    """Shape of the reply, then text, every codebook of every frame and the audio against generate."""
    assert isinstance(reply.codes, list) and len(reply.codes) <= n_codes
    assert all(isinstance(f, list) and len(f) == 16 and all(type(c) is int for c in f) for f in reply.codes)
    want_text, want_codes, want_wav = reference(a, ids, voice, n_text, n_codes)
    assert reply.text_ids == want_text
    assert len(reply.codes) == len(want_codes), (len(reply.codes), len(want_codes))
    mismatches = sum(x != y for f, g in zip(reply.codes, want_codes) for x, y in zip(f, g))
    assert mismatches == 0, f"{mismatches} of {16 * len(want_codes)} codes differ"
    assert len(reply.audio) == len(want_wav) == SAMPLES_PER_FRAME * len(reply.codes) - SEAM_LAG
    assert float(np.abs(reply.audio - want_wav).max()) <= AUDIO_BOUND
    return want_wav


def ids_for(a: Assistant, prompt: str, conversation: Conversation | None = None) -> list[int]:
    conv = conversation or Conversation(system=a.default_system)
    return build_ids(a.loaded.tokenizer, conv.messages(prompt))


# (model, voice, prompt, text tokens, how the text ends, how the speech ends): every voice on every model,
# each model with text ending by EOS and by length; speech ending by the codec EOS on two of them.
CASES = [
    ("builtin", "Aiden", "Ok", N_TEXT, "eos", "limit"),
    ("builtin", "Chelsie", LONG, N_TEXT, "length", "limit"),
    ("builtin", "Ethan", "Please play some quiet music.", N_TEXT, "length", "stop"),  # after 2 frames
    ("wide", "Aiden", "What time is it?", N_TEXT, "length", "limit"),
    ("wide", "Chelsie", "Why?", N_TEXT, "eos", "limit"),
    ("wide", "Ethan", "Thanks", N_TEXT, "eos", "limit"),
    ("deep", "Aiden", "Thanks", N_TEXT, "eos", "limit"),  # a 3-token reply: text-EOS fed at frame 2
    ("deep", "Chelsie", "Hi", N_TEXT, "length", "limit"),
    ("deep", "Ethan", "What time is it?", 20, "length", "stop"),
]


@pytest.mark.parametrize("name, voice, prompt, n_text, text_end, speech_end", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[4]}-{c[5]}" for c in CASES])
def test_greedy_reply_matches_generate(name, voice, prompt, n_text, text_end, speech_end):
    a = assistant(name)
    ids = ids_for(a, prompt)
    reply = a.say(prompt, greedy=True, voice=voice, max_text_tokens=n_text, max_codes=N_CODES)
    check_reply(a, reply, ids, voice, n_text, N_CODES)
    # The case is what it says it is (else it would silently cover less).
    assert (reply.text_ids[-1] in a.engine.eos_ids) == (text_end == "eos")
    assert (len(reply.text_ids) == n_text) == (text_end == "length")
    assert (len(reply.codes) < N_CODES) == (speech_end == "stop") and len(reply.codes) >= 1
    if speech_end == "limit":
        assert len(reply.text_ids) < len(reply.codes)  # the talker was fed text-EOS and text-pad too


@pytest.mark.parametrize("name", ["builtin", "wide", "deep"])
def test_second_turn_matches_generate(name):
    """A conversation with a system prompt: the thinker reads it all, the talker only the two user turns."""
    a = assistant(name)
    chat = a.conversation(system="Be brief.")
    ids = ids_for(a, "Tell me a short story.", chat.history)
    first = chat.say("Tell me a short story.", greedy=True, voice="Chelsie", max_text_tokens=8, max_codes=8)
    check_reply(a, first, ids, "Chelsie", 8, 8)
    assert chat.history.turns[-1] == {"role": "assistant", "content": first.text}
    ids = ids_for(a, "And then what happened?", chat.history)
    im_start = a.loaded.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 5  # system, two users, one assistant, the opener
    second = chat.say("And then what happened?", greedy=True, voice="Chelsie", max_text_tokens=N_TEXT,
                      max_codes=N_CODES)
    check_reply(a, second, ids, "Chelsie", N_TEXT, N_CODES)
    assert len(chat.history.turns) == 4


class _Recorder:
    """A sink that keeps each block and when it arrived (time.perf_counter())."""

    def __init__(self) -> None:
        self.blocks: list[np.ndarray] = []
        self.times: list[float] = []
        self.rate = None
        self.closed = self.aborted = False
        self.thread: set[str] = set()

    def start(self, sample_rate: int) -> None:
        self.rate = sample_rate
        self.thread.add(threading.current_thread().name)

    def write(self, block) -> None:
        self.times.append(time.perf_counter())
        self.blocks.append(np.array(block, dtype=np.float32, copy=True))
        self.thread.add(threading.current_thread().name)

    def close(self) -> None:
        self.closed = True
        self.thread.add(threading.current_thread().name)

    def abort(self) -> None:
        self.aborted = True


def test_streamed_audio_is_the_whole_decode_and_starts_early():
    a = assistant("builtin")
    frames = 80  # 6.4 s of speech: chunks of 4, 8, 16, 25, 25 and the rest
    sink = _Recorder()
    ids = ids_for(a, LONG)
    reply = a.say(LONG, greedy=True, voice="Chelsie", max_text_tokens=12, max_codes=frames, sink=sink)
    want_wav = check_reply(a, reply, ids, "Chelsie", 12, frames)  # codes equal: generate's waveform applies
    assert len(reply.codes) == frames

    # What the sink received is reply.audio, sample for sample, in several blocks, from one thread.
    assert sink.closed and not sink.aborted and sink.rate == reply.sample_rate == 24_000 and len(sink.thread) == 1
    assert len(sink.blocks) >= 5 and len(sink.blocks[0]) < len(reply.audio) // 4
    streamed = np.concatenate(sink.blocks)
    assert np.array_equal(streamed, reply.audio)
    assert len(streamed) == SAMPLES_PER_FRAME * frames - SEAM_LAG

    # The whole decode of the reply's own frames (transformers' code2wav in one call), and generate's.
    with torch.inference_mode():
        whole = a.loaded.model.code2wav(torch.tensor(reply.codes).T[None]).reshape(-1).float().numpy()
    assert len(whole) == len(streamed)
    assert float(np.abs(streamed - whole).max()) <= AUDIO_BOUND
    assert float(np.abs(streamed - want_wav).max()) <= AUDIO_BOUND
    assert float(np.abs(streamed).max()) > 0.05  # not silence compared with silence

    # Streaming: the first block reached the sink while the talker still had frames to make.
    first_audio, last_step = reply.stats["time_to_first_audio"], reply.stats["talker_last_step"]
    assert first_audio is not None and last_step is not None
    assert first_audio < last_step, (first_audio, last_step)
    assert sink.times[0] - reply.stats["started_at"] < last_step
    assert reply.stats["talker_steps"] >= frames
