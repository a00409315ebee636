"""Mixture-of-experts models: exact float64 routing and the router's load-balancing loss.

Float64. transformers runs the experts through ``grouped_mm`` by default, which refuses float64,
and its softmax-top-k routers compute their probabilities in float32 whatever the model dtype.
A float64 model therefore gets the eager experts (a loop over experts, any dtype) and routers
that compute in the model dtype (:func:`use_float64_routing`): with float32 routing the router
weight gradient of the tree differs from the flat one by ~1e-8 relative (measured on tiny
Qwen3-MoE and Mixtral configs), because a shared prefix token's routing backward runs once on a
summed gradient instead of once per trajectory, each rounded to float32. Routers other than the
softmax-top-k ones a model's family names (its spec's ``routers``, :mod:`ds_tree.models.families`) are
refused in float64.

Load-balancing loss, per trajectory (a sequence-wise balance loss). For trajectory ``i`` of
``|i|`` tokens (all of them: prompt, first token and trained tokens alike), over the ``L`` MoE
layers, ``E`` experts, top-``K`` routing, with ``p_lt`` the softmax of token ``t``'s router
logits in layer ``l``:

    f_ie = sum_l sum_{t in i} [e in top-K(p_lt)] / (L |i|)        (a count: no gradient)
    P_ie = sum_l sum_{t in i} p_lte / (L |i|)
    aux_i = E * sum_e f_ie P_ie

which is transformers' ``load_balancing_loss_func`` applied to trajectory ``i`` alone (it pools
the layers the same way). The step's loss is the token-weighted mean
``aux = sum_i |i| aux_i / N_flat`` with ``N_flat = sum_i |i|`` over every trajectory of the
optimizer step (all ranks), and the trained objective adds ``coefficient * aux``. It is defined
for the families' softmax-top-k routers; a model with another router must set the coefficient to 0.

Why per trajectory: transformers pools ``f`` and ``P`` over a whole forward batch, so its value
depends on which sequences share a micro-batch, and tree and flat packing put different
sequences together; no micro-batch-pooled definition can agree between them. A trajectory is
never cut between rows (a split tree part carries its leaves' whole ancestor paths), so each
``aux_i`` is computed inside one row, in either mode, from the same router outputs.

Exactness in tree mode: a shared token stands for every trajectory through it, so its router
statistics enter each of their ``f_i`` and ``P_i``. With ``G_t = sum_{i through t} F_i / |i|``
(``F_i`` the summed counts) the row's share is ``E / (L^2 N_flat) * sum_t sum_e Q_te G_te``
(``Q_t = sum_l p_lt``) over its distinct tokens: each token's router probabilities weighted by
its multiplicity, per trajectory. Dropping that weighting (each tree token counted once) changes
the loss of every shared prefix; the tests check that it fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ds_tree.models.families import families_with, family_of_model
from ds_tree.models.token_mixing import UnsupportedModelError
from ds_tree.packing.rows import PackedRow


def known_routers() -> list[str]:
    """The routers of every registered family: they pick the top-k of a softmax over their logits (the
    load-balancing loss's model), and :func:`_router_forward_float64` reproduces their forward in float64."""
    return [router for spec in families_with(lambda spec: bool(spec.routers)) for router in spec.routers]


def router_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose first output is a layer's router logits (the model's own recording spec)."""
    model = getattr(model, "module", model)  # the DeepSpeed engine wraps the Hugging Face model
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None:
        return []
    target = getattr(recorder, "target_class", recorder)
    return [module for module in model.modules() if isinstance(module, target)]


def check_router_noise(model: torch.nn.Module) -> None:
    """Refuse router jitter: each copy of a token would draw its own noise, the tree's one copy one draw."""
    for module in model.modules():
        noise = getattr(module, "jitter_noise", 0.0) or 0.0
        if noise > 0:
            raise UnsupportedModelError(
                f"{type(module).__name__}: router jitter noise ({noise}, config router_jitter_noise) multiplies each "
                "token's hidden state by random noise during training, so a shared prefix token (one copy in the "
                "tree, one per trajectory in the flat baseline) would be routed differently in the two modes; set "
                "router_jitter_noise to 0"
            )


def _unknown_routers(model, routers: list[torch.nn.Module]) -> list[str]:
    """The classes of ``routers`` that ``model``'s family does not name."""
    return sorted({type(router).__name__ for router in routers} - set(family_of_model(model).routers))


def _router_forward_float64(self, hidden_states: torch.Tensor):
    """A softmax-top-k router (:func:`known_routers`) without its float32 cast: same outputs, in the model dtype."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    top_value, top_index = torch.topk(torch.softmax(router_logits, dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # Mixtral always normalises; Qwen's routers by config
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return router_logits, top_value, top_index


def use_float64_routing(model) -> int:
    """Eager experts and float64 routers for a float64 MoE model; returns how many routers changed."""
    routers = router_modules(model)
    if not routers:
        return 0
    refused = _unknown_routers(model, routers)
    if refused:
        raise UnsupportedModelError(
            f"{type(model).__name__}: router {', '.join(refused)} computes in float32, which float64 verification "
            f"cannot check to float64 round-off; float64 routing is known for {', '.join(known_routers())}. "
            "Run this model in float32"
        )
    model.set_experts_implementation("eager")  # grouped_mm refuses float64
    for router in routers:
        router.forward = _router_forward_float64.__get__(router)
    return len(routers)


def default_coefficient(model) -> float:
    """The model config's ``router_aux_loss_coef`` when the model has routers, else 0."""
    if not router_modules(model):
        return 0.0
    config = getattr(model, "module", model).config
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


