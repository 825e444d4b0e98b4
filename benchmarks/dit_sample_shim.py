"""Runs facebookresearch/DiT's ``sample.py``, unmodified, on a CPU without downloads (benchmarks.vs_peers' peer).

    python benchmarks/dit_sample_shim.py DIT_REPO VAE_DIR -- [sample.py's arguments]

What it changes, and nothing else:

1. ``DIT_REPO`` goes first on ``sys.path`` (sample.py imports its repository's ``diffusion``, ``models`` and
   ``download`` as top-level modules, as when it is run from there);
2. ``torch.cuda.is_available`` returns False, so sample.py's ``device = "cuda" if ... else "cpu"`` picks the CPU;
3. ``diffusers.models.AutoencoderKL.from_pretrained("stabilityai/sd-vae-ft-{ema,mse}")`` loads ``VAE_DIR`` (an
   AutoencoderKL folder) instead of the Hub's weights; any other name loads as it would.

The DiT weights need no change: sample.py's ``--ckpt`` reads a local state dict (its ``find_model``). The file is
run with :func:`runpy.run_path` as ``__main__`` with ``sys.argv`` set to its own arguments. This file imports nothing
of this project (its ``diffusion`` package would shadow DiT's); run it by path, not with ``-m``.
"""
import runpy
import sys
from pathlib import Path

SD_VAE_NAMES = ("stabilityai/sd-vae-ft-ema", "stabilityai/sd-vae-ft-mse")


def main(argv):
    if len(argv) < 3 or argv[2] != "--":
        sys.exit("usage: python benchmarks/dit_sample_shim.py DIT_REPO VAE_DIR -- [sample.py's arguments]")
    repo, vae_dir, script_args = Path(argv[0]).resolve(), str(Path(argv[1]).resolve()), argv[3:]
    sys.path.insert(0, str(repo))

    import torch
    from diffusers.models import AutoencoderKL

    torch.cuda.is_available = lambda: False
    load = AutoencoderKL.from_pretrained  # bound to the class

    def from_local(cls, name, *args, **kwargs):
        return load(vae_dir if str(name) in SD_VAE_NAMES else name, *args, **kwargs)

    AutoencoderKL.from_pretrained = classmethod(from_local)
    script = repo / "sample.py"
    sys.argv = [str(script), *script_args]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
