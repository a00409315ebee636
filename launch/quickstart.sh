#!/usr/bin/env bash
# The README's main command: set up, build the tokenizer and synthetic agentic tree data (and a small
# held-out file of another seed), then train the tiny Llama for a few dozen steps on 2 CPU ranks with
# ZeRO-3 (a few minutes on 2 cores), logging eval/loss on the held-out file every 10 steps.
# Extra arguments are config overrides (key=value), e.g. max_steps=10.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh
DS_TREE=.venv/bin/ds-tree
RUN=${RUN:-runs/quickstart}
if [ ! -f "$RUN/tokenizer/tokenizer.json" ]; then
  "$DS_TREE" make-tokenizer --output "$RUN/tokenizer"
fi
if [ ! -f "$RUN/data/synthetic.jsonl" ]; then
  mkdir -p "$RUN/data"
  "$DS_TREE" make-synthetic --output "$RUN/data/synthetic.jsonl" --groups 64 --por 0.7 --seed 0
fi
if [ ! -f "$RUN/data/heldout.jsonl" ]; then
  "$DS_TREE" make-synthetic --output "$RUN/data/heldout.jsonl" --groups 8 --por 0.7 --seed 1
fi
"$DS_TREE" stats "$RUN/data/synthetic.jsonl"
NGPU=${NGPU:-2} bash launch/train.sh configs/tiny_cpu.yaml "data.path=$RUN/data/synthetic.jsonl" "model.tokenizer=$RUN/tokenizer" \
  "eval.data=$RUN/data/heldout.jsonl" eval.every_steps=10 "output_dir=$RUN/train" "$@"
cat <<MSG

Done.
  TensorBoard logs : $RUN/train/tensorboard   (tensorboard --logdir $RUN/train/tensorboard)
  metrics          : $RUN/train/metrics.jsonl   (eval/loss: the held-out $RUN/data/heldout.jsonl)
  checkpoints      : $RUN/train/checkpoints   (latest: $(cat "$RUN/train/checkpoints/latest" 2>/dev/null || echo none))
  exported model   : $RUN/train/hf
Run it again to resume from the latest checkpoint (raise max_steps=N to train further).
MSG
