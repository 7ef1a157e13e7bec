"""The flags the faces share, defined once (as simonw/llm shares its option decorators), and the typer
pieces every command is made of: `make_app`, the one-line usage errors (`OneLineErrors`), `--version`.

A face declares its parameters with these `Annotated` types and maps them onto the frozen options
objects (`config.ReplyOptions`, `config.RuntimeOptions`) in one place each, so a flag's name, help and
meaning cannot drift between omni-say, omni-chat and omni-serve. It imports typer and nothing heavier.
"""

from __future__ import annotations

import contextlib
import re
import sys
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand

try:  # typer >= 0.24 carries its own copy of click; older ones use click itself
    from typer._click.exceptions import ClickException
    from typer.exceptions import Abort
except ImportError:  # pragma: no cover - older typer
    from click.exceptions import Abort, ClickException  # type: ignore[assignment]

from .program import err_line, stop_reporting_library_logs


def make_app(name: str, help: str) -> typer.Typer:
    """A typer app as every program of ours is: no completion or pretty tracebacks, -h for help."""
    return typer.Typer(name=name, help=help, add_completion=False, pretty_exceptions_enable=False,
                       rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"]})


class OneLineErrors(TyperCommand):
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
                stop_reporting_library_logs()  # in-process callers (tests, CliRunner) get logging back as it was
        except ClickException as exc:
            message = " ".join(exc.format_message().split()).rstrip(".")
            # "Invalid value for '--seed': Input should be..." -> our lower-case style, sentence by clause.
            message = re.sub(r"(^|: )([A-Z])(?=[a-z])", lambda m: m.group(1) + m.group(2).lower(), message)
            message = _range_in_words(message)
            with contextlib.suppress(OSError):
                err_line(f"error: {message} (see {name} --help)")
            code = exc.exit_code
        except Abort:  # click's own prompts (none today) hit EOF or Ctrl-C
            code = 1
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


# click's and pydantic's (typer 0.29) wordings of a number out of its range, each said one way here, so that
# the message is the same whichever typer is installed: "--max-codes must be at least 1 (got -5)".
_RANGES = [
    (re.compile(r"(?P<flag>'[^:]+'): (?P<got>\S+) is not in the range x>=(?P<low>[^ ,]+)"), "{flag} must be at least {low} (got {got})"),
    (re.compile(r"(?P<flag>'[^:]+'): (?P<got>\S+) is not in the range x<=(?P<high>[^ ,]+)"), "{flag} must be at most {high} (got {got})"),
    (re.compile(r"(?P<flag>'[^:]+'): (?P<got>\S+) is not in the range (?P<low>[^<]+)<=x<=(?P<high>[^ ,]+)"),
     "{flag} must be from {low} to {high} (got {got})"),
    (re.compile(r"(?P<flag>'[^:]+'): input should be greater than or equal to (?P<low>[^ ,]+)"), "{flag} must be at least {low}"),
    (re.compile(r"(?P<flag>'[^:]+'): input should be less than or equal to (?P<high>[^ ,]+)"), "{flag} must be at most {high}"),
]


def _range_in_words(message: str) -> str:
    for pattern, words in _RANGES:
        found = pattern.search(message)
        if found is not None:
            parts = found.groupdict()
            parts["flag"] = parts["flag"].replace("'", "")  # "'--frames' / '--codes'" -> "--frames / --codes"
            return words.format(**parts)
    return message


def _show_version(ctx: typer.Context, value: bool) -> None:
    if value:
        from .. import __version__

        print(f"{ctx.find_root().info_name or 'omni-cli'} {__version__}", flush=True)
        raise typer.Exit(0)


# `--version` (eager: before anything else is checked); omni-bench can take it from here too.
VersionOpt = Annotated[bool, typer.Option("--version", callback=_show_version, is_eager=True,
                                          help="Print the program's version and exit.")]


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


KernelsOpt = Annotated[bool, typer.Option(
    "--kernels/--no-kernels", help="Our fused kernels on a GPU (the decode steps; a prompt's experts, norms and "
    "rotary embedding; a no-op on CPU); --no-kernels: the library's ops, as does OMNI_NO_KERNELS=1.")]
AttentionKernelOpt = Annotated[bool, typer.Option(
    "--attention-kernel/--no-attention-kernel", help="One launch for each decode step's attention on a GPU "
    "(Qwen3-Omni; a no-op elsewhere); --no-attention-kernel: the library's attention, as does OMNI_NO_ATTEND=1.")]
CodesCapacityOpt = Annotated[Optional[int], typer.Option(
    "--codes-capacity", min=1, metavar="N", show_default=False,
    help="Talker steps the caches and the vocoder are sized for (the longest reply's speech; default: the "
    "family's, about 82 s).")]
MaxContextOpt = Annotated[int, typer.Option(
    "--max-context", min=64, metavar="N",
    help="Tokens of conversation the model keeps; older turns are dropped, with a notice.")]


QuantizeOpt = Annotated[Optional[str], typer.Option(
    "--quantize", metavar="int4|fp8", show_default=False,
    help="Pack the thinker's and talker's decoder layers while loading: int4 (group scales, about a quarter "
    "of bfloat16's bytes) or fp8 (128x128 blocks, about half). The float weights are read on the CPU and "
    "packed layer by layer on the device, so only the packed model has to fit there. Not with a checkpoint "
    "quantized already; packed steps are not compiled.")]
GroupSizeOpt = Annotated[Optional[int], typer.Option(
    "--group-size", min=1, metavar="N", show_default=False,
    help="--quantize int4: the inputs each scale covers (default 128; a divisor of the layers' widths).")]


KeepAliveOpt = Annotated[str, typer.Option(
    "--keep-alive", metavar="DURATION", envvar="OMNI_KEEP_ALIVE",
    help="When no omni-serve answers, load the model in one started in the background, which keeps it for "
    "DURATION after the last request, so the next command answers at once (e.g. 30s, 5m, 1h; 0: load it in "
    "this process, gone with the command; default: $OMNI_KEEP_ALIVE, else 5m).")]


QUANTIZE_CHOICES = ("int4", "fp8")


def check_quantize(quantize: str | None, group_size: int | None) -> str | None:
    """--quantize as RuntimeOptions holds it ("INT4" -> "int4"), or a one-line UsageError: an unknown name,
    or --group-size without int4."""
    from ..errors import UsageError

    if quantize is not None:
        quantize = quantize.strip().lower()
        if quantize not in QUANTIZE_CHOICES:
            raise UsageError(f"--quantize must be int4 or fp8 (got {quantize!r})")
    if group_size is not None and quantize != "int4":
        raise UsageError("--group-size is for --quantize int4: give that too, or leave --group-size out")
    return quantize


def runtime_options(device: str, dtype: str, graphs: bool, compile: bool, max_context: int | None = None,
                    kernels: bool = True, attention_kernel: bool = True, codes_capacity: int | None = None,
                    quantize: str | None = None, group_size: int | None = None):
    """The one `RuntimeOptions` of a command, from its flags and the environment (read there, once): a
    switch left at its default (graphs, kernels on; compile off) is "not given", so OMNI_NO_GRAPHS=1 and
    the like still turn it off; one given on the command line wins. A UsageError for a bad --quantize."""
    from ..config import RuntimeOptions

    quantize = check_quantize(quantize, group_size)
    return RuntimeOptions.from_env(device=device, dtype=dtype, graphs=None if graphs else False,
                                   compile=True if compile else None, kernels=None if kernels else False,
                                   attention_kernel=None if attention_kernel else False, max_context=max_context,
                                   max_codes=codes_capacity, quantize=quantize, group_size=group_size)


def where_from_flags(model, runtime, server, api_key, local: bool, keep_alive: str, quiet: bool):
    """The command's `connect.Where`, checked: a mistyped model path or keep-alive is a usage error here,
    before any server is asked, started or stopped."""
    from ..api.keep_alive import parse_duration
    from .connect import Where, check_model

    check_model(model)
    keep_seconds = 0.0 if local or server else parse_duration(keep_alive)
    return Where(model=model, runtime=runtime, server=server, api_key=api_key, local=local,
                 keep_seconds=keep_seconds, quiet=quiet)


# Talk mode (omni-chat --talk, /talk): its flags, and the one place they become audio/listener.ListenOptions.
TalkOpt = Annotated[bool, typer.Option("--talk", help="Start in talk mode: speak, and the reply is spoken back; "
                                       "each turn ends when you stop speaking, speech interrupts a reply (barge-in); "
                                       "Enter leaves talk mode (/talk enters it again).")]
HeadphonesOpt = Annotated[bool, typer.Option("--headphones", help="Talk mode without echo cancelling (the "
                                             "speaker cannot reach the microphone): less work, no reference needed.")]
VadModelOpt = Annotated[str, typer.Option("--vad-model", metavar="webrtc|silero", help="Talk mode's voice-activity "
                                          "detection: webrtc (light, no torch) or silero (a small neural model from "
                                          "the silero-vad package, steadier in noise; needs torch).")]
BargeInOpt = Annotated[int, typer.Option("--barge-in-ms", min=0, max=5000, metavar="MS", help="Talk mode: how much "
                                         "speech (ms) interrupts a reply; a cough or a click is shorter.")]
EndSilenceOpt = Annotated[int, typer.Option("--end-silence-ms", min=100, max=10000, metavar="MS", help="Talk mode: "
                                            "the silence (ms) after speech that ends your turn.")]


def listen_options(input_device: str | None, headphones: bool, vad_model: str, barge_in_ms: int,
                   end_silence_ms: int):
    """Talk mode's flags as one audio/listener.ListenOptions (a UsageError, exit 2, for a bad value)."""
    from ..audio.listener import ListenOptions

    return ListenOptions(device=input_device, echo="off" if headphones else "webrtc", vad=vad_model.strip().lower(),
                         barge_in_ms=barge_in_ms, end_silence_ms=end_silence_ms)
