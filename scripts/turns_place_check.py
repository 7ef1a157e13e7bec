"""`omni-bench --turns ...` with every audio or image placement checked first (a host sync, so its times are
not the bench's): the placeholders the host counted, the device ids' count, the encoder's rows, and which
positions of the prompt's rest differ between the device's ids and the host's (for kept turns; a whole
conversation's turns compare against the last kept prompt, so their differences mean nothing).

Written to chase a device-side assert in the placeholders' scatter (docs/benchmarks.md, nineteenth and
twentieth passes). Usage, arguments as omni-bench's:
    python scripts/turns_place_check.py --preset qwen2.5-omni-7b --turns 10 --audio-seconds 5 \
        --text-tokens 64 --codes 250 --no-compile --json > turns.json 2> turns.log
Each placement is a "[diag] place" line in the log."""
import runpy
import sys

from omni_cli.runtime import context, encoders

orig_reuse = context.KeptContext.reuse
orig_place = encoders.place
seen = {"ids": None, "start": 0, "n": 0}


def reuse(self, ids, media):
    r = orig_reuse(self, ids, media)
    seen.update(ids=list(ids), start=r.start)
    return r


def place(embeds, input_ids, token, features, places):
    seen["n"] += 1
    if input_ids.is_cuda:
        dev = input_ids[0].tolist()
        host = (seen["ids"] or [])[seen["start"]:]
        count = sum(1 for t in dev if t == token)
        diff = [(i, h, d) for i, (h, d) in enumerate(zip(host, dev)) if h != d]
        print(f"[diag] place #{seen['n']}: places={places} device count={count} rows={features.shape[0]} "
              f"len host={len(host)} device={len(dev)} differing={len(diff)} {diff[:12]}", file=sys.stderr, flush=True)
    return orig_place(embeds, input_ids, token, features, places)


context.KeptContext.reuse = reuse
encoders.place = place
sys.argv = ["omni-bench"] + sys.argv[1:]
runpy.run_module("omni_cli.faces.bench", run_name="__main__")
