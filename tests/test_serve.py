"""omni-serve end to end on the built-in tiny model, in a subprocess on a free port with an API key: the
official `openai` client streams a reply with text and audio (and gets a whole one with a WAV);
`omni-say --server` writes the WAV the server streamed; omni-chat `--server` in a real terminal (tmux)
does a turn and a Ctrl-C; a wrong key is a 401, a bad body a 400 and the server lives on; a client that
disconnects mid-reply frees the engine at once; 20 requests from 4 clients at once all complete whole,
with the server's memory flat; SIGTERM stops it cleanly. The shapes themselves (both servers' streams,
request parsing) are test_api_shapes.py's.
"""

from __future__ import annotations

import base64
import io
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import REPO_ROOT, cli_env, run_omni_say

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
HELLO = [{"role": "user", "content": "Hello there"}]


class Server:
    """`python -m omni_cli.faces.serve` in a subprocess; its stderr is read on a thread (the banner gives the URL)."""

    def __init__(self, *args: str, python: tuple[str, ...] = ()) -> None:
        env = cli_env()
        env.pop("OMNI_LOCAL", None)
        self.proc = subprocess.Popen([sys.executable, *python, "-m", "omni_cli.faces.serve", "--port", "0", *args], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
        self.lines: list[str] = []
        self.url: str | None = None
        ready = threading.Event()

        def drain():
            for line in self.proc.stderr:
                self.lines.append(line)
                m = re.search(r" at (http://\S+)/v1 ", line)
                if m:
                    self.url = m[1]
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        assert ready.wait(180) and self.url, "".join(self.lines)

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY)
    yield s
    url = s.url
    code = s.stop()
    # SIGTERM: a clean stop (uvicorn shuts down, then the signal unwinds the command: exit 128 + 15), port freed.
    assert code == 128 + signal.SIGTERM and any("stopped" in line for line in s.lines), (code, "".join(s.lines))
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)


def model_name(server: Server) -> str:
    return httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["id"]


def stream_raw(server: Server, body: dict) -> tuple[str, bytes, dict, dict]:
    """(transcript, PCM16 bytes, the final chunk's omni field, headers) of a streamed request."""
    text, pcm, omni = [], [], {}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200, r.read()
        done = False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            omni = chunk.get("omni") or omni
            for choice in chunk["choices"]:
                audio = choice["delta"].get("audio") or {}
                text.append(audio.get("transcript") or choice["delta"].get("content") or "")
                if audio.get("data"):
                    pcm.append(base64.b64decode(audio["data"]))
        assert done, "the stream ended without [DONE]"
        return "".join(text), b"".join(pcm), omni, dict(r.headers)


def spoken(messages=HELLO, **extra) -> dict:
    return {"messages": messages, "modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "pcm16"},
            "stream": True, **extra}


def test_openai_client_streams_text_and_audio(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    name = client.models.list().data[0].id
    stream = client.chat.completions.create(model=name, messages=HELLO, modalities=["text", "audio"],
                                            audio={"voice": "Chelsie", "format": "pcm16"}, stream=True, seed=1)
    transcript, pcm, omni = [], [], {}
    for chunk in stream:
        omni = (chunk.model_extra or {}).get("omni") or omni
        for choice in chunk.choices:
            audio = choice.delta.audio  # the SDK's own type for OpenAI's streamed audio
            if audio is not None:
                transcript.append(audio.transcript or "")
                if audio.data:
                    pcm.append(base64.b64decode(audio.data))
    samples = sum(len(b) for b in pcm) // 2
    assert "".join(transcript).strip()
    assert samples > 24_000 and samples == round(omni["audio_seconds"] * 24_000)  # every block arrived

    whole = client.chat.completions.create(model=name, messages=HELLO, modalities=["text", "audio"],
                                           audio={"voice": "Ethan", "format": "wav"}, seed=1)
    message = whole.choices[0].message
    import soundfile

    wav, rate = soundfile.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="int16")
    assert rate == 24_000 and len(wav) > 24_000 and message.audio.transcript.strip() and message.content is None
    text_only = client.chat.completions.create(model=name, messages=HELLO, max_tokens=5, seed=1)
    assert text_only.choices[0].message.content and text_only.usage.completion_tokens <= 5


