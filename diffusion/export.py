"""Share a DiT the Hugging Face way: a ``save_pretrained`` folder, or a diffusers pipeline folder.

    # any topology: config.json (the model's description) + diffusion_pytorch_model.safetensors; DiTModel.from_pretrained
    python -m diffusion.export --checkpoint runs/dit_b2_siamese/ema.safetensors --out dit_b2_siamese --format hub
    # a diffusers pipeline (model_index.json, transformer/, scheduler/, vae/ and its own code), loaded anywhere with
    # DiffusionPipeline.from_pretrained(DIR, trust_remote_code=True); a Pre-Norm DiT becomes diffusers' own
    # DiTTransformer2DModel
    python -m diffusion.export --checkpoint runs/dit_b2_pre/ema.safetensors --out dit_b2_pre --format diffusers
    # and upload it (needs network access and `hf auth login`)
    python -m diffusion.export --checkpoint ... --out DIR --format hub --push-to-hub user/dit_b2_siamese

Checkpoints are read as ``diffusion.sample`` reads them (the same ``--model``/``--image-size``/``--vae`` overrides for
plain state dicts). The diffusers format carries the VAE the model decodes with (checked against the one its latents
were encoded with); pixel-space models have none, and a model trained with SiT's transport (flow matching) exports as
``--format hub`` only. A file of a ``diffusion.train`` run that has not finished is refused unless
``--allow-unfinished`` (the summary records the run's step). What the folders hold and how to load them:
docs/models.md.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

from common.cli import ArgumentParser, one_line_errors
from diffusion.sampling.decoder import Decoder
from diffusion.sampling.options import SamplingError

FORMATS = ("hub", "diffusers")


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m diffusion.export", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="ema.safetensors / step_*.pt of diffusion.train, or a state dict")
    p.add_argument("--out", required=True, type=Path, help="folder to write")
    p.add_argument("--format", choices=FORMATS, default="hub",
                   help="hub: DiTModel.save_pretrained (any topology; loads where this project is installed); "
                        "diffusers: a DiTSamplingPipeline folder with its code, which loads without this project "
                        "(DiffusionPipeline.from_pretrained(DIR, trust_remote_code=True))")
    p.add_argument("--weights", default=None, help="entry of a training checkpoint to export (default: ema)")
    p.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="also upload the folder to this Hub repository")
    p.add_argument("--allow-unfinished", action="store_true",
                   help="export a checkpoint of a run that has not finished (its ema.safetensors is the EMA of its "
                        "newest checkpoint); refused otherwise")
    m = p.add_argument_group("model (override what the checkpoint says; needed for plain state dicts)")
    m.add_argument("--model", default=None, help="a DiT of diffusion.models.DiT_models: DiT-{S,B,L,XL}/{2,4,8}, "
                                                 "LightningDiT-{B,L,XL,1p0B,1p6B}/{1,2}, e.g. DiT-XL/2")
    m.add_argument("--image-size", type=int, default=None,
                   help="image size in pixels (latents: divided by the VAE's downsampling, 2^(blocks - 1): 8 for the "
                        "SD VAE, 16 for LightningDiT's VA-VAE); without it the weights' position table gives the size")
    m.add_argument("--num-classes", type=int, default=None)
    m.add_argument("--vae", default=None, help="AutoencoderKL directory or cached HF id; 'none' for pixel space")
    p.add_argument("--quiet", action="store_true", help="no JSON summary on stdout")
    return p.parse_args(argv)


def checkpoint_run(checkpoint: Path) -> Optional[Path]:
    """The training run a checkpoint file belongs to: its folder (``ema.safetensors``, ``model.safetensors``) or the
    one above (``checkpoints/step_*.pt``), where that holds the run's ``config.yaml``; None elsewhere."""
    for folder in (checkpoint.parent, checkpoint.parent.parent):
        if checkpoint.is_file() and (folder / "config.yaml").is_file() and (folder / "checkpoints").is_dir():
            return folder
    return None


def export(args) -> dict:
    from common.checkpoint import upload_to_hub
    from common.trainer import run_state, unfinished_run_error
    from diffusion.checkpoints import load_dit  # timm: once the command line is checked

    run = checkpoint_run(Path(args.checkpoint))
    state = run_state(run) if run is not None else None
    if state is not None and not state["finished"] and not args.allow_unfinished:
        raise unfinished_run_error(run, state, "diffusion.train", f"its {Path(args.checkpoint).name} as it is")
    if args.out.exists() and any(args.out.iterdir()):
        raise SamplingError(f"--out {args.out} is not empty; export into a new folder")
    overrides = {"name": args.model, "image_size": args.image_size, "num_classes": args.num_classes,
                 "autoencoder": args.vae}
    model, spec, weights = load_dit(args.checkpoint, overrides, args.weights)
    if args.format == "hub":
        from diffusion.hub import DiTModel

        shared = DiTModel.from_dit(model, spec)
    else:
        from diffusion.pipeline import DiTSamplingPipeline

        vae = Decoder(spec.autoencoder, "cpu", expect=vars(spec)).vae  # the VAE the latents were made with
        shared = DiTSamplingPipeline.from_dit(model, spec, vae)
    shared.save_pretrained(args.out)
    result = {"out": str(args.out), "format": args.format, "checkpoint": str(args.checkpoint), "weights": weights,
              "model": spec.name, "topology": spec.topology}
    if state is not None:  # a run's file: how far the run got
        step = state["newest"] if state["newest"] is not None else (state["final"] or {}).get("steps")
        result.update(run=str(run), finished=state["finished"], step=step, total_steps=state["total_steps"])
    if args.push_to_hub:
        upload_to_hub(lambda: shared.push_to_hub(args.push_to_hub), args.push_to_hub, args.out)
        result["pushed_to"] = args.push_to_hub
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    with one_line_errors(SamplingError):
        result = export(args)
    if not args.quiet:
        print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
