"""Quantized weights (issue 30): what a packed weight is (`formats`), what a checkpoint's
`quantization_config` says (`detect`), and a linear layer over a packed weight (`linear`, whose decode
path calls runtime.quant_kernels). Foundations only: nothing in the engine uses them yet, and no kernel
lives here (the kernels are tested against `formats.dequantize`)."""
