"""Speed, measured tree against flat in one run (``ds-tree bench*``).

``steps`` (training steps, SFT and RL, and the cost-weighted ideal), ``sequence_parallel_rl``
(the RL step sharded over ranks), ``attention`` (the CPU attention engines alone), ``kernel`` (the
Triton kernel and FlexAttention), ``engines`` (sampling throughput of the hf and vLLM engines) and
``multiturn_reuse`` (tokens the multi-turn sampler computes, trees against independent episodes).
The benchmarks may reuse the checks (:mod:`ds_tree.verify`); the checks never import them.
"""
