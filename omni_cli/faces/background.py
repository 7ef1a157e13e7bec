"""`omni-say --ps` and `omni-say --stop` (as `ollama ps` and `ollama stop`): what the background omni-serve
that keeps a model loaded is doing, and stopping it.

Only a server that omni-say or omni-chat started (api/keep_alive.py's record) is shown or stopped; a
server started by hand, or any other process, is never touched. It imports no torch.
"""

from __future__ import annotations

import sys

from ..errors import OmniError
from .console import shown
from .program import err_line


def show_or_stop(stop: bool) -> None:
    """Print the background server on stdout (`--ps`: pid, model, port, idle or busy, the keep-alive), or
    stop it (`--stop`; an OmniError if it is serving a reply or held by an open chat)."""
    from ..api import client
    from ..api.keep_alive import read_record, stop_background

    if stop:
        record, gone = stop_background()
        if record is None:
            err_line("no background omni-serve is running")
        elif gone:
            err_line(f"stopped the background omni-serve (pid {record['pid']})")
        else:
            raise OmniError(f"the background omni-serve (pid {record['pid']}) is busy (a reply, or an open chat): "
                            "it was left running")
        return
    record = read_record()
    if record is None:
        err_line("no background omni-serve is running")
        return
    url = f"http://127.0.0.1:{record.get('port')}"
    try:
        health = client.health(url, client.PROBE_TIMEOUT)
    except (OSError, ValueError):
        health = {}
    state = ("busy" if health.get("queued") else "held by a chat" if health.get("held") else "idle") \
        if health else "loading"
    keep = health.get("keep_alive")
    line = f"pid {record['pid']}  {record.get('model', '?')}  {url}  {state}" + (f"  (stops after {keep:g} s idle)" if keep else "")
    print(shown(line, sys.stdout), flush=True)  # the model's name is the record's: shown safely
