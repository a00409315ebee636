#!/usr/bin/env bash
# Online GRPO demo (docs/RL.md, "Online RL"): a random-init tiny Llama learns the digit-parity task on
# 2 CPU ranks with ZeRO-3, with tree sampling and with independent sampling of the same 8 leaves per
# prompt (configs/online_parity_cpu.yaml), once per seed (model init, prompt order and sampling), then
# both samplers' reward curves, averaged over the seeds, are plotted with a table of figures.
# Extra arguments are config overrides for every run (key=value), e.g. max_steps=10.
# A run whose output directory already holds its last checkpoint is not trained again.
# Environment: RUN [runs/online_parity], SEEDS ["0"], PLOT [docs/bench/online_rl.png], NGPU [2].
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh
DS_TREE=.venv/bin/ds-tree
RUN=${RUN:-runs/online_parity}
SEEDS=${SEEDS:-0}
PLOT=${PLOT:-docs/bench/online_rl.png}
if [ ! -f "$RUN/tokenizer/tokenizer.json" ]; then
  "$DS_TREE" make-tokenizer --output "$RUN/tokenizer"
fi
curves=()
for sampler in tree independent; do
  independent=false
  if [ "$sampler" = independent ]; then independent=true; fi
  runs=()
  for seed in $SEEDS; do
    output="$RUN/$sampler-seed$seed"
    NGPU=${NGPU:-2} bash launch/train.sh configs/online_parity_cpu.yaml "model.tokenizer=$RUN/tokenizer" \
      "output_dir=$output" "rollout.independent=$independent" "model.seed=$seed" "rollout.seed=$seed" "$@"
    runs+=("$output")
  done
  curves+=("$sampler=$(IFS=,; echo "${runs[*]}")")
done
"$DS_TREE" plot-online "${curves[@]}" --output "$PLOT"
cat <<MSG

Done.
  runs          : $RUN/SAMPLER-seedSEED for SAMPLER in tree, independent and SEED in $SEEDS
                  (metrics.jsonl; tensorboard/ with rollout/reward_mean, rollout/por, ...)
  reward curves : $PLOT
MSG
