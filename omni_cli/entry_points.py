"""The installed programs (pyproject's `[project.scripts]`): each arranges where Python keeps bytecode
(`ui.cache_bytecode`) before it imports its command.

Where Python writes no bytecode (PYTHONDONTWRITEBYTECODE, container images), the programs keep it under
`~/.cache/omni_cli/pycache`; but an entry point that names `omni_cli.cli:say_main` has imported the CLI,
typer and click before `say_main` can say so, and those ~0.1 s of compiling sources came back at every
command (an H200 machine: 0.14-0.21 s from the command to its first line, against 0.08-0.09 s with
bytecode; through a running omni-serve that is a third of the wait for the first audio). Here the
setting comes first. It imports nothing else at module level.
"""

from __future__ import annotations


def _bytecode_first() -> None:
    from .ui import cache_bytecode

    cache_bytecode()


def say() -> None:
    """omni-say"""
    _bytecode_first()
    from .cli import say_main

    say_main()


def chat() -> None:
    """omni-chat"""
    _bytecode_first()
    from .cli import chat_main

    chat_main()


def serve() -> None:
    """omni-serve"""
    _bytecode_first()
    from .serve import serve_main

    serve_main()


def bench() -> None:
    """omni-bench"""
    _bytecode_first()
    from .bench import bench_app

    bench_app()
