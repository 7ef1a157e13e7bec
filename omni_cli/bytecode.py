"""Python's bytecode for the programs where the environment says to write none (container images).

`cache_bytecode()` (before torch is imported) keeps it under the cache folder. A first start (no folder
yet) compiles the sources a start imports (`startup_sources.txt`, in import order) on worker processes
beside its own imports, which then find most of them compiled (`compile_ahead`), and writes none itself;
`write_bytecode_later()` compiles the rest on a detached low-priority process once the model is loaded
and marks the folder complete. Later starts read it and write what is new as they import it.
It knows nothing of the programs that call it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .config import env_flag


BYTECODE_ENV = "OMNI_NO_PYCACHE"  # 1: leave Python's "write no bytecode" as it is (see cache_bytecode)
AHEAD_ENV = "OMNI_NO_COMPILE_AHEAD"  # 1: a first start compiles no sources ahead (see compile_ahead)
SOURCES = Path(__file__).with_name("startup_sources.txt")  # scripts/startup_sources.py writes it
COMPLETE = ".complete"  # in the folder, once a start's bytecode was all written (write_bytecode_later)
MAX_WORKERS = 8


_bytecode_later: str | None = None  # the folder write_bytecode_later fills, when this start wrote none


# The background writer: it reads the whole list first (so that the program's write returns at once),
# then compiles each source not compiled yet into the folder -X pycache_prefix names, at the lowest CPU
# priority, and marks the folder complete.
_WRITER = """
import os, sys, py_compile, importlib.util
files = sys.stdin.read().split("\\n")
if hasattr(os, "nice"):
    os.nice(19)
for file in files:
    try:
        cached = importlib.util.cache_from_source(file)
        if not (os.path.exists(cached) and os.path.getmtime(cached) >= os.path.getmtime(file)):
            py_compile.compile(file, doraise=True)
    except Exception:
        pass
try:
    open(os.path.join(sys.pycache_prefix, %r), "w").close()
except OSError:
    pass
""" % COMPLETE

# A worker of `compile_ahead`: `compile_listed` on the caller's sys.path, a little below its priority.
_AHEAD = """
import os, sys
sys.path[:] = sys.argv[4].split(os.pathsep)
if hasattr(os, "nice"):
    os.nice(5)
