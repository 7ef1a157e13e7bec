"""Streaming token2wav (omni_cli.models.qwen2_5_omni.vocoder) against the whole-utterance decode and transformers' token2wav.

The model is a tiny Qwen2_5OmniToken2WavModel built here with seeded random weights. transformers'
own init (std 0.02) makes a DiT that barely mixes frames and a BigVGAN that outputs ~1e-8, which would
make every streaming error look negligible; the weights are therefore redrawn at unit gain
(std 1/sqrt(fan_in)) so the DiT's attention really carries information between frames, and BigVGAN's
gain is set for speech-like levels (rms ~0.15, no clipping).

The tiny DiT keeps the real model's window shape: 24-frame blocks, two look-back layers and one
look-ahead layer (real: 22 layers, look-back [0, 20], look-ahead [10]), so the default window is the
real one: 48 frames of past, 24 of future.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from transformers import Qwen2_5OmniToken2WavConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

from omni_cli.runtime.channel import Cancelled, Channel
from omni_cli.models.qwen2_5_omni.vocoder import StreamingVocoder
from omni_cli.runtime.vocoder_worker import END, vocoder_worker

SEED = 1234
MAX_CODES = 160
HOP = 240  # samples per mel frame (5*3*2*2*2*2)


def _tiny_token2wav() -> Qwen2_5OmniToken2WavModel:
    config = Qwen2_5OmniToken2WavConfig(
        dit_config=dict(
            hidden_size=64, num_hidden_layers=4, num_attention_heads=2, head_dim=32, ff_mult=2, emb_dim=32,
            enc_emb_dim=192, enc_dim=32, enc_channels=[32, 32, 32, 64], enc_kernel_sizes=[5, 3, 3, 1],
            enc_dilations=[1, 2, 3, 1], enc_attention_channels=16, enc_res2net_scale=2, enc_se_channels=16,
            look_ahead_layers=[1], look_backward_layers=[0, 3], block_size=24, repeats=2, num_embeds=8193,
            mel_dim=80, max_position_embeddings=4096,
        ),
        bigvgan_config=dict(
            mel_dim=80, upsample_initial_channel=64, resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3, 5]],
            upsample_rates=[5, 3, 2, 2, 2, 2], upsample_kernel_sizes=[11, 7, 4, 4, 4, 4],
        ),
    )
    torch.manual_seed(0)
    model = Qwen2_5OmniToken2WavModel(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Embedding):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g))
            elif isinstance(module, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                weight = module.weight
                if isinstance(module, torch.nn.ConvTranspose1d):
                    fan_in = weight.shape[0] * weight.shape[2] / module.stride[0]
                else:
                    fan_in = weight[0].numel()
                gain = 0.6 if "bigvgan" in name else 1.0  # BigVGAN's level is very gain-sensitive
                weight.copy_(torch.randn(weight.shape, generator=g) * gain / fan_in**0.5)
                if module.bias is not None:
                    module.bias.copy_(torch.randn(module.bias.shape, generator=g) * 0.1)
        model.code2wav_bigvgan_model.conv_post.weight.mul_(4.0)  # rms ~0.15, peak ~0.4
    return model


@pytest.fixture(scope="module")
def token2wav():
    return _tiny_token2wav()


@pytest.fixture(scope="module")
def voice():
    g = torch.Generator().manual_seed(7)
    return torch.randn(1, 192, generator=g), torch.randn(1, 150, 80, generator=g)


def _vocoder(token2wav, voice, **kwargs) -> StreamingVocoder:
    # Padded last windows as on a GPU (graphs), so the padding is exercised here too.
    kwargs.setdefault("pad_windows", True)
    return StreamingVocoder(token2wav, *voice, max_codes=MAX_CODES, generator=SEED, **kwargs)


def _codes(n: int) -> list[int]:
    return torch.randint(0, 8192, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def _pieces(codes: list[int], pattern: str) -> list[list[int]]:
    if pattern == "all":
        return [codes]
    if pattern == "one":
        return [[c] for c in codes]
    sizes, pieces, i, k = [5, 1, 17, 3, 30, 2], [], 0, 0
    while i < len(codes):
        pieces.append(codes[i : i + sizes[k % len(sizes)]])
        i += sizes[k % len(sizes)]
        k += 1
    return pieces


def _stream(vocoder: StreamingVocoder, pieces) -> list[np.ndarray]:
    blocks = []
    for piece in pieces:
        blocks += vocoder.push(piece)
    return blocks + vocoder.finish()


def _snr_db(signal: np.ndarray, reference: np.ndarray) -> float:
    noise = float(((signal - reference) ** 2).sum())
    return float("inf") if noise == 0 else 10 * np.log10(float((reference**2).sum()) / noise)


# -- the reference --------------------------------------------------------------------------------
def test_noise_prefix_matches_a_shorter_draw():
    # What lets the stream and transformers share noise: on CPU, the first T rows of one long draw
    # are exactly what a draw of T rows gives under the same seed (80 bins = 5 groups of 16).
    long = torch.randn([1, MAX_CODES * 2, 80], generator=torch.Generator().manual_seed(SEED))
    for frames in (1, 14, 100, 274):
        torch.manual_seed(SEED)
        assert torch.equal(long[:, :frames], torch.randn([1, frames, 80]))


@pytest.mark.parametrize("n", [7, 50])
def test_decode_whole_equals_transformers_token2wav(token2wav, voice, n):
    cond, ref_mel = voice
    codes = _codes(n)
    torch.manual_seed(SEED)
    with torch.no_grad():
        reference = token2wav(torch.tensor([codes]), cond, ref_mel).numpy()
    ours = _vocoder(token2wav, voice).decode_whole(codes)
    assert ours.shape == reference.shape == (n * 2 * HOP,)
    # Measured: within 8.3e-7 (dit.py's fused modulations and residuals round a product and its sum once;
    # bit-identical without them: the speaker encoder, computed once, runs on the same batch of two).
    assert np.abs(ours - reference).max() <= 1e-5


def test_the_dit_plans_attention_is_the_librarys(token2wav, voice):
    """dit.py's attention (q/k/v in one product, the first head's RoPE inputs from `rope_rows`) against
    the layers' own modules, which the compiled DiT runs, on one evaluation mid-ODE (measured on CPU:
    bit-identical). A wrong row order or sign in `rope_rows` is off by the size of the output."""
    from omni_cli.models.qwen2_5_omni import dit

    vocoder = _vocoder(token2wav, voice)
    frames = 48
    code = torch.tensor([_codes(frames // 2)])
    noise, blocks = vocoder.noise[:, :frames], vocoder._block_index(frames, frames)
    static = vocoder._static_inputs(code)
    rope = vocoder.dit.rotary_embed(static, torch.arange(frames)[None, :].repeat(2, 1))
    masks = dit.attention_masks(vocoder.dit, blocks[None, :] - blocks[:, None], noise.dtype)
    args = (vocoder._plan, noise, vocoder._grid[3][2], static, rope, masks)
    with torch.inference_mode():
        fused, library = dit.dit_forward(*args), dit.dit_forward_compiled(*args)
    assert vocoder._plan.fused_attention
    assert float((fused - library).abs().max()) <= 1e-6 * float(library.abs().max())
    # `_modulated` takes the first row of the CFG batch's time conditioning for both: they are one time point.
    assert all(torch.equal(c[:, 0], c[:, 1]) for step in vocoder._grid for c in step)


# -- streaming fidelity ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [7, 12, 50, 137])
def test_streamed_audio_matches_whole_decode(token2wav, voice, n):
    """Streamed vs whole, same noise, default window (first chunk 12 codes, then 24; past 48,
    future 24 frames; BigVGAN context 20 frames).

    Measured on this tiny model (audio rms 0.15): n=7 and n=12 (one window holds the whole utterance,
    padded to a full window's length) differ only by rounding: max abs err 5e-7, SNR 123 dB; n=50:
    max abs err 4.4e-5, SNR 88.4 dB; n=137: 5.4e-5, 89.1 dB (before the chunks grew to 48 codes: 1.0e-4, 85.1 dB). In mel the
    largest difference is 3e-3 against a std of 1.63 (mel SNR 71-75 dB), just before each chunk's
    look-ahead block. Over 12 other seeds (voice, codes, noise): SNR 85-101 dB, max abs <= 7.7e-5.
    BigVGAN's seams are exact here (its receptive field is +-13 frames < 20); nearly all of the
    error is the DiT window. Asserted with margin: SNR >= 70 dB and max abs err <= 1e-3.
    """
    vocoder = _vocoder(token2wav, voice)
    codes = _codes(n)
    whole = vocoder.decode_whole(codes)
    results = []
    for pattern in ("all", "one", "uneven"):
        vocoder.reset(seed=SEED)  # the same noise again (a plain reset() draws fresh noise)
        blocks = _stream(vocoder, _pieces(codes, pattern))
        assert all(b.dtype == np.float32 and b.ndim == 1 and b.size for b in blocks)
        results.append(np.concatenate(blocks))
    streamed = results[0]
    assert len(streamed) == len(whole) == n * 2 * HOP
    # The chunk schedule depends only on the codes, never on how they were pushed.
    for other in results[1:]:
        assert np.array_equal(other, streamed)
    if n <= 12:  # one window: the padding rows are masked out, so only rounding differs
        assert np.abs(streamed - whole).max() <= 1e-5
        vocoder = _vocoder(token2wav, voice, pad_windows=False)  # unpadded, one window is the whole decode
        assert np.array_equal(np.concatenate(_stream(vocoder, _pieces(codes, "all"))), whole)
    else:
        assert _snr_db(streamed, whole) >= 70.0
        assert np.abs(streamed - whole).max() <= 1e-3


@pytest.mark.parametrize("pad_windows", [True, False])
def test_ode_by_steps_equals_the_whole_ode(token2wav, voice, pad_windows):
    """The uncompiled path (`compiled=False`: the ODE one RK4 step at a time, each step a CUDA graph on a
    GPU) does the same float operations as the whole-ODE path, so the audio is identical, bit for bit."""
    codes = _codes(137)
    whole = _vocoder(token2wav, voice, pad_windows=pad_windows)
    by_step = _vocoder(token2wav, voice, pad_windows=pad_windows, compiled=False)
    a = np.concatenate(_stream(whole, _pieces(codes, "uneven")))
    b = np.concatenate(_stream(by_step, _pieces(codes, "uneven")))
    assert a.shape == b.shape == (137 * 2 * HOP,)
    assert np.array_equal(a, b)
    assert whole.dit_calls == by_step.dit_calls > 1


def test_look_ahead_context_matters(token2wav, voice):
    # Guards the window: dropping the future context (what a naive chunker does) is far worse.
    # Measured (n=50): 88.4 dB with the default 24 frames vs 51.4 dB with none (12 seeds: 50-58 dB).
    codes = _codes(50)
    snrs = []
    for future in (None, 0):
        vocoder = _vocoder(token2wav, voice, future_frames=future)
        whole = vocoder.decode_whole(codes)
        snrs.append(_snr_db(np.concatenate(_stream(vocoder, [codes])), whole))
    assert snrs[0] >= snrs[1] + 15.0



@pytest.mark.parametrize("voice_name", ["Chelsie", "Ethan"])
def test_built_in_tiny_model_streams_within_the_same_bound(voice_name):
    """The project's committed tiny model (omni_dev/tiny_qwen2_5.py) and its voices, 137 codes.

    Measured: Chelsie max abs err 1.9e-5, SNR 104.4 dB; Ethan 2.1e-5, 97.9 dB (rms 0.09); and
    `decode_whole` is bit-identical to transformers' token2wav under the same seed.
    """
    from omni_dev.tiny_qwen2_5 import build_tiny_model

    model = build_tiny_model()
    t2w, spk = model.token2wav, model.speaker_map[voice_name]
    codes = _codes(137)
    vocoder = StreamingVocoder(t2w, spk["cond"], spk["ref_mel"], max_codes=MAX_CODES, generator=SEED)
    whole = vocoder.decode_whole(codes)
    streamed = np.concatenate(_stream(vocoder, _pieces(codes, "uneven")))
    assert len(streamed) == len(whole) == 137 * 2 * HOP
    assert _snr_db(streamed, whole) >= 70.0
    assert np.abs(streamed - whole).max() <= 1e-3
    torch.manual_seed(SEED)
    with torch.no_grad():
        reference = t2w(torch.tensor([codes]), spk["cond"], spk["ref_mel"]).numpy()
    assert np.abs(whole - reference).max() <= 1e-5

# -- incremental ----------------------------------------------------------------------------------
@pytest.mark.parametrize("first_chunk_codes, first_at, first_frames", [(12, 24, 4), (24, 36, 28)])
def test_first_block_latency(token2wav, voice, first_chunk_codes, first_at, first_frames):
    # First audio after first chunk + one look-ahead block (12 codes); BigVGAN holds back its
    # 20-frame right context, so the first block is (first chunk frames - 20) frames long.
    vocoder = _vocoder(token2wav, voice, first_chunk_codes=first_chunk_codes, codes_per_chunk=24)
    got = []
    for i, code in enumerate(_codes(80), start=1):
        got += [(i, len(b)) for b in vocoder.push([code])]
    assert got[0] == (first_at, first_frames * HOP)
    # After that, one block every 24 codes, 48 frames long.
    assert [i for i, _ in got] == list(range(first_at, 81, 24))
    assert all(length == 48 * HOP for _, length in got[1:])


def test_chunks_grow_from_the_first_to_the_steady_size(token2wav, voice):
    # Default schedule: 12 codes, then 24, then 48 from there on; each block comes once its chunk
    # and the 12-code look-ahead exist, and BigVGAN holds back 20 frames at every seam.
    vocoder = _vocoder(token2wav, voice)
    got = []
    for i, code in enumerate(_codes(MAX_CODES), start=1):
        got += [(i, len(b) // HOP) for b in vocoder.push([code])]
    assert got == [(24, 4), (48, 48), (96, 96), (144, 96)]
    # Windows: [0, 48), [0, 96), then 48 past + 96 + 24 ahead = 168 frames each.
    assert (vocoder.dit_calls, vocoder.dit_frames) == (4, 48 + 96 + 168 + 168)
    vocoder.finish()
    # Every mel frame is made final by exactly one logged chunk (the engine's stats are built on it).
    assert [frames for frames, _ in vocoder.chunk_log] == [24, 48, 96, 96, 2 * MAX_CODES - 264]


def test_history_is_never_decoded_again(token2wav, voice):
    n = 137
    vocoder = _vocoder(token2wav, voice)
    frames_seen = []  # counted inside the DiT itself, independently of the vocoder's counters
    hook = token2wav.code2wav_dit_model.proj_out.register_forward_hook(
        lambda module, args, out: frames_seen.append(args[0].shape[1])
    )
    try:
        _stream(vocoder, _pieces(_codes(n), "one"))
    finally:
        hook.remove()
    evaluations = 36  # RK4: 9 steps x 4 evaluations
    windows = frames_seen[::evaluations]
    assert len(frames_seen) == evaluations * len(windows) == evaluations * vocoder.dit_calls
    # Every window is one chunk plus constant context; the total is the audio plus that context, plus
    # the padding of the last window (run at full length) of at most one chunk and its look-ahead.
    assert max(windows) <= vocoder.past_frames + vocoder.chunk_frames + vocoder.future_frames
    overhead = vocoder.past_frames + vocoder.future_frames
    padding = vocoder.chunk_frames + vocoder.future_frames
    assert sum(windows) == vocoder.dit_frames <= 2 * n + len(windows) * overhead + padding
    assert vocoder.bigvgan_frames <= 2 * n + len(windows) * 2 * vocoder.bigvgan_context


def test_rejects_what_it_cannot_decode(token2wav, voice):
    vocoder = _vocoder(token2wav, voice)
    with pytest.raises(ValueError, match="audio code"):
        vocoder.push([5, 8294])  # codec eos must be stripped before the vocoder
    with pytest.raises(ValueError, match="max_codes"):
        vocoder.push([1] * (MAX_CODES + 1))
    with pytest.raises(ValueError, match="multiple"):
        _vocoder(token2wav, voice, codes_per_chunk=10)
    assert vocoder.finish() == []  # nothing pushed: nothing to say
    assert vocoder.chunk_log == []  # and no chunk to account for (the stats divide by its frames)
    with pytest.raises(RuntimeError):
        vocoder.push([1])


# -- the worker thread ----------------------------------------------------------------------------
def _run_worker(vocoder, codes: Channel, pcm: Channel, **kwargs) -> threading.Thread:
    thread = threading.Thread(target=vocoder_worker, args=(vocoder, codes, pcm), kwargs=kwargs, daemon=True)
    thread.start()
    return thread


def test_worker_streams_blocks_and_closes(token2wav, voice):
    codes = _codes(60)
    expected = _stream(_vocoder(token2wav, voice), [codes])
    code_ch, pcm_ch = Channel(maxsize=4, name="codes"), Channel(maxsize=2, name="pcm")
    stamps = []
    thread = _run_worker(_vocoder(token2wav, voice), code_ch, pcm_ch, on_block=lambda b, t: stamps.append((len(b), t)))
    for piece in _pieces(codes, "uneven"):
        code_ch.put(piece)
    code_ch.close()
    blocks = list(pcm_ch)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert len(blocks) == len(expected) and all(np.array_equal(a, b) for a, b in zip(blocks, expected))
    assert [n for n, _ in stamps] == [len(b) for b in blocks]
    assert all(t0 <= t1 for (_, t0), (_, t1) in zip(stamps, stamps[1:]))


def test_worker_stops_at_end_marker(token2wav, voice):
    code_ch, pcm_ch = Channel(name="codes"), Channel(name="pcm")
    thread = _run_worker(_vocoder(token2wav, voice), code_ch, pcm_ch)
    code_ch.put(_codes(30))
    code_ch.put(END)  # the channel itself stays open
    audio = np.concatenate(list(pcm_ch))
    thread.join(timeout=30)
    assert not thread.is_alive() and len(audio) == 30 * 2 * HOP


class _Boom(RuntimeError):
    pass


class _FailingVocoder(StreamingVocoder):
    def push(self, codes):
        if self.n_codes >= 24:
            raise _Boom("DiT exploded")
        return super().push(codes)


def test_worker_error_reaches_the_consumer(token2wav, voice):
    vocoder = _FailingVocoder(token2wav, *voice, max_codes=MAX_CODES, generator=SEED)
    code_ch, pcm_ch = Channel(maxsize=2, name="codes"), Channel(name="pcm")
    thread = _run_worker(vocoder, code_ch, pcm_ch)
    with pytest.raises(Cancelled):  # the worker cancels the codes channel: the engine stops too
        for piece in _pieces(_codes(100), "one"):
            code_ch.put(piece)
    received = []
    with pytest.raises(_Boom, match="DiT exploded"):
        for block in pcm_ch:  # the blocks made before the failure still arrive first
            received.append(block)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert len(received) == 1 and code_ch.cancelled


def test_worker_passes_on_an_engine_failure(token2wav, voice):
    code_ch, pcm_ch = Channel(name="codes"), Channel(name="pcm")
    thread = _run_worker(_vocoder(token2wav, voice), code_ch, pcm_ch)
    code_ch.put(_codes(10))
    code_ch.fail(ValueError("talker died"))
    with pytest.raises(ValueError, match="talker died"):
        pcm_ch.get(timeout=30)
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_worker_returns_quietly_when_the_consumer_leaves(token2wav, voice):
    code_ch, pcm_ch = Channel(name="codes"), Channel(maxsize=1, name="pcm")
    thread = _run_worker(_vocoder(token2wav, voice), code_ch, pcm_ch)
    code_ch.put(_codes(100))  # enough for several blocks: the worker blocks on the full pcm channel
    pcm_ch.get(timeout=30)
    pcm_ch.cancel()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert code_ch.cancelled
    with pytest.raises(Cancelled):
        code_ch.put([1])


@pytest.mark.parametrize("chunk", [48, 96, 192])
def test_warmup_codes_reach_every_window_an_utterance_uses(token2wav, voice, chunk):
    # The engine captures the windows' CUDA graphs by streaming `warmup_codes`; a window it missed
    # would run eagerly (slowly) in every reply. Compare with utterances of many lengths: every DiT
    # window length, and every BigVGAN span before the last (the last one's length varies).
    from omni_cli.models.qwen2_5_omni.vocoder import warmup_codes

    def windows(codes):
        vocoder = StreamingVocoder(token2wav, *voice, max_codes=len(codes), generator=SEED,
                                   codes_per_chunk=chunk, pad_windows=True)
        seen, run = set(), vocoder._graphs.run

        def record(key, fn, *inputs, **options):
            if key[0] == "dit" or not vocoder.finished:
                seen.add((key[0], key[-1]))
            return run(key, fn, *inputs, **options)

        vocoder._graphs.run = record
        try:
            _stream(vocoder, [codes])
        finally:
            del vocoder._graphs.run  # the instance attribute; the class's method is back
        return seen

    warm = windows(warmup_codes(chunk))
    for n in (5, 30, 100, 250, 420):
        assert windows(_codes(n)) <= warm, n
