"""What Qwen2.5-Omni's token2wav in bfloat16 (a packed model's, quant/apply.cast_token2wav) does to
its audio and its time, at true size: random weights, the same ones in float32 and in bfloat16.

Prints one JSON object: whole-utterance SNR of bfloat16 against float32 (same codes, voice, noise), the
streamed bfloat16 audio against its own whole decode, the weights' bytes in each dtype, and the wall time
of the first streamed window and of the whole stream in each (eager, synchronised: the product replays
these windows as CUDA graphs, so only the ratio means much). Random weights: not a quality test.

    python scripts/vocoder_dtype.py [--codes 250] [--device cuda]
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import numpy as np
import torch


def _snr_db(signal: np.ndarray, reference: np.ndarray) -> float:
    return float(10 * np.log10((reference ** 2).sum() / max(((signal - reference) ** 2).sum(), 1e-30)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codes", type=int, default=250)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

    from omni_cli.models.qwen2_5_omni.presets import build_config
    from omni_cli.models.qwen2_5_omni.vocoder import StreamingVocoder

    device = torch.device(args.device)
    config = build_config("qwen2.5-omni-7b").token2wav_config
    torch.manual_seed(0)
    with torch.device(device):
        models = {"float32": Qwen2_5OmniToken2WavModel._from_config(config, dtype=torch.float32).eval()}
    models["bfloat16"] = copy.deepcopy(models["float32"]).to(torch.bfloat16)  # the same weights, rounded
    g = torch.Generator(device=device).manual_seed(0)
    cond = torch.randn(1, config.dit_config.enc_emb_dim, device=device, generator=g)
    ref_mel = torch.randn(1, 300, config.dit_config.mel_dim, device=device, generator=g)
    codes = np.random.default_rng(0).integers(0, 8192, args.codes).tolist()
    result: dict = {"codes": args.codes, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    audio = {}
    for name, model in models.items():
        result[f"weights_bytes_{name}"] = sum(p.numel() * p.element_size() for p in model.parameters())
        vocoder = StreamingVocoder(model, cond, ref_mel, max_codes=args.codes + 12, generator=7, compiled=False)
        audio[name] = vocoder.decode_whole(codes)
        for _ in range(2):  # the second run is timed (the first pays for kernels' first launches)
            vocoder.reset(seed=7)
            blocks, first = [], None
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(0, len(codes), 4):  # four codes a push, as the talker makes them ~every 7 ms
                blocks += vocoder.push(codes[i:i + 4])
                if first is None and blocks:
                    first = time.perf_counter() - t0
            blocks += vocoder.finish()
            total = time.perf_counter() - t0
        result[f"first_window_s_{name}"], result[f"stream_s_{name}"] = first, total
        audio[name + "_streamed"] = np.concatenate(blocks)
    result["snr_db_bf16_whole_vs_f32_whole"] = _snr_db(audio["bfloat16"], audio["float32"])
    result["snr_db_bf16_streamed_vs_bf16_whole"] = _snr_db(audio["bfloat16_streamed"], audio["bfloat16"])
    result["snr_db_f32_streamed_vs_f32_whole"] = _snr_db(audio["float32_streamed"], audio["float32"])
    result["rms_f32"] = float(np.sqrt((audio["float32"] ** 2).mean()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