from omni_cli.bytecode import compile_listed
compile_listed(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
"""


def cache_bytecode() -> str | None:
    """When Python was told to write no bytecode (PYTHONDONTWRITEBYTECODE, usual in container images)
    and the installed torch ships none, every start compiles torch's and transformers' Python sources
    again: on the H200 machines this project measures on, importing them took 12-17 s each time, and
    6.4 s once their bytecode was kept. So the programs keep it, in `~/.cache/omni_cli/pycache` (under
    `$XDG_CACHE_HOME` if set; `$PYTHONPYCACHEPREFIX` if the user set one), never beside the sources the
    setting kept clean: ~100 MB. Nothing changes where bytecode is written anyway, or with
    OMNI_NO_PYCACHE=1. Call it before torch is imported.

    The first start (no such folder yet) writes none itself: writing ~3,700 files on the importing thread
    while the weights came from a cold disk made a fresh start of the 7B model 0.4-6.7 s longer (three pairs
    on H200 machines, page cache dropped). Workers compile ahead of its imports instead (`compile_ahead`),
    and `write_bytecode_later` the rest once the model is loaded. Until that has marked the folder
    complete, a start only reads it (another start's workers may still be filling it) and leaves the rest
    for its own `write_bytecode_later`. Returns the folder, or None when it did nothing."""
    global _bytecode_later
    if not sys.dont_write_bytecode or env_flag(BYTECODE_ENV):
        return None
    if sys.pycache_prefix is None:
        from .paths import cache_dir

        sys.pycache_prefix = str(cache_dir("pycache"))
    prefix = sys.pycache_prefix
    if os.path.isfile(os.path.join(prefix, COMPLETE)):
        sys.dont_write_bytecode = False
        return prefix
    _bytecode_later = prefix
    if not os.path.isdir(prefix) and not env_flag(AHEAD_ENV):
        compile_ahead(prefix)
    return prefix


def compile_ahead(prefix: str, sources: Path | None = None) -> int:
    """Start workers that compile the sources a start imports (`sources`, None: `SOURCES`, in import
    order) into `prefix`, each every K-th of them, while this process imports: the imports find them
    compiled, where a first start compiled each on its one thread. An H100 machine, nothing cached:
    importing torch and transformers took 22.7 s of a 50 s start, 9.8 s with the workers; on a 2-core CPU
    9.1 s against 6.1-6.5 s with one worker (docs/benchmarks.md, twentieth pass). The workers are detached
    (a start that ends first leaves them to finish) and run a little below this process's priority; a file
    they fail on is compiled by whoever imports it, as without them. Returns the workers started (one
    fewer than the CPUs this process may use, at least one, at most MAX_WORKERS; none without a list or a
    folder)."""
    import subprocess

    sources = SOURCES if sources is None else sources
    try:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
        if not sources.is_file():
            return 0
        os.makedirs(prefix, exist_ok=True)
    except OSError:
        return 0
    workers = max(1, min(MAX_WORKERS, cpus - 1))
    command = [sys.executable, "-X", f"pycache_prefix={prefix}"] + ["-O"] * sys.flags.optimize + ["-c", _AHEAD]
    started = 0
    for i in range(workers):
        try:
            subprocess.Popen(command + [str(sources), str(i), str(workers), os.pathsep.join(sys.path)],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
            started += 1
        except (OSError, ValueError):
            break
    return started


def compile_listed(listing: str, i: int, k: int) -> None:
    """A `compile_ahead` worker's share: every `k`-th source of the list in `listing` from its `i`-th (so that
    the workers together go down it in the order a start imports it), compiled where this process keeps
    bytecode; a source not found or not compiled is left to whoever imports it."""
    import py_compile

    roots: dict[str, str | None] = {}
    for line in listed(Path(listing))[i::k]:
        path = source_path(line, roots)
        if path is None:
            continue
        try:
            py_compile.compile(path, doraise=True)
        except Exception:  # noqa: BLE001 - any failure: the importer compiles it, as without the list
            pass


def listed(listing: Path = SOURCES) -> list[str]:
    """The sources a list names, one a line, in its order (comments and blank lines left out)."""
    return [line for line in listing.read_text().splitlines() if line and not line.startswith("#")]


def source_path(line: str, roots: dict[str, str | None]) -> str | None:
    """The file a line of the list names on this sys.path (`@stdlib/...`, or a path under a top-level package
    or module), or None where its root is not found; `roots` keeps each root's folder once found."""
    root, _, rest = line.partition("/")
    if root == "@stdlib":
        return os.path.join(os.path.dirname(os.__file__), rest)
    if root not in roots:
        roots[root] = _root_folder(root)
    folder = roots[root]
    return None if folder is None else os.path.join(folder, line)


def _root_folder(root: str) -> str | None:
    """The folder holding the top-level package or module `root` ("torch", "typing_extensions.py") on
    sys.path, found without importing it."""
    import importlib.machinery

    spec = importlib.machinery.PathFinder.find_spec(root[:-3] if root.endswith(".py") else root)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return os.path.dirname(list(spec.submodule_search_locations)[0])
    return os.path.dirname(spec.origin) if spec.origin else None


def write_bytecode_later() -> None:
    """If this start wrote no bytecode (see `cache_bytecode`): write that of every module imported so far
    and not compiled yet (by `compile_ahead`'s workers), on a detached process at the lowest CPU priority,
    then mark the folder complete, so that the next start finds it and writes what is new itself. Once per
    process; it outlives the program and never reports (a file it cannot write is compiled again next
    time)."""
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

