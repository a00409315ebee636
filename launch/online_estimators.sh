#!/usr/bin/env bash
# Advantage estimators side by side on the online digit-parity task (docs/RL.md, "Tree estimators
# compared"): configs/online_parity_cpu.yaml with tree sampling, once per estimator and seed (model
# init, prompt order and sampling), then the reward curves averaged over the seeds, one per estimator,
# plotted with a table of figures. Extra arguments are config overrides for every run (key=value).
# A run whose output directory already holds its last checkpoint is not trained again.
# Environment: RUN [runs/online_estimators], ESTIMATORS ["grpo treepo tempo"], SEEDS ["0 1 2"],
# PLOT [docs/bench/online_estimators.png], NGPU [2], MASTER_PORT [29500].
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh
DS_TREE=.venv/bin/ds-tree
RUN=${RUN:-runs/online_estimators}
ESTIMATORS=${ESTIMATORS:-grpo treepo tempo}
SEEDS=${SEEDS:-0 1 2}
PLOT=${PLOT:-docs/bench/online_estimators.png}
if [ ! -f "$RUN/tokenizer/tokenizer.json" ]; then
  "$DS_TREE" make-tokenizer --output "$RUN/tokenizer"
fi
curves=()
for estimator in $ESTIMATORS; do
  runs=()
  for seed in $SEEDS; do
    output="$RUN/$estimator-seed$seed"
    NGPU=${NGPU:-2} bash launch/train.sh configs/online_parity_cpu.yaml "model.tokenizer=$RUN/tokenizer" \
      "output_dir=$output" "objective.estimator=$estimator" "model.seed=$seed" "rollout.seed=$seed" "$@"
    runs+=("$output")
  done
  curves+=("$estimator=$(IFS=,; echo "${runs[*]}")")
done
"$DS_TREE" plot-online "${curves[@]}" --output "$PLOT"
cat <<MSG

Done.
  runs          : $RUN/ESTIMATOR-seedSEED for ESTIMATOR in $ESTIMATORS and SEED in $SEEDS
  reward curves : $PLOT
MSG
