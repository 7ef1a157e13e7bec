"""The API under a property-based fuzz and a bounded soak (issue 29), in-process on a fake assistant.

Fuzz (Hypothesis, a fixed budget of examples): request bodies that look valid with one field made wrong
(types, huge or odd numbers, NaN, deep nesting, bad base64, unknown parts), arbitrary JSON, arbitrary
bytes, under odd content types: never a 500, always JSON (or, a 200 streamed, events of JSON), each case
bounded in time. Soak: clients streaming, disconnecting midway and queueing, for a fixed count of
requests on uvicorn in a thread: all complete or are freed, and the process's memory grows by a stated
bound. Both print their figures (pytest -s).
"""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_serve_hostile import ServedFake, Uvicorn, app_of, client

CASE_SECONDS = 2.0  # each case's bound (a fake reply takes milliseconds)
EXAMPLES = 300

ENDPOINT = "/v1/chat/completions"
KINDS = ["application/json", "application/json; charset=utf-8", "text/plain", "", "application/x-www-form-urlencoded",
         "multipart/form-data; boundary=x", "APPLICATION/JSON", "application/json; charset=utf-16"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**40), max_value=10**40),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30))
any_json = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                          st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=20)
bad_base64 = st.one_of(st.text(max_size=40), st.just("%%%"), st.just("QUJD"), st.just("iVBORw0KGgo="),
                       st.binary(max_size=30).map(lambda b: b.hex()))
parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(st.text(max_size=40), any_json)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.one_of(
        st.fixed_dictionaries({"url": bad_base64.map(lambda d: "data:image/png;base64," + d)}), any_json)}),
    st.fixed_dictionaries({"type": st.just("input_audio"), "input_audio": st.one_of(
        st.fixed_dictionaries({"data": bad_base64, "format": st.sampled_from(["wav", "mp3", "x"])}), any_json)}),
    any_json)
messages = st.lists(st.fixed_dictionaries({
    "role": st.one_of(st.sampled_from(["user", "assistant", "system", "developer", "tool"]), any_json),
    "content": st.one_of(st.text(max_size=60), st.lists(parts, max_size=3), any_json)}), max_size=4)
FIELDS = {"model": st.one_of(st.just("fake"), any_json), "stream": any_json, "modalities": st.one_of(
    st.sampled_from([["text"], ["text", "audio"], ["audio"], []]), any_json),
    "audio": st.one_of(st.fixed_dictionaries({"voice": any_json, "format": any_json}), any_json),
    "seed": any_json, "temperature": any_json, "top_p": any_json, "top_k": any_json, "n": any_json,
    "max_tokens": any_json, "max_completion_tokens": any_json, "stream_options": any_json,
    "omni": st.one_of(st.fixed_dictionaries({"max_codes": any_json, "greedy": any_json}), any_json)}
chat_bodies = st.builds(lambda m, extra: json.dumps({"messages": m, **extra}).encode(), messages,
                        st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), max_size=5).flatmap(
                            lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in keys})))
nested = st.integers(min_value=1, max_value=3000).map(lambda n: b'{"messages": ' + b"[" * n + b"]" * n + b"}")
VALID = {"messages": [{"role": "user", "content": "Hello"}], "modalities": ["text", "audio"],
         "audio": {"voice": "Chelsie", "format": "wav"}}
WELL_FORMED = {"stream": st.booleans(), "seed": st.integers(min_value=-(2**70), max_value=2**70),
               "temperature": st.floats(min_value=-1, max_value=200), "top_p": st.floats(min_value=-1, max_value=2),
               "top_k": st.integers(min_value=-5, max_value=10**12),
               "max_completion_tokens": st.integers(min_value=-5, max_value=10**13),
               "omni": st.fixed_dictionaries({"max_codes": st.integers(min_value=-5, max_value=10**13)}),
               "audio": st.fixed_dictionaries({"format": st.sampled_from(["wav", "pcm16", "flac", "mp3", "opus", "x"])})}
# a valid request with one or two fields made odd (of the right type, or any JSON): most reach the reply
valid_ish = st.dictionaries(st.sampled_from(sorted({*FIELDS, *WELL_FORMED})), st.none(), min_size=1, max_size=2).flatmap(
    lambda keys: st.fixed_dictionaries({k: st.one_of(WELL_FORMED[k], WELL_FORMED[k], FIELDS.get(k, any_json))
                                        if k in WELL_FORMED else FIELDS[k] for k in keys})).map(
    lambda odd: json.dumps({**VALID, **odd}).encode())
bodies = st.one_of(valid_ish, valid_ish, chat_bodies, any_json.map(lambda v: json.dumps(v).encode()),
                   st.binary(max_size=200), nested)
