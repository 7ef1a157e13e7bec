"""/listen's live meter: a level bar and the seconds heard on stderr, redrawn in place; on a terminal it
also watches stdin for Enter, which ends the turn. It knows nothing of the microphone itself."""

from __future__ import annotations

import sys
from typing import Any

from ..console import isatty

class Meter:
    """/listen's live line on stderr: a level bar and the seconds heard, redrawn in place; on a terminal
    it also watches stdin for Enter, which ends the turn (`stop`)."""

    WIDTH = 20  # characters of the bar, for -60..0 dBFS

    def __init__(self, err: Any, interactive: bool) -> None:
        import threading

        self.err = err
        self.interactive = interactive and isatty(sys.stdin)
        self.stop = threading.Event()
        self.drawn = False

    def __call__(self, level_dbfs: float, seconds: float) -> None:
        filled = max(0, min(self.WIDTH, round((level_dbfs + 60) / 60 * self.WIDTH)))
        if self.interactive:
            self.err.file.write(f"\r  [{'#' * filled}{' ' * (self.WIDTH - filled)}] {seconds:4.1f} s ")
            self.err.file.flush()
            self.drawn = True
            if self._enter_pressed():
                self.stop.set()

    def _enter_pressed(self) -> bool:
        import select

        try:
            ready, _, _ = select.select([sys.stdin], [], [], 0)
        except (OSError, ValueError):
            return False
        if ready:
            sys.stdin.readline()
            return True
        return False

    def done(self) -> None:
        if self.drawn:
            self.err.file.write("\r" + " " * (self.WIDTH + 14) + "\r")
            self.err.file.flush()

