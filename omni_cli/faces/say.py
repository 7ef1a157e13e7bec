"""omni-say: one question, one answer — the text on stdout as it is generated, the speech through the
speakers while it is generated, into an audio file (`-o FILE`), or as WAV on stdout (`-o -`).

The prompt is the argument, piped stdin (or `-f FILE`), or both (stdin/file first). Everything a person
can get wrong (the outputs, the format, the voice, a model path, a sound device) is checked before the
model loads; through a server the request goes out first and the server works while the outputs are
opened here. Ctrl-C stops the reply at once: the sound, the generation and the files (an interrupted
reply leaves no file, and the text stops where the Ctrl-C came).

It holds no model logic: the assistant comes from `connect`, and is used through `omni_cli.interface`.
Nothing heavy is imported before the command runs, so `--help` is instant.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..config import ReplyOptions
from ..errors import OmniError, OutputError, UsageError
from . import connect
from .console import TextOut, consoles, print_audio_devices, safe_text_streams, shown
from .inputs import gather_prompt, read_clips, read_images
from .options import (
    ApiKeyOpt, AttentionKernelOpt, AudioDeviceOpt, CompileOpt, DebugOpt, DeviceOpt, DtypeOpt, GraphsOpt, GreedyOpt, KeepAliveOpt, KernelsOpt, QuantizeOpt, GroupSizeOpt,
    ListDevicesOpt, LocalOpt, MaxCodesOpt, MaxTextOpt, ModelOpt, OneLineErrors, SeedOpt, ServerOpt, TemperatureOpt,
    TopKOpt, TopPOpt, VerboseOpt, VersionOpt, VoiceOpt, make_app, runtime_options, where_from_flags,
)
from .program import (
    InterruptTimes, end_on_signals, err_line, exit_on, process_started_at, report_library_logs, run,
    stop_on_interrupt,
)
from .timing import AudioClock, print_command_startup, print_memory, print_timing, speech_steps

say_app = make_app(
    "omni-say",
    "Ask a local Qwen-Omni model (Qwen2.5-Omni or Qwen3-Omni) one question: the answer's text on stdout, its "
    "speech through the speakers (or into a WAV file with -o).")

# The names --format takes, for --help (what this machine writes is checked when it is used).
FORMAT_NAMES = "wav, flac, ogg (Vorbis), opus, mp3"


@say_app.command(cls=OneLineErrors)
def say(
    prompt: Annotated[Optional[str], typer.Argument(
        metavar="PROMPT", show_default=False,
        help="What to say to the model. Piped stdin (or -f FILE) is used too, before PROMPT.")] = None,
    file: Annotated[Optional[str], typer.Option(
        "--file", "-f", metavar="FILE", show_default=False,
        help="Read the prompt from FILE ('-': stdin), before PROMPT if both are given; stdin is then not read. "
        "A regular file of at most 16 MiB (a FIFO or device is refused).")] = None,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", metavar="FILE", show_default=False, dir_okay=False,
        help="Write the speech to this audio file instead of playing it (24 kHz mono; the format from the "
        "extension: .wav, .flac, .ogg, .opus, .mp3; none: WAV); '-' streams WAV to stdout.")] = None,
    format: Annotated[Optional[str], typer.Option(
        "--format", metavar="FORMAT", show_default=False,
        help=f"The audio format of -o FILE whatever its extension: {FORMAT_NAMES}.")] = None,
    play: Annotated[bool, typer.Option("--play", help="Play through the speakers too when -o is given.")] = False,
    voice: VoiceOpt = None,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    graphs: GraphsOpt = True,
    compile: CompileOpt = False,
    kernels: KernelsOpt = True,
    quantize: QuantizeOpt = None,
    group_size: GroupSizeOpt = None,
    attention_kernel: AttentionKernelOpt = True,
    seed: SeedOpt = None,
    greedy: GreedyOpt = False,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    max_text_tokens: MaxTextOpt = None,
    max_codes: MaxCodesOpt = None,
    text_only: Annotated[bool, typer.Option("--text-only", help="Answer in text only: no speech is generated.")] = False,
    audio_device: AudioDeviceOpt = None,
    server: ServerOpt = None,
    api_key: ApiKeyOpt = None,
    local: LocalOpt = False,
    keep_alive: KeepAliveOpt = "5m",
    audio: Annotated[Optional[list[str]], typer.Option(
        "--audio", "-a", metavar="FILE", show_default=False,
        help="Say this audio to the model with the prompt (any format libsndfile reads, any rate; '-': stdin); "
        "repeatable. The prompt's text is then optional. At most 10 minutes and 256 MiB a file.")] = None,
    image: Annotated[Optional[list[str]], typer.Option(
        "--image", "-i", metavar="FILE", show_default=False,
        help="Show the model this image with the prompt (any format Pillow opens); repeatable. At most 40 MP "
        "(read from its header) and 256 MiB.")] = None,
    list_voices: Annotated[bool, typer.Option("--list-voices", help="List the model's voices (read from the checkpoint, without loading it) and exit.")] = False,
    list_audio_devices: ListDevicesOpt = False,
    verbose: VerboseOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No notices or summary on stderr (errors still).")] = False,
    debug: DebugOpt = False,
    version: VersionOpt = False,
    system: Annotated[Optional[str], typer.Option(
        "--system", "-s", metavar="TEXT", show_default=False,
        help="A system prompt for this question (default: the model's own: Qwen2.5-Omni's, which it needs to "
        "speak; none for Qwen3-Omni).")] = None,
    ps: Annotated[bool, typer.Option("--ps", help="Show the background omni-serve that keeps a model loaded, and exit.")] = False,
    stop: Annotated[bool, typer.Option("--stop", help="Stop the background omni-serve (if idle), and exit.")] = False,
) -> None:
    """Answer PROMPT: the text on stdout, the speech through the speakers, an audio file (-o FILE) or stdout (-o -)."""
    t_command = time.perf_counter()
    t_process = process_started_at()  # before this function: the interpreter's start and our imports

    safe_text_streams()
    end_on_signals()
    report_library_logs(quiet)
    outputs = _Outputs()
    interrupt = InterruptTimes()
    try:
        if list_audio_devices:
            print_audio_devices()
            return
        if ps or stop:
            from .background import show_or_stop

            show_or_stop(stop=stop)
            return
        if list_voices or voice == "?":
            _print_voices(model)
            return
        from ..atomic import descriptor_of

        # -o - (and -o /dev/stdout, the same descriptor): the WAV is stdout, so the text goes to stderr
        to_stdout = output is not None and (str(output) == "-" or descriptor_of(output) == 1)
        if text_only and (output is not None or play):
            raise UsageError("--text-only makes no speech: leave out -o and --play")
        if format is not None and output is None:
            raise UsageError("--format is the format of -o FILE: give -o FILE too")
        if to_stdout and format is not None and format.strip().lower() != "wav":
            raise UsageError("-o - streams WAV only: write other formats to a file (-o FILE --format ...)")
        options = ReplyOptions(voice=voice, greedy=greedy, seed=seed, max_text_tokens=max_text_tokens,
                               max_codes=max_codes, text_only=text_only, temperature=temperature, top_p=top_p,
                               top_k=top_k).check()
        where = where_from_flags(model, runtime_options(device, dtype, graphs, compile, kernels=kernels, attention_kernel=attention_kernel, quantize=quantize, group_size=group_size), server, api_key, local,
                                 keep_alive, quiet)
        play = not text_only and (play or output is None)
        clips = read_clips(audio or [])
        pictures = read_images(image or [])  # checked before the model loads
        # With audio or an image the text is optional (`--audio -` has read stdin to its end already).
        text = gather_prompt(prompt, file, optional=bool(clips or pictures))
        media = {**({"audio": clips} if clips else {}), **({"images": pictures} if pictures else {})}

        # A server first, as it needs no loading: the request goes out now, and the server works on the
        # reply while the outputs (and the consoles: rich's import, ~17 ms) are set up here.
        t_remote = time.perf_counter()
        assistant = connect.find_server(where)
        if assistant is not None:
            options = options if text_only else connect.voice_for(options, where, assistant)
            assistant.send(text, options, **_with_system(media, assistant, system))
            # --verbose: the client's share of the wait (the server's is the reply's first audio)
            assistant.startup = {"before the server (prompt)": t_remote - t_command,
                                 "find the server, check the model and voice, send": time.perf_counter() - t_remote}
        _, err = consoles()

        # Outputs and voice before loading: a bad path or format, a missing sound device or an unknown voice
        # should not cost a minute of loading (through a server: the request is withdrawn).
        try:
            _open_outputs(outputs, output, format, to_stdout, play, audio_device)
        except BaseException:
            if assistant is not None:
                assistant.close()
            raise
        if assistant is None:
            if not text_only:
                options = connect.voice_for(options, where)
            assistant = connect.load(where, err, t_command, "before loading (prompt, outputs, voice)")
            media = _with_system(media, assistant, system)
        else:
            media = _with_system(media, assistant, system)
        if t_process is not None:
            assistant.startup = {"start Python, import the command": t_command - t_process, **assistant.startup}
        if to_stdout:
            with _stdout_for_wav() as wav_file:
                reply = _say_once(assistant, text, options, outputs, wav_file, TextOut(None if quiet else sys.stderr),
                                  interrupt, media)
        else:
            reply = _say_once(assistant, text, options, outputs, None, TextOut(sys.stdout), interrupt, media)
        if not quiet:
            seconds = len(reply.audio) / reply.sample_rate if reply.audio is not None else 0.0
            if outputs.file is not None:
                err_line(f"wrote {output} ({seconds:.1f} s audio)")
            elif to_stdout:
                err_line(f"wrote {seconds:.1f} s of WAV audio to stdout")
        if verbose:
            print_timing(err, reply.stats, outputs.speaker.stats if outputs.speaker is not None else None,
                         unit=speech_steps(assistant)[0])
            print_command_startup(err, assistant, reply.stats, t_command if t_process is None else t_process)
            print_memory(err, assistant)
    except BaseException as exc:  # noqa: BLE001 - every way out is reported, none with a traceback
        if isinstance(exc, (SystemExit, typer.Exit)):
            raise
        exit_on(exc, debug, outputs.sinks(), interrupt if verbose else None)


def _with_system(media: dict, assistant: Any, system: str | None) -> dict:
    """The reply's keyword arguments with `--system`: a one-turn conversation under that system prompt."""
    if system is None:
        return media
    from ..prompt import check_text

    return {**media, "conversation": assistant.conversation(check_text(system, "the system prompt")).history}


