"""Write `omni_cli/startup_sources.txt`: the Python sources a start imports, in the order it imports them,
for `bytecode.compile_ahead` (the first start's bytecode compiled on worker processes beside the imports).

It loads the built-in tiny models here, in one process (Qwen2.5-Omni plain and packed, Qwen3-Omni), has
each say a few words, imports what only a GPU or a server imports (Triton, the kernels, uvicorn), and lists
every module then in `sys.modules` by its root: a top-level package's name, or `@stdlib`. Paths are
relative to that root, so the list holds on any machine; a file another version lacks is skipped there,
and one it adds is compiled by the importing process, as without the list.

Run it again when torch or transformers change much (seconds on a 2-core CPU). `--merge` keeps the lines
of OUT this run did not import after its own (a list made on a GPU machine, with Triton, joined with this
machine's):
    python scripts/startup_sources.py [--merge] [OUT]
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Imported on a GPU (kernels, graphs) or by a server, not by a CPU reply.
EXTRA = ("triton", "triton.language", "omni_cli.runtime.kernels", "omni_cli.runtime.quant_kernels",
         "omni_cli.runtime.fused", "omni_cli.runtime.graphs", "omni_cli.faces.serve", "omni_cli.faces.say",
         "omni_cli.faces.chat.main", "omni_cli.api.server", "omni_cli.api.realtime", "uvicorn", "starlette.applications")


def run_start() -> None:
    import omni_cli
    from omni_cli.config import ReplyOptions, RuntimeOptions

    options = ReplyOptions(max_text_tokens=4, max_codes=12, seed=0)
    for model, quantize in (("assets/tiny-qwen2.5-omni", None), ("assets/tiny-qwen2.5-omni", "int4"),
                            ("assets/tiny-qwen3-omni", None)):
        assistant = omni_cli.load(str(ROOT / model), runtime=RuntimeOptions(quantize=quantize))
        assistant.say("Hi", options)
        assistant.close()
    for name in EXTRA:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a module this machine cannot import is left out
            print(f"left out {name}: {exc}", file=sys.stderr)


def entry(path: str, stdlib: str) -> str | None:
    """`ROOT/relative` for one module's source file, or None for a file outside any root we can name."""
    path = os.path.realpath(path)
    for base in sys.path:
        base = os.path.realpath(base or ".")
        if base == os.path.realpath(stdlib) or not path.startswith(base + os.sep):
            continue
        rel = os.path.relpath(path, base)
        top = rel.split(os.sep)[0]
        if top.endswith(".py") or os.path.isdir(os.path.join(base, top)):
            return rel.replace(os.sep, "/")
    if path.startswith(os.path.realpath(stdlib) + os.sep):
        return "@stdlib/" + os.path.relpath(path, os.path.realpath(stdlib)).replace(os.sep, "/")
    return None


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--merge"]
    out = Path(args[0]) if args else ROOT / "omni_cli" / "startup_sources.txt"
    before = [line for line in out.read_text().splitlines() if line and not line.startswith("#")] \
        if "--merge" in sys.argv and out.is_file() else []
    run_start()
    stdlib = os.path.dirname(os.__file__)
    lines, seen = [], set()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or not path.endswith(".py"):
            continue
        line = entry(path, stdlib)
        if line is None or line in seen or line.startswith("scripts/") or line.startswith("tests/"):
            continue
        seen.add(line)
        lines.append(line)
    lines += [line for line in before if line not in seen]
    header = ("# The Python sources a start imports, in import order (scripts/startup_sources.py wrote it;\n"
              "# bytecode.compile_ahead reads it). A path is relative to its first part's root: @stdlib, or a\n"
              "# top-level package or module found on sys.path.\n")
    out.write_text(header + "\n".join(lines) + "\n")
    print(f"{len(lines)} sources -> {out}")


if __name__ == "__main__":
    main()
