"""The Python API the CLI is built on: `Assistant.load(...)`, `say()`, `stream()`, conversations.

    assistant = omni_cli.load()                 # $OMNI_MODEL, or the built-in tiny demo model
    reply = assistant.say("Hello!", voice="Chelsie", seed=0)
    reply.text, reply.text_ids, reply.codes, reply.audio, reply.sample_rate, reply.stats

    for event in assistant.stream("Tell me a story"):   # TextDelta / AudioBlock / Done
        ...

    chat = assistant.conversation()             # multi-turn: history kept between calls
    chat.say("Hi"); chat.say("And then?")

It turns requests into `runtime.events.TurnRequest`s (prompt ids, sampling settings, limits) and validates them
(empty prompt, unknown voice, context overflow) with errors a person can act on. It knows nothing of
terminals, files or sound devices: audio goes to whatever sink the caller passes.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Generator

import numpy as np

from .config import ReplyOptions, RuntimeOptions, SamplingOptions
from .encoder_inputs import EncoderInputs
from .interface import ModelInfo, OmniAssistant
from .errors import UsageError
from .limits import DEFAULT as DEFAULT_INPUT_LIMITS, LimitError, Limits
from .prompt import Chat, Conversation, MarkerError, check_length, check_prompt, fit  # noqa: F401 - Chat re-exported
from .runtime.engine import Engine, fresh_seed
from .runtime.events import AudioBlock, Done, Reply, TextDelta, TurnRequest
from .warm_up import WarmsUp

__all__ = ["Assistant", "Chat", "Reply", "ReplyOptions", "TextDelta", "AudioBlock", "Done"]

log = logging.getLogger(__name__)

# Reply limits when the caller gives none, in seconds of audio for the talker (the family's
# CODES_PER_SECOND turns them into steps: about 82 s, which sizes the talker's cache too). The demo model
# never stops by itself (random weights), so it gets short ones: a whole demo reply takes seconds on one
# CPU core.
DEFAULT_LIMITS = {"text": 1024, "seconds": 81.92}
DEMO_LIMITS = {"text": 24, "seconds": 3.0}
# GPU memory that must be free to compile the steps beside the serving ones (`compile_beside`): a second set
# of caches and graphs, and the compiler's own work. Measured on an H200 with Qwen2.5-Omni-7B: 21.6 GiB in
# use before, 34.5 GiB held by the process (allocator caches included) once the compiled steps took over.
BESIDE_FREE_GIB = 16


def thinker_sampling(generation_config) -> SamplingOptions:
    """The checkpoint's thinker settings, with transformers' defaults for what it leaves out."""
    g = generation_config

    def get(name, default):
        value = getattr(g, name, None)
        return default if value is None else value

    return SamplingOptions(
        do_sample=bool(get("do_sample", False)),
        temperature=float(get("temperature", 1.0)),
        top_k=int(get("top_k", 50)),
        top_p=float(get("top_p", 1.0)),
        repetition_penalty=float(get("repetition_penalty", 1.0)),
    )


def eos_ids(generation_config, tokenizer) -> list[int]:
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    if isinstance(eos, int):
        eos = [eos]
    return [int(i) for i in eos if i is not None]


class Assistant(WarmsUp):
    url: str | None = None  # a model loaded in this process (interface.OmniAssistant)
    keeps_media = True  # a conversation's turns keep their clips and images (the remote client's too)

    # True while `compile_beside` compiles a second set of steps (omni-serve's /health says "compiling").
    compiling = False
    # The caps on one input's cost (limits.py): a prompt's characters, a clip's length, an image's
    # pixels, checked before tokenizing or decoding. omni-serve sets its own instance here.
    input_limits: Limits = DEFAULT_INPUT_LIMITS

    def __init__(self, loaded, runtime: RuntimeOptions | None = None) -> None:
        """`runtime`: how the steps are built (cache sizes, graphs, compile; None = the defaults), as the
        face read it from its flags and the environment (`RuntimeOptions.from_env`); nothing is read here."""
        runtime = runtime or RuntimeOptions()
        self.loaded = loaded
        self.family = loaded.family
        self.is_demo = loaded.is_demo
        self.name = loaded.name
        limits = DEMO_LIMITS if loaded.is_demo else DEFAULT_LIMITS
        per_second = self.family.CODES_PER_SECOND
        self.limits = {"text": limits["text"], "codes": round(limits["seconds"] * per_second)}
        self.thinker_sampling = thinker_sampling(loaded.generation_config)
        self.talker_sampling = self.family.talker_sampling(loaded.generation_config)
        self.max_context = runtime.max_context
        t = time.perf_counter()
        # How the steps are asked for (`compile_beside` builds them again, compiled).
        self.asked = replace(runtime, max_codes=runtime.max_codes or round(DEFAULT_LIMITS["seconds"] * per_second))
        try:
            steps = self.family.build_steps(loaded.model, loaded.speakers, runtime=self.asked)
        except Exception as exc:
            from .models.weights import is_oom

            if is_oom(exc):
                raise _cache_oom(self.max_context, runtime.quantize) from exc
            raise
        self.sample_rate = steps.sample_rate
        # How the model runs, as built (omni-serve tells its clients, which compare it with their flags): a
        # frozen RuntimeOptions, replaced (never changed) when compiled steps take over.
        self.runtime = self._built(steps)
        self.engine = Engine(steps, loaded.tokenizer, eos_ids=eos_ids(loaded.generation_config, loaded.tokenizer))
        # Where start-up time went (`--verbose`): the loader's phases, then ours.
        self.startup = dict(getattr(loaded, "timings", None) or {})
        self.startup["static caches and fused steps"] = time.perf_counter() - t
        # CUDA graphs and compiled kernels: made while loading, so turns only replay them.
        t = time.perf_counter()
        phases = self.engine.warmup()
        self.startup.update(phases or {"warm-up": time.perf_counter() - t})
        self.ready_at = time.perf_counter()  # when a request can start (perf_counter)

    def _built(self, steps) -> RuntimeOptions:
        """`self.asked` as `steps` were built: the device and dtype they run on, graphs and compile as they are."""
        dtype = next(self.loaded.model.thinker.parameters()).dtype  # the talker's too (token2wav: float32 unless packed)
        return steps.policy.to_runtime(replace(self.asked, max_codes=steps.max_codes),
                                       str(dtype).removeprefix("torch."))

    @classmethod
    def load(cls, model: str | None = None, device: str = "auto", dtype: str = "auto",
             runtime: RuntimeOptions | None = None, progress=None) -> "Assistant":
        """Load a checkpoint; `runtime` overrides device/dtype and sets graphs, cache sizes and packing
        (`quantize`). Without it, the options are `device`, `dtype` and the environment's switches
        (`RuntimeOptions.from_env`: OMNI_NO_GRAPHS=1, ...), as a face would read them. `progress(done,
        total)`: after each decoder layer packed (with `quantize`)."""
        from .loader import load_model

        rt = runtime or RuntimeOptions.from_env(device=device, dtype=dtype)
        return cls(load_model(model, device=rt.device, dtype=rt.dtype, quantize=rt.quantize,
                              group_size=rt.group_size, progress=progress), rt)

    @property
    def memory(self) -> dict:
        """The model's bytes as `--verbose` and /show tell them: `packed` (the packed weights, 0 without
        --quantize), `float` (the parameters left in their dtype), `weights` (both), `quantize`; `peak`:
        the device's most allocated so far (torch.cuda.max_memory_allocated; None off CUDA, where only the
        weights are known); `host`: of the weights, the bytes waiting in host memory (the vision tower until
        the first image: runtime/vision_place.py); `context`: the conversation's context kept for the next
        turn (`held` positions, `bytes` in the thinker's cache, already reserved, and beside it)."""
        import torch

        from .quant.apply import packed_bytes
        from .runtime.vision_place import host_bytes

        model = self.loaded.model
        packed = packed_bytes(model)
        floats = sum(p.numel() * p.element_size() for p in model.parameters())
        device = torch.device(self.loaded.device)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        return {"packed": packed, "float": floats, "weights": packed + floats,
                "quantize": getattr(self.loaded, "quantize", None), "peak": peak, "host": host_bytes(model),
                "context": self.engine.steps.kept_context()}

    def compile_beside(self, on_ready=None, on_failure=None):
        """Compile the steps on a thread of their own while the plain ones go on serving (runtime/beside.py);
        the engine takes the compiled ones between two turns, and `runtime` (replaced) says so; `compiling` is
        True meanwhile. `on_ready` gets the seconds it took, `on_failure` the exception. Returns the thread, or
        None where nothing would be compiled: a CPU, graphs off, steps compiled already. A RuntimeError where
        the GPU has too little memory free for a second set of steps beside the first (`BESIDE_FREE_GIB`)."""
        from .runtime.beside import compile_beside

        steps = self.engine.steps
        wanted = getattr(steps, "fast_decode", False) and not steps.policy.compile_on
        if not (wanted and steps.policy.compiling().compile_on):
            return None
        import torch

        free = torch.cuda.mem_get_info(steps.device)[0]
        if free < BESIDE_FREE_GIB * 2**30:  # an out-of-memory error could strike a reply that is running
            raise RuntimeError(f"{free / 2**30:.1f} GiB of GPU memory free, {BESIDE_FREE_GIB} GiB wanted beside "
                               "the steps that serve")

        built = {}

        def build():
            built["steps"] = self.family.build_steps(self.loaded.model, self.loaded.speakers,
                                                     runtime=replace(self.asked, compile=True))
            return built["steps"]

        def ready(seconds: float) -> None:
            self.runtime = self._built(built["steps"])
            self.compiling = False
            if on_ready is not None:
                on_ready(seconds)

        def failed(exc: BaseException) -> None:
            self.compiling = False
            if on_failure is not None:
                on_failure(exc)

        self.compiling = True
        return compile_beside(self.engine, build, ready, failed)

    @property
    def voices(self) -> list[str]:
        return list(self.loaded.speakers)

    @property
    def has_audio(self) -> bool:
        return self.engine.has_talker

    @property
    def default_system(self) -> str:
        """The system prompt a conversation gets when none is given (the family's)."""
        return self.family.DEFAULT_SYSTEM

    @property
    def speech_steps(self) -> tuple[str, float]:
        """What the talker's steps are called and how many make a second of audio: ("codes", 50.0) for
        Qwen2.5-Omni (one codec id a step), ("frames", 12.5) for Qwen3-Omni (16 codebooks a step)."""
        steps = self.engine.steps
        return ("frames" if steps.frame_width > 1 else "codes"), float(steps.codes_per_second)

    @property
    def speaks_only_under_default_system(self) -> bool:
        """Qwen2.5-Omni's talker speaks reliably only under its default system prompt."""
        return self.family.NEEDS_DEFAULT_SYSTEM

    @property
    def eos_ids(self) -> list[int]:
        """The token ids that end a reply's text (the checkpoint's generation config)."""
        return list(self.engine.eos_ids)

    @property
    def model_info(self) -> "ModelInfo":
        """The model as the faces show it (interface.ModelInfo)."""
        from .interface import ModelInfo

        unit, per_second = self.speech_steps
        base = self.thinker_sampling
        return ModelInfo(
            name=self.name, title=getattr(self.family, "TITLE", None), where=str(self.loaded.device),
            is_demo=self.is_demo, has_audio=self.has_audio, voices=tuple(self.voices),
            default_voice=self.default_voice if self.has_audio else None, default_system=self.default_system,
            speaks_only_under_default_system=self.speaks_only_under_default_system, sample_rate=self.sample_rate,
            step_unit=unit, steps_per_second=per_second, default_text_tokens=self.limits["text"],
            default_steps=self.limits["codes"], max_steps=self.engine.max_codes, max_context=self.max_context,
            text_sampling={"temperature": base.temperature, "top_p": base.top_p, "top_k": base.top_k},
            text_samples=base.do_sample)

    def interrupt(self) -> None:
        """Stop the reply that is running (from another thread: a server whose client went away)."""
        self.engine.interrupt()

    def close(self) -> None:
        """Nothing to let go of: the model stays loaded while the process runs (interface.OmniAssistant's
        `close`, which a remote assistant's connection needs)."""

    def conversation(self, system: str | None = None) -> "Chat":
        return Chat(self, Conversation(system=self.default_system if system is None else system))

    # ------------------------------------------------------------------------------------------
    def say(self, prompt: str, options: ReplyOptions | None = None, *, sink=None,
            conversation: Conversation | None = None, audio=None, images=None, **fields) -> Reply:
        """One reply, start to end. Audio goes to `sink` as it is produced (if given) and into `reply.audio`.

        `options` (a `ReplyOptions`) and/or its fields as keywords: voice, greedy, seed, max_text_tokens,
        max_codes, text_only, temperature, top_p, top_k (keywords override `options`)."""
        events = self.stream(prompt, options, sink=sink, conversation=conversation, audio=audio, images=images,
                             **fields)
        try:
            for event in events:
                if isinstance(event, Done):
                    return event.reply
        finally:
            events.close()  # on Ctrl-C or an error: stop the turn's threads now, not at garbage collection
        raise RuntimeError("turn ended without a reply")  # unreachable: stream always ends with Done

    def stream(self, prompt: str, options: ReplyOptions | None = None, *, sink=None,
               conversation: Conversation | None = None, audio=None, images=None,
               **fields) -> Generator[TextDelta | AudioBlock | Done, None, None]:
        """Yield `TextDelta`s and `AudioBlock`s as they exist, then `Done(reply)`.

        `audio`: clips the user says with the prompt (paths, `media.AudioClip`s, or (samples, rate)
        pairs); `images`: what the user shows (paths or PIL images); the prompt's text may then be empty. With a `conversation`, the prompt is appended to
        its history and, once the turn completes, the reply too (an interrupted turn leaves the history
        as it was); the turn's clips and images stay with it, so later turns hear and see them again.
        """
        self._after_warm_up()
        opts = reply_options(options, fields)
        req, conv, media, dropped = self._request(prompt, opts, sink, conversation, audio, images)
        events = self.engine.stream(req)
        try:
            for event in events:
                if isinstance(event, Done):
                    if dropped:  # a server sends it back, so that its client's history drops them too
                        event.reply.stats["dropped_exchanges"] = dropped
                    if conversation is not None:
                        conversation.turns[:] = conv.turns
                        conversation.add(prompt, event.reply.text, media)
                yield event
        finally:
            events.close()  # closing this generator (an interrupt) stops the turn at once

    @property
    def default_voice(self) -> str:
        """The voice a reply gets when none is asked for: the family's default (Qwen2.5-Omni: Chelsie,
        Qwen3-Omni: Ethan) when the model has it, else its first."""
        from .loader import check_voice

        voices = self.voices
        try:
            return check_voice(voices, self.family.DEFAULT_VOICE)
        except UsageError:
            return voices[0] if voices else self.family.DEFAULT_VOICE

    def _request(self, prompt, opts: ReplyOptions, sink, conversation, audio=None, images=None):
        from .loader import check_voice

        opts.check()
        n_text = self._limit(opts.max_text_tokens, "text")
        budget = self.max_context - n_text
        if budget < 1:
            raise LimitError(f"the reply's token cap ({n_text}) leaves no room for the prompt: the context holds "
                             f"{self.max_context} tokens in all, prompt and reply: ask for fewer",
                             param="max_text_tokens")
        conv = (Conversation(conversation.system, list(conversation.turns)) if conversation
                else Conversation(system=self.default_system))
        # Before anything else is checked, decoded or tokenized: a prompt no context can hold costs nothing.
        check_length(prompt, conv.system, budget, self.input_limits)
        clips = self._clips(audio)
        pictures = self._images(images)
        prompt = check_prompt(prompt) if not (clips or pictures) or (prompt or "").strip() else ""
        voice = opts.voice or self.default_voice
        text_only = opts.text_only or not self.has_audio
        if not text_only:
            voice = check_voice(self.loaded.speakers, voice)
        n_codes = self._limit(opts.max_codes, "codes")
        if n_codes > self.engine.max_codes:
            raise UsageError(f"max_codes {n_codes} is above this session's limit of {self.engine.max_codes}")
        user, media, expand = self._media_prompt(prompt, clips, pictures, conv)
        try:
            ids, dropped = fit(self.loaded.tokenizer, conv, user, budget, expand, self.input_limits)
        except UsageError as exc:
            if not clips or isinstance(exc, MarkerError):  # the hint is for a prompt too long
                raise
            seconds = sum(clip.seconds for clip in clips)
            raise UsageError(f"{exc} ({seconds:.1f} s of audio is part of it: use a shorter clip)") from None
        if dropped:
            # INFO: expected behaviour worth a note (the faces print INFO as `note: ...`), not a fault.
            log.info("dropped the oldest %d exchange(s) to fit the context", dropped)
            if media is not None:  # the dropped turns' clips and images go with them
                _, media, _ = self._media_prompt(prompt, clips, pictures, conv)
        tsamp = opts.thinker_sampling(self.thinker_sampling)
        ksamp = self.talker_sampling.greedy() if opts.greedy else self.talker_sampling
        req = TurnRequest(
            input_ids=ids, voice=voice, thinker=tsamp, talker=ksamp, max_text_tokens=n_text,
            max_codes=n_codes, seed=fresh_seed() if opts.seed is None else int(opts.seed), text_only=text_only,
            sink=sink, media=media,
        )
        return req, conv, {"audio": clips, "images": pictures}, dropped

    def _clips(self, audio) -> list:
        """The request's audio as 16 kHz clips (a UsageError for what cannot be read, or a model that
        does not hear)."""
        if audio is None:
            return []
        from .media import AudioClip, read_audio

        items = audio if isinstance(audio, (list, tuple)) and not _is_pair(audio) else [audio]
        if items and not self.family.HEARS_AUDIO:
            raise UsageError(f"audio input for {self.family.TITLE} is not supported yet")
        clips = []
        for item in items:
            if isinstance(item, AudioClip):
                clip = item
            elif _is_pair(item):
                clip = AudioClip(np.asarray(item[0], dtype=np.float32).reshape(-1), int(item[1]))
            else:
                clip = read_audio(item, limits=self.input_limits)
            clips.append(clip.at())
        return clips

    def _images(self, images) -> list:
        if images is None:
            return []
        from .media import read_image

        items = images if isinstance(images, (list, tuple)) else [images]
        if items and not self.family.SEES_IMAGES:
            raise UsageError(f"image input for {self.family.TITLE} is not supported yet")
        return [read_image(item, limits=self.input_limits) if isinstance(item, (str, os.PathLike)) else item.convert("RGB")
                for item in items]

    def _media_prompt(self, prompt: str, clips: list, pictures: list, history: Conversation):
        """(the user message: its images, audio and text parts; the encoder inputs for the history's
        media and this message's, in prompt order; how the rendered ids become the prompt's: each
        placeholder repeated as the processor repeats it)."""
        from .prompt import expand_placeholders, user_parts

        user = user_parts(prompt, len(pictures), len(clips)) if clips or pictures else prompt
        past_clips, past_pictures = history.media()
        # A turn this assistant kept holds its clips at the encoder's rate already; a conversation given
        # whole (a server's request, the API) may hold them at the file's rate, for which the placeholders
        # would be counted wrong.
        past_clips = [clip.at() for clip in past_clips]
        clips, pictures = past_clips + clips, past_pictures + pictures
        if not clips and not pictures:
            return prompt, None, None

        config = self.loaded.model.config
        if self._encoder_inputs is None:  # each clip's and image's inputs, made once a conversation
            self._encoder_inputs = EncoderInputs()
        media: dict[str, Any] = {}  # the encoders' inputs, and what the stats count of them
        expansions: list[tuple[int, list[int]]] = []  # (placeholder id, tokens each item becomes)
        if pictures:
            if self._image_processor is None:
                self._image_processor = self.family.image_processor(self.loaded.path)
            found, counts = self._encoder_inputs.image_inputs(self.family, self._image_processor, pictures)
            media.update(found, images=len(pictures))
            expansions.append((self.family.image_token_id(config), counts))
        if clips:
            from transformers import AutoFeatureExtractor

            if self._feature_extractor is None:
                self._feature_extractor = AutoFeatureExtractor.from_pretrained(str(self.loaded.path),
                                                                               local_files_only=True)
            found, counts = self._encoder_inputs.audio_inputs(self.family, self._feature_extractor, clips)
            media.update(found, audio_seconds=sum(clip.seconds for clip in clips))
            expansions.append((self.family.audio_token_id(config), counts))

        def expand(ids):
            for token, counts in expansions:
                ids = expand_placeholders(ids, token, counts)
            return ids

        return user, media, expand

    _feature_extractor = _image_processor = None
    _encoder_inputs: EncoderInputs | None = None

    def _limit(self, value, key) -> int:
        return self.limits[key] if value is None else int(value)


if TYPE_CHECKING:  # pragma: no cover - the type checker holds the class to what the faces use of it
    def _an_omni_assistant(assistant: Assistant) -> OmniAssistant:
        return assistant


def _cache_oom(max_context: int, quantize: str | None):
    """The one-line error of an out-of-memory while the static caches and steps are built: the weights
    are in, the caches sized for `max_context` tokens are not."""
    from .errors import OmniError

    smaller = max(64, max_context // 2)
    more = "" if quantize == "int4" else f", or --quantize {'fp8' if quantize is None else 'int4'} (smaller weights)"
    return OmniError(f"out of device memory building the caches for {max_context} tokens of context: try "
                     f"--max-context {smaller}{more}")


def _is_pair(item) -> bool:
    """(samples, sample rate): an array-like and an int."""
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], int) and hasattr(item[0], "__len__")


def reply_options(options: ReplyOptions | None, fields: dict) -> ReplyOptions:
    """`options` with keyword overrides; an unknown keyword is a TypeError, as for a normal call."""
    from dataclasses import fields as dc_fields, replace

    known = {f.name for f in dc_fields(ReplyOptions)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"unknown reply option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return replace(options or ReplyOptions(), **fields)
