#!/usr/bin/env bash
# Online GRPO demo (docs/RL.md, "Online RL"): a random-init tiny Llama learns the digit-parity task on
# 2 CPU ranks with ZeRO-3, once with tree sampling and once with independent sampling of the same 8
# leaves per prompt (configs/online_parity_cpu.yaml), then both reward curves are plotted.
# Extra arguments are config overrides for both runs (key=value), e.g. max_steps=10.
# Environment: RUN [runs/online_parity], PLOT [docs/bench/online_rl.png], NGPU [2].
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh
DS_TREE=.venv/bin/ds-tree
RUN=${RUN:-runs/online_parity}
PLOT=${PLOT:-docs/bench/online_rl.png}
if [ ! -f "$RUN/tokenizer/tokenizer.json" ]; then
  "$DS_TREE" make-tokenizer --output "$RUN/tokenizer"
fi
for sampler in tree independent; do
  independent=false
  if [ "$sampler" = independent ]; then independent=true; fi
  NGPU=${NGPU:-2} bash launch/train.sh configs/online_parity_cpu.yaml "model.tokenizer=$RUN/tokenizer" \
    "output_dir=$RUN/$sampler" "rollout.independent=$independent" "$@"
done
"$DS_TREE" plot-online "tree=$RUN/tree" "independent=$RUN/independent" --output "$PLOT"
cat <<MSG

Done.
  TensorBoard logs : $RUN/tree/tensorboard, $RUN/independent/tensorboard   (rollout/reward_mean, rollout/por, ...)
  metrics          : $RUN/tree/metrics.jsonl, $RUN/independent/metrics.jsonl
  reward curves    : $PLOT
MSG
