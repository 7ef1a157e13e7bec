"""The command line: `omni-say` (one question, spoken) and `omni-chat` (a conversation), with typer.

omni-say: the prompt is the argument, piped stdin (or `-f FILE`), or both (stdin/file first). The
speech plays through the sound device, or goes to an audio file (`-o FILE`: WAV, FLAC, Ogg Vorbis, Opus
or MP3 by the extension or `--format`; `--play` to do both), or streams as WAV to stdout (`-o -`: then
stdout holds nothing but the WAV bytes, and the text goes to stderr). The reply's text goes to stdout
as it is generated; notices, the summary, `--verbose` timing and errors go to stderr.

Errors: an `OmniError` ends the command with `error: <message>` and its exit code (2 usage, 1 runtime),
no traceback unless `--debug`; click's own usage errors (an unknown flag, a value that is not a number)
become the same one line with exit 2 (`_OneLineErrors`); Ctrl-C exits 130, SIGTERM 143 and SIGHUP 129;
a reader of stdout that went away (`| head`) ends the command quietly with 141, as Unix tools do;
anything else is reported as an internal error (1). Outputs (format, file writable, PortAudio and a
device present) and the voice (Qwen2.5-Omni: spk_dict.pt; Qwen3-Omni: config.json) are checked before
the model loads. What differs between the model families (the default voice and system prompt, codes or
frames, their rate) is read from the loaded `Assistant` (`assistant.family`, `ui.speech_steps`), never
assumed here; only the help texts name the families.

The library logs instead of printing; `_report_library_logs` shows its records on stderr as
`note: ...` (INFO; not with --quiet) and `warning: ...` lines.

It holds no model logic and imports neither torch, transformers, numpy nor sounddevice at import time,
so `--help` is instant: the model side is imported inside the commands.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperCommand

try:  # typer >= 0.24 carries its own copy of click; older ones use click itself
    from typer._click.exceptions import ClickException
    from typer.exceptions import Abort
except ImportError:  # pragma: no cover - older typer
    from click.exceptions import Abort, ClickException

from .config import ReplyOptions
from .errors import OmniError, OutputError, StdoutClosed, UsageError, known_failure


class _OneLineErrors(TyperCommand):
    """A typer command whose usage errors, click's own included (an unknown flag, a missing value, a
    value that is not a number or out of range), are one `error: ...` line on stderr with exit code 2,
    like every other error of these programs, instead of typer's usage block. Used by omni-say and
    omni-chat (`cls=`), so it holds for `python -m`, the entry points and CliRunner alike."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        name = prog_name or self.name or "omni-say"
        try:
            # Not standalone: click raises its errors instead of printing them, and returns the code of
            # a typer.Exit (None when the command just returns).
            try:
                code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            finally:
                _stop_reporting_library_logs()  # in-process callers (tests, CliRunner) get logging back as it was
        except ClickException as exc:
            message = " ".join(exc.format_message().split()).rstrip(".")
            # "Invalid value for '--seed': Input should be..." -> our lower-case style, sentence by clause.
            message = re.sub(r"(^|: )([A-Z])(?=[a-z])", lambda m: m.group(1) + m.group(2).lower(), message)
            with contextlib.suppress(OSError):
                _err(f"error: {message} (see {name} --help)")
            code = exc.exit_code
        except Abort:  # click's own prompts (none today) hit EOF or Ctrl-C
            code = 1
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


def _show_version(ctx: typer.Context, value: bool) -> None:
    if value:
        from . import __version__

        print(f"{ctx.find_root().info_name or 'omni-cli'} {__version__}", flush=True)
        raise typer.Exit(0)


# `--version` (eager: before anything else is checked); omni-bench can take it from here too.
VersionOpt = Annotated[bool, typer.Option("--version", callback=_show_version, is_eager=True,
                                          help="Print the program's version and exit.")]

say_app = typer.Typer(
    name="omni-say",
    help="Ask a local Qwen-Omni model (Qwen2.5-Omni or Qwen3-Omni) one question: the answer's text on "
    "stdout, its speech through the speakers (or into a WAV file with -o).",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

chat_app = typer.Typer(
    name="omni-chat",
    help="Talk with a local Qwen-Omni model (Qwen2.5-Omni or Qwen3-Omni): type a message, read and hear "
    "the reply.",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# -- options both commands share --------------------------------------------------------------

ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", metavar="FOLDER|HUB_ID", show_default=False,
    help="Model folder or hub id (e.g. Qwen/Qwen2.5-Omni-7B, Qwen/Qwen3-Omni-30B-A3B-Instruct). Default: "
    "$OMNI_MODEL, else the built-in tiny random-weight demo model (a Qwen2.5-Omni).")]
