#!/usr/bin/env bash
# Multi-turn agentic RL example (docs/ENVIRONMENTS.md) on 2 CPU ranks with ZeRO-3: the project
# tokenizer (made once), then ONE run of configs/multiturn_cpu.yaml (an SFT warm-up on format-only
# demonstrations, then GRPO against ds_tree.envs.secret_tool:LoudSecretToolEnv), then its curve.
# Extra arguments are overrides of the config (key=value).
# Environment: RUN [runs/multiturn], NGPU [2], PLOT [unset: no plot; e.g. docs/bench/multiturn_rl.png].
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh
RUN=${RUN:-runs/multiturn}
if [ ! -f "$RUN/tokenizer/tokenizer.json" ]; then
  .venv/bin/ds-tree make-tokenizer --output "$RUN/tokenizer"
fi
NGPU=${NGPU:-2} bash launch/train.sh configs/multiturn_cpu.yaml "model.tokenizer=$RUN/tokenizer" \
  "output_dir=$RUN/rl" "$@"
if [ -n "${PLOT:-}" ]; then
  .venv/bin/ds-tree plot-online "secret tool=$RUN/rl" --output "$PLOT"
fi
cat <<MSG

Done: $RUN/rl (metrics.jsonl with warmup/sft_loss, then rollout/reward_mean; each RL step's trees in
$RUN/rl/rollouts/)
MSG