def _print_voices(model: str | None) -> None:
    """--list-voices (and -v '?'): the checkpoint's voices, read without torch or the weights."""
    from ..loader import model_voices

    connect.check_model(model)
    for name in model_voices(model):
        print(shown(name, sys.stdout), flush=True)  # the checkpoint's names


def _open_outputs(outputs: "_Outputs", output: Path | None, format: str | None, to_stdout: bool, play: bool,
                  audio_device: str | None) -> None:
    from ..audio.sinks import AudioFileSink
    from ..audio.speaker import SpeakerSink

    outputs.file = AudioFileSink(output, format) if output is not None and not to_stdout else None
    if play:
        outputs.speaker = SpeakerSink(audio_device)


@contextlib.contextmanager
def _stdout_for_wav():
    """A binary file on the real stdout for the WAV stream; fd 1 itself then points at stderr, so that
    nothing else (a library's print, a C warning) can land in the WAV."""
    try:
        fd = sys.stdout.fileno()
        err_fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        yield sys.stdout.buffer  # not a real descriptor (tests): no one else writes there
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    wav = open(os.dup(fd), "wb")
    os.dup2(err_fd, fd)
    try:
        yield wav
    finally:
        try:
            wav.close()
        except OSError:
            pass
        sys.stdout.flush()
        os.dup2(saved, fd)
        os.close(saved)


