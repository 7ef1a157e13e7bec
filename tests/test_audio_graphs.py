"""runtime/audio_graphs.py on the CPU: the padded layout a tower graph runs on (zero chunks after the real
ones, padding rows in a window of their own, windows as a mask made from `cu_seqlens`) gives the library's
output for clips of many lengths, both families (the tiny assets, float32). The graphs themselves need a
GPU (tests/test_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from omni_cli.runtime import audio_graphs, compat  # noqa: E402
from hf_reference import tiny_model  # noqa: E402  (tests/ is on sys.path)


@pytest.fixture(scope="module", params=["qwen2.5", "qwen3"])
def thinker(request):
    return tiny_model(request.param).thinker


def _clips(frames: list[int], seed: int):
    features = torch.tensor(np.random.default_rng(seed).standard_normal((len(frames), 128, max(frames))),
                            dtype=torch.float32)
    mask = torch.zeros(len(frames), max(frames), dtype=torch.long)
    for i, n in enumerate(frames):
        mask[i, :n] = 1
        features[i, :, n:] = 5.0  # the batch's padding: read by neither
    return features, mask


# 57: one partial chunk; 100 and 200: whole chunks of one family; three clips with a batch's padding;
# 1000 frames: more than one of Qwen3-Omni's 800-frame attention windows.
CASES = [[57], [100], [200], [130, 357, 41], [1000, 20]]


@pytest.mark.parametrize("frames", CASES)
def test_the_padded_layout_gives_the_librarys_output(thinker, frames):
    tower = compat.audio_tower(thinker)
    features, mask = _clips(frames, seed=len(frames))
    with torch.inference_mode():
        library = thinker.get_audio_features(features, mask, return_dict=True).last_hidden_state
        lengths = mask.sum(-1)
        layout = audio_graphs.Layout(tower, compat.clips_end_to_end(features, lengths), lengths)
        assert layout.chunks == sum(-(-n // (2 * tower.n_window)) for n in frames)
        for extra in (0, 3):  # the clips' own bucket, and one with three zero chunks after them
            padded = audio_graphs.TowerGraph(tower, layout.chunks + extra, graphed=False)
            ours = padded(layout)
            assert ours.shape == library.shape
            assert (ours - library).abs().max() <= 1e-5 * library.abs().max()


def test_qwen3s_long_clip_has_more_than_one_window(thinker):
    tower = compat.audio_tower(thinker)
    if not hasattr(tower, "n_window_infer"):
        pytest.skip("Qwen2.5-Omni's windows are its chunks")
    layout = audio_graphs.Layout(tower, torch.zeros(128, 1000), torch.tensor([1000]))
    assert len(layout.cu) > 2  # the case above crosses a window's edge


def test_padding_rows_never_reach_a_real_row():
    """windowed_attention: rows attend within their window only; a padding window's values change
    nothing of the others'."""
    q, k, v = (torch.randn(1, 2, 9, 4) for _ in range(3))
    cu = torch.tensor([0, 3, 7, 9, 9], dtype=torch.int32)  # windows 0-2, 3-6, padding 7-8, one empty
    out, _ = audio_graphs.windowed_attention(None, q, k, v, scaling=0.5, cu_seq_lens_q=cu)
    v2 = v.clone()
    v2[:, :, 7:] = 100.0
    out2, _ = audio_graphs.windowed_attention(None, q, k, v2, scaling=0.5, cu_seq_lens_q=cu)
    assert torch.equal(out[:, :7], out2[:, :7]) and not torch.equal(out[:, 7:], out2[:, 7:])
    for a, b in ((0, 3), (3, 7)):  # each window alone, as the library's split computes it
        alone = torch.nn.functional.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=0.5)
        assert torch.allclose(out[:, a:b], alone.transpose(1, 2), atol=1e-6)


def test_without_graphs_the_librarys_call_is_taken(thinker, monkeypatch):
    monkeypatch.setattr(audio_graphs, "ENABLED", True)  # on or off, a CPU makes none
    features, mask = _clips([300], seed=0)
    assert audio_graphs.replay_call(compat.audio_tower(thinker), features, mask) is None
    assert audio_graphs.capture_ahead(thinker) == 0  # off CUDA none are made