VoiceOpt = Annotated[Optional[str], typer.Option("--voice", "-v", metavar="NAME", show_default=False, help="A voice of the model (Qwen2.5-Omni: Chelsie, the default, or Ethan; Qwen3-Omni: Ethan, the default, Chelsie or Aiden); see --list-voices.")]
DeviceOpt = Annotated[str, typer.Option("--device", metavar="DEVICE", help="auto, cpu, cuda, cuda:N, npu, npu:N, mps.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", metavar="DTYPE", help="auto (bfloat16 on accelerators, float32 on CPU), float32, bfloat16, float16.")]
GraphsOpt = Annotated[bool, typer.Option("--graphs/--no-graphs", help="CUDA graphs of the decode steps and the vocoder on a GPU (a no-op on CPU); --no-graphs runs them eagerly, as does OMNI_NO_GRAPHS=1.")]
CompileOpt = Annotated[bool, typer.Option("--compile/--no-compile", show_default=False, help="torch.compile the decode steps and the vocoder before the first reply (GPU, with graphs): faster steady speech after a compile of a minute or more the first time (cached for the next start, in TORCHINDUCTOR_CACHE_DIR or ~/.cache/omni_cli). Default: off (nothing is compiled before the first reply).")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", metavar="N", show_default=False, help="Seed for sampling and the vocoder noise (reproducible replies).")]
GreedyOpt = Annotated[bool, typer.Option("--greedy", help="Greedy decoding instead of sampling.")]
MaxTextOpt = Annotated[Optional[int], typer.Option("--max-text-tokens", min=1, metavar="N", show_default=False, help="Cap on the reply's text tokens (default: the model's).")]
MaxCodesOpt = Annotated[Optional[int], typer.Option("--max-codes", min=1, metavar="N", show_default=False, help="Cap on the reply's speech in talker steps: codes for Qwen2.5-Omni (50 = 1 s of audio), 16-codebook frames for Qwen3-Omni (12.5 = 1 s); up to about 82 s. Default: the model's.")]
TemperatureOpt = Annotated[Optional[float], typer.Option(
    "--temperature", metavar="T", show_default=False,
    help="Sampling temperature of the reply's text (the thinker; the speech keeps the model's settings); "
    "0 = greedy text. Default: the model's generation_config.json.")]
TopPOpt = Annotated[Optional[float], typer.Option(
    "--top-p", metavar="P", show_default=False,
    help="Nucleus sampling of the reply's text: keep the most likely tokens up to probability P (0 < P <= 1).")]
TopKOpt = Annotated[Optional[int], typer.Option(
    "--top-k", metavar="K", show_default=False,
    help="Sample the reply's text from the K most likely tokens (0 = no limit).")]
AudioDeviceOpt = Annotated[Optional[str], typer.Option("--audio-device", metavar="NAME|INDEX", show_default=False, help="Sound device to play on (see --list-audio-devices). Default: the system's default output.")]
ListDevicesOpt = Annotated[bool, typer.Option("--list-audio-devices", help="List the sound output devices and exit.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", help="Timing on stderr after each reply: time to first text and audio, real-time factor, underruns.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")]
ServerOpt = Annotated[Optional[str], typer.Option(
    "--server", metavar="URL", show_default=False, envvar="OMNI_SERVER",
    help="Send the request to an omni-serve (or another OpenAI-compatible Qwen-Omni server, e.g. vLLM-Omni) "
    "at URL instead of loading the model (default: $OMNI_SERVER; without it, an omni-serve on "
    "127.0.0.1:8484 ($OMNI_PORT) serving the same model is used when it answers).")]
ApiKeyOpt = Annotated[Optional[str], typer.Option(
    "--api-key", metavar="KEY", show_default=False, envvar="OMNI_API_KEY",
    help="The server's API key (default: $OMNI_API_KEY).")]
LocalOpt = Annotated[bool, typer.Option(
    "--local", envvar="OMNI_LOCAL", help="Load the model in this process even when an omni-serve answers (so does OMNI_LOCAL=1).")]
MaxContextOpt = Annotated[int, typer.Option(
    "--max-context", min=64, metavar="N",
    help="Tokens of conversation the model keeps; older turns are dropped, with a notice.")]
KeepAliveOpt = Annotated[str, typer.Option(
    "--keep-alive", metavar="DURATION", envvar="OMNI_KEEP_ALIVE",
    help="When no omni-serve answers, load the model in one started in the background, which keeps it for "
    "DURATION after the last request, so the next command answers at once (e.g. 30s, 5m, 1h; 0: load it in "
    "this process, gone with the command; default: $OMNI_KEEP_ALIVE, else 5m).")]


def runtime_flags(graphs: bool, compile: bool) -> dict:
    """RuntimeOptions fields for --graphs/--compile, leaving out what is at its default."""
    return ({} if graphs else {"graphs": False}) | ({"compile": True} if compile else {})


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _LineHandler(logging.Handler):
    """The library's log records as one line each on stderr: INFO as `note: ...`, WARNING and above as
    `warning: ...`. sys.stderr is looked up at each record (CliRunner and `-o -` swap streams)."""

    def emit(self, record: logging.LogRecord) -> None:
        kind = "note" if record.levelno < logging.WARNING else "warning"
        with contextlib.suppress(Exception):  # after SIGHUP the terminal may be gone: never fail for a note
            _err(f"{kind}: {' '.join(record.getMessage().split())}")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """warnings.showwarning for the faces: one `warning: ...` line, no source line."""
    with contextlib.suppress(Exception):
        _err(f"warning: {' '.join(str(message).split())}")


_saved_logging: list = []  # (logger level, warnings.showwarning) to restore; empty when not reporting


def _report_library_logs(quiet: bool = False) -> None:
    """While a command runs, show what the library logs (it never prints): notes unless `quiet`,
    warnings always; Python warnings as one line too. Undone by `_stop_reporting_library_logs`."""
    import warnings

    _stop_reporting_library_logs()
    logger = logging.getLogger("omni_cli")
    _saved_logging.append((logger.level, warnings.showwarning))
    logger.addHandler(_LineHandler(logging.WARNING if quiet else logging.INFO))
    logger.setLevel(logging.INFO)
    warnings.showwarning = _show_warning


def _stop_reporting_library_logs() -> None:
    import warnings

    logger = logging.getLogger("omni_cli")
    for old in [h for h in logger.handlers if isinstance(h, _LineHandler)]:
        logger.removeHandler(old)
    while _saved_logging:
        level, show = _saved_logging.pop()
        logger.setLevel(level)
        warnings.showwarning = show


def _fail(exc: BaseException, debug: bool) -> int:
    """Report an exception on stderr; the exit code to end with."""
    if isinstance(exc, KeyboardInterrupt):
        code = getattr(exc, "exit_code", 130)  # ui.Terminated: 128 + SIGTERM/SIGHUP's number
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            _err("interrupted" if code == 130 else f"terminated (signal {code - 128})")
        return code
    if _stdout_went_away(exc):
        _silence_stdout()
        return StdoutClosed.exit_code  # quietly, as `yes | head` does: the reader has what it wanted
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


def _stdout_went_away(exc: BaseException) -> bool:
    """Did `exc` come from writing to a stdout whose reader is gone (EPIPE), directly or as the cause
    of a sink's OutputError (the WAV stream on `-o -`), however far down the chain?"""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (StdoutClosed, BrokenPipeError)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


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


def read_stdin(terminal_too: bool = False) -> str | None:
    """Piped stdin as text; None when stdin is closed or absent, or a terminal (unless `terminal_too`:
    `-f -` reads what is typed, up to Ctrl-D)."""
    stdin = sys.stdin
    if stdin is None or (_isatty(stdin) and not terminal_too):
        return None
    try:
        data = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read()
    except (OSError, ValueError):  # a closed descriptor
        return None
    return data if isinstance(data, str) else _utf8(data, "stdin")


def _utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        bad = data[exc.start]
        raise UsageError(
            f"{what} is not UTF-8 text (byte 0x{bad:02x} at offset {exc.start}): convert it first, "
            "e.g. iconv -f latin1 -t utf-8"
        ) from exc


def read_prompt_file(name: str) -> str:
    """The text of `-f FILE` (`-` = stdin, a terminal included); a one-line UsageError if unreadable."""
    if name == "-":
        return read_stdin(terminal_too=True) or ""
    try:
        data = Path(name).expanduser().read_bytes()
    except IsADirectoryError:
        raise UsageError(f"cannot read the prompt file {name}: it is a folder") from None
    except OSError as exc:
        raise UsageError(f"cannot read the prompt file {name}: {(exc.strerror or str(exc)).lower()}") from None
    return _utf8(data, f"the prompt file {name}")


def gather_prompt(argument: str | None, file: str | None = None, optional: bool = False) -> str:
    """Piped stdin (or `-f FILE` instead) first, then the argument (like llm); a usage error if there
    is nothing to say, unless `optional` (audio or an image says it): then ""."""
    first = read_prompt_file(file) if file is not None else read_stdin()
    parts = [p.strip() for p in (first, argument) if p is not None and p.strip()]
    if parts or optional:
        return "\n".join(parts)
    if file is not None and argument is None:
        raise UsageError(f"empty prompt: {'stdin' if file == '-' else f'the prompt file {file}'} holds no text")
    if argument is None and not first:
        raise UsageError('no prompt: give one, e.g. omni-say "Hello", or pipe text in: echo Hello | omni-say')
    raise UsageError('empty prompt: say something, e.g. omni-say "Hello"')


# -- shared steps ------------------------------------------------------------------------------


def _consoles():
    from .ui import make_console

    return make_console("stdout"), make_console("stderr")


def _load(model, device, dtype, err, quiet: bool = False, **runtime):
    """omni_cli.load() under a spinner that names the model (not with quiet: then only the library's
    warnings get through, see `_report_library_logs`).

    `runtime`: RuntimeOptions fields beside device and dtype (max_context, ...)."""
    import omni_cli

    from .ui import loading, model_label

    kwargs = {}
    if runtime:
        from .config import RuntimeOptions

        kwargs["runtime"] = RuntimeOptions(device=device, dtype=dtype, **runtime)

    with loading(err, model_label(model), enabled=not quiet):
        assistant = omni_cli.load(model, device=device, dtype=dtype, **kwargs)
    from .ui import write_bytecode_later

    write_bytecode_later()  # the first start's bytecode, now that torch and transformers are imported
    return assistant


def _timed_load(model, device, dtype, err, t_command: float, before: str, quiet: bool = False, **runtime):
    """`_load`, with the assistant's `startup` (`--verbose`) counted from `t_command`: `before` names the
    time until loading began, then importing torch and the engine, then the loader's own phases."""
    import time

    t_load = time.perf_counter()
    assistant = _load(model, device, dtype, err, quiet=quiet, **runtime)
    loading = time.perf_counter() - t_load
    phases = getattr(assistant, "startup", None) or {}
    assistant.startup = {before: t_load - t_command, "import torch and the engine": loading - sum(phases.values()),
                         **phases}
    return assistant


def _remote(server: str | None, api_key: str | None, local: bool, model: str | None, quiet: bool,
            runtime: dict | None = None):
    """The server to use instead of loading the model, or None: `--server URL` (a ServerError if it
    does not answer), else an omni-serve on the default address serving the same model (said on
    stderr), unless --local. `runtime`: the command's --device, --dtype, --graphs and --compile, which a
    note compares with how the server runs the model. No torch is imported on this path."""
    from .api.client import RemoteAssistant, find_local_server, model_key

    if server:
        remote = RemoteAssistant.connect(server, api_key)
        if model is not None and remote.info.get("key") not in (None, model_key(model)) and model != remote.name:
            raise UsageError(f"the server at {remote.url} serves {remote.name}, not {model}: leave out -m, "
                             "or leave out --server to load it here")
    elif local:
        return None
    else:
        remote = find_local_server(model, api_key)
        if remote is not None and not quiet:
            _err(f"note: using omni-serve at {remote.url} ({remote.name}); --local loads the model here instead")
            _demo_note(remote)
    if remote is not None and not quiet and runtime:
        _runtime_note(remote, **runtime)
    return remote


def _runtime_note(remote, device: str, dtype: str, graphs: bool, compile: bool) -> None:
    """A note when the server runs the model otherwise than this command's flags ask: they would apply to
    a model loaded here (--local). Only flags given are compared (auto, and the defaults, ask nothing);
    a server that does not say how it runs (an older omni-serve, vLLM-Omni) gets no note."""
    from .loader import _DTYPES

    served = remote.info.get("runtime")
    if not isinstance(served, dict):
        return
    differ = []
    where = str(served.get("device", ""))
    if device != "auto" and where and device != (where if ":" in device else where.split(":")[0]):
        differ.append(f"--device {device}")
    if dtype != "auto" and served.get("dtype") and _DTYPES.get(dtype.strip().lower(), dtype) != served["dtype"]:
        differ.append(f"--dtype {dtype}")
    if not graphs and served.get("graphs"):
        differ.append("--no-graphs")
    if compile and not served.get("compile"):
        differ.append("--compile")
    if differ:
        how = f"on {where} in {served.get('dtype')}" + (
            ", compiled" if served.get("compile") else " with plain CUDA graphs" if served.get("graphs") else ", eagerly")
        _err(f"note: the server runs the model {how}: {' '.join(differ)} would apply to a model loaded here "
             "(--local)")


def _demo_note(remote) -> None:
    """The loader's notice about the built-in tiny model, which a server's client does not load."""
    if remote.is_demo:
        from .loader import DEMO_NOTICE

        _err(f"note: {DEMO_NOTICE}")


def _background_server(model, device, dtype, graphs, compile, keep_seconds, api_key, quiet, t_command, err,
                       max_context: int | None = None):
    """The keep-alive (api/keep_alive.py): the model loaded by a background omni-serve, or None where the
    default port is another server's (then this process loads it, and says why). `err`: the console the
    spinner goes to while the server loads, as `_load`'s does."""
    import time

    from .api.keep_alive import start_server
    from .ui import loading, model_label

    t_start = time.perf_counter()
    # Without --compile the server never compiles: compiling in the background (omni-serve's default) would
    # slow the next commands, which come soon after (7B on an H200: first audio 1.5-3.8 s while it compiles).
    flags = ["--device", device, "--dtype", dtype, *([] if graphs else ["--no-graphs"]), *(["--compile"] if compile else ["--no-compile"]),
             *(["--max-context", str(max_context)] if max_context is not None else [])]
    with loading(err, f"{model_label(model)} in a background omni-serve", enabled=not quiet):
        remote = start_server(model, flags, keep_seconds, api_key, note=(lambda text: None) if quiet else
                              (lambda text: _err(f"note: {text}")))
    if remote is None:
        return None  # the note said why
    if not quiet:
        _demo_note(remote)
    remote.startup = {"before the server (prompt, outputs, voice)": t_start - t_command,
                      "start omni-serve in the background, until it serves": time.perf_counter() - t_start}
    # The server's own start, as it counted it (omni-serve serves it in its model info): "of which" rows.
    for phase, seconds in (remote.info.get("startup") or {}).items():
        remote.startup[f"  {phase}"] = seconds
    return remote


def _remote_voice(options, remote):
    """`options` with its voice checked against the server's voices (as `_checked_voice` does locally)."""
    if options.voice is None or not remote.voices:
        return options
    from dataclasses import replace

    from .loader import check_voice

    return replace(options, voice=check_voice(remote.voices, options.voice))


def _checked_voice(options, model):
    """`options` with its voice checked against the model's voices (spk_dict.pt or config.json, read
    without torch) before the model loads (an unknown voice is a usage error in a fraction of a second,
    not after loading); None stays None: the model's default voice."""
    if options.voice is None:
        return options
    from dataclasses import replace

    from .loader import check_voice, model_voices

    # The load that follows gives the demo notice; said twice it would be noise.
    return replace(options, voice=check_voice(model_voices(model, notice=False), options.voice))


def _list_devices() -> None:
    """The sound output devices (what plays), then the input devices (what /listen records from) under
    an `inputs:` line when there are any."""
    from .audio.microphone import input_devices
    from .audio.speaker import output_devices

    outputs = output_devices()
    if not outputs:
        _err("no audio output devices")
    for dev in outputs:
        _device_line(dev)
    try:
        inputs = input_devices()
    except OmniError:
        inputs = []
    if inputs:
        print("inputs:", flush=True)
    for dev in inputs:
        _device_line(dev)


def _device_line(dev: dict) -> None:
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
        from .ui import StreamWrapper, terminal_width

        self.stream = stream
        self.written = False
        # On a terminal, words wrap at its width as they stream; a pipe or a file gets the text as is.
        width = terminal_width(stream) if stream is not None else None
        self.wrapper = StreamWrapper(width) if width else None

    def write(self, text: str) -> None:
        if self.wrapper is not None:
            text = self.wrapper.feed(text)
        self._write(text)

    def _write(self, text: str) -> None:
        if self.stream is None or not text:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except BrokenPipeError as exc:  # `omni-say ... | head -c 5`: the reader has what it wanted
            _silence_stdout()
            raise StdoutClosed("stdout was closed before the reply was written") from exc
        self.written = True

    def end(self) -> None:
        if self.wrapper is not None:
            self._write(self.wrapper.end())
        if self.stream is not None and self.written:
            self._write("\n")


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass


# -- omni-say ----------------------------------------------------------------------------------


# The names --format takes, for --help (what this machine writes is checked when it is used).
FORMAT_NAMES = "wav, flac, ogg (Vorbis), opus, mp3"


@say_app.command(cls=_OneLineErrors)
def say(
    prompt: Annotated[Optional[str], typer.Argument(
        metavar="PROMPT", show_default=False,
        help="What to say to the model. Piped stdin (or -f FILE) is used too, before PROMPT.")] = None,
    file: Annotated[Optional[str], typer.Option(
        "--file", "-f", metavar="FILE", show_default=False,
        help="Read the prompt from FILE ('-': stdin), before PROMPT if both are given; stdin is then not read.")] = None,
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
        "repeatable. The prompt's text is then optional.")] = None,
    image: Annotated[Optional[list[str]], typer.Option(
        "--image", "-i", metavar="FILE", show_default=False,
        help="Show the model this image with the prompt (any format Pillow opens); repeatable.")] = None,
    list_voices: Annotated[bool, typer.Option("--list-voices", help="List the model's voices (read from the checkpoint, without loading it) and exit.")] = False,
    list_audio_devices: ListDevicesOpt = False,
    verbose: VerboseOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No notices or summary on stderr (errors still).")] = False,
    debug: DebugOpt = False,
    version: VersionOpt = False,
) -> None:
    """Answer PROMPT: the text on stdout, the speech through the speakers, an audio file (-o FILE) or stdout (-o -)."""
    import time

    from .ui import InterruptTimes, end_on_signals, process_started_at, safe_text_streams

    t_command = time.perf_counter()
    t_process = process_started_at()  # before this function: the interpreter's start and our imports

    safe_text_streams()
    end_on_signals()
    _report_library_logs(quiet)
    outputs = _Outputs()
    interrupt = InterruptTimes()
    try:
        if list_audio_devices:
            _list_devices()
            return
        to_stdout = output is not None and str(output) == "-"
        if text_only and (output is not None or play):
            raise UsageError("--text-only makes no speech: leave out -o and --play")
        if list_voices:
            from .loader import model_voices

            for name in model_voices(model):  # spk_dict.pt or config.json alone: no torch, no weights
                print(name, flush=True)
            return
        if format is not None and output is None:
            raise UsageError("--format is the format of -o FILE: give -o FILE too")
        if to_stdout and format is not None and format.strip().lower() != "wav":
            raise UsageError("-o - streams WAV only: write other formats to a file (-o FILE --format ...)")
        options = ReplyOptions(voice=voice, greedy=greedy, seed=seed, max_text_tokens=max_text_tokens,
                               max_codes=max_codes, text_only=text_only, temperature=temperature, top_p=top_p,
                               top_k=top_k).check()
        from .api.keep_alive import parse_duration

        keep_seconds = 0.0 if local or server else parse_duration(keep_alive)
        play = not text_only and (play or output is None)
        clips = _read_clips(audio or [])
        pictures = _read_images(image or [])  # checked before the model loads
        # With audio or an image the text is optional (`--audio -` has read stdin to its end already).
        text = gather_prompt(prompt, file, optional=bool(clips or pictures))
        media = {**({"audio": clips} if clips else {}), **({"images": pictures} if pictures else {})}

        # A server first, as it needs no loading: the request goes out now, and the server works on the
        # reply while the outputs (and the consoles: rich's import, ~17 ms) are set up here.
        t_remote = time.perf_counter()
        asked = dict(device=device, dtype=dtype, graphs=graphs, compile=compile)  # compared with a server's
        assistant = _remote(server, api_key, local, model, quiet, asked)
        if assistant is not None:
            options = options if text_only else _remote_voice(options, assistant)
            assistant.send(text, options, **media)
            # --verbose: the client's share of the wait (the server's is the reply's first audio)
            assistant.startup = {"before the server (prompt)": t_remote - t_command,
                                 "find the server, check the model and voice, send": time.perf_counter() - t_remote}
        _, err = _consoles()

        # Outputs and voice before loading: a bad path or format, a missing sound device or an unknown voice
        # should not cost a minute of loading (through a server: the request is withdrawn).
        from .audio.sinks import AudioFileSink
        from .audio.speaker import SpeakerSink

        try:
            outputs.file = AudioFileSink(output, format) if output is not None and not to_stdout else None
            if play:
                outputs.speaker = SpeakerSink(audio_device)
        except BaseException:
            if assistant is not None:
                assistant.close()
            raise
        if assistant is None:
            if not text_only:
                options = _checked_voice(options, model)
            if keep_seconds > 0:
                assistant = _background_server(model, device, dtype, graphs, compile, keep_seconds, api_key, quiet,
                                               t_command, err)
        if assistant is None:
            assistant = _timed_load(model, device, dtype, err, t_command, "before loading (prompt, outputs, voice)",
                                    quiet=quiet, **runtime_flags(graphs, compile))
        if t_process is not None:
            assistant.startup = {"start Python, import the command": t_command - t_process, **assistant.startup}
        if to_stdout:
            with _stdout_for_wav() as wav_file:
                reply = _say_once(assistant, text, options, outputs, wav_file, _TextOut(None if quiet else sys.stderr),
                                  interrupt, media)
        else:
            reply = _say_once(assistant, text, options, outputs, None, _TextOut(sys.stdout), interrupt, media)
        if not quiet:
            seconds = len(reply.audio) / reply.sample_rate if reply.audio is not None else 0.0
            if outputs.file is not None:
                _err(f"wrote {output} ({seconds:.1f} s audio)")
            elif to_stdout:
                _err(f"wrote {seconds:.1f} s of WAV audio to stdout")
        if verbose:
            from .ui import print_timing, speech_steps

            print_timing(err, reply.stats, outputs.speaker.stats if outputs.speaker is not None else None,
                         unit=speech_steps(assistant)[0])
            _print_startup(err, assistant, reply.stats, t_command if t_process is None else t_process)
    except BaseException as exc:  # noqa: BLE001 - every way out is reported, none with a traceback
        if isinstance(exc, (SystemExit, typer.Exit)):
            raise
        _exit_on(exc, debug, outputs.sinks(), interrupt if verbose else None)


