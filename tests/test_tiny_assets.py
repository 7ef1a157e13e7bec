"""The committed tiny checkpoint is exactly what scripts/make_tiny_model.py writes, and it is consistent."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from omni_dev import tiny_qwen2_5 as tiny  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ASSET = ROOT / "assets" / "tiny-qwen2.5-omni"
MAX_BYTES = 10 * 1024 * 1024


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    """Run scripts/make_tiny_model.py's main in-process (a subprocess would pay the imports again)."""
    out = tmp_path_factory.mktemp("tiny") / "tiny-qwen2.5-omni"
    script = runpy.run_path(str(ROOT / "scripts" / "make_tiny_model.py"), run_name="make_tiny_model")
    assert script["main"]([str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ASSET)


@pytest.fixture(scope="module")
def config():
    from transformers import Qwen2_5OmniConfig

    return Qwen2_5OmniConfig.from_pretrained(ASSET)


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _json(path: Path):
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data.pop("transformers_version", None)
    return data


def test_committed_folder_equals_script_output(regenerated):
    from safetensors import safe_open

    assert _files(regenerated) == _files(ASSET)
    for name in _files(ASSET):
        new, old = regenerated / name, ASSET / name
        if name.endswith(".json"):
            assert _json(new) == _json(old), name  # the same but for the stamp of the transformers that wrote it
        elif name.endswith(".safetensors"):
            with safe_open(new, "pt") as a, safe_open(old, "pt") as b:
                assert a.metadata() == b.metadata()
                assert sorted(a.keys()) == sorted(b.keys())
                for key in a.keys():
                    ta, tb = a.get_tensor(key), b.get_tensor(key)
                    assert ta.dtype == tb.dtype and torch.equal(ta, tb), key
        elif name.endswith(".pt"):
            _assert_same_tree(torch.load(new, weights_only=True), torch.load(old, weights_only=True), name)
        else:
            assert new.read_bytes() == old.read_bytes(), name


def _assert_same_tree(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), where
        for key in a:
            _assert_same_tree(a[key], b[key], f"{where}/{key}")
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def test_folder_is_small():
    assert tiny.folder_size(ASSET) <= MAX_BYTES
    for name in ("config.json", "generation_config.json", "model.safetensors", "spk_dict.pt", "tokenizer.json",
                 "tokenizer_config.json", "vocab.json", "merges.txt", "chat_template.jinja",
                 "preprocessor_config.json"):
        assert (ASSET / name).is_file(), name


def test_chat_template_renders_qwen_omni_form(tokenizer):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello there!"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello there!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [
            {"type": "audio", "audio": "a.wav"},
            {"type": "image", "image": "b.png"},
            {"type": "video", "video": "c.mp4"},
            {"type": "text", "text": "What is this?"},
        ]},
        {"role": "assistant", "content": "Noise."},
    ]
    text = tokenizer.apply_chat_template(parts, add_generation_prompt=False, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|><|vision_bos|><|IMAGE|><|vision_eos|>"
        "<|vision_bos|><|VIDEO|><|vision_eos|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\nNoise.<|im_end|>\n"
    )
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in ids


def test_special_ids_agree_with_tokenizer(tokenizer, config):
    from transformers import GenerationConfig

    ids = tokenizer.convert_tokens_to_ids
    thinker, talker = config.thinker_config, config.talker_config
    vocab = thinker.text_config.vocab_size
    assert len(tokenizer) <= vocab

    gen = GenerationConfig.from_pretrained(ASSET)
    assert ids("<|im_end|>") in gen.eos_token_id and ids("<|endoftext|>") in gen.eos_token_id
    assert gen.pad_token_id == ids("<|endoftext|>")
    assert thinker.text_config.eos_token_id == ids("<|im_end|>")

    assert thinker.audio_token_index == talker.audio_token_index == ids(tokenizer.audio_token) == ids("<|AUDIO|>")
    assert thinker.image_token_index == talker.image_token_index == ids(tokenizer.image_token) == ids("<|IMAGE|>")
    assert thinker.video_token_index == talker.video_token_index == ids(tokenizer.video_token) == ids("<|VIDEO|>")
    assert thinker.audio_start_token_id == talker.audio_start_token_id == ids("<|audio_bos|>")
    assert thinker.audio_end_token_id == talker.audio_end_token_id == ids("<|audio_eos|>")
    assert thinker.vision_start_token_id == talker.vision_start_token_id == ids("<|vision_bos|>")
    assert thinker.vision_end_token_id == talker.vision_end_token_id == ids("<|vision_eos|>")
    assert thinker.user_token_id == ids("user")

    speakers = torch.load(ASSET / "spk_dict.pt", weights_only=True)
    assert set(speakers) == {"Chelsie", "Ethan"}
    text_side = [talker.tts_text_start_token_id, talker.tts_text_end_token_id, talker.tts_text_pad_token_id]
    text_side += [v["bos_token"] for v in speakers.values()]
    assert len(set(text_side)) == len(text_side)
    assert all(len(tokenizer) <= i < vocab for i in text_side)  # like the real ids: embedding rows only
    for voice in speakers.values():
        assert voice["cond"].shape == (1, 192) and voice["cond"].dtype == torch.float32
        assert voice["ref_mel"].shape[0] == 1 and voice["ref_mel"].shape[2] == 80
        assert 100 <= voice["ref_mel"].shape[1] <= 300

    assert talker.vocab_size == 8448
    assert (talker.tts_codec_pad_token_id, talker.tts_codec_start_token_id) == (8292, 8293)
    assert (talker.tts_codec_end_token_id, talker.tts_codec_mask_token_id) == (8294, 8296)
    assert talker.embedding_size == thinker.text_config.hidden_size


