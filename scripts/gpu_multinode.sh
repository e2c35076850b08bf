#!/usr/bin/env bash
#SBATCH --job-name=meshlm
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@120
#SBATCH --output=meshlm-%j.log
#
# Train on several GPU machines: one process per GPU under SLURM, or one per machine by hand.
# Every process runs the same `python -m trainer.train FLAGS`.
#
# SLURM (adjust the #SBATCH lines above; submit from the repository root):
#   sbatch scripts/gpu_multinode.sh --model=llama3_8b --mesh=-1,8,1 --batch_size=256 \
#       --output_dir=/shared/runs/8b
#   srun starts one process per GPU; JAX reads SLURM's variables (jax.distributed.initialize()
#   with no arguments). --signal=TERM@120 asks the run to checkpoint and exit 2 minutes
#   before the time limit; submit again (or use --requeue) to resume from that checkpoint.
#
# Any machines, no scheduler: on every machine, the same COORDINATOR (machine 0's address and
# a free port) and NUM_NODES, and that machine's NODE_RANK (0 on machine 0):
#   COORDINATOR=10.0.0.1:8476 NUM_NODES=2 NODE_RANK=0 scripts/gpu_multinode.sh --mesh=-1,8,1 ...
#   COORDINATOR=10.0.0.1:8476 NUM_NODES=2 NODE_RANK=1 scripts/gpu_multinode.sh --mesh=-1,8,1 ...
#   Each process then drives all GPUs of its machine.
#
# --output_dir must be storage that every machine sees (NFS, Lustre, or gs://): all processes
# write each checkpoint together. Keep tp (and preferably fsdp) within a machine, where NVLink
# is; spread dp across machines: --mesh=-1,8,1 is FSDP inside each 8-GPU machine, DP across.
set -euo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  awk 'NR == 1 || /^#SBATCH/ { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
  exit 0
fi

cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
PYTHON=${PYTHON:-python}
# Let XLA overlap the FSDP all-gathers and gradient reductions with compute.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"

if [[ -n "${COORDINATOR:-}" ]]; then
  : "${NUM_NODES:?set NUM_NODES, the number of machines}"
  : "${NODE_RANK:?set NODE_RANK, the index of this machine (0 on the COORDINATOR machine)}"
  exec "$PYTHON" -m trainer.train --coordinator_address="$COORDINATOR" \
    --num_processes="$NUM_NODES" --process_id="$NODE_RANK" "$@"
elif [[ -n "${SLURM_JOB_ID:-}" ]]; then
  exec srun --kill-on-bad-exit=1 "$PYTHON" -m trainer.train "$@"
else
  echo "error: not in a SLURM job and COORDINATOR is not set; see $0 --help" >&2
  exit 2
fi
