"""The faces: what a person uses — omni-say (say.py), omni-chat (chat/), omni-serve (serve.py) and
omni-bench (bench.py) — and what they share: the flags (options.py), the one connect step (connect.py),
the program around a command (program.py), the terminal (console.py, timing.py) and the prompt's inputs
(inputs.py).

A face maps flags onto the frozen options objects and uses an assistant through `omni_cli.interface`;
it holds no model logic and imports no torch at import time (`--help` is instant).
"""
