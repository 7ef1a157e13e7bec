"""paths.py: the folders omni-cli keeps things in. On Linux exactly where they always were (ui.data_dir(),
config.cache_folder(), keep_alive's record), with and without the XDG variables; on macOS and Windows
platformdirs' conventions, from one place."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from omni_cli import paths

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux folders")


@linux
def test_linux_folders_are_the_ones_users_already_have(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert paths.data_dir() == tmp_path / ".local" / "share" / "omni-cli"
    assert paths.default_history_file() == tmp_path / ".local" / "share" / "omni-cli" / "chat_history"
    assert paths.recordings_dir() == tmp_path / ".local" / "share" / "omni-cli" / "recordings"
    assert paths.cache_dir("pycache") == tmp_path / ".cache" / "omni_cli" / "pycache"
    assert paths.keep_alive_record() == tmp_path / ".cache" / "omni_cli" / "serve" / "omni-serve.json"
    monkeypatch.setenv("XDG_DATA_HOME", "/somewhere")
    monkeypatch.setenv("XDG_CACHE_HOME", "/cached")
    assert paths.default_history_file() == Path("/somewhere/omni-cli/chat_history")
    assert paths.cache_dir("torch-compile") == Path("/cached/omni_cli/torch-compile")
    assert paths.server_dir() == Path("/cached/omni_cli/serve")
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty: the default, as before
    assert paths.cache_dir("x") == tmp_path / ".cache" / "omni_cli" / "x"


@linux
def test_linux_keeps_the_folders_users_have(monkeypatch, tmp_path):
    """The folders of the helpers paths.py replaced (ui.data_dir, config.cache_folder), exactly: a user's
    history and caches stay where they were."""
    from omni_cli import config

    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("XDG_DATA_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert paths.data_dir() == tmp_path / ".local" / "share" / "omni-cli"
    assert paths.default_history_file() == tmp_path / ".local" / "share" / "omni-cli" / "chat_history"
    assert config.cache_folder("serve") == str(tmp_path / ".cache" / "omni_cli" / "serve")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "d"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    assert paths.data_dir() == tmp_path / "d" / "omni-cli"
    assert config.cache_folder("serve") == str(tmp_path / "c" / "omni_cli" / "serve")


def test_macos_and_windows_follow_their_conventions(monkeypatch, tmp_path):
    import platformdirs

    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("XDG_DATA_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    from platformdirs.macos import MacOS

    monkeypatch.setattr(platformdirs, "PlatformDirs", MacOS)  # what platformdirs picks on a Mac
    assert paths.data_dir() == tmp_path / "Library" / "Application Support" / "omni-cli"
    assert paths.cache_dir("serve") == tmp_path / "Library" / "Caches" / "omni_cli" / "serve"


def test_the_keep_alive_record_is_written_whole_and_private_by_the_server_itself(monkeypatch, tmp_path):
    """keep_alive wrote its record in place (a reader could see half of it), from the command that started
    the server; now the server writes it (record_self, once it has bound the port) through a temporary
    file and a rename, mode 0600 even over an older record's 0644, and only when the keep-alive started it."""
    import json
    import os
    import stat

    from omni_cli import atomic
    from omni_cli.api import keep_alive

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert keep_alive._record_file() == paths.keep_alive_record()
    made = []
    real = atomic.Replacement.create
    monkeypatch.setattr(atomic.Replacement, "create", lambda self: made.append(self.target.path) or real(self))
    monkeypatch.delenv(keep_alive.RECORD_ENV, raising=False)
    keep_alive.record_self(8484, "some-model")  # a server started by hand: no record
    assert not paths.keep_alive_record().exists() and made == []
    keep_alive.server_folder(make=True)
    paths.keep_alive_record().write_text("{}")
    paths.keep_alive_record().chmod(0o644)
    monkeypatch.setenv(keep_alive.RECORD_ENV, "1")
    keep_alive.record_self(8484, "some-model")
    assert made == [paths.keep_alive_record()]
    assert keep_alive.RECORD_ENV not in os.environ  # not passed on to what the server starts
    record = json.loads(paths.keep_alive_record().read_text())
    assert record["pid"] == os.getpid() and record["port"] == 8484 and record["started"]
    assert stat.S_IMODE(paths.keep_alive_record().stat().st_mode) == 0o600
    assert stat.S_IMODE(paths.server_dir().stat().st_mode) == 0o700  # server_folder(make=True): private
    assert keep_alive.read_record() == record
    assert sorted(p.name for p in paths.server_dir().iterdir()) == ["omni-serve.json"]  # no temporary file left
