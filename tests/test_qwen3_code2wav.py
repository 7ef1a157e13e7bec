"""StreamingCode2Wav on the committed tiny Qwen3-Omni's code2wav: the streamed audio is the whole decode
(transformers' one `code2wav(codes)` call) to float rounding, whatever the utterance length and pushes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from omni_cli.models.qwen3_omni.code2wav import StreamingCode2Wav, conv_reach, decoded_lag  # noqa: E402

ASSET = Path(__file__).resolve().parent.parent / "assets" / "tiny-qwen3-omni"
BOUND = 1e-6  # the module docstring's bound; measured 3e-7 here (F = 200)
T = 1920  # samples per frame


@pytest.fixture(scope="module")
def code2wav():
    """The tiny checkpoint's code2wav alone (float32, CPU): the module and its `code2wav.*` weights."""
    from safetensors.torch import load_file
    from transformers import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    model = Qwen3OmniMoeCode2Wav(Qwen3OmniMoeConfig.from_pretrained(ASSET).code2wav_config)
    weights = load_file(ASSET / "model.safetensors")
    model.load_state_dict({k.removeprefix("code2wav."): v for k, v in weights.items() if k.startswith("code2wav.")})
    return model.eval()


def frames(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2048, size=(n, 16))


_whole: dict = {}


def reference(code2wav, fr: np.ndarray) -> np.ndarray:
    """transformers' own call on all frames (cached per utterance: the tests share a few)."""
    key = fr.tobytes()
    if key not in _whole:
        with torch.inference_mode():
            _whole[key] = code2wav(torch.from_numpy(fr.T[None].copy()))[0, 0].numpy()
    return _whole[key]


def stream(vocoder: StreamingCode2Wav, fr: np.ndarray, sizes) -> list[np.ndarray]:
    """Push `fr` in batches of `sizes` (cycled), then finish; the blocks in order."""
    blocks, i, k = [], 0, 0
    while i < len(fr):
        blocks += vocoder.push(fr[i : i + sizes[k % len(sizes)]].tolist())
        i, k = i + sizes[k % len(sizes)], k + 1
    return blocks + vocoder.finish()


PATTERNS = {"one_by_one": [1], "uneven": [3, 1, 7, 2, 11], "all_at_once": [10**6]}


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("n", [1, 3, 4, 5, 29, 60, 200])
def test_stream_is_the_whole_decode(code2wav, n, pattern):
    fr = frames(n, seed=n)
    vocoder = StreamingCode2Wav(code2wav, max_frames=200)
    audio = np.concatenate(stream(vocoder, fr, PATTERNS[pattern]))
    whole = reference(code2wav, fr)
    assert len(whole) == T * n - 555
    assert audio.dtype == np.float32 and audio.shape == whole.shape  # nothing lost at the seams
    assert np.abs(audio - whole).max() <= BOUND
    assert sum(f for f, _ in vocoder.chunk_log) == n and all(s >= 0 for _, s in vocoder.chunk_log)
    assert np.array_equal(vocoder.decode_whole(fr), whole)


@pytest.mark.parametrize("first_chunk, chunk", [(1, 7), (9, 4)])
def test_other_schedules_at_the_least_context(code2wav, first_chunk, chunk):
    fr = frames(90, seed=5)
    vocoder = StreamingCode2Wav(code2wav, max_frames=90, first_chunk=first_chunk, chunk=chunk, left_context=10)
    audio = np.concatenate(stream(vocoder, fr, [2, 13]))
    assert np.abs(audio - reference(code2wav, fr)).max() <= BOUND
    want, size = [], first_chunk  # doubling from the first chunk, capped at `chunk`; the rest at finish()
    while sum(want) + size <= 90:
        want, size = want + [size], min(2 * size, chunk)
    assert [f for f, _ in vocoder.chunk_log] == want + [90 - sum(want)] * (sum(want) < 90)


