"""Triton tree attention against a float64 dense reference: forward and dq/dk/dv.

Runs on a GPU, or on the CPU under the Triton interpreter (``TRITON_INTERPRET=1`` in the
environment before Python starts: transformers and torch may import triton early):

    TRITON_INTERPRET=1 OMP_NUM_THREADS=1 python -m pytest tests/test_triton_attention.py -q

Inputs are fresh random numbers every run; a failure prints the seed to replay it.
"""

from __future__ import annotations

import functools
import os
import random

import pytest
import torch

from ds_tree.attention.reference import tree_attention_reference, visibility_mask
from ds_tree.kernel.block_stats import block_stats
from ds_tree.kernel.tile_lists import SCHEDULE_VARIABLE, SCHEDULES, classify_tiles

if not (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from ds_tree.kernel import kernels  # noqa: E402
from ds_tree.kernel.function import triton_tree_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not kernels.INTERPRET else "cpu"


@pytest.fixture(params=SCHEDULES)
def tile_schedule(request) -> str:
    """Every kernel test runs on both tile schedules: the per-tile loop and the full/partial lists."""
    return request.param


def reference(query, key, value, kv_end, scale=None):
    """The oracle: dense mask, any dtype (float64 here, or the test dtype for the bf16 rule)."""
    return tree_attention_reference(query, key, value, kv_end, scale)


# ---------------------------------------------------------------- random trees -> kv_end


def _append_tree(rng, kv_end, depth, max_depth, branching, max_node_len):
    """Append one tree in DFS pre-order; each token's kv_end is the end of its node's subtree."""
    start = len(kv_end)
    node_len = rng.randint(1, max_node_len)
    kv_end.extend([0] * node_len)
    if depth < max_depth:
        for _ in range(rng.randint(0, branching)):
            _append_tree(rng, kv_end, depth + 1, max_depth, branching, max_node_len)
    kv_end[start : start + node_len] = [len(kv_end)] * node_len


def random_forest_kv_end(rng, n, max_depth, branching, max_node_len, padding):
    """Random trees concatenated into ``n`` tokens, the last ``>= padding`` being padding.

    Padding tokens see only themselves (``kv_end = k + 1``), as the packer lays them out.
    """
    kv_end: list[int] = []
    for _ in range(50):  # draws that do not fit are dropped, so big trees cannot end the forest early
        tree: list[int] = []
        _append_tree(rng, tree, 0, max_depth, branching, max_node_len)
        if len(kv_end) + len(tree) <= n - padding:
            kv_end += [end + len(kv_end) for end in tree]
    kv_end += range(len(kv_end) + 1, n + 1)
    return kv_end


# GPU tiles are 128x64 (16x16 under the interpreter): on a GPU the rows and nodes grow by GROW so
# that every layout spans several tiles in both directions, as it does under the interpreter.
GROW = 1 if kernels.INTERPRET else 9
LAYOUTS = {
    # name: (n, builder(rng, n)); n is never a multiple of the 16-wide interpreter blocks (nor of 64).
    "causal": (77 * GROW, lambda rng, n: [n] * n),
    "deep_chain": (61 * GROW, lambda rng, n: random_forest_kv_end(rng, n, 12, 1, 6 * GROW, 1)),
    "wide_fork": (70 * GROW, lambda rng, n: random_forest_kv_end(rng, n, 1, 12, 3 * GROW, 2)),
    "one_token_nodes": (53 * GROW, lambda rng, n: random_forest_kv_end(rng, n, 4 + GROW // 3, 3, 1, 1)),
    "forest": (90 * GROW, lambda rng, n: random_forest_kv_end(rng, n, 4, 3, 9 * GROW, 3)),
}

# (layout, batch, query heads, kv heads, head dim): GQA ratios 1/2/4, native and padded head dims.
SHAPES = [
    ("causal", 1, 2, 2, 64),
    ("deep_chain", 2, 4, 2, 48),
    ("wide_fork", 1, 4, 1, 64),
    ("one_token_nodes", 1, 2, 1, 32),
    ("forest", 2, 4, 1, 80),
]


def _kv_end(layout, batch, rng):
    n, build = LAYOUTS[layout]
    return torch.tensor([build(rng, n) for _ in range(batch)], dtype=torch.int64)


def _poisoned(allocate):
    """Wrap a torch allocator so fresh float buffers start as NaN: unwritten elements show up."""

    def wrapper(*args, **kwargs):
        tensor = allocate(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    return wrapper


def _run(fn, inputs, kv_end, grad_out):
    """Output and (dq, dk, dv) of ``fn``; q/k/v enter as non-contiguous views, like HF passes them."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    views = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in leaves]
    out = fn(*views, kv_end.to(inputs[0].device))
    out.backward(grad_out)
    return [out.detach()] + [x.grad for x in leaves]


def _max_error(actual, expected):
    return (actual.double() - expected).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout,batch,heads_q,heads_kv,head_dim", SHAPES)
def test_matches_float64_reference(layout, batch, heads_q, heads_kv, head_dim, dtype, tile_schedule, monkeypatch):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kv_end = _kv_end(layout, batch, rng)
    n = kv_end.shape[1]
    inputs = [
        torch.randn(batch, heads, n, head_dim, dtype=torch.float64).to(dtype) for heads in (heads_q, heads_kv, heads_kv)
    ]
    grad_out = torch.randn(batch, n, heads_q, head_dim, dtype=torch.float64).to(dtype)
    # The reference sees exactly the rounded inputs, so only the computation's error is measured.
    expected = _run(reference, [x.double() for x in inputs], kv_end, grad_out.double())

    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty", _poisoned(torch.empty))
        patch.setattr(torch, "empty_like", _poisoned(torch.empty_like))
        kernel = functools.partial(triton_tree_attention, tile_schedule=tile_schedule)
        actual = _run(kernel, [x.to(DEVICE) for x in inputs], kv_end, grad_out.to(DEVICE))
    actual = [a.cpu() for a in actual]

    if dtype == torch.float32:
        # fp32 all the way (IEEE dots on GPU): errors are round-off, ~1e-6 at these sizes.
        bounds = [1e-5 * (1 + e.abs().max().item()) for e in expected]
    else:
        # 16-bit rule: at most twice the error of PyTorch's own computation in the same dtype.
        # The 1e-5 floor covers exact-zero gradients (a token that sees only itself), where
        # both leave fp32 round-off of ~1e-7 and a bare 2x would compare 0 with 0.
        # fp16 also gets the error an exact kernel makes by rounding its result to fp16: at
        # these small sizes that final rounding is most of both errors, so their maxima are
        # noisy and a bare 2x measured up to 1.8x (bf16, whose intermediates round 8x coarser,
        # up to 1.1x).
        own = _run(reference, inputs, kv_end, grad_out)
        bounds = [2 * _max_error(o, e) + 1e-5 for o, e in zip(own, expected, strict=True)]
        if dtype == torch.float16:
            bounds = [bound + _max_error(e.to(dtype), e) for bound, e in zip(bounds, expected, strict=True)]
    for name, a, e, bound in zip(("out", "dq", "dk", "dv"), actual, expected, bounds, strict=True):
        assert a.dtype == dtype and a.shape == e.shape, name
        assert not a.isnan().any(), f"{name}: unwritten (NaN) elements; seed {seed}"
        error = _max_error(a, e)
        assert error <= bound, f"{name}: max error {error:.3g} > {bound:.3g}; seed {seed}, kv_end {kv_end.tolist()}"


def test_causal_case_uses_the_unmasked_fast_path():
    """The tests above only cover the fast path if some layout has fully visible tiles."""
    block_m, block_n = kernels.block_sizes(64)["forward"]
    n = LAYOUTS["causal"][0]
    assert block_stats(torch.full((n,), n), block_m, block_n)["fully_visible_tiles"] > 0


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_layouts_meet_every_tile_class(direction):
    """The kernel tests above (both schedules) see full, partial and empty tiles below the diagonal, and
    ragged last blocks, with the tiles each kernel really uses."""
    block_m, block_n = kernels.block_sizes(64)[direction]
    rng = random.Random(0)
    counts = {"full": 0, "partial": 0, "empty below the diagonal": 0}
    for layout in LAYOUTS:
        kv_end = _kv_end(layout, 1, rng)
        n = kv_end.shape[1]
        assert n % block_m and n % block_n, f"{layout}: no ragged last block"
        listed, full = classify_tiles(kv_end, block_m, block_n)
        query_last = torch.clamp(torch.arange(0, n, block_m) + block_m, max=n) - 1
        below = torch.arange(0, n, block_n)[None, :] <= query_last[:, None]
        counts["full"] += int(full.sum())
        counts["partial"] += int((listed & ~full).sum())
        counts["empty below the diagonal"] += int((below & ~listed[0]).sum())
    assert all(counts.values()), counts


def test_schedule_comes_from_the_argument_or_the_environment(monkeypatch):
    """``tile_schedule`` wins, else ``$DS_TREE_TRITON_TILES``; an unknown name is refused naming its source."""
    q = torch.zeros(1, 2, 4, 16, device=DEVICE)
    monkeypatch.setenv(SCHEDULE_VARIABLE, "tiles")
    with pytest.raises(ValueError, match=r"\$DS_TREE_TRITON_TILES = 'tiles'"):
        triton_tree_attention(q, q, q, torch.full((1, 4), 4))
    assert triton_tree_attention(q, q, q, torch.full((1, 4), 4), tile_schedule="list").shape == (1, 4, 2, 16)
    with pytest.raises(ValueError, match="tile_schedule = 'bogus': choose one of loop, list"):
        triton_tree_attention(q, q, q, torch.full((1, 4), 4), tile_schedule="bogus")


def test_an_installed_configuration_is_used_and_exact(tile_schedule):
    """What autotune installs reaches the launch: other tile shapes than the defaults (a backward whose
    key blocks are wider than its query blocks), still exact on both schedules."""
    from ds_tree.kernel import autotune

    rng = random.Random(1)
    kv_end = _kv_end("forest", 1, rng)
    n = kv_end.shape[1]
    config = {"forward": (32, 16), "backward": (16, 32), "num_warps": 1, "num_stages": 1}
    key = kernels.tuning_key(32, torch.float32, n, tile_schedule)
    inputs = [torch.randn(1, heads, n, 32, dtype=torch.float64) for heads in (4, 2, 2)]
    grad_out = torch.randn(1, n, 4, 32, dtype=torch.float64)
    expected = _run(reference, inputs, kv_end, grad_out)
    with autotune.installed([{"key": key, "winner": config}]):
        assert kernels.launch_config(32, torch.float32, n, tile_schedule) == config
        kernel = functools.partial(triton_tree_attention, tile_schedule=tile_schedule)
        actual = _run(kernel, [x.float().to(DEVICE) for x in inputs], kv_end, grad_out.float().to(DEVICE))
    assert kernels.launch_config(32, torch.float32, n, tile_schedule) == kernels.block_sizes(32)
    for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected, strict=True):
        error = _max_error(a.cpu(), e)
        assert error <= 1e-5 * (1 + e.abs().max().item()), f"{name}: max error {error:.3g}"


def test_autotune_refuses_the_interpreter_and_the_cpu():
    from ds_tree.kernel import autotune

    with pytest.raises(RuntimeError, match="CUDA GPU only"):
        autotune.tune(torch.full((1, 8), 8), 2, 1, 16, torch.float32, "list")


def test_rejects_mismatched_heads():
    q = torch.zeros(1, 3, 4, 16, device=DEVICE)
    kv = torch.zeros(1, 2, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="multiple"):
        triton_tree_attention(q, kv, kv, torch.full((1, 4), 4))


# ---------------------------------------------------------------- block_stats


def test_block_stats_causal_sequence():
    # N=5, 2x2 tiles: query/key blocks [0,1] [2,3] [4]. The lower block triangle is visited
    # (3 + 2 + 1 = 6 tiles); only (q[2,3], k[0,1]) is fully visible: (q[4], k[0,1]) is a
    # ragged query block, whose last row index 5 is past min(kv_end) = 5.
    stats = block_stats(torch.full((5,), 5), block_m=2, block_n=2)
    assert stats == {
        "visited_tiles": 6,
        "fully_visible_tiles": 1,
        "total_tiles": 9,
        "useful_elements": 15,  # 5 + 4 + 3 + 2 + 1
        "computed_elements": 24,
        "tile_efficiency": 15 / 24,
    }


def test_block_stats_two_independent_sequences():
    # Two sequences of length 2 packed in one row: only the two diagonal tiles are visited,
    # each holding 3 visible pairs out of 4.
    two_sequences = torch.tensor([2, 2, 4, 4])
    stats = block_stats(two_sequences, block_m=2, block_n=2)
    assert stats == {
        "visited_tiles": 2,
        "fully_visible_tiles": 0,
        "total_tiles": 4,
        "useful_elements": 6,
        "computed_elements": 8,
        "tile_efficiency": 0.75,
    }
    # A batch sums its rows: causal length 4 visits 3 tiles (1 full) with 10 visible pairs.
    batch = block_stats(torch.stack([two_sequences, torch.full((4,), 4)]), block_m=2, block_n=2)
    assert (batch["visited_tiles"], batch["fully_visible_tiles"], batch["total_tiles"]) == (5, 1, 8)
    assert (batch["useful_elements"], batch["computed_elements"]) == (16, 20)


# ---------------------------------------------------------------- sliding window


def _depths(kv_end: torch.Tensor) -> torch.Tensor:
    """Each token's depth: the keys it sees besides itself are its ancestors (padding: depth 0)."""
    return visibility_mask(kv_end).sum(-1) - 1


# (layout, batch, query heads, kv heads, head dim, window). The causal window spans two to three
# key blocks, so its rows meet skipped, fully visible and masked tiles; the tree windows are shorter
# than the trees' depths (made so when a random forest comes out shallower).
WINDOW_SHAPES = [
    ("causal", 1, 2, 1, 16, 40 * GROW),
    ("deep_chain", 1, 4, 2, 16, 3),
    ("forest", 2, 2, 1, 16, 7 * GROW),
]


@pytest.mark.parametrize("layout,batch,heads_q,heads_kv,head_dim,window", WINDOW_SHAPES)
def test_window_matches_float64_reference(layout, batch, heads_q, heads_kv, head_dim, window, tile_schedule):
    """fp32 with a sliding window on the tokens' depths: forward and dq/dk/dv to fp32 round-off."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kv_end = _kv_end(layout, batch, rng)
    positions = _depths(kv_end)
    window = max(1, min(window, int(positions.max())))  # a random forest may be shallow: still cut its deepest path
    n = kv_end.shape[1]
    inputs = [torch.randn(batch, heads, n, head_dim, dtype=torch.float64) for heads in (heads_q, heads_kv, heads_kv)]
    grad_out = torch.randn(batch, n, heads_q, head_dim, dtype=torch.float64)
    expected = _run(
        lambda q, k, v, e: tree_attention_reference(q, k, v, e, positions=positions, window=window),
        inputs,
        kv_end,
        grad_out,
    )
    windowed = positions.to(DEVICE)
    actual = _run(
        lambda q, k, v, e: triton_tree_attention(
            q, k, v, e, positions=windowed, window=window, tile_schedule=tile_schedule
        ),
        [x.float().to(DEVICE) for x in inputs],
        kv_end,
        grad_out.float().to(DEVICE),
    )
    for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected, strict=True):
        error = _max_error(a.cpu(), e)
        bound = 1e-5 * (1 + e.abs().max().item())
        assert error <= bound, f"{name}: max error {error:.3g} > {bound:.3g}; seed {seed}, window {window}"


# ---------------------------------------------------------------- soft-capping (Gemma 2)

# (layout, batch, query heads, kv heads, head dim, window or None, cap, dtype). Queries and keys are drawn
# with variance 2 * cap, so the scaled scores (variance (2 * cap)**2 with the default scale) have a
# standard deviation of twice the cap: tanh saturates for many visible pairs and is in its linear part
# for others (checked).
SOFTCAP_SHAPES = [
    ("causal", 1, 2, 1, 16, None, 2.0, torch.float32),
    ("forest", 1, 4, 2, 16, None, 5.0, torch.float32),
    ("deep_chain", 1, 2, 1, 16, 3, 3.0, torch.float32),
    ("forest", 1, 2, 1, 16, 7 * GROW, 2.0, torch.float32),
    ("one_token_nodes", 1, 2, 1, 32, None, 3.0, torch.bfloat16),
    ("forest", 1, 4, 1, 16, 7 * GROW, 2.0, torch.float32),  # GQA 4 with a window and a cap
]


def softcap_errors(seed, layout, batch, heads_q, heads_kv, head_dim, window, cap, dtype, tile_schedule):
    """``{name: (max error, bound)}`` for out, dq, dk, dv of one random soft-capped case."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kv_end = _kv_end(layout, batch, rng)
    positions = _depths(kv_end) if window is not None else None
    if window is not None:
        window = max(1, min(window, int(positions.max())))
    n = kv_end.shape[1]
    inputs = [
        (std * torch.randn(batch, heads, n, head_dim, dtype=torch.float64)).to(dtype)
        for heads, std in ((heads_q, (2 * cap) ** 0.5), (heads_kv, (2 * cap) ** 0.5), (heads_kv, 1.0))
    ]
    grad_out = torch.randn(batch, n, heads_q, head_dim, dtype=torch.float64).to(dtype)
    options = {"positions": positions, "window": window, "softcap": cap}

    # The cap must bite: some visible scores far into tanh's flat part, some in its linear part.
    group = heads_q // heads_kv
    scores = inputs[0].double() @ inputs[1].double().repeat_interleave(group, 1).transpose(-1, -2) * head_dim**-0.5
    ratio = (scores / cap).abs()[visibility_mask(kv_end, positions, window)[:, None].expand_as(scores)]
    assert (ratio > 3).double().mean() > 0.03 and (ratio < 0.25).double().mean() > 0.01, seed

    def reference_capped(q, k, v, e):
        return tree_attention_reference(q, k, v, e, **options)

    expected = _run(reference_capped, [x.double() for x in inputs], kv_end, grad_out.double())
    device_options = {
        **options,
        "positions": None if positions is None else positions.to(DEVICE),
        "tile_schedule": tile_schedule,
    }
    actual = _run(
        lambda q, k, v, e: triton_tree_attention(q, k, v, e, **device_options),
        [x.to(DEVICE) for x in inputs],
        kv_end,
        grad_out.to(DEVICE),
    )
    if dtype == torch.float32:
        bounds = [1e-5 * (1 + e.abs().max().item()) for e in expected]
    else:  # the 16-bit rule of test_matches_float64_reference (bf16: no final-rounding term)
        own = _run(reference_capped, inputs, kv_end, grad_out)
        bounds = [2 * _max_error(o, e) + 1e-5 for o, e in zip(own, expected, strict=True)]
    errors = {}
    for name, a, e, bound in zip(("out", "dq", "dk", "dv"), actual, expected, bounds, strict=True):
        assert a.dtype == dtype and not a.isnan().any(), f"{name}: wrong dtype or NaN; seed {seed}"
        errors[name] = (_max_error(a.cpu(), e), bound)
    return errors


@pytest.mark.parametrize("layout,batch,heads_q,heads_kv,head_dim,window,cap,dtype", SOFTCAP_SHAPES)
def test_softcap_matches_float64_reference(
    layout, batch, heads_q, heads_kv, head_dim, window, cap, dtype, tile_schedule
):
    """Capped scores ``cap * tanh(s / cap)``: forward and dq/dk/dv against the float64 reference, with the
    tolerances of the uncapped tests for the same dtype."""
    seed = random.randrange(2**31)
    errors = softcap_errors(seed, layout, batch, heads_q, heads_kv, head_dim, window, cap, dtype, tile_schedule)
    for name, (error, bound) in errors.items():
        assert error <= bound, f"{name}: max error {error:.3g} > {bound:.3g}; seed {seed}, cap {cap}, window {window}"


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan")])
def test_rejects_bad_softcap(cap):
    q = torch.zeros(1, 2, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="soft-cap"):
        triton_tree_attention(q, q, q, torch.full((1, 4), 4), softcap=cap)
