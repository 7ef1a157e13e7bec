"""Talk mode over a server's /v1/realtime (faces/chat/talk_remote.py), against a fake realtime server: a
websockets sync server in a thread that records what the client sends and plays a script of server events.

No model and no microphone: a fake listener hands the talk loop 16 kHz blocks as the real one would
(echo cancelled, `find_turns=False`); the speaker is the real SpeakerSink on a fake sound device. They
check that the audio goes out as PCM16 at 24 kHz, that `session.update` asks for server VAD with
--end-silence-ms, that a reply's deltas are shown and played, that speech over a playing reply stops
the speaker and truncates the reply to what was played, and that /talk falls back to per-turn HTTP
with a server that has no /v1/realtime. Fast: the whole file takes a few seconds.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import numpy as np
import pytest
from audio_device import FakeSoundDevice
from fakes import FakeAssistant

RATE = 24_000


# -- the fake server ------------------------------------------------------------------------------------


class FakeRealtime:
    """A /v1/realtime that answers session.update and then runs `script(self)` on its own thread."""

    def __init__(self, script=None, realtime: bool = True, refuse: bool = False) -> None:
        from websockets.sync.server import serve

        self.script = script
        self.refuse = refuse
        self.received: list[dict] = []
        self.ws = None
        self.ended: BaseException | None = None
        self.got = threading.Condition()

        def process_request(connection, request):
            if not realtime or not request.path.startswith("/v1/realtime"):
                return connection.respond(404, "Not Found\n")
            return None

        self.server = serve(self._handler, "127.0.0.1", 0, process_request=process_request, compression=None)
        self.url = f"http://127.0.0.1:{self.server.socket.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _handler(self, ws) -> None:
        self.ws = ws
        self.send("session.created", session={"id": "sess_1"})
        try:
            for raw in ws:
                event = json.loads(raw)
                with self.got:
                    self.received.append(event)
                    self.got.notify_all()
                if event["type"] == "session.update" and self.refuse:  # a /v1/realtime of another shape
                    self.send("error", error={"type": "invalid_request_error", "message": "unknown field audio"})
                elif event["type"] == "session.update":
                    self.send("session.updated", session=event["session"])
                    if self.script is not None:
                        threading.Thread(target=self.script, args=(self,), daemon=True).start()
        except Exception as exc:  # noqa: BLE001 - the client went away
            self.ended = exc

    def send(self, kind: str, **fields) -> None:
        self.ws.send(json.dumps({"type": kind, **fields}))

    def wait_for(self, predicate, timeout: float = 5.0):
        """The first received event `predicate` accepts (waiting for it)."""
        deadline = time.monotonic() + timeout
        with self.got:
            while True:
                for event in self.received:
                    if predicate(event):
                        return event
                left = deadline - time.monotonic()
                assert left > 0, f"not received; got {[e['type'] for e in self.received]}"
                self.got.wait(left)

    def wait_for_all(self, kind: str, n: int, timeout: float = 5.0) -> list[dict]:
        """The first `n` received events of `kind` (waiting for them)."""
        deadline = time.monotonic() + timeout
        while len(self.of(kind)) < n:
            assert time.monotonic() < deadline, f"not received; got {[e['type'] for e in self.received]}"
            time.sleep(0.01)
        return self.of(kind)[:n]

    def of(self, kind: str) -> list[dict]:
        with self.got:
            return [e for e in self.received if e["type"] == kind]

    def close(self) -> None:
        self.server.shutdown()


def appended(server: FakeRealtime) -> np.ndarray:
    """The audio the client appended, as int16 samples."""
    data = b"".join(base64.b64decode(e["audio"]) for e in server.of("input_audio_buffer.append"))
    return np.frombuffer(data, "<i2")


def reply_events(server: FakeRealtime, seconds: float, done: bool = True, blocks: int = 4) -> None:
    """A turn's end and a reply: its text, `seconds` of a 300 Hz tone, and (`done`) its response.done;
    once the client has sent the turn's audio (its clip is cut from what was sent)."""
    deadline = time.monotonic() + 5
    while appended(server).shape[0] < 0.45 * RATE and time.monotonic() < deadline:
        time.sleep(0.01)
    server.send("input_audio_buffer.speech_started", audio_start_ms=0, item_id="item_u1")
    server.send("input_audio_buffer.speech_stopped", audio_end_ms=300, item_id="item_u1")
    server.send("response.created", response={"id": "resp_1", "status": "in_progress"})
    server.send("response.output_item.added", response_id="resp_1", output_index=0,
                item={"id": "item_a1", "type": "message", "role": "assistant"})
    for text in ("Hello ", "there, ", "how are you?"):
        server.send("response.output_audio_transcript.delta", response_id="resp_1", item_id="item_a1",
                    output_index=0, content_index=0, delta=text)
    tone = (0.25 * np.sin(2 * np.pi * 300 * np.arange(round(seconds * RATE)) / RATE)).astype(np.float32)
    for part in np.array_split(tone, blocks):
        pcm = (part * 32767).astype("<i2").tobytes()
        server.send("response.output_audio.delta", response_id="resp_1", item_id="item_a1", output_index=0,
                    content_index=0, delta=base64.b64encode(pcm).decode())
    if done:
        server.send("response.done", response={"id": "resp_1", "status": "completed"})


