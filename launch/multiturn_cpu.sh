#!/usr/bin/env bash
# Multi-turn agentic RL example (docs/ENVIRONMENTS.md) on 2 CPU ranks with ZeRO-3: the project
# tokenizer, the secret-tool tasks and format-only demonstrations (ds_tree.rollout.secret_tool), an SFT
# warm-up (configs/multiturn_sft_cpu.yaml, exported to $RUN/sft/hf), then RL against the environment
# (configs/multiturn_cpu.yaml). Extra arguments are overrides of the RL config (key=value).
# Environment: RUN [runs/multiturn], NGPU [2]. A finished warm-up (its export present) is not redone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh
RUN=${RUN:-runs/multiturn}
if [ ! -f "$RUN/tokenizer/tokenizer.json" ]; then
  .venv/bin/ds-tree make-tokenizer --output "$RUN/tokenizer"
fi
.venv/bin/python -m ds_tree.rollout.secret_tool --tokenizer "$RUN/tokenizer" \
  --tasks "$RUN/tasks.jsonl" --demonstrations "$RUN/demonstrations.jsonl"
if [ ! -f "$RUN/sft/hf/config.json" ]; then
  NGPU=${NGPU:-2} bash launch/train.sh configs/multiturn_sft_cpu.yaml "model.tokenizer=$RUN/tokenizer" \
    "data.path=$RUN/demonstrations.jsonl" "output_dir=$RUN/sft"
fi
NGPU=${NGPU:-2} bash launch/train.sh configs/multiturn_cpu.yaml "model.source=$RUN/sft/hf" \
  "model.tokenizer=$RUN/tokenizer" "rollout.prompts=$RUN/tasks.jsonl" "output_dir=$RUN/rl" "$@"
cat <<MSG

Done.
  warm-up : $RUN/sft (metrics.jsonl; the exported model in $RUN/sft/hf)
  RL      : $RUN/rl (metrics.jsonl with rollout/reward_mean; each step's trees in $RUN/rl/rollouts/)
MSG
