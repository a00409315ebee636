"""Command-line entry points: one module per tool, each with ``main(argv) -> int``.

``ds-tree COMMAND ...`` (the console script) dispatches to them; ``python tools/X.py`` runs the
same ``main``. A command's module is imported only when it runs, and builds its parser
(``build_parser``) without torch, transformers or deepspeed: it imports them after parsing, so
``--help`` and usage errors answer at once (and bench-kernel can choose the Triton interpreter
before torch is imported).
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": "train on a config with the DeepSpeed launcher (launch/train.sh: NGPU, NNODES, DRY_RUN=1, ...)",
    "convert": "convert chat, tokens or explicit-tree JSONL into a tree dataset",
    "verify": "check tree mode against the flat baseline (loss, log-probs, gradients)",
    "stats": "tree statistics of a data set: POR, ideal speedup, depth, branching",
    "bench": "time tree vs flat training steps",
    "bench-sweep": "POR sweep and shared data sets through bench, with table and plot",
    "bench-attention": "time the CPU tree-attention engine alone, tree vs flat",
    "bench-kernel": "time the Triton tree-attention kernel (a smoke run without a GPU)",
    "bench-engines": "sampling throughput of the tree sampler on the hf and vLLM engines",
    "multiturn-reuse": "tokens the multi-turn sampler computes: episode trees vs independent episodes",
    "reasoning-reuse": "tokens of reasoning turns as episode trees vs per-turn samples vs re-rendered sequences",
    "make-tokenizer": "train the project's byte-level BPE tokenizer (--chat-format: a model family's template)",
    "make-synthetic": "write synthetic agentic tree data with a target POR",
    "plot-online": "reward curves and sampler tokens of online RL runs (metrics.jsonl) into a PNG and a table",
    "plot-multiturn": "learning curve and tree reuse of a multi-turn RL run (metrics.jsonl) into a PNG",
    "sample": "sample prompts' groups as trees with a HF model, score them, write rollouts JSONL",
    "plan": "predicted peak memory per rank of a training config, and the largest row that fits",
    "eval": "a config's eval section (held-out loss, pass@k on held-out tasks) on a checkpoint or model",
    "gpu-check": "prove the GPU path on one CUDA GPU: engines exact, kernels and steps timed, the trainer run",
}
USAGE = "usage: ds-tree COMMAND [options]   (ds-tree COMMAND --help for a command's options)\n\ncommands:\n" + "".join(
    f"  {name:<16} {summary}\n" for name, summary in COMMANDS.items()
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    if not argv:
        print(USAGE, end="", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"{USAGE}\nds-tree: error: unknown command {command!r}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"ds_tree.cli.{command.replace('-', '_')}")
    return module.main(rest, prog=f"ds-tree {command}")
