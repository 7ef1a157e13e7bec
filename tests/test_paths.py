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


def test_the_keep_alive_record_is_written_whole(monkeypatch, tmp_path):
    """keep_alive wrote its record in place (a reader could see half of it); now through atomic_write."""
    from omni_cli import atomic
    from omni_cli.api import keep_alive

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert keep_alive._record_file() == paths.keep_alive_record()
    keep_alive.server_folder(make=True)
    written = []
    real = atomic.atomic_write
    monkeypatch.setattr(atomic, "atomic_write", lambda path, data, **kw: written.append(Path(path)) or real(path, data, **kw))
    import json


    class Proc:
        pid = 12345

    monkeypatch.setattr(keep_alive.client, "listening", lambda url: False)
    monkeypatch.setattr(keep_alive.subprocess, "Popen", lambda *a, **k: Proc())
    monkeypatch.setattr(keep_alive, "_wait", lambda *a, **k: "remote")
    assert keep_alive.start_server("some-model", [], 60.0) == "remote"
    assert written == [paths.keep_alive_record()]
    record = json.loads(paths.keep_alive_record().read_text())
    assert record["pid"] == 12345 and record["port"] and sorted(p.name for p in paths.server_dir().iterdir()) == \
        ["omni-serve-%d.log" % record["port"], "omni-serve.json"]
