"""The speaker's adaptive start (SpeakerSink, omni_cli/audio/speaker.py) against a fake device paced at real time.

A producer delivers blocks the way the streamed vocoder does: growing chunks (0.04, 0.48, then 0.96 s,
the vocoder's default schedule), each one arriving when a producer at a given real-time factor (RTF:
seconds of work per second of audio) has made it. At RTF 0.9 the producer is faster than real time on
average, yet a 0.96 s block takes 0.86 s to come while the start-up buffer holds less: a speaker that
starts at a fixed 0.2 s runs dry at each new block. The adaptive start waits until the queued audio
covers that and plays through; at RTF 0.3 it starts as early as the fixed one.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from audio_device import FakeSoundDevice, assert_underruns_reported, heard
from omni_cli.audio.speaker import SpeakerSink

SR = 24_000
SCHEDULE = [0.04, 0.48] + [0.96] * 3  # seconds of audio per block: the vocoder's growing chunks, 3.4 s


def _audio(seconds: float, start: int) -> np.ndarray:
    n = round(seconds * SR)
    return ((np.arange(start, start + n) % 997) + 1).astype(np.float32) / 1000  # never 0: gaps show


def produce(sink: SpeakerSink, rtf: float, latency: float = 0.1) -> np.ndarray:
    """Write SCHEDULE's blocks into `sink`, block k at `latency + rtf * (audio up to and with block k)`."""
    sink.start(SR)
    t0 = time.perf_counter()
    made, blocks = 0.0, []
    for seconds in SCHEDULE:
        block = _audio(seconds, sum(b.size for b in blocks))
        made += seconds
        delay = t0 + latency + rtf * made - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sink.write(block)
        blocks.append(block)
    sink.close()
    return np.concatenate(blocks)


def _play(rtf: float, **sink_options):
    sd = FakeSoundDevice(speed=1.0, blocksize=480)
    sink = SpeakerSink(backend=sd, **sink_options)
    reply = produce(sink, rtf)
    (stream,) = sd.streams
    sound = heard(stream.audio)
    np.testing.assert_array_equal(sound.samples, reply)  # every sample, once, in order
    assert_underruns_reported(sound, sink.stats)  # and every break a listener hears is counted
    return sink.stats


def test_a_producer_just_faster_than_real_time_starts_later_and_does_not_break_up():
    stats = _play(0.9)
    assert stats["underruns"] == 0, stats
    # It waited for more than the floor, and says why: the third block (0.96 s) takes 0.86 s to come.
    assert stats["start_reason"] in ("production rate", "block gaps"), stats  # not the floor, not capped
    assert stats["start_buffered"] > 0.9 and stats["start_wait"] > 0.4, stats
    assert 0.3 < stats["production_rate"] < 1.2, stats


def test_the_same_producer_breaks_up_with_a_fixed_start_up_buffer():
    # The old rule (play once 0.2 s are queued): the premise of the test above, so it can fail.
    stats = _play(0.9, prebuffer=0.2, max_prebuffer=0.2)
    assert stats["underruns"] >= 1 and stats["underrun_seconds"] > 0.1, stats
    assert stats["start_reason"].endswith("(capped)") and stats["start_needed"] == 0.2, stats


def test_a_fast_producer_starts_early():
    stats = _play(0.3)
    assert stats["underruns"] == 0, stats
    # The second block (0.48 s, 0.14 s after the first) fills the buffer: no wait beyond it.
    assert stats["start_reason"] in ("buffer filled", "block gaps"), stats
    assert stats["start_wait"] < 0.3, stats
    assert stats["start_buffered"] < 0.6, stats


def test_a_reply_shorter_than_the_buffer_starts_at_its_end():
    sd = FakeSoundDevice(speed=1.0, blocksize=480)
    sink = SpeakerSink(backend=sd, prebuffer=1.0)
    sink.start(SR)
    sink.write(_audio(0.3, 0))
    time.sleep(0.05)
    assert not sd.streams[0].audio.any()  # 0.3 s queued, 1 s asked for: still silent
    sink.close()
    stats = sink.stats
    assert stats["start_reason"] == "reply ended" and abs(stats["start_buffered"] - 0.3) < 1e-9, stats
    np.testing.assert_array_equal(heard(sd.streams[0].audio).samples, _audio(0.3, 0))


def test_a_dry_spell_at_the_end_is_no_underrun_but_one_inside_is():
    # Gaps are counted when the sound resumes after them: the silence before close() is the reply's end.
    sd = FakeSoundDevice(speed=1.0, blocksize=480)
    sink = SpeakerSink(backend=sd, prebuffer=0.05)
    sink.start(SR)
    sink.write(_audio(0.1, 0))
    time.sleep(0.3)  # runs dry for ~0.2 s
    sink.write(_audio(0.1, 2400))
    time.sleep(0.3)  # runs dry again, then the input ends
    sink.close()
    sound = heard(sd.streams[0].audio)
    assert sink.stats["underruns"] == 1 == sound.gaps, (sink.stats, sound.gap_lengths)
    assert_underruns_reported(sound, sink.stats)


def test_abort_from_another_thread_while_waiting_to_start():
    sd = FakeSoundDevice(speed=1.0, blocksize=480)
    sink = SpeakerSink(backend=sd, prebuffer=2.0)
    sink.start(SR)
    sink.write(_audio(0.5, 0))
    stopper = threading.Thread(target=sink.abort)
    stopper.start()
    stopper.join(1.0)
    assert not stopper.is_alive() and sink.aborted and not sd.streams[0].audio.any()
    sink.write(_audio(0.1, 0))  # the producer may still write: dropped
    sink.close()
    assert sink.stats["start_reason"] is None


def test_start_after_says_where_the_sink_started():
    """`start_after` (the rule alone, for omni-bench's recorded blocks) starts where the sink did, for a
    producer at the floor (RTF 0.3: the second block) and one that waits for the rate (RTF 0.9)."""
    from omni_cli.audio.speaker import start_after

    for rtf, at in ((0.3, 1), (0.9, 3)):
        stats = _play(rtf)
        made = np.cumsum(SCHEDULE)
        index = start_after(0.0, [(0.1 + rtf * m, round(s * SR)) for m, s in zip(made, SCHEDULE)], SR)
        assert index == at and stats["start_buffered"] == pytest.approx(made[index], abs=1e-3), (rtf, stats)
