"""Imports beside the weights read ahead (omni_cli/prefetch.py), measured without a model: the read ahead
of FOLDER's weight files starts, torch and transformers' Qwen2.5-Omni are imported, then every file is read
as a loader would read it; prints the imports' and the reads' seconds. Run it with the page cache dropped,
with an empty bytecode folder (a fresh machine), with OMNI_NO_PREFETCH=1 and without:

    sync; echo 3 > /proc/sys/vm/drop_caches; rm -rf /tmp/pc; PYTHONDONTWRITEBYTECODE=1 \\
        python -X pycache_prefix=/tmp/pc scripts/prefetch_overlap.py FOLDER
"""

import sys
import time

t0 = time.perf_counter()
from omni_cli import prefetch  # noqa: E402
from omni_cli.early_weights import weight_files  # noqa: E402
from pathlib import Path  # noqa: E402

folder = Path(sys.argv[1])
ahead = prefetch.start(folder)
import torch  # noqa: E402, F401
from transformers import Qwen2_5OmniForConditionalGeneration  # noqa: E402, F401

t1 = time.perf_counter()
buffer = bytearray(16 << 20)
for path in weight_files(folder) or []:
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
t2 = time.perf_counter()
print(f"read ahead: {'on' if ahead else 'off'}; imports {t1 - t0:.2f} s, reads after them {t2 - t1:.2f} s, "
      f"in all {t2 - t0:.2f} s")
