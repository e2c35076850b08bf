#!/usr/bin/env bash
# Train on a Cloud TPU pod slice: every worker runs the same `python -m trainer.train FLAGS`.
#
#   export TPU_NAME=my-v5p-64 ZONE=us-east5-a     # and PROJECT=... if not gcloud's default
#   scripts/tpu_pod.sh setup                      # copy this checkout to every worker, install it
#   scripts/tpu_pod.sh train --model=llama3_8b --mesh=1,-1,1 --batch_size=256 \
#       --output_dir=gs://my-bucket/runs/8b       # start the run on every worker, in the background
#   scripts/tpu_pod.sh logs                       # follow worker 0's log (Ctrl-C stops following)
#   scripts/tpu_pod.sh stop                       # SIGTERM everywhere: save a checkpoint, exit
#
# On a Cloud TPU VM JAX finds the other workers itself (jax.distributed.initialize() with no
# arguments), so there are no coordinator flags. --output_dir must be a gs:// path: all
# workers write each checkpoint together, worker 0 the metrics. Running `train` again with the
# same flags (after `stop`, a crash, or a spot preemption) resumes from the newest checkpoint.
set -euo pipefail

usage() {  # the comment block at the top of this file
  awk 'NR == 1 || /^#SBATCH/ { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
}

command=${1:-}
case "$command" in
  -h|--help|help) usage; exit 0 ;;
  setup|train|logs|stop) shift ;;
  *) usage >&2; exit 2 ;;
esac

: "${TPU_NAME:?set TPU_NAME to the TPU VM (pod slice) name}"
: "${ZONE:?set ZONE to its zone, e.g. us-east5-a}"
REMOTE_DIR=${REMOTE_DIR:-meshlm}  # on each worker, relative to the home directory
PYTHON=${PYTHON:-python3}

tpu_vm() {  # tpu_vm ssh|scp ARGS...: gcloud's TPU VM command, with our zone and project
  local verb=$1
  shift
  gcloud compute tpus tpu-vm "$verb" "$@" --zone="$ZONE" ${PROJECT:+--project="$PROJECT"}
}

on_workers() {  # on_workers WORKERS COMMAND: a shell command on those workers, in parallel
  tpu_vm ssh "$TPU_NAME" --worker="$1" --command="$2"
}

case "$command" in
  setup)
    # The checkout's tracked files, with uncommitted edits, to every worker; then install.
    cd "$(dirname "$0")/.."
    tarball=$(mktemp "${TMPDIR:-/tmp}/meshlm.XXXXXX")
    trap 'rm -f "$tarball"' EXIT
    git ls-files -z | tar --null -czf "$tarball" -T -
    tpu_vm scp "$tarball" "$TPU_NAME:meshlm.tar.gz" --worker=all
    on_workers all "mkdir -p $REMOTE_DIR && tar -xzf meshlm.tar.gz -C $REMOTE_DIR \
      && cd $REMOTE_DIR && $PYTHON -m pip install --user -q -e '.[tpu]'"
    ;;
  train)
    # nohup, with every stream redirected: the run outlives this ssh session.
    flags=""
    if (($#)); then flags=$(printf ' %q' "$@"); fi  # each flag quoted for the remote shell
    on_workers all "cd $REMOTE_DIR && { nohup $PYTHON -m trainer.train$flags \
      > train.log 2>&1 < /dev/null & echo \$! > train.pid; }"
    echo "started on every worker of $TPU_NAME; follow it with: $0 logs"
    ;;
  logs)
    on_workers 0 "tail -n 200 -F $REMOTE_DIR/train.log"
    ;;
  stop)
    # SIGTERM: each process finishes its step, all save a checkpoint together, then exit.
    on_workers all "test -f $REMOTE_DIR/train.pid && kill -TERM \$(cat $REMOTE_DIR/train.pid) \
      2> /dev/null || true"
    ;;
esac
