#!/usr/bin/env bash
# One training process per SLURM task (srun starts one per GPU): torch.distributed's environment from SLURM's,
# then the command. accelerate reads RANK / WORLD_SIZE / LOCAL_RANK and joins the process group.
set -euo pipefail
export RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS" LOCAL_RANK="$SLURM_LOCALID"
export LOCAL_WORLD_SIZE="${SLURM_NTASKS_PER_NODE:-$SLURM_NTASKS}"
export MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}"
export MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
# Bad input is printed by rank 0 alone; every rank writes its message here (common/cli.py), where train.sbatch finds
# the ones only other ranks met. A folder on a file system the nodes share; made only when a rank writes.
export TORCHELASTIC_ERROR_FILE="${RANK_ERRORS:-${SLURM_SUBMIT_DIR:-.}/errors-${SLURM_JOB_ID}}/rank${RANK}.json"
exec "$@"
