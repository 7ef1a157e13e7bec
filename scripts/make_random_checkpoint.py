"""Write a Qwen2.5-Omni model folder with random weights at a preset's true size (for timing cold start).

Usage: python scripts/make_random_checkpoint.py OUT_DIR [--preset qwen2.5-omni-7b] [--device cuda]
                                                [--dtype bfloat16] [--force]

What it writes: the files of a real Qwen2.5-Omni checkpoint, which `omni_cli.load(OUT_DIR)` and
`omni-say -m OUT_DIR` read: config.json; the weights as model-0000K-of-0000N.safetensors shards of at most
4 GB with model.safetensors.index.json (a single model.safetensors when they fit in one); generation_config.json;
the tokenizer files with chat_template.jinja; preprocessor_config.json; spk_dict.pt (voices Chelsie and Ethan).
The model is the preset's (omni_cli/models/qwen2_5_omni/presets.py: build_config), initialised as transformers
initialises a new model, on --device, with fixed seeds: thinker and talker in --dtype, token2wav in float32.

What it does not give: anything a trained model knows (text is gibberish, speech is noise), nor a real
tokenizer: none can be downloaded here, so the folder takes the built-in tiny model's
(assets/tiny-qwen2.5-omni), whose vocabulary is ~790 tokens. A tokenizer's ids must agree with the config, so
every special text id in config.json (keys ending in `token_id` / `token_index`, at any level: <|AUDIO|>,
<|vision_bos|>, the talker's tts_text ids, user_token_id, the text config's bos/eos/pad) is the tiny one's,
and so are the voices' bos_token ids; the codec ids (`tts_codec_*`) are the talker's own vocabulary and keep
the real values. Shapes and weight names stay the real ones (the thinker still has 152064 embedding rows;
ids past the tiny tokenizer's decode to nothing). --force overwrites the files it writes and removes old
weight files; anything else in the folder stays.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TINY = ROOT / "assets" / "tiny-qwen2.5-omni"
COPIED = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
          "chat_template.jinja", "preprocessor_config.json", "generation_config.json")
VOICES = ("Chelsie", "Ethan")
REF_MEL_FRAMES = 300
SEED = 0


def copy_text_ids(src: dict, dst: dict) -> dict:
    """Into `dst`, at the same place, every int-valued `*token_id` / `*token_index` of `src` (nested dicts
    followed where both have them) except the talker's codec ids (`tts_codec_*`). Returns `dst`."""
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            copy_text_ids(value, dst[key])
        elif (isinstance(key, str) and key.endswith(("token_id", "token_index")) and not key.startswith("tts_codec")
              and isinstance(value, int) and not isinstance(value, bool)):
            dst[key] = value
    return dst


def make_config(preset: str):
    """The preset's true-size Qwen2_5OmniConfig with the tiny tokenizer's text ids."""
    from transformers import Qwen2_5OmniConfig

    from omni_cli.models.qwen2_5_omni.presets import build_config

    tiny = json.loads((TINY / "config.json").read_text(encoding="utf-8"))
    return Qwen2_5OmniConfig.from_dict(copy_text_ids(tiny, build_config(preset).to_dict()))


def make_model(config, device, dtype):
    """Random weights allocated and initialised on `device` (seeded): LLMs in `dtype`, token2wav in float32."""
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    torch.manual_seed(SEED)  # seeds the CPU and every CUDA generator
    if device.type == "cpu":
        model = Qwen2_5OmniForConditionalGeneration._from_config(config, dtype=dtype)
    else:
        with torch.device(device):
            model = Qwen2_5OmniForConditionalGeneration._from_config(config, dtype=dtype)
    model.token2wav.float()
    return model.eval()


def make_voices(config) -> dict:
    """spk_dict.pt's contents: per voice the tiny model's bos_token id and seeded random cond / ref_mel."""
    import torch

    tiny = torch.load(TINY / "spk_dict.pt", weights_only=True, map_location="cpu")
    dit = config.token2wav_config.dit_config
    g = torch.Generator().manual_seed(SEED)
    return {name: {"bos_token": int(tiny[name]["bos_token"]),
                   "cond": torch.randn(1, dit.enc_emb_dim, generator=g),
                   "ref_mel": torch.randn(1, REF_MEL_FRAMES, dit.mel_dim, generator=g)}
            for name in VOICES}


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", metavar="OUT_DIR", type=Path)
    parser.add_argument("--preset", default="qwen2.5-omni-7b", help="qwen2.5-omni-7b (default), qwen2.5-omni-3b, tiny")
    parser.add_argument("--device", default="auto",
                        help="where the weights are made (default auto: cuda if any, else cpu)")
    parser.add_argument("--dtype", default="bfloat16", help="thinker and talker dtype (default bfloat16)")
    parser.add_argument("--force", action="store_true", help="write into a non-empty OUT_DIR")
    args = parser.parse_args(argv)

    def fail(message: str) -> int:
        print(f"make_random_checkpoint: {message}", file=sys.stderr)
        return 2

    from omni_cli.models.qwen2_5_omni.presets import PRESETS

    out: Path = args.out
    if args.preset not in PRESETS:
        return fail(f"unknown preset '{args.preset}': use one of {', '.join(PRESETS)}")
    if out.exists() and not out.is_dir():
        return fail(f"{out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        return fail(f"{out} is not empty: pass --force to write into it")

    from omni_cli.errors import OmniError
    from omni_cli.loader import pick_device, pick_dtype
    from omni_cli.models.weights import quiet_transformers

    try:
        device = pick_device(args.device)
        dtype = pick_dtype(args.dtype, device)
    except OmniError as exc:
        return fail(str(exc))

    import torch

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {message}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    with quiet_transformers():  # config warnings and progress bars: nothing to act on here
        config = make_config(args.preset)
        say(f"building {args.preset} on {device} ({str(dtype).removeprefix('torch.')}, token2wav float32) ...")
        model = make_model(config, device, dtype)
        n = sum(p.numel() for p in model.parameters())
        say(f"built {n / 1e9:.2f} B parameters" if n >= 1e9 else f"built {n / 1e6:.1f} M parameters")

        out.mkdir(parents=True, exist_ok=True)
        for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
            old.unlink(missing_ok=True)  # stale shards of an earlier run would be read beside the new ones
        say(f"saving the weights to {out} ...")
        model.save_pretrained(out, max_shard_size="4GB")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for name in COPIED:  # after save_pretrained: its generation_config.json gives way to the tiny one's
        shutil.copyfile(TINY / name, out / name)
    torch.save(make_voices(config), out / "spk_dict.pt")
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    size = _size(out)
    size_text = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
    say(f"wrote {out}: {len(files)} files, {size_text} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