def test_a_conversation_through_the_openai_client_prefills_only_its_new_part(server):
    """Each request resends the conversation; one that extends the last request's is prefilled over the
    kept context (usage.prompt_tokens_details.cached_tokens: the last prompt's tokens), and its greedy
    replies equal a local model's that prefills every prompt whole (the path test_parity.py holds to
    transformers)."""
    openai = pytest.importorskip("openai")
    from omni_cli.assistant import Assistant

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    name = client.models.list().data[0].id
    local = Assistant.load(None, device="cpu")
    local.engine.steps.thinker.context = None
    chat, messages, last_prompt = local.conversation(), [], None
    for text in ("Hello there", "Tell me more.", "And then what?"):
        messages.append({"role": "user", "content": text})
        r = client.chat.completions.create(model=name, messages=messages, max_tokens=8, seed=0,
                                           extra_body={"omni": {"greedy": True}})
        expected = chat.say(text, greedy=True, seed=0, max_text_tokens=8, text_only=True)
        assert r.choices[0].message.content == expected.text
        assert r.usage.prompt_tokens == expected.stats["prompt_tokens"]
        if last_prompt is not None:  # (the first request may find another test's prompt's start kept)
            assert r.usage.prompt_tokens_details.cached_tokens == last_prompt
        last_prompt = r.usage.prompt_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})


def test_say_with_server_writes_the_wav_the_server_streamed(server, tmp_path):
    import soundfile

    _text, pcm, _omni, _ = stream_raw(server, spoken([{"role": "user", "content": "Sing"}], seed=7))
    out = tmp_path / "say.wav"
    r = run_omni_say("Sing", "--server", server.url, "--api-key", KEY, "--seed", "7", "-o", str(out),
                     env=cli_env(OMNI_LOCAL="0"))
    assert r.returncode == 0, r.stderr
    wav, rate = soundfile.read(out, dtype="int16")
    assert rate == 24_000 and len(wav) > 0
    assert np.array_equal(wav, np.frombuffer(pcm, dtype="<i2"))  # sample for sample
    assert r.stdout.strip()  # the text on stdout, as for a local model
    assert "the server runs the model" not in r.stderr  # no flag asked for anything else


def test_say_with_server_notes_flags_the_server_does_not_run_with(server):
    """The server runs the tiny model on the CPU in float32: --dtype bfloat16 and --compile ask otherwise,
    which a one-line note says (the reply still comes from the server); --dtype float32 asks nothing new."""
    r = run_omni_say("Hi", "--server", server.url, "--api-key", KEY, "--text-only", "--max-text-tokens", "3",
                     "--dtype", "bf16", "--compile", env=cli_env(OMNI_LOCAL="0"))
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if "the server runs the model" in line]
    assert notes == ["note: the server runs the model on cpu in float32, eagerly: --dtype bf16 --compile would "
                     "apply to a model loaded here (--local)"], r.stderr
    r = run_omni_say("Hi", "--server", server.url, "--api-key", KEY, "--text-only", "--max-text-tokens", "3",
                     "--dtype", "float32", "--device", "cpu", env=cli_env(OMNI_LOCAL="0"))
    assert r.returncode == 0 and "the server runs the model" not in r.stderr, r.stderr


