#!/usr/bin/env bash
# On-policy distillation demo on the digit-parity task (docs/RL.md, "On-policy distillation on the parity task"):
# a teacher is trained first with online GRPO (configs/online_parity_cpu.yaml, 60 steps, exported to
# TEACHER/hf), then a random-init student of another seed learns it on its own sampled trees
# (configs/online_parity_distill_cpu.yaml), once per distillation loss in LOSSES; the reward curves (the teacher's
# GRPO run and each student's) are plotted with a table of figures. The student never sees the reward: it is
# only logged. Extra arguments are config overrides for the student runs (key=value).
# A run whose output directory already holds its last checkpoint is not trained again, so running the script
# again resumes it; TEACHER may name an existing run of configs/online_parity_cpu.yaml exported with
# checkpoint.export_hf=true (e.g. launch/online_parity.sh's GRPO run, with the same tokenizer builder).
# Environment: LOSSES ["reverse_kl_sampled kl"], RUN [runs/distill_parity], TEACHER [RUN/teacher],
# PLOT [docs/bench/distill_parity.png], NGPU [2], MASTER_PORT [29500].
set -euo pipefail
cd "$(dirname "$0")/.."
LOSSES=${LOSSES:-reverse_kl_sampled kl}
RUN=${RUN:-runs/distill_parity}
TEACHER=${TEACHER:-$RUN/teacher}
PLOT=${PLOT:-docs/bench/distill_parity.png}
bash tools/bootstrap.sh
PYTHON=.venv/bin/python
DS_TREE=.venv/bin/ds-tree
if [ ! -f "$RUN/tokenizer/tokenizer.json" ]; then
  "$DS_TREE" make-tokenizer --output "$RUN/tokenizer"
fi
NGPU=${NGPU:-2} bash launch/train.sh configs/online_parity_cpu.yaml "model.tokenizer=$RUN/tokenizer" \
  "output_dir=$TEACHER" model.seed=0 rollout.seed=0 checkpoint.export_hf=true
curves=("teacher (GRPO)=$TEACHER")
for loss in $LOSSES; do
  clip=()
  if [ "$loss" != reverse_kl_sampled ]; then clip=(objective.eps_high=0.2); fi # the ratio clip: sampled loss only
  NGPU=${NGPU:-2} bash launch/train.sh configs/online_parity_distill_cpu.yaml "model.tokenizer=$RUN/tokenizer" \
    "objective.teacher=$TEACHER/hf" "output_dir=$RUN/student-$loss" "objective.distill.loss=$loss" \
    ${clip[@]+"${clip[@]}"} "$@"
  curves+=("student ($loss)=$RUN/student-$loss")
done
"$DS_TREE" plot-online "${curves[@]}" --output "$PLOT"
# Held-out reward of the final policies, and of the untrained student (model.seed 1), on the held-out phrasings of
# configs/online_parity_eval_prompts.jsonl with the same sampling seeds (ds-tree eval, --step 0 for all).
evaluate() {  # NAME [--checkpoint DIR]
  local name=$1
  shift
  if [ ! -f "$RUN/eval/$name.json" ]; then
    mkdir -p "$RUN/eval"
    "$DS_TREE" eval configs/online_parity_cpu.yaml "model.tokenizer=$RUN/tokenizer" model.seed=1 eval.samples=16 \
      "$@" >"$RUN/eval/$name.json.tmp"
    mv "$RUN/eval/$name.json.tmp" "$RUN/eval/$name.json"
  fi
}
evaluate student-untrained
evaluate teacher --checkpoint "$TEACHER/checkpoints"
names=(student-untrained teacher)
for loss in $LOSSES; do
  evaluate "student-$loss" --checkpoint "$RUN/student-$loss/checkpoints"
  names+=("student-$loss")
done
echo "| policy | held-out eval/reward_mean | eval/pass@1 |"
echo "|---|---|---|"
for name in "${names[@]}"; do
  "$PYTHON" -c 'import json, sys; r = json.load(open(sys.argv[1]))
print("| %s | %.3f | %.3f |" % (sys.argv[2], r["eval/reward_mean"], r["eval/pass@1"]))' "$RUN/eval/$name.json" "$name"
done
cat <<MSG

Done.
  teacher       : $TEACHER (GRPO; exported model $TEACHER/hf)
  students      : $RUN/student-LOSS for LOSS in $LOSSES (metrics.jsonl: rollout/reward_mean, distill/divergence)
  reward curves : $PLOT
  held-out      : $RUN/eval/NAME.json (ds-tree eval of the untrained student, the teacher and each student)
MSG