# -- the client's side ----------------------------------------------------------------------------------


class FakeListener:
    """The listener of `find_turns=False`: 10 ms blocks of a 440 Hz tone at 16 kHz to `on_audio`, paced."""

    def __init__(self, options, *, on_level=None, find_turns=True, on_audio=None, seconds: float = 0.5) -> None:
        assert find_turns is False  # the server finds the turns
        self.options, self.on_audio, self.seconds = options, on_audio, seconds
        self.rate = options.sample_rate
        self.references = 0
        self.replies = 0
        self.closed = threading.Event()

    def start(self) -> None:
        def run():
            n = self.rate // 100
            t = np.arange(round(self.seconds * self.rate)) / self.rate
            tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
            for i in range(0, tone.shape[0], n):
                if self.closed.is_set():
                    return
                self.on_audio(tone[i:i + n])
                time.sleep(0.002)

        threading.Thread(target=run, daemon=True).start()

    def reference(self, block, rate) -> None:
        assert rate == RATE
        self.references += 1

    def reply_started(self) -> None:
        self.replies += 1

    def reply_ended(self) -> None:
        pass

    def check(self) -> None:
        pass

    def close(self) -> None:
        self.closed.set()


def make_repl(speed: float = 1.0, verbose: bool = False, url: str | None = None):
    from omni_cli.audio.speaker import SpeakerSink
    from omni_cli.faces.chat.loop import ChatRepl
    from omni_cli.faces.console import make_console

    sd = FakeSoundDevice(speed=speed)
    sinks = []

    def speaker():
        sink = SpeakerSink(backend=sd, prebuffer=0.05)
        sink.open(RATE)
        sinks.append(sink)
        return sink

    assistant = FakeAssistant()
    assistant.url = url
    out, err = io.StringIO(), io.StringIO()
    repl = ChatRepl(assistant, make_console("stdout", file=out), make_console("stderr", file=err),
                    speaker=speaker, verbose=verbose, piped=True)
    return repl, out, err, sinks, sd


def talk(repl, server: FakeRealtime, **listen):
    from omni_cli.api.realtime_client import RealtimeSession
    from omni_cli.audio.listener import ListenOptions
    from omni_cli.faces.chat.talk_remote import RemoteTalk

    session = RealtimeSession.connect(server.url, timeout=5.0)
    return RemoteTalk(repl, ListenOptions(echo="off", **listen), session, listener=FakeListener, stdin=False)


def run_until(mode, done, timeout: float = 8.0) -> None:
    """`mode.run()` here until `done()` holds (looked at on another thread), then Enter's stop."""
    def watch():
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            time.sleep(0.01)
        mode.stop.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    mode.run()
    watcher.join()


# -- the tests ------------------------------------------------------------------------------------------


