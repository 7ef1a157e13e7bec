"""The command line: `omni-say` (one question, spoken) and `omni-chat` (a conversation), with typer.

omni-say: the prompt is the argument, piped stdin, or both (stdin first). The speech plays through
the sound device, or goes to a WAV file (`-o FILE`, `--play` to do both), or streams as WAV to stdout
(`-o -`: then stdout holds nothing but the WAV bytes, and the text goes to stderr). The reply's text
goes to stdout as it is generated; notices, the summary, `--verbose` timing and errors go to stderr.

Errors: an `OmniError` ends the command with `error: <message>` and its exit code (2 usage, 1 runtime),
no traceback unless `--debug`; Ctrl-C exits 130; anything else is reported as an internal error (1).
Outputs are checked (file writable, PortAudio and a device present) before the model loads.

It holds no model logic and imports neither torch, transformers, numpy nor sounddevice at import time,
so `--help` is instant: the model side is imported inside the commands.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .errors import OmniError, OutputError, UsageError, known_failure

say_app = typer.Typer(
    name="omni-say",
    help="Ask a local Qwen2.5-Omni model one question: the answer's text on stdout, its speech through "
    "the speakers (or into a WAV file with -o).",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

chat_app = typer.Typer(
    name="omni-chat",
    help="Talk with a local Qwen2.5-Omni model: type a message, read and hear the reply.",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# -- options both commands share --------------------------------------------------------------

ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", metavar="FOLDER|HUB_ID", show_default=False,
    help="Model folder or hub id (e.g. Qwen/Qwen2.5-Omni-7B). Default: $OMNI_MODEL, else the built-in "
    "tiny random-weight demo model.")]
VoiceOpt = Annotated[str, typer.Option("--voice", "-v", metavar="NAME", help="Voice from the model's spk_dict.pt (Qwen2.5-Omni: Chelsie, Ethan).")]
DeviceOpt = Annotated[str, typer.Option("--device", metavar="DEVICE", help="auto, cpu, cuda, cuda:N, npu, mps.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", metavar="DTYPE", help="auto (bfloat16 on accelerators, float32 on CPU), float32, bfloat16, float16.")]
GraphsOpt = Annotated[bool, typer.Option("--graphs/--no-graphs", help="CUDA graphs and compiled decode steps on a GPU (a no-op on CPU); --no-graphs runs them eagerly, as does OMNI_NO_GRAPHS=1.")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", metavar="N", show_default=False, help="Seed for sampling and the vocoder noise (reproducible replies).")]
GreedyOpt = Annotated[bool, typer.Option("--greedy", help="Greedy decoding instead of sampling.")]
MaxTextOpt = Annotated[Optional[int], typer.Option("--max-text-tokens", min=1, metavar="N", show_default=False, help="Cap on the reply's text tokens (default: the model's).")]
MaxCodesOpt = Annotated[Optional[int], typer.Option("--max-codes", min=1, metavar="N", show_default=False, help="Cap on the speech codes (50 codes = 1 s of audio).")]
AudioDeviceOpt = Annotated[Optional[str], typer.Option("--audio-device", metavar="NAME|INDEX", show_default=False, help="Sound device to play on (see --list-audio-devices). Default: the system's default output.")]
ListDevicesOpt = Annotated[bool, typer.Option("--list-audio-devices", help="List the sound output devices and exit.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", help="Timing on stderr after each reply: time to first text and audio, real-time factor, underruns.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")]


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _fail(exc: BaseException, debug: bool) -> int:
    """Report an exception on stderr; the exit code to end with."""
    if isinstance(exc, KeyboardInterrupt):
        code = getattr(exc, "exit_code", 130)  # ui.Terminated: 128 + SIGTERM/SIGHUP's number
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            _err("interrupted" if code == 130 else f"terminated (signal {code - 128})")
        return code
    exc = known_failure(exc)
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, OmniError):
        _err(f"error: {' '.join(str(exc).split())}")
        return int(getattr(exc, "exit_code", 1))
    detail = " ".join(str(exc).split())
    hint = "" if debug else " (run with --debug for the traceback)"
    _err(f"error: internal error: {type(exc).__name__}: {detail}{hint}")
    return 1


def _exit_on(exc: BaseException, debug: bool, sinks=(), interrupt=None) -> None:
    for sink in sinks:
        if sink is not None:
            try:
                sink.abort()
            except Exception:
                pass
    if isinstance(exc, KeyboardInterrupt) and interrupt is not None and interrupt.signal_at is not None:
        import time

        now = time.perf_counter()
        code = getattr(exc, "exit_code", 130)
        with contextlib.suppress(OSError):
            _err(f"{'interrupted' if code == 130 else 'terminated'}: silent after "
                 f"{((interrupt.silenced_at or now) - interrupt.signal_at) * 1000:.0f} ms, "
                 f"generation stopped after {(now - interrupt.signal_at) * 1000:.0f} ms")
        raise typer.Exit(code) from None
    raise typer.Exit(_fail(exc, debug)) from None


# -- the prompt --------------------------------------------------------------------------------


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def read_stdin() -> str | None:
    """Piped stdin as text; None when stdin is a terminal, closed or absent."""
    stdin = sys.stdin
    if stdin is None or _isatty(stdin):
        return None
    try:
        data = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read()
    except (OSError, ValueError):  # a closed descriptor
        return None
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        bad = data[exc.start]
        raise UsageError(
            f"stdin is not UTF-8 text (byte 0x{bad:02x} at offset {exc.start}): convert it first, "
            "e.g. iconv -f latin1 -t utf-8"
        ) from exc


def gather_prompt(argument: str | None) -> str:
    """stdin first, then the argument (like llm); a usage error if there is nothing to say."""
    piped = read_stdin()
    parts = [p.strip() for p in (piped, argument) if p is not None and p.strip()]
    if parts:
        return "\n".join(parts)
    if argument is None and not piped:
        raise UsageError('no prompt: give one, e.g. omni-say "Hello", or pipe text in: echo Hello | omni-say')
    raise UsageError('empty prompt: say something, e.g. omni-say "Hello"')


# -- shared steps ------------------------------------------------------------------------------


def _consoles():
    from .ui import make_console

    return make_console("stdout"), make_console("stderr")


def _load(model, device, dtype, err, quiet: bool = False, **runtime):
    """omni_cli.load() under a spinner that names the model; with quiet, only warnings get through.

    `runtime`: RuntimeOptions fields beside device and dtype (max_context, ...)."""
    import omni_cli

    from .ui import loading, model_label

    kwargs = {}
    if runtime:
        from .config import RuntimeOptions

        kwargs["runtime"] = RuntimeOptions(device=device, dtype=dtype, **runtime)

    if not quiet:
        with loading(err, model_label(model)):
            return omni_cli.load(model, device=device, dtype=dtype, **kwargs)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return omni_cli.load(model, device=device, dtype=dtype, **kwargs)
    finally:
        for line in captured.getvalue().splitlines():
            if line.startswith("warning:"):
                _err(line)


def _voices(model, quiet: bool) -> list[str]:
    """The model's voices without loading it (its spk_dict.pt); quiet keeps the demo notice off stderr."""
    from .loader import model_voices

    if not quiet:
        return model_voices(model)
    with contextlib.redirect_stderr(io.StringIO()):
        return model_voices(model)


