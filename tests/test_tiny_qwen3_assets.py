"""The committed tiny Qwen3-Omni is exactly what scripts/make_tiny_qwen3_omni.py writes, it is consistent
with the real checkpoint's ids and structure, and transformers' own `generate` runs on it end to end."""

from __future__ import annotations

import json
import math
import runpy
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
ASSET = ROOT / "assets" / "tiny-qwen3-omni"
SCRIPT = ROOT / "scripts" / "make_tiny_qwen3_omni.py"
MAX_BYTES = 10 * 1024 * 1024
FILES = ("chat_template.jinja", "config.json", "generation_config.json", "merges.txt", "model.safetensors",
         "preprocessor_config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
         "vocab.json")


@pytest.fixture(scope="module")
def script() -> dict:
    """The generator as a module namespace (it is a script, not part of the package)."""
    return runpy.run_path(str(SCRIPT), run_name="make_tiny_qwen3_omni")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ASSET)


@pytest.fixture(scope="module")
def config():
    from transformers import Qwen3OmniMoeConfig

    return Qwen3OmniMoeConfig.from_pretrained(ASSET)


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(ASSET).eval()  # CPU, float32 (as saved)


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_committed_folder_equals_script_output(script, tmp_path):
    out = tmp_path / "tiny-qwen3-omni"
    assert script["main"]([str(out)]) == 0
    assert _files(out) == _files(ASSET) == sorted(FILES)
    for name in _files(ASSET):
        if name.endswith(".json"):  # the same but for the stamp of the transformers that wrote it
            assert _json(out / name) == _json(ASSET / name), name
        else:
            assert (out / name).read_bytes() == (ASSET / name).read_bytes(), name
    assert script["folder_size"](ASSET) <= MAX_BYTES


def _json(path: Path):
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data.pop("transformers_version", None)
    return data


def test_config_has_the_real_structure_and_ids(config, tokenizer):
    thinker, talker, code2wav = config.thinker_config, config.talker_config, config.code2wav_config
    text, tt, cp = thinker.text_config, talker.text_config, talker.code_predictor_config
    assert config.model_type == "qwen3_omni_moe" and config.enable_audio_output
    # MoE thinker (renormalised top-k) and MoE talker with a shared expert (not renormalised)
    assert text.num_experts > text.num_experts_per_tok == 2 and text.norm_topk_prob
    assert tt.num_experts > tt.num_experts_per_tok == 2 and not tt.norm_topk_prob
    assert tt.shared_expert_intermediate_size > 0
    assert 1 <= talker.accept_hidden_layer <= text.num_hidden_layers
    assert talker.thinker_hidden_size == text.hidden_size
    assert thinker.audio_config.output_dim == thinker.vision_config.out_hidden_size == text.hidden_size
    for cfg in (text, tt):
        assert sum(cfg.rope_parameters["mrope_section"]) == cfg.head_dim // 2
    # codec side exactly as the real checkpoint
    assert talker.num_code_groups == cp.num_code_groups == code2wav.num_quantizers == 16
    assert cp.vocab_size == code2wav.codebook_size == 2048
    assert tt.vocab_size == 2048 + 1024
    assert cp.hidden_size == tt.hidden_size
    assert (talker.codec_pad_id, talker.codec_bos_id, talker.codec_eos_token_id) == (2148, 2149, 2150)
    assert (talker.codec_nothink_id, talker.codec_think_bos_id, talker.codec_think_eos_id) == (2155, 2156, 2157)
    assert talker.speaker_id == {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
    assert math.prod(code2wav.upsample_rates) * math.prod(code2wav.upsampling_ratios) == 1920
    # text side: the tokenizer's ids, at the real offsets from <|endoftext|>
    ids = tokenizer.convert_tokens_to_ids
    base = ids("<|endoftext|>")
    assert config.im_start_token_id == ids("<|im_start|>") == base + 1
    assert config.im_end_token_id == ids("<|im_end|>") == base + 2 == tokenizer.eos_token_id
    assert (config.tts_pad_token_id, config.tts_bos_token_id, config.tts_eos_token_id) == (
        ids("<tts_pad>"), ids("<tts_text_bos>"), ids("<tts_text_eod>")) == (base + 28, base + 29, base + 30)
    assert thinker.audio_token_id == talker.audio_token_id == ids("<|audio_pad|>") == base + 32
    assert thinker.image_token_id == talker.image_token_id == ids("<|image_pad|>") == base + 12
    assert thinker.video_token_id == talker.video_token_id == ids("<|video_pad|>") == base + 13
    assert thinker.audio_start_token_id == talker.audio_start_token_id == ids("<|audio_start|>") == base + 26
    assert talker.vision_start_token_id == ids("<|vision_start|>") == base + 9
    for role in ("system", "user", "assistant"):  # single tokens, as in the real tokenizer
        assert len(tokenizer(role).input_ids) == 1, role
    assert config.user_token_id == thinker.user_token_id == ids("user")
    assert config.assistant_token_id == ids("assistant") and config.system_token_id == ids("system")
    assert len(tokenizer) <= text.vocab_size


def test_chat_template_renders_qwen3_omni_form(tokenizer):
    parts = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "audio", "audio": "a.wav"},
            {"type": "image", "image": "b.png"},
            {"type": "video", "video": "c.mp4"},
            {"type": "text", "text": "What is this?"},
        ]},
    ]
    text = tokenizer.apply_chat_template(parts, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|><|vision_start|><|image_pad|><|vision_end|>"
        "<|vision_start|><|video_pad|><|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.decode(tokenizer(text).input_ids) == text


def test_heads_only_favour_audio_codes_and_rare_stops():
    from safetensors import safe_open

    with safe_open(ASSET / "model.safetensors", "pt") as f:
        codec_head = f.get_tensor("talker.codec_head.weight")
        lm_head = f.get_tensor("thinker.lm_head.weight")
        keys = list(f.keys())
    norms = codec_head.norm(dim=1)
    assert torch.all(norms[:2048] > 0) and norms[2150] > 0
    control = torch.ones(codec_head.shape[0], dtype=torch.bool)
    control[:2048] = False
    control[2150] = False
    assert torch.all(norms[control] == 0)
    assert lm_head[768 + 2].norm() > 0 and torch.all(lm_head[768 + 3:] == 0)  # <|im_end|> yes, other specials no
    assert sum(k.startswith("talker.code_predictor.lm_head.") for k in keys) == 15
    # experts are saved one by one, as in the real checkpoint (transformers fuses them on load)
    assert "talker.model.layers.0.mlp.shared_expert.gate_proj.weight" in keys
    assert "talker.model.layers.0.mlp.shared_expert_gate.weight" in keys
    assert "thinker.model.layers.0.mlp.experts.3.gate_proj.weight" in keys
    assert "talker.model.layers.0.mlp.experts.3.up_proj.weight" in keys


def test_loading_gives_back_the_built_weights(script, model):
    built = script["build_tiny_qwen3_model"](seed=0).state_dict()
    loaded = model.state_dict()
    assert sorted(built) == sorted(loaded)
    for key, value in built.items():
        assert loaded[key].dtype == torch.float32 and torch.equal(loaded[key], value), key


def test_build_is_seeded(script):
    from omni_cli.runtime.compat import checkpoint_name

    def weights(seed):  # by checkpoint key, whatever transformers calls the parameters
        return {checkpoint_name(k): v for k, v in script["build_tiny_qwen3_model"](seed=seed).state_dict().items()}

    a, b, c = weights(1), weights(1), weights(2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["talker.codec_head.weight"], c["talker.codec_head.weight"])
    # MoE experts and routers are filled (transformers would leave the talker's routers at zero)
    assert a["talker.model.layers.0.mlp.gate.weight"].abs().sum() > 0
    assert a["thinker.model.layers.0.mlp.experts.down_proj"].abs().sum() > 0
    with pytest.raises(TypeError):
        script["tiny_qwen3_config"](no_such_size=1)
    with pytest.raises(ValueError, match="accept_hidden_layer"):
        script["tiny_qwen3_config"](accept_hidden_layer=3)


def _generate(model, tokenizer, prompt: str, speaker: str, frames: int, text_tokens: int = 8):
    """transformers' own greedy generate with audio; returns (reply ids, codes [1, 16, F], wav [1, 1, N])."""
    ids = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )["input_ids"]
    caught = {}
    hook = model.code2wav.register_forward_pre_hook(lambda _m, args: caught.setdefault("codes", args[0]))
    try:
        sequences, wav = model.generate(
            ids,
            speaker=speaker,
            thinker_max_new_tokens=text_tokens,
            thinker_eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),  # the default is the literal 151645
            thinker_do_sample=False,
            talker_do_sample=False,
            talker_max_new_tokens=frames + 1,  # N new talker tokens give N-1 frames
        )
    finally:
        hook.remove()
    assert torch.equal(sequences[:, : ids.shape[1]], ids)
    return sequences[0, ids.shape[1]:], caught["codes"], wav


