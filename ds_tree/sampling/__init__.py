"""Sampling: the sampler's and episodes' settings (``settings``, torch-free: the config reads them), the
engines behind one interface (``interface``: prefix requests in, token continuations out, the tree driver
over segments), ``hf`` (the in-process tree sampler on a shared KV cache), ``vllm`` (a managed vLLM
server and its client) and ``state_cache`` (per-branch cache rows, recurrent layers' states included).
The rollouts above (:mod:`ds_tree.rollout`) use them.
"""
