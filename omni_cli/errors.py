"""Errors a person can act on.

An `OmniError` carries a one-line message that says what went wrong and what to do, and the exit
code the CLI should end with. The CLI prints `error: <message>` on stderr (the traceback only with
`--debug`). Anything that is not an `OmniError` is a bug and is reported as such.
"""

from __future__ import annotations


class OmniError(Exception):
    """A failure with a message meant for the user. Exit code 1 (runtime failure)."""

    exit_code = 1


class UsageError(OmniError):
    """The request itself is wrong (bad flag value, empty prompt, unknown voice). Exit code 2."""

    exit_code = 2


class ModelError(OmniError):
    """The model could not be found or is not a checkpoint of a supported family. Exit code 1."""


class OutputError(OmniError):
    """An output (WAV file, stdout, sound device) could not be written. Exit code 1."""


class AudioDeviceError(OutputError):
    """Sound cannot be played: no PortAudio, no output device, or the device failed. Exit code 1."""


class StdoutClosed(OutputError):
    """Whoever read stdout stopped reading (`omni-say ... | head -c 5`). Not a failure to report: the
    CLI ends quietly with 141, the status a shell shows for a Unix tool ended by SIGPIPE (128 + 13)."""

    exit_code = 141


def known_failure(exc: BaseException) -> BaseException:
    """`exc`, or an OmniError that says what to do when `exc` is a failure with a known cure raised
    below us as a plain exception (running out of device memory; an OSError naming a file)."""
    if isinstance(exc, OmniError):
        return exc
    if isinstance(exc, OSError) and exc.filename is not None and not isinstance(exc, BrokenPipeError):
        # A file that could not be read or written, raised by code below a face's own checks: one line
        # naming the file, as a Unix tool says it (a full disk names the file system that is full).
        from .atomic import os_reason  # atomic imports this module

        new = OmniError(f"{exc.filename}: {os_reason(exc, exc.filename)}")
        new.__cause__ = exc
        return new
    if type(exc).__name__ == "OutOfMemoryError" or (isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()):
        new = OmniError("out of device memory while answering: try a shorter prompt, a lower --max-codes or "
                        "--max-text-tokens, --text-only, or --dtype bfloat16")
        new.__cause__ = exc
        return new
    return exc