def test_reference_generate_speaks(model, tokenizer):
    start = time.perf_counter()
    reply, codes, wav = _generate(model, tokenizer, "Hello there!", "Ethan", frames=16)
    elapsed = time.perf_counter() - start

    assert 1 <= reply.numel() <= 8
    assert torch.all(reply < 768 + 3)  # printable BPE text or <|im_end|>
    assert codes.dtype == torch.long and codes.shape == (1, 16, 16)  # 16 codebooks a frame
    assert torch.all((codes >= 0) & (codes < 2048))  # every id valid for code2wav's codebooks
    assert wav.shape == (1, 1, 1920 * 16 - 555)  # the facts note's formula for one decode call
    assert wav.dtype == torch.float32
    assert 0.01 < float(wav.std()) < 0.3 and float(wav.abs().max()) < 1.0  # audible noise, never clipped
    with torch.no_grad():
        assert torch.equal(model.code2wav(codes), wav)  # one code2wav call on the frames is the waveform
    assert elapsed < 10, f"reference generate took {elapsed:.1f} s"


def test_every_voice_runs_and_differs(model, tokenizer):
    voices = {}
    for speaker in ("Chelsie", "Ethan", "Aiden"):
        _, codes, wav = _generate(model, tokenizer, "Hello there!", speaker, frames=4, text_tokens=4)
        assert codes.shape == (1, 16, 4) and wav.shape[-1] == 1920 * 4 - 555
        voices[speaker] = codes
    assert not torch.equal(voices["Chelsie"], voices["Ethan"])
    assert not torch.equal(voices["Ethan"], voices["Aiden"])
    with pytest.raises(NotImplementedError):
        _generate(model, tokenizer, "Hello there!", "Nobody", frames=2)


def test_speech_can_end_by_itself(model, tokenizer):
    """The codec EOS row is live: this prompt's greedy speech stops early, through generate's own EOS path."""
    _, codes, wav = _generate(model, tokenizer, "Please play some quiet music.", "Ethan", frames=30, text_tokens=20)
    frames = codes.shape[-1]
    assert 1 <= frames < 30
    assert wav.shape[-1] == 1920 * frames - 555
