"""bytecode.cache_bytecode: when Python is told to write no bytecode (PYTHONDONTWRITEBYTECODE), the programs keep
the bytecode of what they import under ~/.cache/omni_cli/pycache instead of compiling torch's and
transformers' sources again at every start; never beside the sources; not with OMNI_NO_PYCACHE=1; and
nothing changes when Python writes bytecode anyway. The first start writes none itself: workers compile
the sources a start imports beside its imports (`compile_ahead`), and a background process the rest, after
`write_bytecode_later`, which marks the folder complete; only then do starts write as they import. Each case
runs in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import REPO_ROOT, cli_env

PROBE = ("import sys; from omni_cli.bytecode import cache_bytecode, write_bytecode_later; where = cache_bytecode(); "
         "sys.path.insert(0, {src!r}); import probe_mod; print(where)")
LATER = PROBE + "; write_bytecode_later()"


def _env(tmp_path, **extra):
    env = cli_env(XDG_CACHE_HOME=str(tmp_path / "cache"), **extra)
    for name in ("OMNI_NO_PYCACHE", "PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE"):
        if name not in extra:
            env.pop(name, None)
    return env


def _probe(tmp_path, env, code: str = PROBE) -> tuple[str, list[str], list[str]]:
    """(what cache_bytecode returned, .pyc files under the cache, .pyc files beside the source)."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "probe_mod.py").write_text("X = 1\n")
    done = subprocess.run([sys.executable, "-c", code.format(src=str(src))], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    cached = sorted(p.name for p in (tmp_path / "cache").rglob("probe_mod*.pyc"))
    beside = sorted(p.name for p in src.rglob("*.pyc"))
    return done.stdout.strip(), cached, beside


def _eventually(pattern: str, folder, seconds: float = 60.0) -> list:
    """The files matching `pattern` under `folder`, once there are any (the background writer's)."""
    end = time.monotonic() + seconds
    while not (found := list(folder.rglob(pattern))) and time.monotonic() < end:
        time.sleep(0.1)
    return found


def test_bytecode_is_kept_in_the_cache_when_python_would_write_none(tmp_path):
    env = _env(tmp_path, PYTHONDONTWRITEBYTECODE="1", OMNI_NO_COMPILE_AHEAD="1")
    cache = tmp_path / "cache" / "omni_cli" / "pycache"
    # The first start writes nothing itself, beside the sources or in the cache...
    where, cached, beside = _probe(tmp_path, env)
    assert where == str(cache)
    assert cached == [] and beside == [] and not cache.exists()
    # ... until it asks for its bytecode to be written later, by a background process, which then marks
    # the folder complete.
    _probe(tmp_path, env, LATER)
    assert _eventually("probe_mod*.pyc", cache)
    assert _eventually(".complete", cache)
    # Once the folder is complete, a start writes what it imports as it imports it.
    (tmp_path / "src" / "probe_mod.py").write_text("X = 2\n")
    for pyc in cache.rglob("probe_mod*.pyc"):
        pyc.unlink()
    where, cached, beside = _probe(tmp_path, env)
    assert len(cached) == 1 and beside == []


@pytest.mark.parametrize("case", ["OMNI_NO_PYCACHE=1", "bytecode written anyway"])
def test_nothing_changes_otherwise(tmp_path, case):
    extra = {"PYTHONDONTWRITEBYTECODE": "1", "OMNI_NO_PYCACHE": "1"} if case.startswith("OMNI") else {}
    where, cached, beside = _probe(tmp_path, _env(tmp_path, **extra))
    assert where == "None" and cached == []
    assert beside == ([] if extra else ["probe_mod.cpython-%d%d.pyc" % sys.version_info[:2]])


def test_the_programs_do_it_before_their_imports(tmp_path):
    """omni-say's entry point: the loader (imported inside the command) lands in the cache, written on
    the first start's way out (no model loaded), then read by the next start. (No workers compiling the
    shipped list ahead: 4,000 files would keep a CI core busy long after the test.)"""
    env = _env(tmp_path, PYTHONDONTWRITEBYTECODE="1", OMNI_NO_COMPILE_AHEAD="1")
    done = subprocess.run([sys.executable, "-c", "from omni_cli.entry_points import say; say()", "--list-voices"],
                          env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _eventually("loader*.pyc", tmp_path / "cache" / "omni_cli" / "pycache")


@pytest.mark.parametrize("program", ["say", "chat", "serve", "bench"])
def test_an_installed_program_arranges_it_before_importing_its_command(tmp_path, program):
    """The entry points pyproject names (omni_cli.entry_points) set the cache before the command's module
    is imported: with the folder there, omni_cli/faces/options.py itself (and typer) are written into it as
    they are imported, so the next start reads them. (An entry point naming omni_cli.faces.say:main compiled them
    from source at every start: they were imported before say_main could set anything.)"""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later

    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[f"omni-{program}"] == f"omni_cli.entry_points:{program}"
    env = _env(tmp_path, PYTHONDONTWRITEBYTECODE="1")
    cache = tmp_path / "cache" / "omni_cli" / "pycache"
    cache.mkdir(parents=True)
    (cache / ".complete").touch()
    done = subprocess.run([sys.executable, "-c", f"from omni_cli.entry_points import {program}; {program}()", "--help"],
                          env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    written = [p for p in cache.rglob("*.pyc") if p.parent.name == "faces"]
    assert "options" in {p.name.split(".")[0] for p in written}
    assert list(cache.rglob("typer/main.*.pyc"))


AHEAD = ("import sys; from pathlib import Path; import omni_cli.bytecode as b; b.SOURCES = Path({listing!r}); "
         "where = b.cache_bytecode(); sys.path.insert(0, {src!r}); import probe_mod; print(where)")


def test_a_first_start_compiles_the_listed_sources_on_workers_and_writes_none_itself(tmp_path):
    """Workers compile the list (a package's module and a standard-library one, by root; an entry that
    exists nowhere is skipped) into the cache; the start itself writes nothing, not even the module it
    imports that the list lacks; while the folder is not marked complete, a second start only reads it
    (it starts no workers and writes nothing as it imports); `write_bytecode_later` then writes the rest
    and marks it."""
    pkg = tmp_path / "src" / "aheadpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "mod_a.py").write_text("A = 1\n")
    listing = tmp_path / "startup_sources.txt"
    listing.write_text("# a comment\naheadpkg/__init__.py\naheadpkg/mod_a.py\n@stdlib/colorsys.py\n"
                       "nowhere/x.py\n@stdlib/no_such_module.py\n")
    env = _env(tmp_path, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(tmp_path / "src"))
    cache = tmp_path / "cache" / "omni_cli" / "pycache"
    code = AHEAD.replace("{listing!r}", repr(str(listing)))
    where, cached, beside = _probe(tmp_path, env, code)
    assert where == str(cache)
    assert _eventually("mod_a*.pyc", cache) and _eventually("colorsys*.pyc", cache)
    assert _eventually("__init__*.pyc", cache / str(pkg).lstrip("/"))
    assert cached == [] and beside == []  # probe_mod: imported, not listed, so not written (yet)
    assert not (cache / ".complete").exists()
    # A second start meanwhile: the folder is not complete, so it writes nothing as it imports.
    where, cached, _ = _probe(tmp_path, env, code)
    assert cached == []
    _probe(tmp_path, env, code + "; b.write_bytecode_later()")
    assert _eventually("probe_mod*.pyc", cache) and _eventually(".complete", cache)


def test_the_shipped_list_names_sources_found_here():
    """startup_sources.txt resolves on this machine: most of its first entries (the standard library's,
    torch's) are files here, by the same rule as the workers'."""
    import os

    from omni_cli.bytecode import listed, source_path

    lines = listed()
    assert len(lines) > 1000
    roots: dict = {}
    found = sum(os.path.isfile(path) for line in lines[:400] if (path := source_path(line, roots)) is not None)
    assert found >= 0.9 * 400