def test_first_block_after_first_chunk_then_growing_chunks(code2wav):
    fr = frames(120, seed=1)
    vocoder = StreamingCode2Wav(code2wav, max_frames=120)
    assert vocoder.codes_for_first_audio == 4 and vocoder.device == torch.device("cpu")
    got = [(i + 1, block) for i in range(len(fr)) for block in vocoder.push([fr[i].tolist()])]
    got += [(len(fr), block) for block in vocoder.finish()]
    pushed, first = got[0]
    assert pushed == 4 and len(first) == 4 * T - 555  # early: 4 of 120 frames, the seam's tail held back
    whole = reference(code2wav, fr)
    assert np.abs(first - whole[: len(first)]).max() <= BOUND  # the reference's prefix
    # Chunks double up to 25 frames; each block after the first is exactly its frames' samples.
    assert [f for f, _ in vocoder.chunk_log] == [4, 8, 16, 25, 25, 25, 17]
    assert [p for p, _ in got] == [4, 12, 28, 53, 78, 103, 120]
    assert [len(b) for _, b in got[1:]] == [T * f for f, _ in vocoder.chunk_log[1:]]


def test_chunked_decode_of_the_reference(code2wav):
    """transformers' `chunked_decode` in one chunk is the whole decode, so the stream matches it too. In
    25-frame chunks with 25 frames of context on codes it loses 555 samples at each seam and differs
    from the whole decode (the pre-transformer reaches 71 frames back); the stream does neither."""
    fr = frames(200, seed=2)
    codes = torch.from_numpy(fr.T[None].copy())
    audio = np.concatenate(stream(StreamingCode2Wav(code2wav, max_frames=200), fr, [9]))
    with torch.inference_mode():
        one_chunk = code2wav.chunked_decode(codes)[0, 0].numpy()
        chunked = code2wav.chunked_decode(codes, chunk_size=25, left_context_size=25)[0, 0].numpy()
    assert np.abs(audio - one_chunk).max() <= BOUND
    assert len(chunked) == len(audio) - 7 * 555
    whole, worst = reference(code2wav, fr), 0.0
    for i, s in enumerate(range(0, 200, 25)):  # chunk i: samples [s*T, (s+25)*T - 555) of the whole decode
        piece = chunked[i * (25 * T - 555) : (i + 1) * (25 * T - 555)]
        worst = max(worst, np.abs(piece - whole[s * T : s * T + len(piece)]).max())
    assert worst > 1e-3  # measured 8.5e-3 (full size, random weights: 1.26)