class ForwardProxy:
    """A minimal HTTP forward proxy on a free port: each request (absolute-form, as a client sends it to a
    proxy) goes to `target` (host, port) whatever host it names, with Connection: close; the response is
    relayed as it comes. `seen`: the request lines it got."""

    def __init__(self, target: tuple[str, int]) -> None:
        import socket

        self.target, self.seen = target, []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn) -> None:
        import socket
        from urllib.parse import urlsplit

        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                piece = conn.recv(65536)
                if not piece:
                    return
                head += piece
            head, body = head.split(b"\r\n\r\n", 1)
            line, *headers = head.decode("latin-1").split("\r\n")
            self.seen.append(line)
            method, url, version = line.split(" ")
            length = next((int(h.split(":", 1)[1]) for h in headers if h.lower().startswith("content-length:")), 0)
            while len(body) < length:
                body += conn.recv(65536)
            where = urlsplit(url)
            kept = [h for h in headers if not h.lower().startswith(("connection:", "proxy-"))]
            request = "\r\n".join([f"{method} {where.path}{'?' + where.query if where.query else ''} {version}",
                                    *kept, "Connection: close", "", ""]).encode("latin-1") + body
            with socket.create_connection(self.target) as upstream:
                upstream.sendall(request)
                while piece := upstream.recv(65536):
                    conn.sendall(piece)

    def close(self) -> None:
        self.sock.close()


def test_a_server_elsewhere_is_reached_through_the_environments_proxy(server):
    """HTTP_PROXY is used for a server that is not on this machine (here a name only the proxy can
    reach); NO_PROXY naming it goes without; this machine's servers never go through a proxy."""
    from urllib.parse import urlsplit

    port = urlsplit(server.url).port
    proxy = ForwardProxy(("127.0.0.1", port))
    try:
        elsewhere = f"http://omni-serve.invalid:{port}"
        args = ("Hi", "--api-key", KEY, "--text-only", "--max-text-tokens", "3")
        r = run_omni_say(*args, "--server", elsewhere, env=cli_env(OMNI_LOCAL="0", HTTP_PROXY=proxy.url))
        assert r.returncode == 0 and r.stdout.strip(), r.stderr
        assert f"GET {elsewhere}/v1/models HTTP/1.1" in proxy.seen
        assert f"POST {elsewhere}/v1/chat/completions HTTP/1.1" in proxy.seen
        seen = len(proxy.seen)
        r = run_omni_say(*args, "--server", elsewhere, env=cli_env(OMNI_LOCAL="0", HTTP_PROXY=proxy.url,
                                                                  NO_PROXY="omni-serve.invalid"))
        assert r.returncode == 1 and len(proxy.seen) == seen, r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith(f"error: no server answers at {elsewhere} (")
        # This machine's server, with a proxy that answers nothing: reached directly, /health too.
        dead = "http://127.0.0.1:9"
        r = run_omni_say(*args, "--server", server.url, env=cli_env(OMNI_LOCAL="0", HTTP_PROXY=dead, ALL_PROXY=dead))
        assert r.returncode == 0 and r.stdout.strip(), r.stderr
        assert len(proxy.seen) == seen
    finally:
        proxy.close()


def test_this_machines_server_is_never_asked_through_a_proxy(server, monkeypatch):
    from omni_cli.api import client

    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
    assert client.health(server.url, 5.0)["status"] == "ok"


def test_say_with_server_and_a_bad_output_withdraws_its_request(server, tmp_path):
    """omni-say sends its request before it opens its outputs: an output it cannot write is still the one-line
    error a local model gives, the request is withdrawn (the engine is free again at once), and the next one is served."""
    bad = str(tmp_path / "no" / "such" / "folder" / "x.wav")
    local = run_omni_say("Tell me a long story", "-o", bad)  # the error without a server
    r = run_omni_say("Tell me a long story", "--server", server.url, "--api-key", KEY, "--max-codes", "150",
                     "-o", bad, env=cli_env(OMNI_LOCAL="0"))
    t = time.monotonic()  # a reply of 150 codes would keep the engine busy for a second or more
    # (The server's client says first that the model is the built-in one; a local load fails before loading.)
    errors = "".join(line for line in r.stderr.splitlines(True) if not line.startswith("note: "))
    assert r.returncode == local.returncode == 1 and errors == local.stderr, (r.stderr, local.stderr)
    assert errors.startswith("error: ") and len(errors.strip().splitlines()) == 1
    while server.health()["queued"]:
        assert time.monotonic() - t < 0.5, "the withdrawn request still holds the engine"
        time.sleep(0.01)
    text, pcm, _, _ = stream_raw(server, spoken(max_tokens=4))
    assert text and pcm


