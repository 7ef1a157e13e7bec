"""Regenerate the built-in tiny random-weight Qwen2.5-Omni checkpoint.

Usage: python scripts/make_tiny_model.py [OUT_DIR]   (default: assets/tiny-qwen2.5-omni)

The output is deterministic; tests/test_tiny_assets.py checks that the committed folder equals it.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from omni_dev.tiny_qwen2_5 import folder_size, save_checkpoint  # noqa: E402

DEFAULT_OUT = ROOT / "assets" / "tiny-qwen2.5-omni"


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0] in ("-h", "--help")):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    out = Path(argv[0]) if argv else DEFAULT_OUT
    save_checkpoint(out)
    print(f"wrote {out} ({folder_size(out) / 1e6:.2f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