@pytest.fixture(scope="module")
def loud_code2wav():
    """A small random code2wav whose every branch is loud enough to show in float32 (the tiny checkpoint's
    ConvNeXt blocks are scaled by 1e-6, so its convolutions look shorter than they are)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    torch.manual_seed(0)
    config = Qwen3OmniMoeCode2WavConfig(
        hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1,
        decoder_dim=16,
    )
    model = Qwen3OmniMoeCode2Wav(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.fill_(1.0)
            elif p.ndim >= 2 and "embedding" not in name:
                p.normal_(0, p[0].numel() ** -0.5)
    return model


def test_conv_reach_is_exact(loud_code2wav):
    """The convolutions' reach, by changing hidden states: frames more than `conv_reach` before a chunk
    leave its first emitted sample (and all after) alone, the frame `conv_reach` before it does not."""
    config = loud_code2wav.config
    assert decoded_lag(config) == 555 and conv_reach(config) == 10
    vocoder = StreamingCode2Wav(loud_code2wav, max_frames=1)
    start, reach = 30, conv_reach(config)
    first = start * T - 555  # the first sample a chunk starting at frame 30 emits
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 40, config.hidden_size, generator=gen)
    with torch.inference_mode():
        base = vocoder._convs(hidden)[first:]
        for changed, same in ((start - reach, True), (start - reach + 1, False)):
            other = hidden.clone()
            other[:, :changed] = torch.randn(1, changed, config.hidden_size, generator=gen)
            diff = (vocoder._convs(other)[first:] - base).abs().max()
            assert diff == 0 if same else diff > 1e-3


def test_reset_repeats_an_utterance_exactly(code2wav):
    vocoder = StreamingCode2Wav(code2wav, max_frames=80)
    a = np.concatenate(stream(vocoder, frames(70, seed=3), [5]))
    vocoder.reset()
    vocoder.push(frames(40, seed=4)[:30].tolist())  # another one, left unfinished
    vocoder.reset()
    assert vocoder.chunk_log == [] and vocoder.finish() == []
    vocoder.reset()
    assert np.array_equal(np.concatenate(stream(vocoder, frames(70, seed=3), [5])), a)


def test_bad_frames_and_misuse(code2wav):
    vocoder = StreamingCode2Wav(code2wav, max_frames=10)
    good = [0] * 16
    for bad in ([2048] + [0] * 15, [0] * 15 + [-1], [8292] * 16):
        with pytest.raises(ValueError, match="not a codec id"):
            vocoder.push([good, bad])
        with pytest.raises(ValueError, match="not a codec id"):
            vocoder.decode_whole([bad])
    with pytest.raises(ValueError, match="16 codec ids"):
        vocoder.push([[0] * 15])
    assert vocoder.n_frames == 0 and vocoder.push([]) == []  # nothing taken from a rejected push
    with pytest.raises(ValueError, match="max_frames"):
        vocoder.push([good] * 11)
    pushed = vocoder.push([good] * 3)
    assert len(np.concatenate(pushed + vocoder.finish())) == 3 * T - 555 and vocoder.finish() == []
    with pytest.raises(RuntimeError, match="reset"):
        vocoder.push([good])
    with pytest.raises(ValueError):
        StreamingCode2Wav(code2wav, max_frames=10, left_context=0)


@pytest.mark.parametrize("first", [2, 4])
def test_chunk_graphs_buffers_give_the_stream(code2wav, first, monkeypatch):
    """`ChunkGraphs` without CUDA (`graphed=False`: the graphs' input buffers run eagerly): every chunk but
    the last goes through the buffers (the stream's context and cache copied in, the positions of the
    steady chunks an input, copies handed back) and the audio is the plain stream's, bit for bit, twice
    over (a graph's positions left from one utterance must not reach the next); a chunk whose context is
    shorter than the one it was made with, or that starts elsewhere before the cache is full, runs the
    stream's own way, and a steady chunk of another schedule replays the steady graph."""
    from omni_cli.models.qwen3_omni.code2wav import ChunkGraph, ChunkGraphs

    fr = frames(200, seed=7)
    plain = [np.concatenate(stream(StreamingCode2Wav(code2wav, max_frames=200, first_chunk=first), fr, p))
             for p in PATTERNS.values()]
    graphs = ChunkGraphs.capture(code2wav, first, 25, 25, graphed=False)
    calls = []
    real = ChunkGraph.__call__
    monkeypatch.setattr(ChunkGraph, "__call__", lambda self, start, *a: calls.append((self.start, start)) or real(self, start, *a))
    try:
        assert graphs is not None and max(graphs.graphs) == graphs.full == 71  # through the first chunk with a full cache
        for _round in range(2):
            for want, p in zip(plain, PATTERNS.values()):
                calls.clear()
                voc = StreamingCode2Wav(code2wav, max_frames=200, first_chunk=first)
                got = np.concatenate(stream(voc, fr, p))
                assert np.array_equal(got, want)
                chunks = [0] + list(np.cumsum([f for f, _ in voc.chunk_log])[:-2])  # every start but the last chunk's
                assert [start for _, start in calls] == chunks
                assert all(made == min(start, graphs.full) or made >= graphs.full for made, start in calls)
                assert sum(made >= graphs.full for made, _ in calls) >= 3  # the steady graph, at several starts
        calls.clear()
        stream(StreamingCode2Wav(code2wav, max_frames=200, first_chunk=first, left_context=5), fr, [1])
        assert [start for _, start in calls] == [0, first]  # then the context is 5 frames, not 2 * first
        calls.clear()  # another schedule: its early chunks are not the graphs', its steady ones are
        other = np.concatenate(stream(StreamingCode2Wav(code2wav, max_frames=200, first_chunk=first + 1), fr, [1]))
        assert calls and all(start > graphs.full and made >= graphs.full for made, start in calls)
        code2wav._omni_chunk_graphs = None
        assert np.array_equal(other, np.concatenate(stream(StreamingCode2Wav(code2wav, max_frames=200, first_chunk=first + 1), fr, [1])))
    finally:
        code2wav._omni_chunk_graphs = None
