#!/usr/bin/env bash
# Online RL demo on the digit-parity task (configs/online_parity_cpu.yaml: a random-init tiny Llama on
# 2 CPU ranks with ZeRO-3): one run per variant and seed (model init, prompt order and sampling), then
# the variants' reward curves, averaged over the seeds, plotted with a table of figures.
#   COMPARE=sampler   (default; docs/RL.md, "Online RL"): tree sampling against independent sampling of
#                     the same 8 leaves per prompt.
#   COMPARE=estimator (docs/RL.md, "Tree estimators compared"): tree sampling, one run per advantage
#                     estimator in ESTIMATORS. `gae` (docs/RL.md, "PPO with a learned critic") trains a critic
#                     of its own: CRITIC (a model config, random init) at CRITIC_LR, its advantages whitened over
#                     the step (GAE_WHITEN=false: not normalised).
# Extra arguments are config overrides for every run (key=value), e.g. max_steps=10.
# A run whose output directory already holds its last checkpoint is not trained again.
# Environment: COMPARE [sampler], SEEDS ["0"], ESTIMATORS ["grpo treepo tempo"],
# CRITIC [configs/models/tiny_llama.json], CRITIC_LR [2e-4], GAE_WHITEN [true],
# RUN [runs/online_parity, or runs/online_estimators], PLOT [docs/bench/online_rl.png, or
# docs/bench/online_estimators.png], NGPU [2], MASTER_PORT [29500].
set -euo pipefail
cd "$(dirname "$0")/.."
COMPARE=${COMPARE:-sampler}
SEEDS=${SEEDS:-0}
case $COMPARE in
  sampler)
    variants=(tree independent)
    RUN=${RUN:-runs/online_parity}
    PLOT=${PLOT:-docs/bench/online_rl.png}
    ;;
  estimator)
    read -r -a variants <<<"${ESTIMATORS:-grpo treepo tempo}"
    RUN=${RUN:-runs/online_estimators}
    PLOT=${PLOT:-docs/bench/online_estimators.png}
    ;;
  *)
    echo "online_parity.sh: COMPARE must be sampler or estimator, got '$COMPARE'" >&2
    exit 2
    ;;
esac
bash tools/bootstrap.sh
DS_TREE=.venv/bin/ds-tree
if [ ! -f "$RUN/tokenizer/tokenizer.json" ]; then
  "$DS_TREE" make-tokenizer --output "$RUN/tokenizer"
fi
curves=()
for variant in "${variants[@]}"; do
  if [ "$COMPARE" = sampler ]; then
    independent=false
    if [ "$variant" = independent ]; then independent=true; fi
    overrides=("rollout.independent=$independent")
  elif [ "$variant" = gae ]; then
    overrides=(objective.estimator=gae "objective.normalise_advantages=${GAE_WHITEN:-true}"
      "objective.critic.source=${CRITIC:-configs/models/tiny_llama.json}" "objective.critic.lr=${CRITIC_LR:-2e-4}")
  else
    overrides=("objective.estimator=$variant")
  fi
  runs=()
  for seed in $SEEDS; do
    output="$RUN/$variant-seed$seed"
    NGPU=${NGPU:-2} bash launch/train.sh configs/online_parity_cpu.yaml "model.tokenizer=$RUN/tokenizer" \
      "output_dir=$output" "${overrides[@]}" "model.seed=$seed" "rollout.seed=$seed" "$@"
    runs+=("$output")
  done
  curves+=("$variant=$(IFS=,; echo "${runs[*]}")")
done
"$DS_TREE" plot-online "${curves[@]}" --output "$PLOT"
cat <<MSG

Done.
  runs          : $RUN/VARIANT-seedSEED for VARIANT in ${variants[*]} and SEED in $SEEDS
                  (metrics.jsonl; tensorboard/ with rollout/reward_mean, rollout/por, ...)
  reward curves : $PLOT
MSG
