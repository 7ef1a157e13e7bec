"""Python's bytecode for the programs where the environment says to write none (container images).

`cache_bytecode()` (before torch is imported) keeps it under the cache folder; the first start writes
none and `write_bytecode_later()` writes it on a detached low-priority process once the model is loaded.
It knows nothing of the programs that call it.
"""

from __future__ import annotations

import os
import sys

from .config import env_flag


BYTECODE_ENV = "OMNI_NO_PYCACHE"  # 1: leave Python's "write no bytecode" as it is (see cache_bytecode)


_bytecode_later: str | None = None  # the folder write_bytecode_later fills, when this start wrote none


# The background writer: it reads the whole list first (so that the program's write returns at once),
# then compiles each source into the folder -X pycache_prefix names, at the lowest CPU priority.
_WRITER = """
import os, sys, py_compile
files = sys.stdin.read().split("\\n")
if hasattr(os, "nice"):
    os.nice(19)
for file in files:
    try:
        py_compile.compile(file, doraise=True)
    except Exception:
        pass
"""


def cache_bytecode() -> str | None:
    """When Python was told to write no bytecode (PYTHONDONTWRITEBYTECODE, usual in container images)
    and the installed torch ships none, every start compiles torch's and transformers' Python sources
    again: on the H200 machines this project measures on, importing them took 12-17 s each time, and
    6.4 s once their bytecode was kept. So the programs keep it, in `~/.cache/omni_cli/pycache` (under
    `$XDG_CACHE_HOME` if set; `$PYTHONPYCACHEPREFIX` if the user set one), never beside the sources the
    setting kept clean: ~100 MB. Nothing changes where bytecode is written anyway, or with
    OMNI_NO_PYCACHE=1. Call it before torch is imported.

    The first start (no such folder yet) writes none: writing ~3,700 files while the weights come from a
    cold disk made a fresh start of the 7B model 0.4-6.7 s longer (three pairs on H200 machines, page cache
    dropped). `write_bytecode_later` then writes them on a background process, once the model is
    loaded. Returns the folder, or None when it did nothing."""
    global _bytecode_later
    if not sys.dont_write_bytecode or env_flag(BYTECODE_ENV):
        return None
    if sys.pycache_prefix is None:
        from .paths import cache_dir

        sys.pycache_prefix = str(cache_dir("pycache"))
    if os.path.isdir(sys.pycache_prefix):
        sys.dont_write_bytecode = False
    else:
        _bytecode_later = sys.pycache_prefix
    return sys.pycache_prefix


def write_bytecode_later() -> None:
    """If this start wrote no bytecode (see `cache_bytecode`): write that of every module imported so far,
    on a detached process at the lowest CPU priority, so that the next start finds it. Once per process;
    it outlives the program and never reports (a file it cannot write is compiled again next time)."""
    global _bytecode_later
    prefix, _bytecode_later = _bytecode_later, None
    if prefix is None:
        return
    import subprocess

    files = sorted({f for m in list(sys.modules.values()) if isinstance(f := getattr(m, "__file__", None), str)
                    and f.endswith(".py")})
    try:
        writer = subprocess.Popen([sys.executable, "-X", f"pycache_prefix={prefix}", "-c", _WRITER],
                                  stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True, text=True)
        assert writer.stdin is not None  # stdin=PIPE
        writer.stdin.write("\n".join(files))
        writer.stdin.close()
    except (OSError, ValueError):
        pass  # no bytecode kept: the next start compiles again, as without this

