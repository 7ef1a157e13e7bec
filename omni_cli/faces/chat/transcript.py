"""omni-chat's saved conversations: `/save PATH` writes PATH.json (the transcript: system prompt, turns,
where the model's context starts, the attachments) and PATH.wav (every reply's speech, with where each
is); `/load PATH` and `omni-chat --load PATH` resume one, so the next reply follows on from it.

A part of `ChatRepl` (loop.py). The files of one /save (the WAV, the recordings, the transcript) are
written under temporary names first and renamed together at the end, the transcript last
(atomic.stage, commit_all): a failure or a Ctrl-C before that leaves every old file as it was, and a
transcript never names a WAV that did not arrive. A file replaced keeps its mode. One that is not a
transcript changes nothing when loaded. It knows nothing of the model beyond the assistant's interface.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ... import atomic
from ...errors import OmniError, UsageError
from ...limits import read_regular_file
from ...prompt import TRANSCRIPT_FORMAT
from .commands import count
from .state import SessionState

# Seconds of silence between two replies in the WAV that /save writes.
SAVE_GAP = 0.5



class Transcripts(SessionState):
    """Saving and resuming of `ChatRepl` (which sets every attribute they use)."""

    def cmd_save(self, arg: str) -> None:
        if not arg:
            raise UsageError("/save needs a path: /save PATH writes PATH.json and PATH.wav")
        base = Path(arg).expanduser()
        if base.suffix.lower() in (".json", ".wav"):
            base = base.with_suffix("")
        json_path = base.with_name(base.name + ".json")
        wav_path = base.with_name(base.name + ".wav")
        json_target = atomic.output_target(json_path)  # a folder there: said before any audio is written
        staged: list = []  # renamed together at the end, the transcript last
        try:
            seconds = self._save_wav(wav_path, staged) if self.speech else None
            data = {
                "format": TRANSCRIPT_FORMAT,
                "model": self.assistant.name,
                "voice": self.voice,
                "system": self.chat.history.system,
                "turns": self.transcript,
                "context_from": self._context_from(),
                "audio": wav_path.name if seconds is not None else None,
                "audio_segments": self._segments(),
                # Audio said with a message: {"turn": index, "audio": [files]} (recordings written beside).
                "attachments": self._save_attachments(base, staged),
            }
            staged.append(atomic.stage(json_target, json.dumps(data, ensure_ascii=False, indent=2) + "\n"))
            atomic.commit_all(staged)
        except BaseException:
            atomic.discard_all(staged)
            raise
        if seconds is None:
            self.say(f"saved {json_path} ({count(len(self.transcript) // 2, 'exchange')}; no speech to save)")
        else:
            self.say(f"saved {json_path} ({count(len(self.transcript) // 2, 'exchange')}) and {wav_path} ({seconds:.1f} s)")

    def _save_attachments(self, base: Path, staged: list) -> list[dict]:
        """The attachments as the transcript names them: a file's path, or for a recording (/listen) the
        name of a WAV written beside the transcript (BASE.listen-N.wav, staged: see cmd_save)."""
        from ...audio.microphone import stage_clip

        out, n = [], 0
        for entry in self.attachments:
            names = list(entry.get("names", []))  # from a loaded transcript: the audio files it named
            for clip in entry.get("clips", []):
                if clip.source != "microphone":
                    names.append(clip.source)
                    continue
                n += 1
                path = base.with_name(f"{base.name}.listen-{n}.wav")
                staged.append(stage_clip(clip, path))
                names.append(path.name)
            saved = {"turn": entry["turn"], "audio": names}
            if entry.get("images"):
                saved["images"] = list(entry["images"])
            out.append(saved)
        return out

    def _context_from(self) -> int:
        """Where the model's history starts in the transcript (turns dropped to fit the context come
        before it), so that a loaded conversation prompts the model exactly as this one would."""
        history = self.chat.history.text_turns()
        start = len(self.transcript) - len(history)
        if start >= 0 and start % 2 == 0 and self.transcript[start:] == history:
            return start
        return 0  # not a suffix (cannot happen through this REPL): keep everything

    def _restore_media(self, start: int) -> None:
        """Give the loaded turns back the clips and images the transcript names, so that the model goes
        on hearing and seeing them as the saved session did (a server too: each request carries them).
        A file that is gone or unreadable is a note; its turn goes on without it."""
        if not getattr(self.assistant, "keeps_media", False):
            return
        from ...media import read_audio, read_image

        history = self.chat.history.turns
        for entry in self.attachments:
            turn = entry["turn"] - start
            if not 0 <= turn < len(history):
                continue  # dropped from the model's history before the save
            media: dict[str, list] = {"audio": [], "images": []}
            for kind, names, read in (("audio", entry["names"], lambda n: read_audio(n, limits=self.limits).at()),
                                      ("images", entry["images"], lambda n: read_image(n, limits=self.limits))):
                for name in names:
                    try:
                        media[kind].append(read(name))
                    except OmniError as exc:
                        self.say(f"note: {exc}; that turn goes on without it")
            if media["audio"] or media["images"]:
                history[turn]["media"] = media

    # -- resuming a saved conversation -----------------------------------------------------------
    def cmd_load(self, arg: str) -> None:
        if not arg:
            raise UsageError("/load needs a path: /load PATH reads PATH or PATH.json (written by /save)")
        self.load_transcript(arg)

    def load_transcript(self, path: str | os.PathLike) -> None:
        """Resume the conversation saved with /save at `path` (or `path`.json): its system prompt and turns
        become the model's history and this session's transcript, so the next reply follows on from it
        and the next /save writes all of it. The speech of its replies stays in the WAV saved beside it
        (this session's WAV holds the replies from now on). Raises UsageError (the file is missing, is
        not JSON, or is not a transcript) and then changes nothing. `omni-chat --load PATH` calls this."""
        from ...prompt import TranscriptError, parse_json, read_transcript

        file = _transcript_path(path)
        try:  # a regular file within the cap, checked before it is read (a FIFO, /dev/zero: refused at once)
            raw = read_regular_file(file, self.limits.transcript_bytes, "the transcript")
        except FileNotFoundError:
            tried = f"{file}" if str(file) == str(path) else f"{path} or {file}"
            raise UsageError(f"cannot load {tried}: no such file (/save PATH writes PATH.json)") from None
        except OSError as exc:
            raise UsageError(f"cannot load {file}: {exc.strerror or exc}") from None
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise UsageError(f"cannot load {file}: it is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
                             f"{exc.start}), so not a transcript") from None
        try:
            data = parse_json(text)
            system, turns, start = read_transcript(data, self.assistant.default_system)
        except TranscriptError as exc:
            raise TranscriptError(f"cannot load {file}: {exc}") from None
        saved: dict = data if isinstance(data, dict) else {}  # read_transcript checked it is one
        replaced = len(self.transcript) // 2
        self.chat.history.system = system
        self.chat.history.turns[:] = [dict(t) for t in turns[start:]]
        self.transcript = [dict(t) for t in turns]
        self.speech = []  # indexes into the transcript: the loaded turns have no audio in this session
        self.attachments = _loaded_attachments(saved.get("attachments"), file.parent, len(turns))
        self._restore_media(start)
        self.loaded_from = file
        self.say(f"loaded {file} ({count(len(turns) // 2, 'exchange')})"
                 + (f"; it replaces this session's {count(replaced, 'exchange')}" if replaced else ""))
        audio = saved.get("audio")
        if isinstance(audio, str) and audio:
            self.say(f"note: the speech of those replies stays in {file.with_name(audio)}; "
                     "the next /save writes the speech of the replies from now on")
        model = saved.get("model")
        if isinstance(model, str) and model and model != self.assistant.name:
            self.say(f"note: it was saved with the model {model}; this session runs {self.assistant.name}")
        if start:
            self.say(f"note: the model sees the last {count((len(turns) - start) // 2, 'exchange')} "
                     "(the older ones no longer fitted its context)")

    def _segments(self) -> list[dict]:
        """Where each reply's speech is in the saved WAV."""
        rate, at, out = self.assistant.sample_rate, 0, []
        for i, (index, audio) in enumerate(self.speech):
            if i:
                at += int(SAVE_GAP * rate)
            out.append({"turn": index, "start": at / rate, "seconds": len(audio) / rate})
            at += len(audio)
        return out

    def _save_wav(self, path: Path, staged: list) -> float:
        """Every reply's speech into a WAV at `path`, left under its temporary name in `staged`."""
        import numpy as np

        from ...audio.sinks import WavSink

        rate = self.assistant.sample_rate
        sink = WavSink(path)  # checks the folder first
        try:
            sink.start(rate)
            for i, (_, audio) in enumerate(self.speech):
                if i:
                    sink.write(np.zeros(int(SAVE_GAP * rate), dtype=np.float32))
                sink.write(audio)
            staged.append(sink.close_staged())
        except BaseException:
            sink.abort()
            raise
        return sink.seconds


