"""Sampling throughput of the tree sampler on the hf and vllm engines (docs/ROLLOUTS.md).

The same model (configs/models/tiny_llama_vllm.json of the repository, float32, seed 0), the same
prompts (--groups of --prompt-tokens ids, after one warm-up group) and the same tree shape (the
sampler's default: 16-token segments, 2 x 2 x 2, 64 tokens, no EOS; --independent samples the
leaves independently) on each engine: hf, then vLLM with prefix caching on and off (a managed
server each, started from vLLM's own venv and stopped here). Prints one JSON line per engine as it
finishes: engine, groups, sampled tokens, seconds, tokens/s. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys

from ds_tree.cli.common import command_parser
from ds_tree.errors import DataError


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument(
        "--tokenizer", required=True, metavar="DIR", help="tokenizer directory (the vLLM server loads it)"
    )
    parser.add_argument("--groups", type=int, default=4, help="timed groups, after one warm-up (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=200, help="ids in each prompt (default %(default)s)")
    parser.add_argument("--independent", action="store_true", help="sample every leaf from the prompt (no tree)")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    for option, value in (("--groups", args.groups), ("--prompt-tokens", args.prompt_tokens)):
        if value < 1:
            parser.error(f"{option} must be >= 1")
    from ds_tree.bench.engines import engine_throughput
    from ds_tree.sampling.interface import EngineError

    name = prog or "ds-tree bench-engines"
    try:
        for result in engine_throughput(
            args.tokenizer, groups=args.groups, prompt_tokens=args.prompt_tokens, independent=args.independent
        ):
            print(json.dumps(result), flush=True)
    except DataError as error:
        print(f"{name}: error: {error}", file=sys.stderr)
        return 2
    except EngineError as error:
        print(f"{name}: error: {error}", file=sys.stderr)
        return 1
    return 0
