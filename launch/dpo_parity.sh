#!/usr/bin/env bash
# DPO on a preference set of the digit-parity task (docs/RL.md, "DPO on the parity task"): per prompt of
# configs/online_parity_prompts.jsonl, PAIRS records whose chosen answer is digits of the asked parity and whose
# rejected answer is as many digits of the other parity (ds_tree.envs.digit_parity.preference_records), converted
# with `ds-tree convert --format preference` (each record a tree: its prompt once, the two answers as sibling
# leaves), then configs/dpo_parity_cpu.yaml trains a random-init tiny Llama on them (the reference is that initial
# model) with a checkpoint every CHECKPOINT_EVERY steps. The task reward is measured by sampling the held-out
# phrasings of configs/online_parity_eval_prompts.jsonl (`ds-tree eval` with the online parity config's eval
# section) for the initial model and every checkpoint; the reward and dpo/ curves are plotted.
# Extra arguments are config overrides for the DPO run (key=value). Steps whose output exists are skipped,
# so running the script again resumes it.
# Environment: PAIRS [16], SAMPLES [16] (completions per held-out prompt), CHECKPOINT_EVERY [24],
# RUN [runs/dpo_parity], PLOT [docs/bench/dpo_parity.png], NGPU [2], MASTER_PORT [29500].
set -euo pipefail
cd "$(dirname "$0")/.."
PAIRS=${PAIRS:-16}
SAMPLES=${SAMPLES:-16}
CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-24}
RUN=${RUN:-runs/dpo_parity}
PLOT=${PLOT:-docs/bench/dpo_parity.png}
bash tools/bootstrap.sh
PYTHON=.venv/bin/python
DS_TREE=.venv/bin/ds-tree
mkdir -p "$RUN/eval"
if [ ! -f "$RUN/tokenizer/tokenizer.json" ]; then
  "$DS_TREE" make-tokenizer --output "$RUN/tokenizer"
fi
if [ ! -f "$RUN/pairs.jsonl" ]; then
  "$PYTHON" - "$RUN/pairs.jsonl" "$PAIRS" <<'PY'
import json, sys
from ds_tree.envs.digit_parity import preference_records
prompts = [json.loads(line) for line in open("configs/online_parity_prompts.jsonl") if line.strip()]
with open(sys.argv[1] + ".tmp", "w") as out:
    for record in preference_records(prompts, pairs_per_prompt=int(sys.argv[2]), seed=0):
        out.write(json.dumps(record) + "\n")
PY
  mv "$RUN/pairs.jsonl.tmp" "$RUN/pairs.jsonl"
fi
if [ ! -d "$RUN/data" ]; then
  "$DS_TREE" convert --format preference --input "$RUN/pairs.jsonl" --tokenizer "$RUN/tokenizer" --output "$RUN/data"
fi
NGPU=${NGPU:-2} bash launch/train.sh configs/dpo_parity_cpu.yaml "model.tokenizer=$RUN/tokenizer" \
  "data.path=$RUN/data" "output_dir=$RUN/dpo" "checkpoint.every=$CHECKPOINT_EVERY" "$@"
# The task reward: the initial model (the config's model.source at model.seed 0, as the DPO run starts) and each
# checkpoint, on the same held-out prompts and sampling seeds (--step 0 for all).
evaluate() {  # NAME [--checkpoint DIR]
  local name=$1
  shift
  if [ ! -f "$RUN/eval/$name.json" ]; then
    "$DS_TREE" eval configs/online_parity_cpu.yaml "model.tokenizer=$RUN/tokenizer" model.seed=0 \
      "eval.samples=$SAMPLES" "$@" >"$RUN/eval/$name.json.tmp"
    mv "$RUN/eval/$name.json.tmp" "$RUN/eval/$name.json"
  fi
}
evaluate step_0
for checkpoint in "$RUN"/dpo/checkpoints/step_*; do
  evaluate "$(basename "$checkpoint")" --checkpoint "$checkpoint"
done
# The curves: dpo/margin and dpo/accuracy per step (the run's metrics.jsonl), the held-out task reward per
# checkpoint (the evaluations above); a Markdown table of both on stdout.
"$PYTHON" - "$RUN" "$PLOT" <<'PY'
import json, sys
from pathlib import Path
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from ds_tree.reports.figures import save_figure
from ds_tree.reports.records import metrics_records
run, plot = Path(sys.argv[1]), Path(sys.argv[2])
steps = [record for _, record in metrics_records(run / "dpo" / "metrics.jsonl") if "dpo/margin" in record]
evals = sorted((json.loads((run / "eval" / name).read_text()) | {"at": int(name[5:-5])} for name in
                (p.name for p in (run / "eval").glob("step_*.json"))), key=lambda e: e["at"])
figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
left.plot([r["step"] for r in steps], [r["dpo/margin"] for r in steps], label="dpo/margin")
left.plot([r["step"] for r in steps], [r["dpo/accuracy"] for r in steps], label="dpo/accuracy")
left.set_xlabel("DPO step"); left.set_title("preference pairs (training batches)"); left.legend()
right.plot([e["at"] for e in evals], [e["eval/reward_mean"] for e in evals], "o-", label="eval/reward_mean")
right.plot([e["at"] for e in evals], [e["eval/pass@1"] for e in evals], "s--", label="eval/pass@1")
right.set_xlabel("DPO step (checkpoint)"); right.set_ylim(0, 1.02); right.set_title("held-out task, sampled")
right.legend()
save_figure(figure, plot, dpi=80)
by_step = {r["step"]: r for r in steps}
print("| step | dpo/margin | dpo/accuracy | eval/reward_mean | eval/pass@1 |")
print("|---|---|---|---|---|")
for e in evals:
    r = by_step.get(e["at"], {})
    cells = [f"{r[k]:.3f}" if k in r else "-" for k in ("dpo/margin", "dpo/accuracy")]
    print(f"| {e['at']} | {' | '.join(cells)} | {e['eval/reward_mean']:.3f} | {e['eval/pass@1']:.3f} |")
PY
cat <<MSG

Done.
  preference set : $RUN/pairs.jsonl (converted: $RUN/data)
  DPO run        : $RUN/dpo (metrics.jsonl with dpo/margin, dpo/accuracy; exported model: $RUN/dpo/hf)
  task reward    : $RUN/eval/step_N.json (ds-tree eval on the held-out prompts; step_0 = the initial model)
  curves         : $PLOT
MSG
