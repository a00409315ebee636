"""Check tree mode against the flat baseline: same weights, same data, one JSON report.

    ds-tree verify --data PATH --model CONFIG_OR_DIR [--dtype float64|float32]
        [--seed N] [--budget TOKENS] [--attention torch|reference|triton]

PATH is a tokens JSONL file (one trajectory a line) or a dataset directory written by
``ds-tree convert``. Exits 1 when the errors exceed the dtype's tolerance, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from ds_tree.attention.registry import ENGINES
from ds_tree.data import load_trajectories
from ds_tree.errors import DataError
from ds_tree.losses import NORMALISATIONS, POLICIES
from ds_tree.verification import VERIFY_DTYPES, compare


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", required=True, help="tokens JSONL file or converted dataset directory")
    parser.add_argument("--model", required=True, help="model config JSON (random init) or local HF directory")
    parser.add_argument("--dtype", default="float64", choices=VERIFY_DTYPES)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init")
    parser.add_argument("--budget", type=int, default=4096, help="token budget of one packed row")
    parser.add_argument("--block", type=int, default=1, help="pad rows to a multiple of this")
    parser.add_argument("--attention", default="torch", choices=ENGINES)
    parser.add_argument("--normalisation", default="token_mean", choices=NORMALISATIONS)
    parser.add_argument("--policy", default="exact", choices=POLICIES)
    parser.add_argument("--limit", type=int, default=None, help="use only the first N trajectories")
    args = parser.parse_args(argv)
    try:
        trajectories = load_trajectories(args.data)
        if args.limit is not None:
            trajectories = trajectories[: args.limit]
        report = compare(
            trajectories,
            args.model,
            dtype=args.dtype,
            seed=args.seed,
            budget=args.budget,
            block=args.block,
            attention=args.attention,
            normalisation=args.normalisation,
            policy=args.policy,
        )
    except (DataError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1
