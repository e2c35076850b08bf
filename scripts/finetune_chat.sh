#!/usr/bin/env bash
# Fine-tune a Hugging Face chat model on your conversations with LoRA, then write the merged
# model as a Hugging Face dir (its tokenizer and chat template kept), ready for transformers,
# `python -m trainer.serve --checkpoint=OUT/model` or the hub.
#
#   scripts/finetune_chat.sh MODEL_DIR CHATS.jsonl OUT [more train flags...]
#
# CHATS.jsonl: one {"messages": [{"role": "system"|"user"|"assistant", "content": ...}]} per
# line; the loss is on the assistant turns, conversations are packed without seeing each
# other, and long ones lose whole early turns (see README, "Fine-tuning"). OUT/run holds the
# checkpoints and metrics, OUT/model the result. Spot-safe: a checkpoint every SAVE_EVERY
# steps and on SIGTERM, and running the same command again resumes (and exports, if a
# finished run was stopped before its export). Later flags override these defaults, e.g.
# --steps=2000 --lora.rank=64 --mesh=1,4,2 --seq_len=4096.
set -euo pipefail
usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
if [ $# -lt 3 ]; then usage >&2; exit 2; fi
model=$1 data=$2 out=${3%/}
shift 3
exec "${PYTHON:-python}" -m trainer.train \
  --init_from="$model" --data.path="$data" --data.format=chat \
  --lora.rank=16 --lora.alpha=32 --lora.base_dtype=bfloat16 \
  --seq_len=2048 --batch_size=16 --steps=1000 --save_every="${SAVE_EVERY:-100}" \
  --optimizer.lr=2e-4 --optimizer.warmup_steps=20 --optimizer.weight_decay=0 \
  --output_dir="$out/run" --export_hf="$out/model" "$@"
