"""What compiling a start's modules on worker processes beside its imports would save, where Python writes
no bytecode (a fresh GPU machine: omni_cli/bytecode.py). `list` imports torch, transformers and
Qwen2.5-Omni's model code and writes the source files it imported, in import order, to FILE; `run K FILE`
starts K workers compiling FILE's sources into this process's pycache prefix, round-robin, then imports
the same and prints how long the imports took. Run `run` with an empty prefix, as a first start meets it:

    python scripts/compile_ahead_probe.py list /tmp/startup.txt
    for k in 0 1 2; do rm -rf /tmp/pc; PYTHONDONTWRITEBYTECODE=1 python -X pycache_prefix=/tmp/pc \\
        scripts/compile_ahead_probe.py run $k /tmp/startup.txt; done
"""

import subprocess
import sys
import time

WORKER = """
import sys, py_compile
for path in sys.stdin.read().split("\\n"):
    try:
        py_compile.compile(path, doraise=True)
    except Exception:
        pass
"""


def imports() -> None:
    import torch  # noqa: F401
    from transformers import Qwen2_5OmniForConditionalGeneration  # noqa: F401


if sys.argv[1] == "list":
    imports()
    files = [f for m in list(sys.modules.values()) if isinstance(f := getattr(m, "__file__", None), str) and f.endswith(".py")]
    with open(sys.argv[2], "w") as out:
        out.write("\n".join(files))
    print(f"{len(files)} source files")
else:
    t0 = time.perf_counter()
    k, files = int(sys.argv[2]), open(sys.argv[3]).read().split("\n")
    for i in range(k):
        worker = subprocess.Popen([sys.executable, "-X", f"pycache_prefix={sys.pycache_prefix}", "-c", WORKER],
                                  stdin=subprocess.PIPE, text=True)
        worker.stdin.write("\n".join(files[i::k]))
        worker.stdin.close()
    imports()
    print(f"{k} workers: imports {time.perf_counter() - t0:.2f} s")