def test_heads_never_favour_overflow_codes():
    from safetensors import safe_open

    with safe_open(ASSET / "model.safetensors", "pt") as f:
        head = f.get_tensor("talker.codec_head.weight")
    norms = head.norm(dim=1)
    assert torch.all(norms[:8192] > 0)
    overflow = torch.ones(head.shape[0], dtype=torch.bool)
    overflow[:8192] = False
    overflow[[8292, 8294]] = False
    assert torch.all(norms[overflow] == 0)
    assert norms[8292] > 0 and norms[8294] > 0


def _mrope_ok(cfg) -> bool:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return sum(cfg.rope_parameters["mrope_section"]) == head_dim // 2


def test_tiny_config_overrides_change_shapes():
    from transformers import Qwen2_5OmniForConditionalGeneration

    variants = [
        {},
        {"thinker_hidden": 32, "thinker_layers": 1, "thinker_heads": 2, "thinker_kv_heads": 1,
         "thinker_intermediate": 48, "talker_hidden": 24, "talker_layers": 1, "talker_heads": 2,
         "talker_kv_heads": 1, "talker_head_dim": 8, "talker_intermediate": 40},
        {"thinker_hidden": 96, "thinker_layers": 3, "thinker_heads": 6, "thinker_kv_heads": 3,
         "thinker_intermediate": 160, "talker_hidden": 64, "talker_layers": 3, "talker_heads": 4,
         "talker_kv_heads": 4, "talker_head_dim": 32, "talker_intermediate": 128},
    ]
    shapes = []
    for overrides in variants:
        cfg = tiny.tiny_config(**overrides)
        assert _mrope_ok(cfg.thinker_config.text_config) and _mrope_ok(cfg.talker_config)
        assert cfg.talker_config.embedding_size == cfg.thinker_config.text_config.hidden_size
        with torch.device("meta"):
            model = Qwen2_5OmniForConditionalGeneration(cfg)
        shapes.append({k: tuple(v.shape) for k, v in model.state_dict().items()})
    assert shapes[0] != shapes[1] != shapes[2] != shapes[0]
    assert shapes[1]["thinker.lm_head.weight"] == (tiny.THINKER_VOCAB, 32)
    assert shapes[2]["talker.model.layers.2.self_attn.q_proj.weight"] == (4 * 32, 64)
    with pytest.raises(TypeError):
        tiny.tiny_config(no_such_size=1)


def test_build_is_seeded():
    cfg = tiny.tiny_config(thinker_layers=1, talker_layers=1)
    a = tiny.build_tiny_model(cfg, seed=1).state_dict()
    b = tiny.build_tiny_model(cfg, seed=1).state_dict()
    c = tiny.build_tiny_model(cfg, seed=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["talker.codec_head.weight"], c["talker.codec_head.weight"])


def test_vocoder_keeps_the_real_window_and_hop(config):
    """Shrunk for CPU time, the token2wav still has the real model's streaming shape: 24-frame DiT blocks
    at two mel frames a code, two look-back layers and one look-ahead layer (so a stream decodes with 48
    frames of past and 24 of future), and BigVGAN stages whose rates multiply to 240 samples a frame,
    each giving exactly `rate` samples a frame."""
    import math

    from transformers import Qwen2_5OmniForConditionalGeneration

    from omni_cli.models.qwen2_5_omni.vocoder import StreamingVocoder

    dit, bigvgan = config.token2wav_config.dit_config, config.token2wav_config.bigvgan_config
    assert (dit.block_size, dit.repeats, dit.mel_dim) == (24, 2, 80)
    assert len(dit.look_backward_layers) == 2 and len(dit.look_ahead_layers) == 1
    assert math.prod(bigvgan.upsample_rates) == 240
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(ASSET)
    speakers = torch.load(ASSET / "spk_dict.pt", weights_only=True)
    voice = speakers["Chelsie"]
    vocoder = StreamingVocoder(model.token2wav, voice["cond"], voice["ref_mel"], max_codes=60, generator=0)
    assert (vocoder.past_frames, vocoder.future_frames) == (48, 24)
    codes = list(range(100, 160))
    audio = vocoder.decode_whole(codes)
    assert audio.shape == (60 * 2 * 240,)
    assert 0.03 < float(audio.std()) < 0.3 and float(abs(audio).max()) < 1.0  # audible noise, never clipped


def test_tiny_config_rejects_a_vocoder_off_24_khz():
    with pytest.raises(ValueError, match="multiply to 240"):
        tiny.tiny_config(bigvgan_upsample_rates=(5, 4, 4, 2))
    with pytest.raises(ValueError, match="bigvgan_channels"):
        tiny.tiny_config(bigvgan_channels=8, bigvgan_upsample_rates=(5, 4, 4, 3))
    config = tiny.tiny_config(bigvgan_upsample_rates=(5, 3, 2, 2, 2, 2), bigvgan_channels=64)
    assert config.token2wav_config.bigvgan_config.upsample_kernel_sizes == [11, 7, 4, 4, 4, 4]  # the real ones
