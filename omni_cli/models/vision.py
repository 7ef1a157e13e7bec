"""The image processor both families' thinkers take their images from (Qwen-VL's: 14- or 16-pixel
patches over 2 frames, merged 2x2 into one token): loading it as transformers picks it, and the inputs and
token counts it makes. No torch at import.

Each family's package re-exports these (Qwen3-Omni with its vision config's patch sizes); it knows no
model and no prompt.
"""

from __future__ import annotations

from pathlib import Path


def image_processor(path: Path):
    """The checkpoint's image processor as transformers picks it (its fast one needs torchvision; without
    it, the Pillow one, which the library falls back to as well; so too when the folder's configs name no
    image processor, as the built-in tiny Qwen3-Omni's do under transformers 5.24)."""
    from transformers import AutoImageProcessor

    from .weights import quiet_transformers

    with quiet_transformers():
        try:
            return AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
        except (ImportError, ValueError):  # no torchvision; or a config that names no image processor
            from transformers import Qwen2VLImageProcessorPil

            return Qwen2VLImageProcessorPil.from_pretrained(str(path), local_files_only=True)


def image_inputs(image_processor, images) -> tuple[dict, list[int]]:
    """The vision encoder's inputs for `images` (RGB PIL images) as the processor makes them (patches and
    each image's grid), and how many image tokens each becomes (its grid's patches merged 2x2)."""
    out = image_processor(images=images, return_tensors="pt")
    grid = out["image_grid_thw"]
    counts = (grid.prod(-1) // image_processor.merge_size**2).tolist()
    return {"pixel_values": out["pixel_values"], "image_grid_thw": grid}, counts
