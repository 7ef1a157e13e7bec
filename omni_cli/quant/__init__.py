"""Quantized weights (issue 30): what a packed weight is (`formats`) and what a checkpoint's
`quantization_config` says (`detect`). Foundations only: nothing in the engine uses them yet, and no
kernel lives here (the kernels will be tested against `formats.dequantize`)."""