def _print_startup(err, assistant, stats: dict, t_command: float) -> None:
    """`--verbose`: the start-up's phases (a local model) and the first audio's time after the command
    began (`t_command`: the process's start where known, else when omni-say's code began)."""
    from .ui import print_startup

    first = stats.get("time_to_first_audio")
    started = stats.get("started_at")
    since = started + first - t_command if first is not None and started is not None else None
    after = {}
    ready = getattr(assistant, "ready_at", None)
    if ready is not None and started is not None:
        after["the request (chat template, tokens)"] = started - ready
    if first is not None:
        after["the reply's first audio" + (" (server and network)" if ready is None else "")] = first
        if ready is None and stats.get("server_time_to_first_audio") is not None:
            after["  of which the server's turn"] = stats["server_time_to_first_audio"]  # the rest: HTTP, queue, prompt
    print_startup(err, getattr(assistant, "startup", None) or {}, after, since)


@dataclass
class _Outputs:
    """Where one omni-say reply's speech goes; each None when not asked for."""

    file: Any = None  # AudioFileSink for -o FILE
    stream: Any = None  # WavStreamSink on stdout for -o -
    speaker: Any = None  # SpeakerSink when playing

    def sinks(self) -> list:
        return [s for s in (self.file, self.stream, self.speaker) if s is not None]


