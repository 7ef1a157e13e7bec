"""Run a module (as `python -m`) with module-level settings changed first: an A/B of a constant on one
machine, in one call, without a flag in the product for it. For a GPU machine's side-by-side runs:

    python scripts/with_setting.py omni_cli.models.qwen3_omni.code2wav.FIRST_CHUNK=4 -- \\
        omni_cli.faces.bench --preset qwen3-omni-30b-a3b --runs 3 --json

Each SETTING is `package.module.NAME=VALUE` (VALUE read as a Python literal); the module after `--` runs
with the arguments after it.
"""

from __future__ import annotations

import ast
import importlib
import runpy
import sys


def main(argv: list[str]) -> None:
    if "--" not in argv:
        raise SystemExit(__doc__)
    cut = argv.index("--")
    for setting in argv[:cut]:
        target, value = setting.split("=", 1)
        module, name = target.rsplit(".", 1)
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            raise SystemExit(f"{module} has no {name}")
        setattr(mod, name, ast.literal_eval(value))
        print(f"with_setting: {target} = {getattr(mod, name)!r}", file=sys.stderr)
    sys.argv = argv[cut + 1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