def _list_devices() -> None:
    from .sinks import output_devices

    devices = output_devices()
    if not devices:
        _err("no audio output devices")
        return
    for dev in devices:
        mark = "  (default)" if dev["default"] else ""
        api = f"{dev['hostapi']}, " if dev["hostapi"] else ""
        print(f"{dev['index']:>3}  {dev['name']}  [{api}{dev['channels']} ch, {dev['samplerate']:.0f} Hz]{mark}", flush=True)


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


class _TextOut:
    """Where the reply's text streams: stdout, or stderr when stdout carries the WAV, or nowhere."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.written = False

    def write(self, text: str) -> None:
        if self.stream is None or not text:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except BrokenPipeError as exc:
            _silence_stdout()
            raise OutputError("stdout was closed before the reply was written") from exc
        self.written = True

    def end(self) -> None:
        if self.stream is not None and self.written:
            self.write("\n")


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass


# -- omni-say ----------------------------------------------------------------------------------


@say_app.command()
def say(
    prompt: Annotated[Optional[str], typer.Argument(
        metavar="PROMPT", show_default=False,
        help="What to say to the model. Piped stdin is used too (before PROMPT).")] = None,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", metavar="FILE", show_default=False, dir_okay=False,
        help="Write the speech to this WAV file (24 kHz mono, 16-bit) instead of playing it; '-' streams "
        "WAV to stdout.")] = None,
    play: Annotated[bool, typer.Option("--play", help="Play through the speakers too when -o is given.")] = False,
    voice: VoiceOpt = "Chelsie",
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    graphs: GraphsOpt = True,
    seed: SeedOpt = None,
    greedy: GreedyOpt = False,
    max_text_tokens: MaxTextOpt = None,
    max_codes: MaxCodesOpt = None,
    text_only: Annotated[bool, typer.Option("--text-only", help="Answer in text only: no speech is generated.")] = False,
    audio_device: AudioDeviceOpt = None,
    list_voices: Annotated[bool, typer.Option("--list-voices", help="List the model's voices and exit.")] = False,
    list_audio_devices: ListDevicesOpt = False,
    verbose: VerboseOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No notices or summary on stderr (errors still).")] = False,
    debug: DebugOpt = False,
) -> None:
    """Answer PROMPT: the text on stdout, the speech through the speakers, a WAV file (-o FILE) or stdout (-o -)."""
    from .ui import InterruptTimes, end_on_signals, safe_text_streams

    safe_text_streams()
    end_on_signals()
    sinks: list[Any] = []
    speaker = None
    interrupt = InterruptTimes()
    try:
        if list_audio_devices:
            _list_devices()
            return
        to_stdout = output is not None and str(output) == "-"
        if text_only and (output is not None or play):
            raise UsageError("--text-only makes no speech: leave out -o and --play")
        if list_voices:
            for name in _voices(model, quiet):
                print(name, flush=True)
            return
        play = not text_only and (play or output is None)
        text = gather_prompt(prompt)

        # Outputs first: a bad path or a missing sound device should not cost a minute of loading.
        from .sinks import SpeakerSink, WavSink

        wav = WavSink(output) if output is not None and not to_stdout else None
        if play:
            speaker = SpeakerSink(audio_device)
        _, err = _consoles()
        assistant = _load(model, device, dtype, err, quiet=quiet, **({} if graphs else {"graphs": False}))
        from .loader import check_voice

        if not text_only and assistant.has_audio:
            voice = check_voice(assistant.voices, voice)
        if to_stdout:
            with _stdout_for_wav() as wav_file:
                reply = _say_once(assistant, text, voice, seed, greedy, max_text_tokens, max_codes, text_only,
                                  wav, speaker, wav_file, _TextOut(None if quiet else sys.stderr), sinks, interrupt)
        else:
            reply = _say_once(assistant, text, voice, seed, greedy, max_text_tokens, max_codes, text_only,
                              wav, speaker, None, _TextOut(sys.stdout), sinks, interrupt)
        if not quiet:
            seconds = len(reply.audio) / reply.sample_rate if reply.audio is not None else 0.0
            if wav is not None:
                _err(f"wrote {output} ({seconds:.1f} s audio)")
            elif to_stdout:
                _err(f"wrote {seconds:.1f} s of WAV audio to stdout")
        if verbose:
            from .ui import print_timing

            print_timing(err, reply.stats, speaker.stats if speaker is not None else None)
    except BaseException as exc:  # noqa: BLE001 - every way out is reported, none with a traceback
        if isinstance(exc, (SystemExit, typer.Exit)):
            raise
        _exit_on(exc, debug, [*sinks, speaker], interrupt if verbose else None)


def _say_once(assistant, text, voice, seed, greedy, max_text_tokens, max_codes, text_only, wav, speaker,
              wav_file, text_out: _TextOut, sinks: list, interrupt):
    from .assistant import AudioBlock, Done, TextDelta
    from .sinks import TeeSink, WavStreamSink
    from .ui import AudioClock, stop_on_interrupt

    parts = [s for s in (wav, WavStreamSink(wav_file) if wav_file is not None else None, speaker) if s is not None]
    sinks.extend(parts)
    if speaker is not None:
        speaker.open(assistant.sample_rate)  # device errors now, before any generation
    sink = parts[0] if len(parts) == 1 else TeeSink(parts) if parts else None
    reply = None
    clock = AudioClock()
    try:
        with stop_on_interrupt(speaker, times=interrupt):
            events = assistant.stream(text, voice=voice, greedy=greedy, seed=seed, max_text_tokens=max_text_tokens,
                                      max_codes=max_codes, sink=sink, text_only=text_only)
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
    finally:
        with contextlib.suppress(OutputError):
            text_out.end()  # the text's line is ended, also before an error message
    if sink is not None:
        sink.close()  # a no-op if the engine closed it already
    reply.stats = clock.stats(reply.stats)
    return reply


# -- omni-chat ---------------------------------------------------------------------------------


@chat_app.command()
def chat(
    model: ModelOpt = None,
    voice: VoiceOpt = "Chelsie",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    graphs: GraphsOpt = True,
    seed: SeedOpt = None,
    greedy: GreedyOpt = False,
    max_text_tokens: MaxTextOpt = None,
    max_codes: MaxCodesOpt = None,
    max_context: Annotated[int, typer.Option("--max-context", min=64, metavar="N", help="Tokens of conversation the model keeps; older turns are dropped, with a notice.")] = 4096,
    system: Annotated[Optional[str], typer.Option("--system", metavar="TEXT", show_default=False, help="System prompt (default: Qwen2.5-Omni's own, which it needs to speak).")] = None,
    mute: Annotated[bool, typer.Option("--mute", help="Start muted: replies in text only (/unmute to hear them).")] = False,
    audio_device: AudioDeviceOpt = None,
    list_audio_devices: ListDevicesOpt = False,
    history_file: Annotated[Optional[Path], typer.Option("--history-file", metavar="FILE", show_default=False, dir_okay=False, help="Where the input history is kept (default: ~/.local/share/omni-cli/chat_history).")] = None,
    no_history: Annotated[bool, typer.Option("--no-history", help="Keep no input history on disk (so does OMNI_NOHISTORY=1).")] = False,
    verbose: VerboseOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Chat with the model: >>> prompts, replies in text and speech, /? for the commands, Ctrl-D to leave."""
    from .ui import end_on_signals, safe_text_streams

    safe_text_streams()
    end_on_signals()
    try:
        if list_audio_devices:
            _list_devices()
            return
        from .chat import CHAT_PLAY_HINT, ChatRepl, line_reader
        from .sinks import SpeakerSink

        if not mute:
            SpeakerSink(audio_device, hint=CHAT_PLAY_HINT)  # PortAudio and a device, before loading
        out, err = _consoles()
        assistant = _load(model, device, dtype, err, max_context=max_context, **({} if graphs else {"graphs": False}))
        from .loader import check_voice

        voice = check_voice(assistant.voices, voice) if assistant.has_audio else voice

        def speaker():
            sink = SpeakerSink(audio_device, hint=CHAT_PLAY_HINT)
            sink.open(assistant.sample_rate)
            return sink

        from .config import ReplyOptions

        options = ReplyOptions(voice=voice, seed=seed, greedy=greedy, max_text_tokens=max_text_tokens,
                               max_codes=max_codes)
        repl = ChatRepl(assistant, out, err, options=options, muted=mute, system=system, speaker=speaker,
                        verbose=verbose, debug=debug)
        if _isatty(sys.stdin) and _isatty(sys.stdout):
            code = _chat_in_terminal(repl, err, assistant, history_file, no_history)
        else:
            code = repl.run(line_reader())
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, (SystemExit, typer.Exit)):
            raise
        _exit_on(exc, debug)
    raise typer.Exit(code)