def _read_images(names: list[str]) -> list:
    """`--image` files, read and checked (media.py, which imports numpy, only when there are some)."""
    if not names:
        return []
    from .media import read_image

    return [read_image(name) for name in names]


def _read_clips(names: list[str]) -> list:
    """`--audio` files (`-`: stdin's bytes) read and checked before the model loads."""
    if not names:
        return []
    from .media import read_audio

    if names.count("-") > 1:
        raise UsageError("--audio - (stdin) can be given once")
    clips = []
    for name in names:
        if name == "-":
            data = sys.stdin.buffer.read() if sys.stdin is not None and hasattr(sys.stdin, "buffer") else b""
            clips.append(read_audio(data, "stdin"))
        else:
            clips.append(read_audio(name))
    return clips


def _say_once(assistant, text: str, options, outputs: _Outputs, wav_file, text_out: _TextOut, interrupt,
              media: dict | None = None):
    """One reply: text to `text_out`, speech to `outputs` (and, for -o -, a WAV stream on `wav_file`);
    `media`: the prompt's clips and images ({"audio": [...], "images": [...]}, each only when given)."""
    from .audio.sinks import TeeSink, WavStreamSink
    from .runtime.events import AudioBlock, Done, TextDelta
    from .ui import AudioClock, stop_on_interrupt

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
        with stop_on_interrupt(speaker, times=interrupt):
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
    reply.stats = clock.stats(reply.stats)
    return reply


