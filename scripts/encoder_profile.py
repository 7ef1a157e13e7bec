"""Where a spoken turn's audio-encoder time goes: one `get_audio_features` call at true size (random
weights, bfloat16, the library's own encoder and SDPA) on a clip of S seconds, timed and profiled.

Issue 31 measured 60-180 ms of encoder time a turn for one 5 s clip on an H200 (Qwen3-Omni and
Qwen2.5-Omni-7B alike) where the arithmetic is a few milliseconds. This prints, as JSON lines: the
wall time of a call (median of 10, synchronised), the same with cuDNN off and with the window indices
made on the host (`compat.audio_plan`, checked equal), as a CUDA graph (runtime/audio_graphs.py: time,
error against the library's call, the capture's time a graph), and the profile of the library's call: its top host
and device ops and its synchronising calls. It builds the audio tower only, not the thinker.

    python scripts/encoder_profile.py qwen3-omni-30b-a3b [--seconds 5]
    python scripts/encoder_profile.py qwen2.5-omni-7b
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _tower(preset: str, device: str):
    """(the audio tower at true size on `device`, the family's presets)."""
    if preset.startswith("qwen3"):
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

        from omni_cli.models.qwen3_omni import presets
        encoder = m.Qwen3OmniMoeAudioEncoder
    else:
        from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as m

        from omni_cli.models.qwen2_5_omni import presets
        encoder = m.Qwen2_5OmniAudioEncoder
    config = presets.build_config(preset).thinker_config.audio_config
    config._attn_implementation = "sdpa"
    with torch.device(device):
        tower = encoder(config).to(torch.bfloat16).eval()
    return tower, presets


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(call, n: int = 10) -> float:
    times = []
    for _ in range(n):
        _sync()
        t = time.perf_counter()
        call()
        _sync()
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("preset")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    from omni_cli.faces.bench_turns import clip

    tower, presets = _tower(args.preset, args.device)
    media, counts = presets.spoken_inputs([clip(args.seconds, 0)])
    features = media["input_features"].to(args.device, torch.bfloat16)
    mask = media["feature_attention_mask"].to(args.device)
    qwen25 = not args.preset.startswith("qwen3")

    from omni_cli.runtime import compat

    host_mask = media["feature_attention_mask"]

    def call(planned: bool = False):  # what the thinkers' `get_audio_features` does (transformers 5.17)
        with torch.inference_mode():
            plan = compat.audio_plan(tower, host_mask.sum(-1), args.device) if planned else {}
            lens = mask.sum(1)
            x = features.permute(0, 2, 1)[mask.bool()].permute(1, 0)
            extra = {"aftercnn_lens": tower._get_feat_extract_output_lengths(lens)[0]} if qwen25 else {}
            return tower(x, feature_lens=lens, **extra, **plan).last_hidden_state

    for _ in range(3):
        call()
    out = {"preset": args.preset, "seconds": args.seconds, "placeholders": counts[0], "frames": int(mask.sum()),
           "call_ms": _timed(call)}
    torch.backends.cudnn.enabled = False
    out["call_ms_no_cudnn"] = _timed(call)
    torch.backends.cudnn.enabled = True
    out["call_ms_planned"] = _timed(lambda: call(True))  # compat.audio_plan: the indices made on the host
    out["planned_equal"] = bool(torch.equal(call(), call(True)))
    # The tower as a CUDA graph for this clip's chunk count (runtime/audio_graphs.py), its host work included
    from omni_cli.runtime import audio_graphs

    t = time.perf_counter()
    graphs = audio_graphs.TowerGraphs.made_for(tower) if args.device == "cuda" else None
    made = graphs.capture_ahead(most=audio_graphs.WARM_CHUNKS) if graphs else 0
    out["graphs"], out["graph_capture_ms_each"] = made, 1000 * (time.perf_counter() - t) / max(1, made)

    def replayed():
        with torch.inference_mode():
            replay = audio_graphs.replay_call(tower, features, host_mask)
            return replay() if replay else None

    if replayed() is not None:
        out["call_ms_graph"] = _timed(replayed)
        lib = call(True).float()
        out["graph_rel_err"] = ((replayed().float() - lib).abs().max() / lib.abs().max()).item()
    print(json.dumps(out), flush=True)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call(True)
        _sync()
    rows = prof.key_averages()
    host = sorted(rows, key=lambda r: r.self_cpu_time_total, reverse=True)[:15]
    device = sorted(rows, key=lambda r: getattr(r, "self_device_time_total", 0), reverse=True)[:10]
    syncs = [r for r in rows if "Synchronize" in r.key or "Memcpy" in r.key or r.key in ("aten::item", "aten::_local_scalar_dense")]
    print(json.dumps({"host_top": [(r.key, r.count, round(r.self_cpu_time_total / 1000, 2)) for r in host]}), flush=True)
    print(json.dumps({"device_top": [(r.key[:80], r.count, round(getattr(r, "self_device_time_total", 0) / 1000, 2))
                                     for r in device]}), flush=True)
    print(json.dumps({"syncs": [(r.key, r.count, round(r.self_cpu_time_total / 1000, 2)) for r in syncs]}), flush=True)
    total = sum(r.self_cpu_time_total for r in rows if r.key.startswith("cuda")) / 1000
    print(json.dumps({"cuda_runtime_ms": round(total, 2), "launches": sum(r.count for r in rows if r.key == "cudaLaunchKernel")}))


if __name__ == "__main__":
    main()