def _chat_in_terminal(repl, err, assistant, history_file, no_history) -> int:
    from prompt_toolkit.patch_stdout import patch_stdout

    from .ui import default_history_file, history_disabled_by_env, make_history, make_session

    path = None if (no_history or history_disabled_by_env()) else (history_file or default_history_file())
    session = make_session(make_history(path, lambda m: err.print(m, style="yellow", markup=False)))
    where = getattr(getattr(assistant, "loaded", None), "device", None)
    sound = "muted" if repl.muted else f"voice {repl.voice}"
    err.print(f"[dim]{assistant.name}{f' on {where}' if where else ''} · {sound} · /? for help · Ctrl-D to leave[/dim]")

    def read(prompt: str) -> str:
        # While the prompt is on screen, output from other threads goes above it (patch_stdout). A
        # reply is written straight to the terminal once the prompt is gone: no proxy delay.
        with patch_stdout(raw=True):
            return session.prompt(prompt)

    return repl.run(read)


# -- entry points ------------------------------------------------------------------------------


def _run(app, name: str) -> None:
    """Run a typer app as a program. After an interrupt the engine may leave its vocoder thread
    finishing a chunk inside torch; letting the interpreter tear down under it aborts the process
    ("terminate called without an active exception"), so then the process ends at once instead."""
    import threading

    try:
        app(prog_name=name)
    except SystemExit as exc:
        if any(t.name.startswith("omni-") and t.is_alive() for t in threading.enumerate()):
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)
        raise


def say_main() -> None:
    """The `omni-say` program."""
    _run(say_app, "omni-say")


def chat_main() -> None:
    """The `omni-chat` program."""
    _run(chat_app, "omni-chat")


if __name__ == "__main__":
    say_main()
