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
    """The model could not be found or is not a Qwen2.5-Omni checkpoint. Exit code 1."""


class OutputError(OmniError):
    """An output (WAV file, stdout, sound device) could not be written. Exit code 1."""


class AudioDeviceError(OutputError):
    """Sound cannot be played: no PortAudio, no output device, or the device failed. Exit code 1."""
