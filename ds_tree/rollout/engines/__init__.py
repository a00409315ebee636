"""Sampling engines behind one interface (``interface``: prefix requests in, token continuations out,
the tree driver over segments): ``hf`` (the in-process tree sampler on a shared KV cache),
``vllm`` (a managed vLLM server and its client) and ``state_cache`` (the per-branch cache rows,
recurrent layers' states included). The loop, episodes and environments above use them.
"""