def test_the_session_asks_for_server_vad_and_the_microphone_goes_out_as_pcm16_at_24_khz():
    server = FakeRealtime()
    try:
        repl, _out, _err, _sinks, _sd = make_repl()
        mode = talk(repl, server, end_silence_ms=650)
        run_until(mode, lambda: appended(server).shape[0] >= 0.45 * RATE)
        update = server.of("session.update")[0]["session"]
        assert update["audio"]["input"]["turn_detection"] == {
            "type": "server_vad", "silence_duration_ms": 650, "interrupt_response": True, "create_response": True}
        assert update["audio"]["output"]["voice"] == "Chelsie"
        assert update["output_modalities"] == ["audio"]
        pcm = appended(server).astype(np.float32) / 32768
        assert 0.45 * RATE <= pcm.shape[0] <= 0.5 * RATE + 100  # 0.5 s sent at 16 kHz: 24 kHz samples
        spectrum = np.abs(np.fft.rfft(pcm[2400:]))
        peak = np.argmax(spectrum) * RATE / (2 * (spectrum.shape[0] - 1))
        assert abs(peak - 440) < 10, peak  # resampled: 16 kHz samples sent as they are would read as 660 Hz
        assert 0.4 < np.max(np.abs(pcm)) < 0.6
    finally:
        server.close()


def test_a_reply_is_shown_and_played_and_kept_in_the_conversation():
    server = FakeRealtime(script=lambda s: reply_events(s, seconds=0.4))
    try:
        repl, out, err, sinks, sd = make_repl(speed=4.0)
        mode = talk(repl, server)
        run_until(mode, lambda: repl.replies == 1)
        assert "Hello there, how are you?" in out.getvalue()
        assert len(sinks) == 1 and sinks[0].played == round(0.4 * RATE)
        heard = sd.streams[0].audio
        assert np.sum(np.abs(heard) > 0.05) > 0.3 * RATE  # the tone reached the device
        assert mode.listener.references > 0 and mode.listener.replies == 1  # the echo canceller's reference
        assert repl.transcript[-1] == {"role": "assistant", "content": "Hello there, how are you?"}
        clip = repl.chat.history.turns[-2]["media"]["audio"][0]
        assert clip.sample_rate == RATE and 0.3 < clip.seconds < 0.8  # the speech, cut from what was sent
        assert server.of("conversation.item.truncate") == []  # heard whole
        assert "interrupted" not in err.getvalue()
    finally:
        server.close()


def test_speech_over_a_playing_reply_stops_the_speaker_and_truncates_to_what_was_played():
    state = {}

    def script(s):
        reply_events(s, seconds=3.0, done=False)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (mode.replies and mode.replies[0].sink is not None
                                                   and mode.replies[0].sink.played >= 0.4 * RATE):
            time.sleep(0.005)
        s.send("input_audio_buffer.speech_started", audio_start_ms=900, item_id="item_u2")
        state["sent"] = time.perf_counter()
        s.wait_for(lambda e: e["type"] == "conversation.item.truncate")
        # The server's own cancel: a late delta, then its response.done (cancelled): nothing more is played.
        s.send("response.output_audio.delta", response_id="resp_1", item_id="item_a1", output_index=0,
               content_index=0, delta=base64.b64encode(np.full(2400, 8000, "<i2").tobytes()).decode())
        s.send("response.done", response={"id": "resp_1", "status": "cancelled"})
        state["done"] = True

    server = FakeRealtime(script=script)
    try:
        repl, _out, err, sinks, sd = make_repl(speed=1.0, verbose=True)
        mode = talk(repl, server)
        run_until(mode, lambda: state.get("done") and mode._reply is None)
        sink = sinks[0]
        assert sink.aborted and sink.silent_time is not None
        assert sink.silent_time - state["sent"] < 1.0  # the sound stopped as the event came (busy CI: slack)
        assert sink.samples == round(3.0 * RATE)  # the late delta was not played
        truncate = server.of("conversation.item.truncate")
        assert len(truncate) == 1 and truncate[0]["item_id"] == "item_a1" and truncate[0]["content_index"] == 0
        end_ms = truncate[0]["audio_end_ms"]
        assert 400 <= end_ms <= 2500, end_ms  # what had been played when the speech came, not the 3 s made
        assert end_ms == round(sink.played / RATE * 1000)
        assert sd.streams[0].audio.shape[0] < 2.8 * RATE  # the device stopped before the reply's end
        text = err.getvalue()
        assert "interrupted: kept" in text and "barge-in: sound off" in text
        kept = repl.transcript[-1]["content"]
        assert kept != "Hello there, how are you?" and "Hello there, how are you?".startswith(kept)
    finally:
        server.close()


