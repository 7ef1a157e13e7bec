"""Where omni-cli keeps things on disk: the user's data (omni-chat's input history, kept recordings), the
caches (compiled kernels, bytecode, the background server's record, lock, log and the user's server
secret), through platformdirs, so
each system gets its own convention from one place:

    data    Linux: $XDG_DATA_HOME/omni-cli, else ~/.local/share/omni-cli
            macOS: ~/Library/Application Support/omni-cli     Windows: %APPDATA%\\omni-cli
    cache   Linux: $XDG_CACHE_HOME/omni_cli/NAME, else ~/.cache/omni_cli/NAME
            macOS: ~/Library/Caches/omni_cli/NAME             Windows: %LOCALAPPDATA%\\omni_cli\\Cache\\NAME

The Linux folders are the ones omni-cli has always used (the data folder's name has a hyphen, the
cache's an underscore), so a user's history and caches stay where they are. (platformdirs also reads
the XDG variables on macOS when they are set.) The keep-alive record stays in the cache, where earlier
versions put it: a command looks there for a server an older one started.

It knows folder names; it creates nothing (callers make a folder when they write into it) and reads
no file. platformdirs is imported when a folder is asked for.
"""

from __future__ import annotations

from pathlib import Path

DATA_NAME = "omni-cli"  # the data folder's name (as ui.data_dir() had it)
CACHE_NAME = "omni_cli"  # the cache folder's name (as config.cache_folder() had it)


def data_dir() -> Path:
    """The user's data folder for omni-cli (history, recordings)."""
    import platformdirs

    # roaming: Windows' %APPDATA% (what omni-cli used), not %LOCALAPPDATA%; appauthor=False: no vendor folder
    return Path(platformdirs.user_data_dir(DATA_NAME, appauthor=False, roaming=True))


def cache_dir(name: str) -> Path:
    """The cache folder called `name` (e.g. "torch-compile", "pycache", "serve")."""
    import platformdirs

    return Path(platformdirs.user_cache_dir(CACHE_NAME, appauthor=False)) / name


def default_history_file() -> Path:
    """omni-chat's input history, unless --history-file says otherwise."""
    return data_dir() / "chat_history"


def recordings_dir() -> Path:
    """Where omni-chat keeps a recording it could not send (/listen that ended in an error)."""
    return data_dir() / "recordings"


def server_dir() -> Path:
    """The background omni-serve's record and log (api/keep_alive.py)."""
    return cache_dir("serve")


def keep_alive_record() -> Path:
    """The record of the background omni-serve that omni-say/omni-chat started (pid, its start time, model,
    port, log), written by that server itself once it listens."""
    return server_dir() / "omni-serve.json"


def keep_alive_lock() -> Path:
    """The lock file that commands hold while they find or start the background omni-serve."""
    return server_dir() / "omni-serve.lock"


def server_secret() -> Path:
    """The user's own secret (0600) that an omni-serve of this user proves it knows (api/ownership.py)."""
    return server_dir() / "secret"
