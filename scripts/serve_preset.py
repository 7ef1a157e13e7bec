"""omni-serve on a benchmark preset: random weights at a preset's true size, built on the device, served as
omni-serve serves a folder (chat completions and /v1/realtime), for timing on a GPU box without a checkpoint.

    python scripts/serve_preset.py qwen2.5-omni-7b [--port 8484] [--max-codes 250] [--compile] [--device cuda]

The tokenizer, voices' names and generation defaults are the preset's tiny asset's (as omni-bench and
scripts/make_random_checkpoint.py do: no real vocabulary can be downloaded here), so text is gibberish and
speech is noise; the weights, shapes, caches and steps are the true size's. Prints `ready` on stderr once it
listens. Not imported by the package; not a product command (a real checkpoint goes through omni-serve -m).
"""

from __future__ import annotations

import argparse
import sys

# The special ids a prompt made by the tokenizer holds (the turn markers, the audio/image placeholders): the
# preset's config takes the tiny tokenizer's, or the Qwen3 talker finds no assistant opener and the encoders'
# features find no placeholders. Model-internal ids (tts_*, codec_*) stay the true size's.
_PROMPT_IDS = ("im_start_token_id", "im_end_token_id", "system_token_id", "user_token_id", "assistant_token_id",
               "audio_token_id", "audio_start_token_id", "audio_end_token_id", "image_token_id", "video_token_id",
               "vision_start_token_id", "vision_end_token_id", "audio_token_index", "image_token_index",
               "video_token_index")


def _with_ids_of(build_config, asset):
    """`build_config` whose configs (top level, thinker, talker) carry `asset`'s prompt ids."""
    import json

    tiny = json.loads((asset / "config.json").read_text())

    def build(name: str):
        config = build_config(name)
        parts = [(config, tiny)] + [(getattr(config, k, None), tiny.get(k) or {}) for k in ("thinker_config", "talker_config")]
        for part, ids in parts:
            for key in _PROMPT_IDS:
                if part is not None and key in ids and hasattr(part, key):
                    setattr(part, key, ids[key])
        return config

    return build


def assistant_for(preset: str, max_codes: int, compile: bool, where: str = "cuda"):
    """An Assistant over the preset's model, built on `where` (CUDA: bfloat16; the CPU, for the tiny presets:
    float32), warmed up as omni-serve's is."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from omni_cli.assistant import Assistant
    from omni_cli.config import RuntimeOptions
    from omni_cli.faces.bench import family_of
    from omni_cli.loader import BUILTIN_TINY_DIRS, LoadedModel, read_family

    device = torch.device(where)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    family = family_of(preset)
    # The family's tiny asset (a full-size preset names none): its tokenizer and generation defaults.
    tiny = [p["asset"] for p in family.PRESETS.values() if "asset" in p]
    asset = next(d for d in BUILTIN_TINY_DIRS if d.name == tiny[0])
    family.build_config = _with_ids_of(family.build_config, asset)
    model, voices = family.build_model(preset, device, dtype, lambda m: print(m, file=sys.stderr))
    loaded = LoadedModel(model=model, tokenizer=AutoTokenizer.from_pretrained(str(asset)), speakers=voices,
                         generation_config=GenerationConfig.from_pretrained(str(asset)), path=asset, device=device,
                         dtype=dtype, is_demo=False, name=preset, family=read_family(asset))
    runtime = RuntimeOptions.from_env(device=where, dtype=str(dtype).removeprefix("torch."), max_codes=max_codes,
                                      compile=True if compile else None)
    return Assistant(loaded, runtime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("preset")
    ap.add_argument("--port", type=int, default=8484)
    ap.add_argument("--max-codes", type=int, default=250)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    import socket

    from omni_cli.config import ReplyOptions
    from omni_cli.faces.serve import _listen, _serve

    assistant = assistant_for(args.preset, args.max_codes, args.compile, args.device)
    print("ready", file=sys.stderr, flush=True)
    _serve(assistant, None, _listen("127.0.0.1", args.port, socket), None, ReplyOptions(max_codes=args.max_codes))


if __name__ == "__main__":
    main()
