"""Runs a script of facebookresearch/DiT or of a fork with its layout (chuanyangjin/fast-DiT), unmodified, without
downloads, on a CPU as well as a GPU (benchmarks.vs_peers' peers).

    python benchmarks/dit_shim.py REPO VAE_DIR SCRIPT DEVICE -- [the script's arguments]

``SCRIPT``: ``sample.py`` (DiT's sampler) or ``train.py`` (fast-DiT's trainer, on latents); ``DEVICE``: ``cpu`` or
``cuda``. What it changes, and nothing else:

1. ``REPO`` goes first on ``sys.path`` (the scripts import their repository's ``diffusion``, ``models`` and
   ``download`` as top-level modules, as when run from there);
2. ``diffusers.models.AutoencoderKL.from_pretrained("stabilityai/sd-vae-ft-{ema,mse}")`` loads ``VAE_DIR`` (an
   AutoencoderKL folder) instead of the Hub's weights; any other name loads as it would;
3. on ``cpu`` only: ``torch.cuda.is_available`` answers False (sample.py's ``device = "cuda" if ... else "cpu"``
   picks the CPU; accelerate and the DataLoader see no GPU), except to train.py's own opening
   ``assert torch.cuda.is_available()`` in its ``main``, which it answers True; ``torch.cuda.synchronize``, which
   train.py calls before each log line, does nothing (a CPU's work is done when the call returns).

The DiT weights need no change: sample.py's ``--ckpt`` reads a local state dict (its ``find_model``). The file is
run with :func:`runpy.run_path` as ``__main__`` with ``sys.argv`` set to its own arguments. This file imports nothing
of this project (its ``diffusion`` package would shadow DiT's); run it by path, not with ``-m``.
"""
import runpy
import sys
from pathlib import Path

SD_VAE_NAMES = ("stabilityai/sd-vae-ft-ema", "stabilityai/sd-vae-ft-mse")
SCRIPTS = ("sample.py", "train.py")


def main(argv):
    if len(argv) < 5 or argv[4] != "--" or argv[2] not in SCRIPTS or argv[3] not in ("cpu", "cuda"):
        sys.exit("usage: python benchmarks/dit_shim.py REPO VAE_DIR {sample.py,train.py} {cpu,cuda} -- [its arguments]")
    repo, vae_dir, script, device = Path(argv[0]).resolve(), str(Path(argv[1]).resolve()), argv[2], argv[3]
    sys.path.insert(0, str(repo))

    import torch
    from diffusers.models import AutoencoderKL

    load = AutoencoderKL.from_pretrained  # bound to the class

    def from_local(cls, name, *args, **kwargs):
        return load(vae_dir if str(name) in SD_VAE_NAMES else name, *args, **kwargs)

    AutoencoderKL.from_pretrained = classmethod(from_local)
    path = repo / script
    if device == "cpu":
        def is_available():
            caller = sys._getframe(1).f_code
            return script == "train.py" and caller.co_name == "main" and Path(caller.co_filename).resolve() == path

        torch.cuda.is_available = is_available
        torch.cuda.synchronize = lambda device=None: None
    sys.argv = [str(path), *argv[5:]]
    runpy.run_path(str(path), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