@contextlib.contextmanager
def captured_router_logits(model: torch.nn.Module, enabled: bool = True) -> Iterator[list[torch.Tensor]]:
    """Collect each router's logits, in layer order, during the forwards run inside the block.

    Forward hooks, removed on exit: leave the block before the backward, where activation
    checkpointing would run the routers again.
    """
    captured: list[torch.Tensor] = []
    handles = []
    if enabled:
        handles = [
            router.register_forward_hook(lambda module, args, output: captured.append(output[0]))
            for router in router_modules(model)
        ]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class RouterAuxLoss:
    """The load-balancing loss of one optimizer step (module docstring)."""

    coefficient: float
    """Weight of the loss in the trained objective (``model.router_aux_loss_coef``)."""
    flat_tokens: float
    """``N_flat``: tokens of every trajectory of the step, all ranks."""
    num_experts: int
    top_k: int

    @classmethod
    def of_model(cls, model, coefficient: float | None, flat_tokens: float) -> RouterAuxLoss | None:
        """The loss for ``model`` (``None`` without a router, or with another router and coefficient 0);
        ``coefficient`` None: the model config's own."""
        routers = router_modules(model)
        if not routers:
            return None
        if coefficient is None:
            coefficient = default_coefficient(model)
        unknown = _unknown_routers(model, routers)
        if unknown:
            if coefficient:
                raise UnsupportedModelError(
                    f"model.router_aux_loss_coef ({coefficient}): the load-balancing loss is implemented for the "
                    f"softmax-top-k routers {', '.join(known_routers())}, not for {', '.join(unknown)}; "
                    "set it to 0"
                )
            return None
        return cls(float(coefficient), float(flat_tokens), int(routers[0].num_experts), int(routers[0].top_k))

    def row_share(self, router_logits: list[torch.Tensor], row: PackedRow) -> torch.Tensor:
        """``sum_i |i| aux_i / N_flat`` over the trajectories of ``row`` (differentiable).

        A sequence-parallel shard (rows ``[start, end)`` of its row) holds its own tokens' router
        outputs only: their top-k counts are summed over the sequence-parallel group into the whole
        row's (no gradient, one all-reduce in every rank of the group), so ``G_t`` is the row's, and the
        shard's share is its own tokens' ``Q_t G_t``; the shares of a row's shards add up to the row's.
        """
        if not router_logits:
            raise RuntimeError("no router logits were captured in the forward of an MoE model")
        layers = len(router_logits)
        start, end = getattr(row, "start", 0), getattr(row, "end", row.n_tokens)
        dtype = torch.float64 if router_logits[0].dtype == torch.float64 else torch.float32
        probabilities = [torch.softmax(logits.reshape(end - start, -1).to(dtype), dim=-1) for logits in router_logits]
        summed = torch.stack(probabilities).sum(0)  # Q: [tokens, experts]
        with torch.no_grad():
            counts = sum(
                F.one_hot(torch.topk(p, self.top_k, dim=-1).indices, self.num_experts).sum(-2).to(dtype)
                for p in probabilities
            )  # F per token: top-k assignments summed over layers
            if end - start != row.n_tokens:
                counts = _whole_row(counts, row.n_tokens, start)
            weights = self.trajectory_weights(counts, row)[start:end]
        scale = self.num_experts / (layers * layers * self.flat_tokens) if self.flat_tokens else 0.0
        return scale * (summed * weights).sum()

    def trajectory_weights(self, counts: torch.Tensor, row: PackedRow) -> torch.Tensor:
        """``G_t = sum_{i through t} F_i / |i|`` for every row token ``t`` (``F_i``: ``counts`` summed over ``i``)."""
        paths = layout_paths(row)
        weights = torch.zeros_like(counts)
        if not paths:
            return weights
        index = torch.as_tensor(np.concatenate(paths), device=counts.device)
        lengths = torch.as_tensor([len(path) for path in paths], device=counts.device)
        owner = torch.repeat_interleave(torch.arange(len(paths), device=counts.device), lengths)
        per_trajectory = torch.zeros(len(paths), counts.shape[1], dtype=counts.dtype, device=counts.device)
        per_trajectory.index_add_(0, owner, counts[index])
        per_trajectory /= lengths[:, None].to(counts.dtype)
        return weights.index_add_(0, index, per_trajectory[owner])


def layout_paths(row: PackedRow) -> list[np.ndarray]:
    """Row indices of every trajectory laid out in ``row`` (a shard's: its whole row's, on every shard)."""
    paths = []
    offset = 0
    for part in row.layout_parts:
        paths += [path + offset for path in part.paths]
        offset += part.n_tokens
    return paths


def _whole_row(counts: torch.Tensor, n_tokens: int, start: int) -> torch.Tensor:
    """A shard's per-token ``counts`` (from row index ``start``) summed over its sequence-parallel group
    into the whole row's ``[n_tokens, experts]``."""
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    whole = counts.new_zeros(n_tokens, counts.shape[1])
    whole[start : start + counts.shape[0]] = counts
    dist.all_reduce(whole, group=parallel_state_sp.get_sequence_parallel_group())
    return whole
