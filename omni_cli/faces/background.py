"""`omni-say --ps` and `omni-say --stop` (as `ollama ps` and `ollama stop`): what the background omni-serve
that keeps a model loaded is doing, and stopping it.

Only a server that omni-say or omni-chat started is shown or stopped: its own record names a pid that
still runs with the recorded start time, and the server on the recorded port proves it is that one
(api/keep_alive.py, api/ownership.py). A server started by hand, another user's, or any other process
is never touched. It imports no torch.
"""

from __future__ import annotations

import sys

from ..errors import OmniError
from .console import shown
from .program import err_line


def show_or_stop(stop: bool) -> None:
    """Print the background server on stdout (`--ps`: pid, model, port, idle or busy, the keep-alive), or
    stop it (`--stop`; an OmniError if it is serving a reply, held by an open chat, or cannot prove that
    it is the recorded server)."""
    from ..api import client
    from ..api.keep_alive import read_record, stop_background

    if stop:
        record, outcome = stop_background()
        if record is None:
            err_line("no background omni-serve is running")
            return
        pid = record["pid"]
        if outcome == "stopped":
            err_line(f"stopped the background omni-serve (pid {pid})")
            return
        why = {"busy": "is busy (a reply, or an open chat)",
               "unproven": "does not answer as the server it recorded (still loading?)",
               }.get(outcome, "did not stop in time")
        raise OmniError(f"the background omni-serve (pid {pid}) {why}: it was left running")
    record = read_record()
    if record is None:
        err_line("no background omni-serve is running")
        return
    url = f"http://127.0.0.1:{record['port']}"
    health = client.proven_health(url, client.PROBE_TIMEOUT)
    if health is not None and health["proof"]["pid"] != record["pid"]:
        health = None  # another server holds the port: it says nothing of the recorded one
    state = ("busy" if health.get("queued") else "held by a chat" if health.get("held") else "idle") \
        if health else "loading"
    keep = health.get("keep_alive") if health else None
    line = (f"pid {record['pid']}  {record.get('model', '?')}  {url}  {state}"
            + (f"  (stops after {keep:g} s idle)" if isinstance(keep, (int, float)) and keep else ""))
    print(shown(line, sys.stdout), flush=True)  # the model's name is the record's: shown safely