def _transcript_path(path: str | os.PathLike) -> Path:
    """What /load PATH reads: PATH, or PATH.json when PATH is not a file (as /save PATH wrote it);
    PATH.wav names the JSON beside it."""
    file = Path(path).expanduser()
    if file.suffix.lower() == ".wav":
        return file.with_suffix(".json")
    # PATH itself when it is there and not a folder (a FIFO or a device too: reading refuses it, saying so).
    if (file.is_dir() or not os.path.lexists(file)) and file.suffix.lower() != ".json":
        return file.with_name(file.name + ".json")
    return file


def _loaded_attachments(entries, folder: Path, turns: int) -> list[dict]:
    """A saved transcript's attachments, kept for the next /save: each file as a path that still finds it
    from anywhere (a name beside the transcript becomes a path under its folder). Entries that do not
    name a user turn of the transcript are dropped (a hand-edited file)."""
    out = []
    for entry in entries if isinstance(entries, list) else []:
        turn = entry.get("turn") if isinstance(entry, dict) else None
        names = entry.get("audio", []) if isinstance(entry, dict) else None
        images = entry.get("images", []) if isinstance(entry, dict) else None
        if isinstance(turn, int) and not isinstance(turn, bool) and 0 <= turn < turns and turn % 2 == 0 \
                and isinstance(names, list) and isinstance(images, list) \
                and all(isinstance(n, str) for n in [*names, *images]):
            out.append({"turn": turn, "names": [str(folder / n) if "/" not in n else n for n in names],
                        "images": list(images)})
    return out
