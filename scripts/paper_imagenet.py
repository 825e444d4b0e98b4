"""The paper's ImageNet table as one study: DeiT-T/S and DiT-B/2, L/4, Pre-Norm and SiameseNorm, trained with the
shipped recipes, scored as their papers score them, and reported beside the paper's numbers.

    python -m scripts.paper_imagenet --launcher slurm --out /shared/paper --imagenet /shared/imagenet \\
        --latents /shared/latents/in256 --vae /shared/models/sd-vae-ft-ema \\
        --inception weights-inception-2015-12-05-6726825d.pth --adm-reference VIRTUAL_imagenet256_labeled.npz
    python -m scripts.paper_imagenet --launcher slurm ... --dry-run    # the plan and the sbatch commands only
    python -m scripts.paper_imagenet --launcher local --models deit_tiny --out runs/paper --imagenet /data/imagenet

Jobs: a training per model and topology (``vision.train`` / ``diffusion.train``), then for DeiT ``vision.evaluate``
(Top-1 of the raw model on ImageNet val) and for DiT ``diffusion.sample`` (50,000 EMA samples, 250 DDPM steps) and
``diffusion.fid`` (against ADM's reference batch). A job is finished when the file it writes last exists; finished
jobs are never redone, so rerunning the same command continues the study (trainings resume from their newest
checkpoint). Before anything runs (``--dry-run`` too), every unfinished training's first checks run here, with the
trainers' own functions: DeiT's image folders (class count, train and val alike), DiT's latents (image size, class count)
and their VAE; input a job would refuse at its start is refused now, naming the job. Then the plan is printed: every job, what it waits for, its command and its cost in
GPU-hours (configs/paper_imagenet.yaml says where each figure comes from). Every invocation ends by writing
``OUT/report.md`` from the jobs finished so far.

Launchers: ``local`` runs the jobs one after another on this machine, each in its own process (forked from this
one, which has imported the job modules once); a job stopped by SIGTERM (exit 4) or at ``train.stop_at_step``
(exit 3) stops the study, and the same command continues it. ``slurm`` submits every unfinished job with
scripts/cluster/train.sbatch (preempted and requeued until done), each after the jobs it needs
(``--dependency=afterok``); jobs submitted before and still queued or running (``squeue``) are not submitted again.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Sequence

from common.cli import InputError, one_line_errors
from comparison.paper_imagenet import (PAPER_FID, Costs, build_jobs, check_inputs, check_state, print_plan,
                                       read_study, run_local, run_slurm, write_paper_report)


# ----------------------------------------------------------------------------- command line

PATHS = {"deit": ("imagenet",), "dit": ("latents", "vae", "inception", "adm_reference")}


def parse_args(argv: Sequence[str], study: dict) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.paper_imagenet", description=__doc__.split("\n\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launcher", choices=("local", "slurm"), required=True)
    p.add_argument("--out", type=Path, required=True, help="the study's folder (runs, samples, logs, report.md); on a "
                   "file system every node shares under slurm")
    p.add_argument("--models", nargs="+", choices=list(study["models"]), default=list(study["models"]))
    p.add_argument("--imagenet", type=Path, help="ImageNet root with train/<wnid>/ and val/<wnid>/ (DeiT)")
    p.add_argument("--latents", type=Path, help="the --out of diffusion.extract_latents on ImageNet 256 (DiT)")
    p.add_argument("--vae", type=Path, help="the SD VAE folder the latents were made with (sd-vae-ft-ema)")
    p.add_argument("--inception", type=Path, help="torch-fidelity's weights-inception-2015-12-05-6726825d.pth")
    p.add_argument("--adm-reference", type=Path, help="ADM's VIRTUAL_imagenet256_labeled.npz")
    p.add_argument("--fid-samples", type=int, default=PAPER_FID["samples"])
    p.add_argument("--sample-steps", type=int, default=PAPER_FID["steps"])
    p.add_argument("--sample-batch-size", type=int, help="diffusion.sample --batch-size (default: its own)")
    p.add_argument("--set-deit", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of the DeiT trainings, "
                   "e.g. optim.grad_accum=2 (the report says when any is given)")
    p.add_argument("--set-dit", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of the DiT trainings")
    p.add_argument("--gpu", default="A100", help="the GPU the cost is estimated for (default A100)")
    p.add_argument("--gpu-check", type=Path, help="a `make gpu-check` JSON: its measured images/s and MFU replace "
                   "the estimates")
    p.add_argument("--dry-run", action="store_true", help="print the plan (and the sbatch commands) only")
    p.add_argument("--report-only", action="store_true", help="run nothing: write the report of the finished jobs")
    args = p.parse_args(argv)
    needed = dict.fromkeys(k for m in args.models for k in PATHS[study["models"][m]["family"]])
    for key in needed:
        path = getattr(args, key)
        if path is None or not path.exists():
            flag = "--" + key.replace("_", "-")
            raise InputError(f"{flag} {path or ''}".strip() + (": no such file or folder" if path else " is needed")
                             + f" for {', '.join(m for m in args.models if key in PATHS[study['models'][m]['family']])}")
        setattr(args, key, path.resolve())
    if args.gpu_check and not args.gpu_check.is_file():
        raise InputError(f"--gpu-check {args.gpu_check}: no such file (`make gpu-check` writes runs/gpu_check.json)")
    args.out = args.out.resolve()
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    study = read_study()
    with one_line_errors():
        opts = parse_args(argv, study)
        jobs = build_jobs(opts, study, Costs(study, opts.gpu, opts.gpu_check))
        command = shlex.join(["python", "-m", "scripts.paper_imagenet",
                              *(a for a in argv if a not in ("--dry-run", "--report-only"))])
        status = 0
        if not opts.report_only:
            check_inputs(jobs)
            print_plan(jobs, opts.launcher)
            if not opts.dry_run:
                check_state(jobs, opts.out)
            status = (run_local(jobs) if opts.launcher == "local" and not opts.dry_run
                      else run_slurm(jobs, opts.out, opts.dry_run) if opts.launcher == "slurm" else 0)
        if not opts.dry_run:
            print(f"\nwrote {write_paper_report(opts, study, jobs, command)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