@dataclass
class _Outputs:
    """Where one omni-say reply's speech goes; each None when not asked for."""

    file: Any = None  # AudioFileSink for -o FILE
    stream: Any = None  # WavStreamSink on stdout for -o -
    speaker: Any = None  # SpeakerSink when playing

    def sinks(self) -> list:
        return [s for s in (self.file, self.stream, self.speaker) if s is not None]


def _say_once(assistant, text: str, options, outputs: _Outputs, wav_file, text_out: TextOut, interrupt,
              media: dict | None = None):
    """One reply: text to `text_out`, speech to `outputs` (and, for -o -, a WAV stream on `wav_file`);
    `media`: the prompt's clips, images and conversation (each only when given).

    A Ctrl-C (or SIGTERM/SIGHUP) aborts every output at once, before the reply's stream is closed: the
    sound stops, no file is left (an interrupted reply is not a whole one) and no more text is printed."""
    from ..audio.sinks import TeeSink, WavStreamSink
    from ..runtime.events import AudioBlock, Done, TextDelta

    if wav_file is not None:
        outputs.stream = WavStreamSink(wav_file)
    parts = outputs.sinks()
    speaker = outputs.speaker
    if speaker is not None:
        speaker.open(assistant.sample_rate)  # device errors now, before any generation
    sink = parts[0] if len(parts) == 1 else TeeSink(parts) if parts else None
    reply = None
    clock = AudioClock()
    try:
        with stop_on_interrupt(*parts, text_out, times=interrupt):
            events = assistant.stream(text, options, sink=sink, **(media or {}))
            try:
                for event in events:
                    if isinstance(event, TextDelta):
                        text_out.write(event.text)
                    elif isinstance(event, AudioBlock):
                        clock.tick()
                    elif isinstance(event, Done):
                        reply = event.reply
            finally:
                events.close()  # on Ctrl-C or an error: stops the engine's threads
    except BaseException:
        with contextlib.suppress(OutputError):
            text_out.end()  # the text's line is ended before the error message; the error is what counts
        raise
    text_out.end()  # a reader gone by now is still a closed pipe (141), as for any other write
    if sink is not None:
        sink.close()  # a no-op if the engine closed it already
    if reply is None:  # a stream ends with Done, or raises: anything else is a bug of the assistant's
        raise OmniError("the reply ended without its end (no Done event)")
    reply.stats = clock.stats(reply.stats)
    return reply



def main() -> None:
    """The `omni-say` program."""
    run(say_app, "omni-say")


if __name__ == "__main__":
    main()
