"""Sampling throughput of the tree sampler on the hf and vllm engines (docs/ROLLOUTS.md, *Sampling engines*).

Same model (configs/models/tiny_llama_vllm.json, float32, seed 0), same prompts and tree shape on
each engine; vLLM with prefix caching on and off (a managed server each, started and stopped here).
Prints one JSON line per engine: sampled tokens, seconds, tokens/s (after one warm-up group).

    python tools/bench_engines.py --tokenizer DIR [--groups 4] [--prompt-tokens 200]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--independent", action="store_true")
    args = parser.parse_args()

    import torch

    from ds_tree.data.convert import load_tokenizer
    from ds_tree.models.loading import load_model
    from ds_tree.rollout.engines import HFEngine
    from ds_tree.rollout.settings import SamplerSettings
    from ds_tree.rollout.vllm_engine import open_engine

    model = load_model("configs/models/tiny_llama_vllm.json", dtype="float32", seed=0).eval()
    tokenizer = load_tokenizer(args.tokenizer)
    settings = SamplerSettings(independent=args.independent)  # 16-token segments, 2 x 2 x 2, 64 tokens
    prompts = [[3 + (7 * g + i) % 1000 for i in range(args.prompt_tokens)] for g in range(args.groups + 1)]

    def run(name, engine):
        trees, seconds = [], 0.0
        for index, prompt in enumerate(prompts):
            started = time.perf_counter()
            tree = engine.sample_tree(
                prompt, settings, generator=torch.Generator().manual_seed(index), eos_token_ids=()
            )
            if index:  # the first group warms up
                seconds += time.perf_counter() - started
                trees.append(tree)
        tokens = sum(t.sampled_tokens for t in trees)
        print(
            json.dumps(
                {
                    "engine": name,
                    "groups": len(trees),
                    "sampled_tokens": tokens,
                    "seconds": round(seconds, 3),
                    "tokens_per_s": round(tokens / seconds, 1),
                }
            ),
            flush=True,
        )

    with torch.no_grad():
        run("hf", HFEngine(model))
    for caching in (True, False):
        with tempfile.TemporaryDirectory() as directory:
            engine = open_engine(model, tokenizer, "", directory, prefix_caching=caching, max_model_len=1024)
            try:
                run(f"vllm (prefix caching {'on' if caching else 'off'})", engine)
            finally:
                engine.close()


if __name__ == "__main__":  # vLLM's server is a separate process; the guard keeps imports side-effect free
    main()
