"""What the first image pays now that the vision encoder waits in host memory (runtime/vision_place.py):
a preset's true-size tower built in host memory (random weights, bfloat16) and moved to the GPU by
`vision_place.bring`, as the first image's turn moves it; timed synchronised, wall clock. Prints one JSON
object. (`--device meta` checks the path on a machine without a GPU; its time means nothing.)

    python scripts/vision_bring.py [--preset qwen2.5-omni-7b|qwen3-omni-30b-a3b] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def tower_of(preset: str):
    """The preset's vision tower, built in host memory in bfloat16 (its class and config found on a meta probe)."""
    from omni_cli.models.weights import quiet_transformers
    from omni_cli.runtime import vision_place

    with quiet_transformers():
        if preset.startswith("qwen3"):
            from transformers import Qwen3OmniMoeForConditionalGeneration as cls

            from omni_cli.models.qwen3_omni.presets import build_config
        else:
            from transformers import Qwen2_5OmniForConditionalGeneration as cls

            from omni_cli.models.qwen2_5_omni.presets import build_config
        with torch.device("meta"):
            probe = cls._from_config(build_config(preset), dtype=torch.bfloat16)
        meta_tower = vision_place.tower(probe)
        return type(meta_tower)._from_config(meta_tower.config, dtype=torch.bfloat16).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-omni-7b", choices=["qwen2.5-omni-7b", "qwen3-omni-30b-a3b"])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    from omni_cli.runtime import vision_place

    class Thinker(torch.nn.Module):  # where `bring` looks for the tower: a thinker's `.visual`
        def __init__(self, tower) -> None:
            super().__init__()
            self.visual = tower

    thinker, dev = Thinker(tower_of(args.preset)), torch.device(args.device)
    size = sum(p.numel() * p.element_size() for p in thinker.visual.parameters())
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    vision_place.bring(thinker, dev)
    sync()
    seconds = time.perf_counter() - t
    assert all(p.device.type == dev.type for p in thinker.visual.parameters())
    print(json.dumps({"preset": args.preset, "tower_bytes": size, "bring_ms": round(1000 * seconds, 1),
                      "gb_per_s": round(size / seconds / 1e9, 2),
                      "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)}))


if __name__ == "__main__":
    main()