def test_say_with_server_takes_audio_and_image_input(server, tmp_path):
    import soundfile

    clip = tmp_path / "q.wav"
    t = np.arange(24_000) / 24_000
    soundfile.write(clip, (0.3 * np.sin(2 * np.pi * 330 * t)).astype(np.float32), 24_000)
    r = run_omni_say("--audio", str(clip), "What is it?", "--server", server.url, "--api-key", KEY, "-o",
                     str(tmp_path / "a.wav"), "--verbose", env=cli_env(OMNI_LOCAL="0"))
    assert r.returncode == 0, r.stderr
    assert re.search(r"audio in\s+1\.0 s \(encoder \d+ ms", r.stderr), r.stderr  # the server heard 1 s
    r = run_omni_say("--audio", str(tmp_path / "nope.wav"), "hi", "--server", server.url, "--api-key", KEY,
                     env=cli_env(OMNI_LOCAL="0"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    from PIL import Image

    Image.fromarray(np.zeros((64, 96, 3), dtype=np.uint8)).save(tmp_path / "p.png")
    r = run_omni_say("--image", str(tmp_path / "p.png"), "And this?", "--server", server.url, "--api-key", KEY,
                     "-o", str(tmp_path / "b.wav"), "--verbose", env=cli_env(OMNI_LOCAL="0"))
    assert r.returncode == 0 and re.search(r"images in\s+1 \(encoder", r.stderr), r.stderr


def test_the_first_streamed_request_imports_nothing():
    """What a streamed reply needs is imported before the server serves (anyio's event-loop backend, which
    starlette's first streamed response would load: 12-20 ms of the first request), so that the first
    request is served as the later ones. `-X importtime` lists every import on stderr as it happens."""
    s = Server(python=("-X", "importtime"))
    try:
        time.sleep(0.5)  # the banner's line and any import after it drained
        before = len(s.lines)
        _text, pcm, _omni, _ = stream_raw(s, spoken(max_tokens=4))
        assert pcm
        time.sleep(0.5)
        imported = [line for line in s.lines[before:] if line.startswith("import time:")]
        assert imported == [], "".join(imported)
    finally:
        assert s.stop() == 128 + signal.SIGTERM


def test_wrong_key_is_401_and_bad_bodies_are_400(server):
    url = f"{server.url}/v1/chat/completions"
    r = httpx.post(url, json=spoken(), headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    for body, param in ((b"{not json", None), (b'{"messages": []}', "messages"),
                        (json.dumps(spoken(temperature="hot")).encode(), "temperature"),
                        (json.dumps(spoken(audio={"voice": "Nobody", "format": "pcm16"})).encode(), None)):
        r = httpx.post(url, content=body, headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["message"] and r.json()["error"]["param"] == param
    text, pcm, _, _ = stream_raw(server, spoken(max_tokens=4))  # and the server lives on
    assert text and pcm


def test_a_client_that_disconnects_frees_the_engine(server):
    body = spoken([{"role": "user", "content": "Tell me a long story"}], max_tokens=24, omni={"max_codes": 150})
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        for line in r.iter_lines():
            if '"data":' in line:  # the first audio: the reply is well under way
                break
        t = time.monotonic()
    # The connection is closed: the server stops the reply and its worker is free again.
    while server.health()["queued"]:
        assert time.monotonic() - t < 5, "the engine is still busy 5 s after the client left"
        time.sleep(0.005)
    freed = time.monotonic() - t
    print(f"engine free {1000 * freed:.0f} ms after the client disconnected")
    assert freed < 0.2
    text, pcm, _, _ = stream_raw(server, spoken(max_tokens=4))  # the next request is served
    assert text and pcm


def test_twenty_requests_from_four_clients_all_complete(server):
    stream_raw(server, spoken(max_tokens=6, omni={"max_codes": 40}))  # warm: memory is measured after
    before = server.rss_mib()
    results, errors = [], []

    def client(n: int) -> None:
        try:
            for i in range(5):
                results.append(stream_raw(server, spoken([{"role": "user", "content": f"Question {n}.{i}"}],
                                                         max_tokens=6, seed=n * 10 + i, omni={"max_codes": 40})))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    after = server.rss_mib()
    print(f"server memory: {before:.0f} MiB before 20 requests, {after:.0f} MiB after")
    assert not errors, errors
    assert len(results) == 20
    for text, pcm, omni, _headers in results:  # every reply whole: its text, all of its audio
        assert text and len(pcm) // 2 == round(omni["audio_seconds"] * 24_000) > 0
    assert max(int(h["x-omni-queue-position"]) for *_, h in results) >= 1  # they did queue
    assert after - before < 50, (before, after)
    assert server.health()["queued"] == 0


def test_commands_find_a_local_server_of_the_same_model(server, monkeypatch):
    from omni_cli.api import client

    monkeypatch.setattr(client, "DEFAULT_URL", server.url)
    assert client.find_local_server(None, KEY) is not None  # the built-in model, as the server's
    assert client.find_local_server(str(REPO_ROOT / "assets" / "tiny-qwen3-omni"), KEY) is None  # another model
    assert client.find_local_server(None, "wrong-key") is None


def test_no_key_means_loopback_only(tmp_path):
    t = time.monotonic()
    env = cli_env()
    env.pop("OMNI_API_KEY", None)
    r = subprocess.run([sys.executable, "-m", "omni_cli.faces.serve", "--host", "0.0.0.0"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "without --api-key" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - t < 10  # refused before loading the model


@pytest.mark.skipif(sys.platform != "linux", reason="tmux and ALSA")
def test_chat_with_server_in_a_terminal(server, tmp_path):
    from audio_device import alsa_file_device, have_portaudio, have_tmux
    from test_tmux import at_prompt, chat_in_tmux, prompts

    if not (have_tmux() and have_portaudio()):
        pytest.skip("needs tmux and PortAudio")
    alsa, raw = alsa_file_device(tmp_path / "alsa")
    env = cli_env(**alsa, TERM="xterm-256color", OMNI_NOHISTORY="1", OMNI_LOCAL="0")
    t = chat_in_tmux(tmp_path, f"--server {server.url} --api-key {KEY} --seed 1 --max-codes 250 --max-text-tokens 60",
                     env)
    try:
        screen = t.wait(at_prompt, what="the first prompt")
        assert server.url in screen
        t.type("Hello there")
        t.wait(lambda s: prompts(s) == 2 and at_prompt(s), what="the end of the first reply")
        assert raw.stat().st_size > 24_000 * 2  # its speech played
        t.type("Tell me a story")
        size = raw.stat().st_size
        t.wait(lambda s: raw.stat().st_size > size + 24_000 * 2, what="the second reply's sound")
        t.keys("C-c")
        screen = t.wait(lambda s: "interrupted" in s and prompts(s) == 3 and at_prompt(s), timeout=10,
                        what="the prompt after Ctrl-C")
        deadline = time.monotonic() + 5
        while server.health()["queued"]:  # the server stopped that reply too
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert t.leave() == "0" and "Traceback" not in t.screen()
    finally:
        t.kill()



def test_a_kept_connection_the_server_closed_is_opened_again(server):
    """The client's turns share one connection; uvicorn closes an idle one after 5 s (while a person types
    the next turn): the next request goes out again on a new connection instead of failing."""
    from omni_cli.api.client import RemoteAssistant

    remote = RemoteAssistant.connect(server.url, KEY)
    try:
        first = remote.say("Hello there", max_codes=10)
        sock = remote.http.conn.sock
        time.sleep(5.5)
        second = remote.say("Hello again", max_codes=10)
        assert remote.http.conn is not None and remote.http.conn.sock is not sock
        assert len(first.audio) and len(second.audio)
    finally:
        remote.close()


def test_a_conversation_through_the_server_hears_an_earlier_turns_clip_again(server):
    """Through a server as in the process: the client sends each earlier turn's clip again and the server
    reads it into the conversation, so the second reply (greedy) equals the local model's, which differs
    from that of a conversation whose first turn had no clip (the clip was heard)."""
    from omni_cli.api.client import RemoteAssistant
    from omni_cli.assistant import Assistant
    from omni_cli.media import AudioClip

    t = np.arange(26_460) / 22_050
    clip = AudioClip((0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), 22_050)
    kw = dict(greedy=True, seed=0, max_text_tokens=8, text_only=True)

    def second_reply(assistant, clips) -> str:
        chat = assistant.conversation()
        chat.say("What is this sound?", audio=clips, **kw)
        return chat.say("And what came before?", **kw).text

    local = Assistant.load(None, device="cpu")
    remote = RemoteAssistant.connect(server.url, KEY)
    try:
        heard = second_reply(local, [clip])
        assert second_reply(remote, [clip]) == heard
        assert second_reply(local, []) != heard
    finally:
        remote.close()


def test_a_warm_up_in_the_background_goes_before_the_next_request(server):
    """omni-chat warms up a background server that made no warm-up while the person types: the next
    request waits for the warm-up's reply (they share one connection), then is answered as usual."""
    from omni_cli.api.client import RemoteAssistant

    remote = RemoteAssistant.connect(server.url, KEY)
    try:
        before = server.health()["served"]
        remote.warm_up(background=True)
        assert remote._warming is not None
        reply = remote.say("Hello there", seed=3, max_text_tokens=4, max_codes=20)
        assert remote._warming is None and reply.text and len(reply.audio) > 0
        assert server.health()["served"] == before + 2  # the warm-up's reply, then this one
    finally:
        remote.close()


def test_a_conversation_that_outgrows_the_servers_context_drops_its_oldest_turns_as_a_local_one(caplog):
    """omni-serve fits a conversation to its --max-context as the local engine does, and says how many
    exchanges it dropped: the client's history drops them too (the next request is no longer), with the
    local note. Turn by turn, the histories' lengths and the replies equal a local model's."""
    import omni_cli
    from omni_cli.api.client import RemoteAssistant
    from omni_cli.config import RuntimeOptions

    caplog.set_level("INFO", logger="omni_cli")
    local = omni_cli.load(runtime=RuntimeOptions(max_context=512))
    served = Server("--max-context", "512", "--no-warm-up")
    remote = RemoteAssistant.connect(served.url)
    try:
        chats = [local.conversation(), remote.conversation()]
        lengths = []
        for i in range(8):
            text = f"Message number {i} with a few more words in it to fill up the context"
            replies = [chat.say(text, seed=1, max_text_tokens=60, text_only=True) for chat in chats]
            assert replies[0].text == replies[1].text
            lengths.append([len(chat.history.turns) for chat in chats])
        assert all(a == b for a, b in lengths) and lengths[-1][0] < 16, lengths
        notes = [r.getMessage() for r in caplog.records if r.name == "omni_cli.api.client"]
        assert notes and all(n.startswith("dropped the oldest") for n in notes)
    finally:
        remote.close()
        served.stop()


def test_on_a_cpu_the_server_compiles_nothing_in_the_background(server):
    """omni-serve compiles its steps in the background by default, on a GPU with graphs; here, a CPU, it
    says nothing of it and its /health reports the plain steps."""
    assert server.health()["steps"] == "plain"
    assert not any("compil" in line for line in server.lines), "".join(server.lines)


@pytest.mark.unit
def test_the_worker_calls_its_after_first_job_hook_once_when_the_first_job_has_ended():
    """`omni-serve --no-warm-up` starts its background compile from this hook: after the first request,
    not during it, and only once."""
    from omni_cli.api.server import EngineWorker

    order = []

    class FakeJob:
        def __init__(self, name):
            self.name, self.cancelled = name, threading.Event()

        def run(self, assistant):
            order.append(self.name)

    worker = EngineWorker(assistant=None)
    worker.after_first_job = lambda: order.append("hook")
    for name in ("first", "second"):
        worker.submit(FakeJob(name))
    deadline = time.monotonic() + 10
    while worker.served < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.stop()
    worker.thread.join(5)
    assert order == ["first", "hook", "second"]
