"""The paper's diagnostics (common/diagnostics.py) of finished DeiT and DiT runs, written as JSON + PNG per diagnostic.

    python -m scripts.diagnose --run runs/fmnist_deit_pre runs/fmnist_deit_siamese --out runs/diagnostics --images 1000
    python -m scripts.diagnose --run runs/fmnist_dit_pre runs/fmnist_dit_siamese --out runs/dit_diagnostics --images 256

A ``vision.train`` run: the model and data come from its ``config.yaml``, the weights from ``model.safetensors`` (or
``--weights ema.safetensors``); the held-out loss is :func:`vision.evaluate.evaluate` on the first ``--images``
validation images. A ``diffusion.train`` run on Fashion-MNIST pixels: its ``ema.safetensors``; the held-out loss is
the diffusion loss at fixed ``t`` and noise on the first ``--images`` test images.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict


def main(argv=None) -> Dict[str, dict]:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.diagnose", description=__doc__.split("\n\n")[0],
        epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, nargs="+", help="vision.train or diffusion.train run directories "
                        "(labels = their names)")
    parser.add_argument("--out", required=True, help="directory for <diagnostic>.json and <diagnostic>.png")
    parser.add_argument("--images", type=int, default=1000, help="held-out images used (default 1000; 0 = all)")
    parser.add_argument("--weights", default="model.safetensors", help="weights file inside each run (or ema.safetensors)")
    args = parser.parse_args(argv)
    print(f"diagnose: loading the libraries for {len(args.run)} run(s)", flush=True)
    from comparison.diagnose import diagnose_deit_run, diagnose_dit_run, is_dit_run  # torch, timm: after the parse
    from common.diagnostics import write_diagnostic

    per_kind: Dict[str, dict] = {}
    for number, run in enumerate(args.run, 1):
        what = "EMA DiT, diffusion loss" if is_dit_run(run) else f"{args.weights}, held-out loss"
        print(f"diagnosing {run} ({number} of {len(args.run)}; {what} on {args.images or 'all'} images): stream "
              "norms, layer removal (one evaluation per block), stream contribution, gradient norms", flush=True)
        try:
            found = (diagnose_dit_run(run, args.images or None) if is_dit_run(run) else
                     diagnose_deit_run(run, args.images or None, weights=args.weights))
        except FileNotFoundError as err:
            parser.exit(2, f"error: {err}\n")
        for kind, result in found.items():
            per_kind.setdefault(kind, {})[Path(run).name] = result
    for kind, results in per_kind.items():
        print(f"wrote {write_diagnostic(kind, results, args.out)}")
    return per_kind


if __name__ == "__main__":
    main(sys.argv[1:])
