"""Why the dfs mode walks in lockstep under ZeRO-3: a minimal reproduction of the failure without it
(not part of the suite: it waits for a timeout; the lockstep schedule is ``ds_tree.engine.dfs.lockstep``).

Two ranks make the same calls, two forwards and two backwards of the tiny Llama, in a different
order: rank 0 as the dfs walk of a parent and its child (forward, forward, backward, backward),
rank 1 as the walk of two leaves (forward, backward, forward, backward). ZeRO-3 gathers each
module's parameters collectively in the forward and again in the backward, so the ranks' gathers
no longer pair up and both wait until the process group's timeout; ZeRO-2 (parameters whole on
every rank, gradients reduced once per backward) completes. Run from the repository root:

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/torchrun --nproc_per_node 2 \\
        tests/distributed/dfs_zero3_repro.py TIMEOUT_S STAGE

Seen with DeepSpeed 0.19.8, gloo, timeout 60 s: stage 2 prints ``done`` on both ranks at once;
stage 3 prints ``RuntimeError after 60.1s: ... Timed out waiting 60000ms for send operation to
complete`` on both.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import deepspeed
import torch

from ds_tree.models.loading import load_model
from ds_tree.train import exit_now


def main() -> None:
    timeout_s, stage = float(sys.argv[1]), int(sys.argv[2])
    deepspeed.init_distributed(timeout=timedelta(seconds=timeout_s))
    rank = int(os.environ["RANK"])
    model = load_model("configs/models/tiny_llama.json", attention="reference")
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    inputs = {
        "input_ids": torch.arange(3, 11)[None],
        "position_ids": torch.arange(8)[None],
        "kv_end": torch.full((1, 8), 8),
        "use_cache": False,
    }

    def forward() -> torch.Tensor:
        return engine(**inputs).logits.sum()

    started = time.time()
    try:
        if rank == 0:  # a parent and its child: the child runs and backpropagates before the parent
            parent = forward()
            child = forward()
            engine.backward(child)
            engine.backward(parent)
        else:  # two leaves, one after the other
            engine.backward(forward())
            engine.backward(forward())
        print(f"rank {rank}: done in {time.time() - started:.1f}s", flush=True)
    except RuntimeError as error:
        print(f"rank {rank}: RuntimeError after {time.time() - started:.1f}s: {str(error)[:200]}", flush=True)


if __name__ == "__main__":
    main()
    exit_now(0)  # as the trainer leaves: past the finalisers that abort a rank now and then (ds_tree/train.py)
