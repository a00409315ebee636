#!/usr/bin/env bash
# Multimodal multi-turn agentic RL example (docs/ENVIRONMENTS.md, "Image observations") on 2 CPU ranks
# with ZeRO-3: a Qwen2.5-VL processor folder (made once), then ONE run of configs/multiturn_gui_cpu.yaml (an
# SFT warm-up on format-only demonstrations, then GRPO against ds_tree.envs.gui_screens:GuiScreensEnv,
# whose screenshot tool answers with images), then its curve.
# Extra arguments are overrides of the config (key=value).
# Environment: RUN [runs/multiturn_gui], NGPU [2], PLOT [unset: no plot; e.g. docs/bench/multiturn_gui_rl.png].
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh
RUN=${RUN:-runs/multiturn_gui}
if [ ! -f "$RUN/tokenizer/tokenizer.json" ]; then
  .venv/bin/ds-tree make-tokenizer --output "$RUN/tokenizer" --vision qwen2_5_vl
fi
NGPU=${NGPU:-2} bash launch/train.sh configs/multiturn_gui_cpu.yaml "model.tokenizer=$RUN/tokenizer" \
  "output_dir=$RUN/rl" "$@"
if [ -n "${PLOT:-}" ]; then
  .venv/bin/ds-tree plot-online "screenshots=$RUN/rl" --output "$PLOT"
fi
cat <<MSG

Done: $RUN/rl (metrics.jsonl with warmup/sft_loss, then rollout/reward_mean; each RL step's trees in
$RUN/rl/rollouts/)
MSG