kinds = st.one_of(st.just("application/json"), st.just("application/json"), st.sampled_from(KINDS))


@pytest.fixture(scope="module")
def http():
    with client(app_of(ServedFake(blocks=2, seconds=0.05))) as c:
        yield c


FIGURES: dict = {"cases": 0, "longest": 0.0, "statuses": {}}


@settings(max_examples=EXAMPLES, deadline=CASE_SECONDS * 1000, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=bodies, kind=kinds)
def test_no_body_is_a_500_nor_anything_but_json(http, body, kind):
    t = time.perf_counter()
    r = http.post(ENDPOINT, content=body, headers={"content-type": kind} if kind else {})
    took = time.perf_counter() - t
    FIGURES["cases"] += 1
    FIGURES["longest"] = max(FIGURES["longest"], took)
    FIGURES["statuses"][r.status_code] = FIGURES["statuses"].get(r.status_code, 0) + 1
    assert r.status_code < 500, (r.status_code, r.text[:300])
    assert took < CASE_SECONDS
    if r.headers["content-type"].startswith("text/event-stream"):
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            json.loads(event)
    else:
        assert r.headers["content-type"].startswith("application/json"), r.headers
        data = r.json()
        if r.status_code != 200:
            assert set(data["error"]) == {"message", "type", "param", "code"}


def test_zz_fuzz_figures():
    """The fuzz's figures (runs after it: the file's tests run in order)."""
    print(f"\nfuzz: {FIGURES['cases']} cases, longest {FIGURES['longest'] * 1000:.0f} ms, "
          f"statuses {dict(sorted(FIGURES['statuses'].items()))}")
    assert FIGURES["cases"] == 0 or FIGURES["longest"] < CASE_SECONDS


def rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


SOAK = 200  # requests
CLIENTS = 8
RSS_GROWTH_MIB = 40.0


def test_soak_streaming_disconnecting_and_queueing_clients_all_complete_and_memory_stays_flat():
    fake = ServedFake(blocks=8, seconds=0.2, block_delay=0.002)
    app = app_of(fake)
    u = Uvicorn(app)
    spoken = {"messages": [{"role": "user", "content": "Hello"}], "stream": True, "modalities": ["text", "audio"],
              "audio": {"format": "pcm16"}}
    whole = {"messages": [{"role": "user", "content": "Hello"}], "modalities": ["text", "audio"]}
    counts = {"whole": 0, "streamed": 0, "left": 0, "failed": []}
    lock = threading.Lock()
    turn = iter(range(SOAK))

    def one(n: int, http: httpx.Client) -> str:
        kind = ("streamed", "left", "whole")[n % 3]
        if kind == "whole":
            r = http.post(f"{u.url}/v1/chat/completions", json=whole, timeout=30)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["audio"]["data"], r.text[:200]
            return kind
        with http.stream("POST", f"{u.url}/v1/chat/completions", json=spoken, timeout=30) as r:
            assert r.status_code == 200
            lines = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines += 1
                    if kind == "left" and lines == 2:
                        return kind  # disconnects midway: the stream is closed unread
                    if line == "data: [DONE]":
                        return kind
        raise AssertionError("the stream ended without [DONE]")

    def worker():
        with httpx.Client() as http:
            while True:
                with lock:
                    n = next(turn, None)
                if n is None:
                    return
                try:
                    kind = one(n, http)
                except Exception as exc:  # noqa: BLE001 - counted and shown
                    with lock:
                        counts["failed"].append(repr(exc)[:200])
                    continue
                with lock:
                    counts[kind] += 1

    def round_of_requests() -> float:
        nonlocal turn
        turn = iter(range(SOAK))
        t = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        return time.perf_counter() - t

    try:
        round_of_requests()  # warm: imports, buffers, the allocator's arenas
        before = rss_mib()
        took = round_of_requests()
        deadline = time.monotonic() + 5
        while app.state.worker.waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        after = rss_mib()
        worker_state = (app.state.worker.waiting, len(app.state.worker.open))
    finally:
        u.close()
    print(f"\nsoak: 2 x {SOAK} requests from {CLIENTS} clients ({counts['streamed']} streamed, {counts['left']} left "
          f"midway, {counts['whole']} whole) in {took:.1f} s (the measured round); RSS {before:.0f} -> {after:.0f} MiB")
    assert not counts["failed"], counts["failed"][:5]
    assert counts["streamed"] + counts["left"] + counts["whole"] == 2 * SOAK
    assert worker_state == (0, 0)  # every job ended or was freed
    assert after - before < RSS_GROWTH_MIB, (before, after)