# -- omni-chat ---------------------------------------------------------------------------------


@chat_app.command(cls=_OneLineErrors)
def chat(
    model: ModelOpt = None,
    voice: VoiceOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    graphs: GraphsOpt = True,
    compile: CompileOpt = False,
    seed: SeedOpt = None,
    greedy: GreedyOpt = False,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    max_text_tokens: MaxTextOpt = None,
    max_codes: MaxCodesOpt = None,
    max_context: MaxContextOpt = 4096,
    system: Annotated[Optional[str], typer.Option("--system", metavar="TEXT", show_default=False, help="System prompt (default: the model's own: Qwen2.5-Omni's, which it needs to speak; none for Qwen3-Omni).")] = None,
    mute: Annotated[bool, typer.Option("--mute", help="Start muted: replies in text only (/unmute to hear them).")] = False,
    audio_device: AudioDeviceOpt = None,
    list_audio_devices: ListDevicesOpt = False,
    server: ServerOpt = None,
    api_key: ApiKeyOpt = None,
    local: LocalOpt = False,
    keep_alive: KeepAliveOpt = "5m",
    input_device: Annotated[Optional[str], typer.Option("--input-device", metavar="NAME|INDEX", show_default=False, help="The microphone /listen records from (see --list-audio-devices). Default: the system's default input.")] = None,
    input_rate: Annotated[Optional[int], typer.Option("--input-rate", min=8000, max=384000, metavar="HZ", show_default=False, help="The rate /listen records at (default: the device's own).")] = None,
    vad: Annotated[bool, typer.Option("--vad/--no-vad", help="/listen ends the turn when you stop speaking (voice-activity detection); --no-vad: only Enter or the length limit end it.")] = True,
    history_file: Annotated[Optional[Path], typer.Option("--history-file", metavar="FILE", show_default=False, dir_okay=False, help="Where the input history is kept (default: ~/.local/share/omni-cli/chat_history).")] = None,
    no_history: Annotated[bool, typer.Option("--no-history", help="Keep no input history on disk (so does OMNI_NOHISTORY=1).")] = False,
    load: Annotated[Optional[Path], typer.Option(
        "--load", metavar="PATH", show_default=False, dir_okay=False,
        help="Resume a conversation saved with /save (PATH or PATH.json): its history is the model's context.")] = None,
    verbose: VerboseOpt = False,
    debug: DebugOpt = False,
    version: VersionOpt = False,
) -> None:
    """Chat with the model: >>> prompts, replies in text and speech, /? for the commands, Ctrl-D to leave."""
    import time

    from .ui import end_on_signals, safe_text_streams

    t_command = time.perf_counter()
    safe_text_streams()
    end_on_signals()
    _report_library_logs()
    try:
        if list_audio_devices:
            _list_devices()
            return
        # One options object from the flags, checked before the model loads (a bad --top-p is exit 2 now).
        options = ReplyOptions(voice=voice, seed=seed, greedy=greedy, max_text_tokens=max_text_tokens,
                               max_codes=max_codes, temperature=temperature, top_p=top_p, top_k=top_k).check()
        from .api.keep_alive import parse_duration

        keep_seconds = 0.0 if local or server else parse_duration(keep_alive)
        from .chat import CHAT_PLAY_HINT, ChatRepl, line_reader
        from .audio.speaker import SpeakerSink

        if not mute:
            SpeakerSink(audio_device, hint=CHAT_PLAY_HINT)  # PortAudio and a device, before loading
        out, err = _consoles()
        asked = dict(device=device, dtype=dtype, graphs=graphs, compile=compile)  # compared with a server's
        assistant = _remote(server, api_key, local, model, False, asked)
        loaded_now = assistant is None  # a model loaded for this chat has not replied yet (a found server has)
        if assistant is None:
            options = _checked_voice(options, model)
            if keep_seconds > 0:  # as omni-say: the model kept loaded for the next command
                assistant = _background_server(model, device, dtype, graphs, compile, keep_seconds, api_key, False,
                                               t_command, err, max_context=max_context)
        if assistant is not None:
            options = _remote_voice(options, assistant)
            served = assistant.info.get("max_context")
            if served and served != max_context:
                _err(f"note: the server keeps {served} tokens of conversation, not the {max_context} of --max-context "
                     "(--local loads the model here with yours)")
            from .api.keep_alive import hold

            hold(assistant.url)  # a server that stops when idle stays while this chat is open
        else:
            assistant = _load(model, device, dtype, err, max_context=max_context, **runtime_flags(graphs, compile))
        if loaded_now and _isatty(sys.stdin) and _isatty(sys.stdout):
            # while the person types (a background server made none: --no-warm-up): the first reply is then
            # as quick as the next
            assistant.warm_up(background=True)

        def speaker():
            sink = SpeakerSink(audio_device, hint=CHAT_PLAY_HINT)
            sink.open(assistant.sample_rate)
            return sink

        from .audio.microphone import RecordOptions

        repl = ChatRepl(assistant, out, err, options=options, muted=mute, system=system,
                        speaker=speaker, verbose=verbose, debug=debug,
                        record=RecordOptions(device=input_device, sample_rate=input_rate, vad=vad))
        if load is not None:
            repl.load_transcript(load)  # an OmniError (one line, exit 2) for a file that is not a transcript
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
    where = getattr(getattr(assistant, "loaded", None), "device", None) or getattr(assistant, "url", None)
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
    from .ui import cache_bytecode, write_bytecode_later

    cache_bytecode()  # before torch is imported
    try:
        app(prog_name=name)
    except SystemExit as exc:
        write_bytecode_later()  # a command that loaded no model (through a server, --help, ...)
        exit_at_once_if(lambda t: t.name.startswith("omni-"), exc)
        raise


def exit_at_once_if(picked, exc: SystemExit) -> None:
    """End the process now, with `exc`'s code and the streams flushed, if a live thread is `picked`: one
    that may be inside torch, under which the interpreter's tear-down can abort the process."""
    import threading

    if any(picked(t) and t.is_alive() for t in threading.enumerate()):
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def say_main() -> None:
    """The `omni-say` program."""
    _run(say_app, "omni-say")


def chat_main() -> None:
    """The `omni-chat` program."""
    _run(chat_app, "omni-chat")


if __name__ == "__main__":
    say_main()
