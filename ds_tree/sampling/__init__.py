"""Sampling: the sampler's and episodes' settings (``settings``, torch-free: the config reads them), the
prompts files and stop tokens (``prompts``), the engines behind one interface (``interface``: prefix
requests in, token continuations out, turn samplers, capabilities, the tree driver over segments),
``hf`` (the in-process tree sampler on a shared KV cache) and ``hf_engine`` (the ``hf`` engine on it),
``vllm`` (a managed vLLM server, its client and the ``vllm`` engine) and ``state_cache`` (per-branch
cache rows, recurrent layers' states included). The engines are registered in
:data:`ds_tree.registries.SAMPLING_ENGINES`; the rollouts above (:mod:`ds_tree.rollout`) use them.
"""
