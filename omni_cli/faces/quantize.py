"""omni-quantize SRC DST: a float Qwen-Omni checkpoint packed into a quantized one that omni-say, omni-chat
and omni-serve load (and that compressed-tensors / vLLM read): int4 (compressed-tensors pack-quantized,
group scales) or FP8 (float-quantized, block scales), thinker and talker decoder layers.

The flags become one `QuantizeOptions`; the work is quant/writing.py's `quantize_folder`. What a person can
get wrong that needs no model (the flags, DST not empty without --force, SRC missing) is checked before
torch is imported; progress goes to stderr (rich), the summary too; stdout stays empty. Errors are one
`error: ...` line with exit code 2 (usage) or 1 (everything else), as omni-say's.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..config import QuantizeOptions
from ..errors import UsageError
from .options import DebugOpt, OneLineErrors, make_app
from .program import err_line, exit_on, report_library_logs, run

quantize_app = make_app(
    "omni-quantize",
    "Quantize a float Qwen-Omni checkpoint folder SRC into DST (compressed-tensors layout): int4 with group "
    "scales (default) or FP8 with block scales, the thinker's and the talker's decoder layers.")

# names SRC may take for the built-in tiny models (their folders work as well)
BUILTIN = {"tiny": 0, "tiny-qwen2.5-omni": 0, "tiny-qwen3-omni": 1}


@quantize_app.command(cls=OneLineErrors)
def quantize(
    src: Annotated[str, typer.Argument(metavar="SRC", help="A float checkpoint: a folder, a hub id, or tiny / tiny-qwen3-omni.")],
    dst: Annotated[Path, typer.Argument(metavar="DST", help="The folder to write (must be absent or empty without --force).")],
    bits: Annotated[Optional[int], typer.Option("--bits", help="Integer bits: 4 (the default unless --fp8).")] = None,
    group_size: Annotated[int, typer.Option("--group-size", min=1, help="int4: inputs sharing one scale.")] = 128,
    zeros: Annotated[bool, typer.Option("--zeros", help="int4: a zero point per group (asymmetric) instead of symmetric codes.")] = False,
    fp8: Annotated[bool, typer.Option("--fp8", help="FP8 e4m3 weights with square block scales instead of int4.")] = False,
    block: Annotated[int, typer.Option("--block", min=1, help="--fp8: the side of a block sharing one scale.")] = 128,
    device: Annotated[str, typer.Option("--device", metavar="DEVICE", help="Where layers are packed: auto, cpu, cuda, cuda:N, npu, mps.")] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", metavar="DTYPE", help="The model's dtype while packing and on disk: auto (config.json's), bfloat16, float16, float32.")] = "auto",
    force: Annotated[bool, typer.Option("--force", help="Replace DST even if it is a folder that is not empty.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress or summary on stderr (errors still).")] = False,
    debug: DebugOpt = False,
) -> None:
    try:
        options = _options(bits, group_size, zeros, fp8, block, device, dtype, force)
        from ..loader import BUILTIN_TINY_DIRS, model_name_problem
        from ..quant.writing import check_destination  # torch is imported here: the flags are fine

        source = str(BUILTIN_TINY_DIRS[BUILTIN[src]]) if src in BUILTIN else src
        problem = model_name_problem(source)
        if problem:
            raise UsageError(problem)
        check_destination(dst, force, source)
        report_library_logs(quiet)
        t0 = time.perf_counter()
        written, packed = _run(source, dst, options, quiet)
        if not quiet:
            what = "int4" if options.kind == "int4" else "fp8"
            err_line(f"wrote {dst}: {packed.layers} layers packed {what} ({packed.bytes_before / 2**20:.1f} -> "
                     f"{packed.bytes_after / 2**20:.1f} MiB), {written.bytes / 2**20:.1f} MiB in {written.files} "
                     f"file{'s' if written.files > 1 else ''}, {time.perf_counter() - t0:.1f} s")
    except BaseException as exc:  # noqa: BLE001 - every way out is reported, none with a traceback
        if isinstance(exc, (SystemExit, typer.Exit)):
            raise
        exit_on(exc, debug)


def _options(bits, group_size, zeros, fp8, block, device, dtype, force) -> QuantizeOptions:
    if fp8 and bits is not None:
        raise UsageError("--fp8 and --bits exclude each other (--fp8 is 8-bit float)")
    if bits is not None and bits != 4:
        raise UsageError(f"--bits {bits}: only 4-bit integers are written (or --fp8)")
    if fp8 and zeros:
        raise UsageError("--zeros is for int4: FP8 has no zero points")
    return QuantizeOptions(kind="fp8" if fp8 else "int4", group_size=group_size, symmetric=not zeros, block=block,
                           device=device, dtype=dtype, force=force)


def _run(source: str, dst: Path, options: QuantizeOptions, quiet: bool):
    from ..quant.writing import quantize_folder

    if quiet:
        return quantize_folder(source, dst, options)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeRemainingColumn(), console=Console(file=sys.stderr), transient=True) as bar:
        tasks: dict[str, TaskID] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task("packing layers" if phase == "layers" else "writing bytes", total=total)
            bar.update(tasks[phase], completed=done)

        return quantize_folder(source, dst, options, progress)


def main() -> None:
    """The `omni-quantize` program."""
    run(quantize_app, "omni-quantize")


if __name__ == "__main__":
    main()
