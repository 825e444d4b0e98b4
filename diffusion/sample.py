"""Sample a class-conditional DiT: a PNG grid to look at, or N images for FID, on one or many processes.

    # a grid of chosen classes (EMA weights of a run of diffusion.train)
    python -m diffusion.sample --checkpoint runs/dit_b2_siamese/ema.safetensors --grid grid.png --labels 207,360,387,974

    # FID-50K samples: 250 respaced DDPM steps, exactly 50,000 images, 50 per class, on 8 GPUs
    accelerate launch --num_processes 8 -m diffusion.sample --checkpoint runs/dit_b2_siamese/ema.safetensors \\
        --num-samples 50000 --out-dir samples/dit_b2_siamese
    python -m diffusion.fid --samples samples/dit_b2_siamese/samples.npz --reference VIRTUAL_imagenet256_labeled.npz

    # the official DiT-XL/2 weights (no metadata inside: say which model), cfg 1.5 on the first 3 latent channels
    python -m diffusion.sample --checkpoint DiT-XL-2-256x256.pt --model DiT-XL/2 --image-size 256 \\
        --cfg-scale 1.5 --num-samples 50000 --out-dir samples/dit_xl2_cfg1.5

Checkpoints: ``.safetensors`` written by diffusion.train (the model, its diffusion schedule and class names are
rebuilt from the metadata inside), training checkpoints ``step_*.pt`` (EMA weights unless ``--weights model``), a
folder of ``python -m diffusion.export --format hub``, or plain state dicts such as the official DiT ones (then
``--model`` is needed; the latents' channels and size are read off the weights; they sample with DiT's schedule).
The VAE (``--vae``) defaults to the one the model was trained with; ``--vae none`` for pixel-space models.

A model trained with SiT's transport (``transport.enabled``, or SiT's own checkpoints: ``--model SiT-XL/2``) is
sampled by SiT's samplers: ``--sampler sde-euler`` (the default, SiT's FID setting: ``--steps 250``, diffusion
``sigma``, last step ``mean`` of size 0.04), ``sde-heun``, or the ODE with ``euler``, ``heun`` or ``dopri5``
(torchdiffeq, ``--atol``/``--rtol``); ``--steps`` is SiT's ``num_steps``, the points of the time grid.
``--guidance-interval 0.3,1`` guides only at those times (t = 1 is data: REPA's ``--guidance-high 0.7``),
``--timestep-shift 0.3`` warps an ODE's grid (LightningDiT). The protocol records the grid and every option.

    python -m diffusion.sample --checkpoint SiT-XL-2-256x256.pt --model SiT-XL/2 --image-size 256 --cfg-scale 1.5 \\
        --num-samples 50000 --out-dir samples/sit_xl2_cfg1.5

DDPM timesteps follow ADM's respacing conventions: ``--sampler ddpm`` keeps ``--steps`` evenly spaced steps (ADM's
"250": 0, 4, 8, ..., 999), ``--sampler ddim`` strides from 0 (ADM's and DiT's "ddim50": 0, 20, ..., 980; step counts
that no integer stride gives are refused). ``--spacing even|ddim`` picks the other rule explicitly. The exact
steps are recorded in the sampling protocol.

Sample ``i`` (0 <= i < N) has class ``i % num_classes`` and its own noise stream, seeded by ``(--seed, i)``:
the set is the same for any number of processes. Work is split in chunks of ``--batch-size`` samples, written
to ``OUT/chunks/`` as they finish; a rerun with the same options skips finished chunks (resume after a crash
or a time limit). ``OUT/settings.json`` records the options and a SHA-256 fingerprint of the sampled weights'
content: a rerun whose checkpoint holds other weights (e.g. a training run refreshed ``ema.safetensors`` in
between) is refused, so a sample set never mixes two models. Every file is written atomically and fsynced.
Outputs: ``OUT/samples.npz`` (ADM format: ``arr_0`` uint8 [N, H, W, C], ``arr_1`` labels, and the sampling
protocol as JSON, which diffusion.fid records), ``OUT/images/*.png`` with ``--format png|both``.
Chunk files must be on a file system all processes share. The sampler itself is :mod:`diffusion.sampling`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import torch

from common.checkpoint import weights_fingerprint
from common.cli import ArgumentParser, one_line_errors
from common.config import did_you_mean
from common.distributed import cuda_available, use_fast_cuda_kernels
from common.preemption import command_stop_signals, exit_when_stopped
from common.topologies import topology_names
from diffusion.gaussian_diffusion import SPACINGS
from diffusion.latents import read_latent_stats
from diffusion.sampling.decoder import Decoder
from diffusion.sampling.grids import class_names, write_grid
from diffusion.sampling.guidance import resolve_guided_channels
from diffusion.sampling.options import PRECISIONS, SAMPLERS, TRANSPORT_SAMPLERS, SamplingError
from diffusion.sampling.sample_sets import write_sample_set
from diffusion.sampling.sampler import Sampler, sampling_objective
from diffusion.transport import DIFFUSION_FORMS, LAST_STEPS, PATHS, PREDICTIONS, Transport

# diffusion.models imports timm: it is imported once the command line is checked (a --model or --topology is
# checked against it before any weights load).
DIT_SAMPLE_LABELS = (207, 360, 387, 974, 88, 979, 417, 279)  # the official DiT sample.py classes


def parse_labels(text: str) -> list:
    """``--labels 207,360`` -> ``[207, 360]``; anything else is refused with the expected form."""
    try:
        labels = [int(v) for v in text.split(",")]
    except ValueError:
        raise SamplingError(f"--labels {text!r}: class numbers separated by commas, e.g. --labels 207,360,387") from None
    if not labels:
        raise SamplingError("--labels is empty: give class numbers separated by commas, e.g. --labels 207,360,387")
    return labels


def check_labels(labels, num_classes: int) -> None:
    bad = [v for v in labels if not 0 <= v < num_classes]
    if bad:
        raise SamplingError(f"--labels {bad} are outside [0, {num_classes}) for this model")


def recorded_num_classes(args) -> Optional[int]:
    """The class count of the model to sample, from the command line or what the checkpoint records in its header
    or config file (no weights are read); None where only loading it tells (a .pt file)."""
    if args.num_classes is not None:
        return args.num_classes
    path = Path(args.checkpoint)
    try:
        if path.is_dir():
            value = json.loads((path / "config.json").read_text()).get("num_classes")
        elif path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                value = (f.metadata() or {}).get("num_classes")
        else:
            return None
    except Exception:  # noqa: BLE001 -- a missing or damaged file: the loader reports it, with its fix
        return None
    return int(value) if value is not None else None


def run_grid(args, sampler: Sampler) -> dict:
    num_classes = sampler.spec.num_classes
    if args.labels:
        labels = parse_labels(args.labels)
    else:
        labels = list(DIT_SAMPLE_LABELS) if num_classes == 1000 else list(range(num_classes))
    check_labels(labels, num_classes)
    images = torch.cat([sampler(torch.arange(i, min(i + args.batch_size, len(labels))),
                                torch.tensor(labels[i: i + args.batch_size]))
                        for i in range(0, len(labels), args.batch_size)])
    names = class_names(num_classes, pixel=sampler.spec.autoencoder == "none", names=sampler.spec.class_names)
    path = write_grid(images, labels, args.grid, names, nrow=args.nrow)
    return {"grid": str(path), "labels": labels}


def run_num_samples(args, sampler: Sampler, state) -> Optional[dict]:
    """Samples ``0..N-1`` into ``--out-dir``, resumable (:func:`diffusion.sampling.sample_sets.write_sample_set`)."""
    settings = {"checkpoint": str(args.checkpoint), "weights": args.weights_used, "weights_sha256": args.weights_sha256,
                "steps": args.steps, "spacing": args.spacing, **sampler.settings(), "num_samples": args.num_samples,
                "batch_size": args.batch_size}
    formats = {"npz": ("npz",), "png": ("png",), "both": ("npz", "png")}[args.format]
    return write_sample_set(sampler, args.out_dir, args.num_samples, args.batch_size, settings, state, formats,
                            progress=not args.quiet, stop_signals=args.stop_signals)


# ------------------------------------------------------------------------------------------- CLI

def parse_args(argv=None):
    p = ArgumentParser(prog="python -m diffusion.sample", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="ema.safetensors / step_*.pt of diffusion.train, or a state dict")
    p.add_argument("--weights", default=None, help="entry of a training checkpoint to sample (default: ema)")
    out = p.add_argument_group("output (one of)")
    out.add_argument("--grid", default=None, help="write a PNG grid here (one sample per --labels entry)")
    out.add_argument("--num-samples", type=int, default=None, help="generate exactly N samples into --out-dir")
    out.add_argument("--labels", default=None, help="grid classes, comma-separated (default: DiT's 8, or all classes)")
    out.add_argument("--nrow", type=int, default=None, help="grid images per row")
    out.add_argument("--out-dir", default=None, help="--num-samples output directory (chunks, samples.npz, images/)")
    out.add_argument("--format", choices=("npz", "png", "both"), default="npz",
                     help="samples.npz (ADM format, for diffusion.fid), a PNG folder, or both")
    s = p.add_argument_group("sampling")
    s.add_argument("--sampler", choices=SAMPLERS + TRANSPORT_SAMPLERS, default=None,
                   help="DDPM models: ddpm (default; ancestral, learned variance, DiT's FID setting) or ddim "
                        "(deterministic at --eta 0). Transport models: sde-euler (default, SiT's FID setting), "
                        "sde-heun, or the ODE by euler, heun or dopri5")
    s.add_argument("--steps", type=int, default=250, help="respaced DDPM steps (DiT's FID-50K: 250); transport: the "
                                                          "time grid's points, SiT's num_steps (its FID: 250)")
    s.add_argument("--spacing", choices=SPACINGS, default=None,
                   help="which steps: 'even' (ADM's \"N\": evenly spaced from 0 to T-1; default for ddpm) or 'ddim' "
                        "(ADM's \"ddimN\": stride T/N from 0; default for ddim, counts without an integer stride "
                        "are refused)")
    s.add_argument("--eta", type=float, default=None, help="--sampler ddim's noise (default 0: deterministic)")
    s.add_argument("--cfg-scale", type=float, default=1.0, help="classifier-free guidance scale, >= 0 (1: none; "
                                                                "DiT's and SiT's FID: 1.5)")
    s.add_argument("--guided-channels", default=None, help="output channels guided: a number or 'all' (REPA); "
                                                           "default min(3, channels): DiT's and SiT's official 3 "
                                                           "of 4 latent channels, a 1-channel model's one")
    f = p.add_argument_group("transport models (SiT's sampler options; default: SiT's)")
    f.add_argument("--guidance-interval", default=None, metavar="LOW,HIGH",
                   help="guide only at times LOW <= t <= HIGH (t = 1 is data; default 0,1: always). REPA's "
                        "guidance-high 0.7 is 0.3,1; LightningDiT's cfg_interval_start 0.11 is 0.11,1")
    f.add_argument("--timestep-shift", type=float, default=None,
                   help="ODE only: warp the time grid by s t / (1 + (s - 1) t) (LightningDiT: 0.3; default 0: none)")
    f.add_argument("--atol", type=float, default=None, help="dopri5's absolute tolerance (SiT: 1e-6)")
    f.add_argument("--rtol", type=float, default=None, help="dopri5's relative tolerance (SiT: 1e-3)")
    f.add_argument("--diffusion-form", choices=DIFFUSION_FORMS, default=None,
                   help="SDE: the diffusion coefficient w_t (SiT's sampler: sigma)")
    f.add_argument("--diffusion-norm", type=float, default=None, help="SDE: its scale (SiT: 1)")
    f.add_argument("--last-step", choices=LAST_STEPS, default=None, help="SDE: the step to the data (SiT: mean)")
    f.add_argument("--last-step-size", type=float, default=None, help="SDE: its length in t (SiT: 0.04)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--batch-size", type=int, default=64, help="samples per forward pass and per chunk file")
    s.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="the model's forward: fp32, or bf16 autocast (docs/sampling-and-fid.md: what it does to FID)")
    s.add_argument("--compile", choices=("auto", "yes", "no"), default="auto",
                   help="torch.compile the model and the VAE decoder once (auto: on CUDA, where it pays; the samples "
                        "equal eager's within float rounding)")
    m = p.add_argument_group("model (override what the checkpoint says; needed for plain state dicts)")
    m.add_argument("--model", default=None, help="a DiT of diffusion.models.DiT_models: DiT-{S,B,L,XL}/{2,4,8}, e.g. "
                                                 "DiT-XL/2; SiT-XL/2 etc.: that DiT trained with SiT's transport "
                                                 "(linear path, velocity), as SiT's checkpoints; "
                                                 "LightningDiT-{B,L,XL,1p0B,1p6B}/{1,2}: LightningDiT's own "
                                                 "checkpoints (its backbone, the same transport)")
    m.add_argument("--path", choices=PATHS, default=None, help="a transport model's path (plain SiT checkpoints)")
    m.add_argument("--prediction", choices=PREDICTIONS, default=None, help="a transport model's prediction")
    m.add_argument("--topology", default=None, help=f"one of {', '.join(topology_names('dit'))} (pre: the "
                                                    "published DiT)")
    m.add_argument("--image-size", type=int, default=None,
                   help="image size in pixels (latents: divided by the VAE's downsampling, 2^(blocks - 1): 8 for the "
                        "SD VAE, 16 for LightningDiT's VA-VAE); without it the weights' position table gives the size")
    m.add_argument("--num-classes", type=int, default=None)
    m.add_argument("--vae", default=None, help="AutoencoderKL directory or cached HF id; 'none' for pixel space")
    m.add_argument("--latent-stats", type=Path, default=None, help="the latents' per-channel mean and std the model "
                   "was trained on (LightningDiT's normalisation): LightningDiT's latents_stats.pt or an extraction's "
                   "metadata.json; undone before decoding (LightningDiT's own checkpoints record none)")
    m.add_argument("--latent-multiplier", type=float, default=1.0, help="with --latent-stats: the factor after "
                   "normalising (LightningDiT's VA-VAE recipes: 1.0)")
    p.add_argument("--device", default=None, help="default: this process's accelerator device")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no JSON summary on stdout")
    return p.parse_args(argv)


def check_args(args) -> None:
    if not Path(args.checkpoint).exists():
        raise SamplingError(f"--checkpoint {args.checkpoint} does not exist: pass an ema.safetensors or step_*.pt of "
                            "diffusion.train, a folder of diffusion.export, or a state dict")
    if (args.grid is None) == (args.num_samples is None):
        raise SamplingError("choose one output: --grid PATH.png, or --num-samples N with --out-dir DIR")
    if args.num_samples is not None:
        if args.num_samples < 1:
            raise SamplingError(f"--num-samples {args.num_samples} must be positive")
        if not args.out_dir:
            raise SamplingError("--num-samples needs --out-dir (where chunks and samples.npz go)")
    if args.batch_size < 1 or args.steps < 1:
        raise SamplingError("--batch-size and --steps must be positive")
    if args.guided_channels not in (None, "all") and not args.guided_channels.isdigit():
        raise SamplingError(f"--guided-channels {args.guided_channels!r}: an integer or 'all'")
    if args.cfg_scale < 0:
        raise SamplingError(f"--cfg-scale {args.cfg_scale:g} would reverse the guidance: give a scale >= 0 (1: no "
                            "guidance, above 1: guided, DiT's and SiT's FID use 1.5; 0: the unconditional model)")
    if args.guidance_interval is not None:
        try:
            low, high = (float(v) for v in args.guidance_interval.split(","))
        except ValueError:
            raise SamplingError(f"--guidance-interval {args.guidance_interval!r}: two numbers LOW,HIGH, e.g. 0.3,1") from None
        args.guidance_interval = (low, high)
    if args.labels is not None:
        labels = parse_labels(args.labels)
        num_classes = recorded_num_classes(args)
        if num_classes is not None:
            check_labels(labels, num_classes)  # before any weights load
    args.sit = bool(args.model) and args.model.startswith(("SiT-", "LightningDiT-"))  # trained with SiT's transport
    if args.model and args.model.startswith("SiT-"):  # SiT-XL/2 etc.: the DiT of that size
        args.model = "DiT-" + args.model[len("SiT-"):]
    if args.model is not None or args.topology is not None:
        from diffusion.models import DIT_TOPOLOGIES, DiT_models

        if args.model is not None and args.model not in DiT_models:
            raise SamplingError(f"--model {args.model!r} is not a DiT{did_you_mean(args.model, DiT_models)}; choose one "
                                f"of {', '.join(DiT_models)}")
        if args.topology is not None and args.topology not in DIT_TOPOLOGIES:
            raise SamplingError(f"--topology {args.topology!r}: choose one of {', '.join(DIT_TOPOLOGIES)}")


def flow_options(args) -> dict:
    """The transport sampler options given on the command line (the others keep SiT's defaults)."""
    names = ("guidance_interval", "timestep_shift", "atol", "rtol", "diffusion_form", "diffusion_norm", "last_step",
             "last_step_size")
    return {k: getattr(args, k) for k in names if getattr(args, k) is not None}


def transport_override(args) -> Optional[dict]:
    """The objective a plain state dict does not record: SiT's for ``--model SiT-*`` (the DiT of that size) and
    ``--model LightningDiT-*``, or ``--path``/``--prediction``."""
    if not (args.sit or args.path or args.prediction):
        return None
    return Transport(args.path or "linear", args.prediction or "velocity").description()


def build_objective(args, spec):
    """The model's objective and sampling options; settles ``args.sampler`` and ``args.spacing`` (recorded with the
    set; a transport has no spacing)."""
    objective, sampling = sampling_objective(spec, args.steps, args.sampler, args.spacing, args.eta,
                                             **flow_options(args))
    args.sampler, args.spacing = sampling.sampler, getattr(sampling, "spacing", None)
    return objective, sampling


def main(argv=None) -> Optional[dict]:
    """``argv=None`` reads the process's own command line: a stop signal (SIGTERM, SIGUSR1) then ends a sample set
    after its current round of chunks with exit 4, which a job script requeues on, and the same command continues."""
    args = parse_args(argv)
    args.stop_signals = command_stop_signals(argv)
    with one_line_errors(SamplingError), exit_when_stopped():
        check_args(args)  # before anything heavy is imported or loaded
        from accelerate import PartialState

        from diffusion.checkpoints import load_dit  # timm

        state = PartialState(cpu=not cuda_available())  # cpu=True joins a gloo group under torchrun
        device = args.device or str(state.device)
        use_fast_cuda_kernels()  # TF32 as DiT's sample.py, cudnn's autotuner for the VAE
        transport = transport_override(args)
        latent_norm = read_latent_stats(args.latent_stats, args.latent_multiplier) if args.latent_stats else None
        overrides = {"name": args.model, "topology": args.topology, "image_size": args.image_size,
                     "num_classes": args.num_classes, "autoencoder": args.vae, "transport": transport,
                     "latent_norm": latent_norm}
        model, spec, args.weights_used = load_dit(args.checkpoint, overrides, args.weights)
        if args.labels is not None:
            check_labels(parse_labels(args.labels), spec.num_classes)  # before the VAE loads
        args.guided_channels = resolve_guided_channels(args.guided_channels, spec.in_channels, "--guided-channels")
        args.weights_sha256 = weights_fingerprint(model.state_dict()) if args.num_samples is not None else None
        objective, sampling = build_objective(args, spec)
        decoder = Decoder(spec.autoencoder, device, expect=vars(spec), latent_norm=spec.latent_norm)
        from common.trainer import resolve_compile

        compile_ = resolve_compile({"yes": True, "no": False}.get(args.compile, args.compile), torch.device(device))
        sampler = Sampler(model.to(device), spec, decoder, objective, sampling, args.cfg_scale, args.guided_channels,
                          args.seed, device, args.precision, compile_)
        if args.grid is not None:
            result = run_grid(args, sampler) if state.is_main_process else None
        else:
            result = run_num_samples(args, sampler, state)
    if result is not None and not args.quiet:
        print(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
