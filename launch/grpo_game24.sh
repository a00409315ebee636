#!/usr/bin/env bash
# Offline GRPO on tot-game24 (docs/RL.md): build the tokenizer, convert the shared chat JSONL
# (100 puzzles x 100 answers with 1/0 rewards) into a tree dataset, then train the tiny Llama with
# configs/grpo_game24_cpu.yaml on 2 CPU ranks with ZeRO-3.
# Extra arguments are config overrides (key=value), e.g. max_steps=4.
# Environment: SAMPLES [../shared/data/tot-game24/samples.jsonl], RUN [runs/grpo_game24],
# LIMIT [unset: every sample; N: the first N lines, 100 a puzzle].
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh
DS_TREE=.venv/bin/ds-tree
SAMPLES=${SAMPLES:-../shared/data/tot-game24/samples.jsonl}
RUN=${RUN:-runs/grpo_game24}
if [ ! -f "$SAMPLES" ]; then
  echo "grpo_game24.sh: $SAMPLES: no such file. This script needs the optional tot-game24 data" \
    "(100 puzzles x 100 answers, MIT): build it with 'python tools/get_shared_data.py --only tot-game24'" \
    "(docs/DATA.md) or set SAMPLES to its samples.jsonl" >&2
  exit 2
fi
if [ ! -f "$RUN/tokenizer/tokenizer.json" ]; then
  "$DS_TREE" make-tokenizer --output "$RUN/tokenizer"
fi
if [ ! -f "$RUN/data/ds_tree_meta.json" ]; then
  limit=()
  if [ -n "${LIMIT:-}" ]; then limit=(--limit "$LIMIT"); fi
  "$DS_TREE" convert --input "$SAMPLES" --output "$RUN/data" --tokenizer "$RUN/tokenizer" --format chat "${limit[@]}"
fi
"$DS_TREE" stats "$RUN/data"
NGPU=${NGPU:-2} bash launch/train.sh configs/grpo_game24_cpu.yaml "data.path=$RUN/data" "model.tokenizer=$RUN/tokenizer" "output_dir=$RUN/train" "$@"
cat <<MSG

Done.
  TensorBoard logs : $RUN/train/tensorboard   (rl/reward_mean, rl/clip_frac_*, rl/approx_kl, rl/kl_ref, ...)
  metrics          : $RUN/train/metrics.jsonl
  checkpoints      : $RUN/train/checkpoints   (latest: $(cat "$RUN/train/checkpoints/latest" 2>/dev/null || echo none))
  exported model   : $RUN/train/hf
MSG
