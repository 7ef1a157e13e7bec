"""The installed programs (pyproject's `[project.scripts]`): each arranges where Python keeps bytecode
(`bytecode.cache_bytecode`) before it imports its command.

Where Python writes no bytecode (PYTHONDONTWRITEBYTECODE, container images), the programs keep it under
`~/.cache/omni_cli/pycache`; but an entry point that names `omni_cli.faces.say:main` has imported the CLI,
typer and click before `say_main` can say so, and compiling their sources came back at every command
(an H200 machine, through a running omni-serve: the command's start 0.20-0.24 s that way, 0.14-0.16 s
with the setting first, of a first audio 0.5-0.7 s after the command). Here the setting comes first. It
imports nothing else at module level.
"""

from __future__ import annotations


def _run(module: str, main: str) -> None:
    """Arrange the bytecode, then import `module` (relative to this package) and call its `main`."""
    from importlib import import_module

    from .bytecode import cache_bytecode

    cache_bytecode()
    getattr(import_module(module, __package__), main)()


def say() -> None:
    """omni-say"""
    _run(".faces.say", "main")


def chat() -> None:
    """omni-chat"""
    _run(".faces.chat.main", "main")


def serve() -> None:
    """omni-serve"""
    _run(".faces.serve", "main")


def bench() -> None:
    """omni-bench"""
    _run(".faces.bench", "main")


def quantize() -> None:
    """omni-quantize"""
    _run(".faces.quantize", "main")
