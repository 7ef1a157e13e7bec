"""The command line: `omni-say "prompt" -o reply.wav` (typer).

Flags become arguments of `omni_cli.load()` and `Assistant.say()`; the reply's text goes to stdout,
everything else (notices, the one-line summary, errors) to stderr. An `OmniError` ends the command
with `error: <message>` and its exit code (2 for usage errors, 1 otherwise), with no traceback unless
`--debug`; Ctrl-C exits 130; anything else is reported as an internal error (exit 1).

It holds no model logic and imports neither torch, transformers nor numpy at import time, so `--help`
is instant: the model side is imported inside the command.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Optional

import typer

from .errors import OmniError, OutputError, UsageError

say_app = typer.Typer(
    name="omni-say",
    help="Ask a local Qwen2.5-Omni model one question: the answer's text on stdout, its speech in a WAV file.",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _fail(exc: BaseException, debug: bool) -> int:
    """Report an exception on stderr; the exit code to end with."""
    if isinstance(exc, KeyboardInterrupt):
        _err("interrupted")
        return 130
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, OmniError):
        _err(f"error: {' '.join(str(exc).split())}")
        return int(getattr(exc, "exit_code", 1))
    detail = " ".join(str(exc).split())
    hint = "" if debug else " (run with --debug for the traceback)"
    _err(f"error: internal error: {type(exc).__name__}: {detail}{hint}")
    return 1


@say_app.command()
def say(
    prompt: str = typer.Argument(..., help="What to say to the model.", metavar="PROMPT", show_default=False),
    output: Path = typer.Option(
        ...,
        "--output",
        "-o",
        metavar="FILE",
        help="WAV file for the spoken reply (required: playback through the speakers is not available yet).",
        show_default=False,
        dir_okay=False,
    ),
    voice: str = typer.Option("Chelsie", "--voice", "-v", metavar="NAME", help="Voice from the model's spk_dict.pt."),
    model: Optional[str] = typer.Option(
        None,
        "--model",
        "-m",
        metavar="FOLDER|HUB_ID",
        help="Model folder or hub id (e.g. Qwen/Qwen2.5-Omni-7B). Default: $OMNI_MODEL, else the built-in "
        "tiny random-weight demo model.",
        show_default=False,
    ),
    device: str = typer.Option("auto", "--device", metavar="DEVICE", help="auto, cpu, cuda, cuda:N, npu, mps."),
    dtype: str = typer.Option("auto", "--dtype", metavar="DTYPE", help="auto (bfloat16 on accelerators, float32 on CPU), float32, bfloat16, float16."),
    seed: Optional[int] = typer.Option(None, "--seed", metavar="N", help="Seed for sampling and the vocoder noise (reproducible replies).", show_default=False),
    greedy: bool = typer.Option(False, "--greedy", help="Greedy decoding instead of sampling."),
    max_text_tokens: Optional[int] = typer.Option(
        None, "--max-text-tokens", min=1, metavar="N", help="Cap on the reply's text tokens (default: the model's).", show_default=False
    ),
    max_codes: Optional[int] = typer.Option(
        None, "--max-codes", min=1, metavar="N", help="Cap on the speech codes (50 codes = 1 s of audio).", show_default=False
    ),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors."),
) -> None:
    """Answer PROMPT: the text on stdout, the speech in the WAV file given with -o."""
    sink = None
    try:
        if not prompt.strip():
            raise UsageError("empty prompt")
        if str(output) == "-":
            raise UsageError("-o - (WAV on stdout) is not available yet: give a file name")
        from .sinks import WavSink

        # Before the model loads: a bad output path should not cost a minute of loading.
        sink = WavSink(output)

        import omni_cli
        from .loader import check_voice

        assistant = omni_cli.load(model, device=device, dtype=dtype)
        voice = check_voice(assistant.voices, voice)
        reply = assistant.say(
            prompt,
            voice=voice,
            greedy=greedy,
            seed=seed,
            max_text_tokens=max_text_tokens,
            max_codes=max_codes,
            sink=sink,
        )
        sink.close()  # a no-op if say() closed it already
        _print_text(reply.text)
        _err(f"wrote {output} ({sink.seconds:.1f} s audio)")
    except BaseException as exc:  # noqa: BLE001 - every way out is reported, none with a traceback
        if isinstance(exc, (SystemExit, typer.Exit)):
            raise
        if sink is not None:
            sink.abort()
        raise typer.Exit(_fail(exc, debug)) from None


def _print_text(text: str) -> None:
    try:
        sys.stdout.reconfigure(errors="replace")  # random-weight models decode to odd characters
    except (AttributeError, ValueError):
        pass
    try:
        print(text, flush=True)
    except BrokenPipeError as exc:
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise OutputError("stdout was closed before the reply was written") from exc


if __name__ == "__main__":
    say_app(prog_name="omni-say")
