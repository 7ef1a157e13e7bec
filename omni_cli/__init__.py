"""omni_cli: talk to a local Qwen-Omni model in the terminal, in text and streamed speech.

`omni_cli.load(...)` returns an `Assistant`; its `say()` gives a `Reply` (text, token ids, codec codes,
audio, stats) and `stream()` yields events as they happen. torch and transformers are imported only
when a model is loaded, so importing this package (and `--help`) is instant.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["load", "__version__"]


def load(model: str | None = None, device: str = "auto", dtype: str = "auto", runtime=None, progress=None):
    """Load a Qwen2.5-Omni or Qwen3-Omni checkpoint (folder, hub id, or None for $OMNI_MODEL / the built-in tiny
    Qwen2.5-Omni model; the family is read from its config.json).

    `runtime`: an `omni_cli.config.RuntimeOptions` (graphs on/off, compile, kernels, cache sizes), taken as
    it is; its device and dtype win over the two arguments. Without it: `device`, `dtype` and the
    environment's switches (`RuntimeOptions.from_env`: OMNI_NO_GRAPHS=1, ...). The assistant's `runtime`
    is then the options as built (device "cuda:0", dtype "bfloat16", graphs as they really are).
    `progress(done, total)`: called after each decoder layer packed (`runtime.quantize`).
    """
    from .assistant import Assistant

    return Assistant.load(model, device=device, dtype=dtype, runtime=runtime, progress=progress)