@pytest.mark.parametrize("server_has", ["realtime", "no realtime", "another realtime"])
def test_talk_with_a_server_uses_its_realtime_session_or_falls_back_to_http(monkeypatch, server_has):
    from omni_cli.faces.chat import talk as talk_module
    from omni_cli.faces.chat import talk_remote

    ran = []

    class Turns:
        def __init__(self, repl, options):
            pass

        def run(self):
            ran.append("http")

    class Realtime(talk_remote.RemoteTalk):
        def run(self):
            ran.append("realtime")
            self.session.close()

    monkeypatch.setattr(talk_module, "TalkMode", Turns)
    monkeypatch.setattr(talk_remote, "RemoteTalk", Realtime)
    server = FakeRealtime(realtime=server_has != "no realtime", refuse=server_has == "another realtime")
    try:
        repl, _out, err, _sinks, _sd = make_repl(url=server.url)
        repl.chat.history.add("What is two and two?", "Four.")
        repl.command("/talk")
        assert ran == (["realtime"] if server_has == "realtime" else ["http"])
        note = "talking turn by turn over HTTP" in err.getvalue()
        assert note is (server_has != "realtime"), err.getvalue()
        if server_has == "no realtime":
            assert "404" in err.getvalue()
        if server_has == "another realtime":
            assert "unknown field" in err.getvalue()
        if server_has == "realtime":  # the chat's earlier turns went with the session
            items = [e["item"] for e in server.wait_for_all("conversation.item.create", 2)]
            assert items[0]["role"] == "user" and items[0]["content"] == [
                {"type": "input_text", "text": "What is two and two?"}]
            assert items[1]["role"] == "assistant" and items[1]["content"][0]["text"] == "Four."
            assert server.of("session.update")[0]["session"]["instructions"] == repl.chat.history.system
        ran.clear()
        local, _o, err2, _s, _d = make_repl(url=None)  # a model loaded here: turn by turn, no note
        local.command("/talk")
        assert ran == ["http"] and "HTTP" not in err2.getvalue()
    finally:
        server.close()


def test_a_listener_without_turns_hands_every_cleaned_block_to_its_callback():
    from omni_cli.audio.listener import Listener, ListenOptions

    got = []
    heard = Listener(ListenOptions(echo="off", vad="silero"), find_turns=False, on_audio=got.append)
    assert heard._vad is None  # no VAD made (Silero's would load torch)
    speech = (0.5 * np.sin(2 * np.pi * 200 * np.arange(RATE) / 16000)).astype(np.float32)
    for i in range(0, speech.shape[0], 160):
        heard.feed(speech[i:i + 160])
    assert sum(b.shape[0] for b in got) == speech.shape[0]
    assert heard.turns.qsize() == 0
    heard.check()  # nothing failed


def test_a_speaker_closed_without_waiting_plays_out_and_can_still_be_stopped():
    from omni_cli.audio.speaker import SpeakerSink

    for stop in (False, True):
        sink = SpeakerSink(backend=FakeSoundDevice(speed=1.0), prebuffer=0.05)
        sink.start(RATE)
        sink.write(np.full(RATE // 2, 0.25, np.float32))
        t0 = time.perf_counter()
        sink.close(wait=False)
        assert time.perf_counter() - t0 < 0.05 and not sink.finished.is_set()
        if stop:
            sink.abort()
            assert sink.finished.is_set() and sink.played < RATE // 2
        else:
            assert sink.finished.wait(2.0)
            sink.close()
            assert sink.closed and sink.played == RATE // 2
