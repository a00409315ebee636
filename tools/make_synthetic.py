"""Write synthetic agentic tree data (tokens JSONL) with a target prefix overlap ratio.

Usage: python tools/make_synthetic.py --output FILE --groups N --por P [--seed S] [--trials T]
       [--vocab-size 1024] [--max-tokens L]
FILE ending in .gz is gzip-compressed. Prints the achieved POR next to the target.
"""

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_tree.data.synthetic import SyntheticConfig, generate  # noqa: E402
from ds_tree.trees import build_forest  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--groups", required=True, type=int, help="number of tasks (trees)")
    parser.add_argument("--por", required=True, type=float, help="target POR in [0, 0.95]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=None, help="trials per task (default: 8 or what --por needs)")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=512, help="length cap of one trajectory")
    args = parser.parse_args(argv)
    try:
        config = SyntheticConfig(
            groups=args.groups,
            por=args.por,
            trials=args.trials,
            vocab_size=args.vocab_size,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
    except ValueError as error:
        parser.error(str(error))
    trajectories = list(generate(config))
    opener = gzip.open if args.output.suffix == ".gz" else open
    with opener(args.output, "wt", encoding="utf-8") as handle:
        for trajectory in trajectories:
            record = {
                "group_id": trajectory.group_id,
                "trial": trajectory.trial,
                "input_ids": trajectory.input_ids.tolist(),
                "loss_mask": trajectory.loss_mask.astype(int).tolist(),  # masks are 0/1 here
                "reward": trajectory.reward,
            }
            handle.write(json.dumps(record, separators=(",", ":")) + "\n")
    trees = build_forest(trajectories, merge="group")
    flat = sum(tree.flat_tokens for tree in trees)
    summary = {
        "output": str(args.output),
        "trajectories": len(trajectories),
        "groups": len({t.group_id for t in trajectories}),
        "flat_tokens": flat,
        "target_por": args.por,
        "por": 1.0 - sum(tree.n_tokens for tree in trees) / flat,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
