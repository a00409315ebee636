"""Triton kernels for tree attention: FlashAttention-2 forward and backward with tile skipping.

Mask (docs/DESIGN.md section 2): query ``q`` sees key ``k`` iff ``k <= q < kv_end[k]``. Every query sees
itself, so no row is fully masked.

Algorithm
- Forward, one program per (query block, batch * query head): loop over key blocks, online
  softmax in the log2 domain (``exp2`` with ``scale * log2(e)`` folded into the scores), fp32
  accumulators, then store the output and the per-row log-sum-exp (log2 domain) for the backward.
- Backward, FlashAttention-2 split: ``delta = rowsum(dO * O)`` (small preprocess kernel); a dK/dV
  kernel, one program per (key block, batch * kv head), looping over query blocks; a dQ kernel,
  one program per (query block, batch * query head), looping over key blocks. Probabilities are
  recomputed from the saved log-sum-exp, so nothing of size N^2 is stored.
- Tile skipping: key block ``j`` can be visible to query block ``i`` only if it starts at or
  before the block's last query and ``max(kv_end[block j]) > first query``. The queries that see a
  key block form the contiguous range ``[first key, max kv_end)``, so the dK/dV loop covers only
  those query blocks. A tile whose keys all precede its first query and whose ``min(kv_end)``
  exceeds its last row is fully visible and skips the element mask. The rules are written once, in
  ``tile_lists.classify_tiles`` (per-key-block max/min of ``kv_end`` from the host,
  ``tile_lists.key_block_end_bounds``); ``block_stats`` counts the tiles they visit.
- Sliding window (``HAS_WINDOW``, a constexpr: the kernels without it are unchanged): query ``q``
  sees key ``k`` only if also ``positions[q] - positions[k] < window`` (the tokens' depths). The
  element mask loads the positions; a tile is skipped when its shallowest query is ``window`` or
  more deeper than its deepest key, and stays on the unmasked path only when its deepest query is
  within ``window`` of its shallowest key (per-block bounds from ``tile_lists.block_position_bounds``).
- Soft-capping (``HAS_SOFTCAP``, a constexpr like ``HAS_WINDOW``; Gemma 2's ``attn_logit_softcapping``):
  the scaled scores ``s = scale * q.k`` become ``cap * tanh(s / cap)`` before the mask and the
  softmax. The cap is applied in natural units and then carried into the log2 domain (``cap *
  log2(e)`` on the log2-domain scores is the same function). The backward recomputes ``t = tanh(s /
  cap)`` with the probabilities and multiplies the score gradient by ``1 - t^2``. tanh is built
  from ``tl.exp`` (no tanh in the interpreter): a Taylor polynomial near zero, ``(1 - e) / (1 + e)``
  with ``e = exp(-2|x|) <= 1`` elsewhere, so nothing overflows and it is accurate to a few ulps.
- GQA: query head ``h`` uses kv head ``h // group`` (HF ``repeat_kv`` order). K/V are never
  repeated in memory; the dK/dV program loops over the ``group`` query heads of its kv head and
  accumulates their contributions in registers, so no atomics are needed.

Tile schedules (``TILE_LIST``, a constexpr; ``tile_lists.SCHEDULES``)
- ``loop``: each program walks every key block up to its diagonal (the dK/dV program: every query
  block in its range) and decides per tile, inside the loop, whether to skip it, run it unmasked or
  run it masked. The branch in the loop body keeps Triton from software-pipelining the loads.
- ``list``: the host classifies every tile once (``tile_lists``, vectorised torch on the kernel's
  device) into per-block ordered lists of full and of partial tiles, FlexAttention's
  ``full_kv_indices`` / ``kv_indices`` pair; each program runs two loops without a branch, the full
  tiles unmasked, then the partial ones masked (``_forward_list``, ``_query_list``,
  ``_key_value_list``). The dK/dV lists are the backward classification transposed. The order of
  accumulation differs from ``loop`` (full tiles first), so results agree to round-off, not bits.
- The default stays ``loop`` (``tile_lists.DEFAULT_SCHEDULE``): both are exact under the interpreter
  (every Triton test runs on both), but ``list`` has not been timed on a GPU yet; ``gpu-check``'s
  kernel table times both (docs/KERNEL.md).
- Launch configurations: ``block_sizes`` (the defaults) unless ``autotune`` installed a measured
  winner for the shape bucket (``launch_config``, ``TUNED``; GPU only).

Limits
- ``HEAD_DIM`` must be a power of two >= 16 (``tl.arange`` and ``tl.dot`` shapes); the autograd
  wrapper pads other head dims with zeros, which changes neither scores nor the real outputs.
- Any N: the ragged last blocks are masked on load and store. Offsets are int32, so each of
  q, k, v and the output must hold fewer than 2**31 elements.
- fp32 inputs use IEEE fp32 dots (not TF32) so an fp32 caller gets fp32 accuracy; fp16/bf16
  inputs feed the tensor cores directly and accumulate in fp32. At D=128 the fp32 kernels need
  up to 144 KiB of shared memory (bf16: 64 KiB): fine on A100/H100, too much for consumer GPUs.
- The ``loop`` kernels ran on an H100 and an H200 (docs/KERNEL.md); the ``list`` kernels have run under
  the interpreter only.

Caveats
- The Triton interpreter (``TRITON_INTERPRET=1``, CPU tests) gets bf16 wrong twice: its bf16
  ``tl.dot`` returns garbage, and it converts fp32 to bf16 by truncation (twice the rounding
  error, biased towards zero). Under the interpreter with bf16 inputs (``INTERPRET_BF16``) dot
  operands are upcast to fp32 and results are rounded to nearest even before the cast. The CPU
  tests therefore do not see the rounding of the probabilities to bf16 that the GPU does
  before ``P @ V``.
- The running max starts at -1e30 rather than -inf: a row can meet tiles where all its keys are
  masked before it meets a visible one, and ``-inf - -inf`` would poison it with NaN.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ds_tree.kernel.tile_lists import (
    DEFAULT_SCHEDULE,
    TileLists,
    backward_tile_lists,
    block_position_bounds,
    key_block_end_bounds,
    query_tile_lists,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = math.log2(math.e)


TUNED: dict[tuple, dict] = {}
"""Configurations :mod:`ds_tree.kernel.autotune` measured fastest, keyed by
:func:`tuning_key`; empty unless a tuning was installed in this process (on a GPU only)."""


def length_bucket(n: int) -> int:
    """The shape bucket of a row of ``n`` tokens for tuned configurations: the next power of two, >= 128."""
    return max(128, 1 << (n - 1).bit_length())


def tuning_key(head_dim: int, dtype: torch.dtype, n: int, schedule: str) -> tuple:
    """What a tuned configuration is cached under: head dim, dtype, :func:`length_bucket`, schedule."""
    return head_dim, str(dtype).removeprefix("torch."), length_bucket(n), schedule


def launch_config(head_dim: int, dtype: torch.dtype, n: int, schedule: str) -> dict:
    """The tuned configuration of this shape bucket if one was measured, else :func:`block_sizes`."""
    return TUNED.get(tuning_key(head_dim, dtype, n, schedule)) or block_sizes(head_dim)


def block_sizes(head_dim: int) -> dict:
    """Default tile shapes and launch options; small tiles under the interpreter keep CPU tests fast.

    GPU values follow the FlashAttention-2 Triton tutorial: 128x64 forward tiles, 64x64 backward
    tiles (the dK/dV program holds k, v, dk and dv for its whole key block), 8 warps for D=128.
    """
    if INTERPRET:
        return {"forward": (16, 16), "backward": (16, 16), "num_warps": 1, "num_stages": 1}
    return {
        "forward": (128, 64),
        "backward": (64, 64),
        "num_warps": 4 if head_dim <= 64 else 8,
        "num_stages": 2,
    }


@triton.jit
def _operand(x, INTERPRET_BF16: tl.constexpr):
    """A ``tl.dot`` operand: bf16 is upcast to fp32 under the interpreter (its bf16 dot is broken)."""
    if INTERPRET_BF16:
        x = x.to(tl.float32)
    return x


@triton.jit
def _to_storage(x, dtype, INTERPRET_BF16: tl.constexpr):
    """Convert an fp32 result to the output dtype with round-to-nearest-even.

    The interpreter converts fp32 to bf16 by truncation, which doubles the worst-case rounding
    error and biases it towards zero; rounding the bits first (the usual +0x7FFF trick) leaves
    it an exact cast. The GPU rounds to nearest even by itself.
    """
    if INTERPRET_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _load_rows(base, rows, n, stride_row, offs_d, MASKED: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """Load ``[len(rows), HEAD_DIM]``; rows past ``n`` read as zero when ``MASKED``."""
    pointers = base + rows[:, None] * stride_row + offs_d[None, :]
    if MASKED:
        block = tl.load(pointers, mask=(rows < n)[:, None], other=0.0)
    else:
        block = tl.load(pointers)
    return _operand(block, INTERPRET_BF16)


@triton.jit
def _tile_is_full(key_start, query_start, min_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """All keys precede the first query and are visible past the last row (both blocks whole)."""
    return (key_start + BLOCK_N - 1 <= query_start) & (min_end > query_start + BLOCK_M - 1)


@triton.jit
def _visible(query_index, key_index, key_end, query_pos, key_pos, window, HAS_WINDOW: tl.constexpr):
    """The tree mask ``k <= q < kv_end[k]`` (and the window on the positions), broadcast over
    whatever tile shape the indices span.

    Callers pass ``[queries, 1]`` and ``[1, keys]`` indices, or the transpose for a
    ``[keys, queries]`` tile, so no boolean tile needs a ``tl.trans``.
    """
    visible = (key_index <= query_index) & (query_index < key_end)
    if HAS_WINDOW:
        visible = visible & (query_pos - key_pos < window)
    return visible


@triton.jit
def _load_positions(pos_base, index, n, HAS_WINDOW: tl.constexpr):
    """Positions of ``index`` (0 past ``n``, where kv_end masks anyway); ``index`` itself without a window."""
    if HAS_WINDOW:
        return tl.load(pos_base + index, mask=index < n, other=0)
    return index


@triton.jit
def _query_block_positions(QUERY_MAX_POS, QUERY_MIN_POS, block, HAS_WINDOW: tl.constexpr):
    """Deepest and shallowest position of a query block (unused zeros without a window)."""
    query_max_pos = 0
    query_min_pos = 0
    if HAS_WINDOW:
        query_max_pos = tl.load(QUERY_MAX_POS + block)
        query_min_pos = tl.load(QUERY_MIN_POS + block)
    return query_max_pos, query_min_pos


@triton.jit
def _tanh(x):
    """tanh from ``tl.exp``, to a few fp32 ulps relative, finite for every finite ``x``.

    Below ``|x| = 1/4`` a Taylor polynomial (truncation error < 1e-8 relative there): ``1 - exp(-2|x|)``
    would lose the relative accuracy of small ``x`` (an error of ~1e-7 absolute, which the cap then
    multiplies). Elsewhere ``sign(x) (1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` in ``(0, 1]``: no
    overflow, and ``e`` underflowing to 0 gives exactly +-1.
    """
    magnitude = tl.abs(x)
    e = tl.exp(-2.0 * magnitude)
    large = (1.0 - e) / (1.0 + e)
    large = tl.where(x < 0, -large, large)
    x2 = x * x
    # x - x^3/3 + 2x^5/15 - 17x^7/315 + 62x^9/2835
    small = x + x * x2 * (
        -0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (-0.05396825396825397 + x2 * 0.021869488536155203))
    )
    return tl.where(magnitude < 0.25, small, large)


@triton.jit
def _soft_cap(scores, softcap):
    """Gemma 2's soft-cap on log2-domain scores ``scores = s * log2(e)``, ``s = scale * q.k``.

    Returns ``cap * tanh(s / cap) * log2(e)`` (the capped score, back in the log2 domain) and ``t =
    tanh(s / cap)`` (the backward's ``1 - t^2``). The cap acts on ``s`` in natural units: with ``c2 =
    cap * log2(e)``, ``s / cap = scores / c2`` and ``cap * t * log2(e) = c2 * t``.
    """
    cap_log2 = softcap * 1.4426950408889634
    t = _tanh(scores * (1.0 / cap_log2))
    return t * cap_log2, t


@triton.jit
def _forward_tile(
    acc,
    row_max,
    row_sum,
    q,
    query_index,
    k_base,
    v_base,
    end_base,
    key_start,
    n,
    stride_kn,
    qk_scale,
    offs_n,
    offs_d,
    query_pos,
    pos_base,
    window,
    softcap,
    MASKED: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    key_index = key_start + offs_n
    k = _load_rows(k_base, key_index, n, stride_kn, offs_d, MASKED, INTERPRET_BF16)
    v = _load_rows(v_base, key_index, n, stride_kn, offs_d, MASKED, INTERPRET_BF16)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if HAS_SOFTCAP:  # capped before the mask: masked scores stay -inf
        scores, _ = _soft_cap(scores, softcap)
    if MASKED:
        # Keys past n read kv_end = 0 and so are invisible to every query.
        key_end = tl.load(end_base + key_index, mask=key_index < n, other=0)
        key_pos = _load_positions(pos_base, key_index, n, HAS_WINDOW)
        visible = _visible(
            query_index[:, None],
            key_index[None, :],
            key_end[None, :],
            query_pos[:, None],
            key_pos[None, :],
            window,
            HAS_WINDOW,
        )
        scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    correction = tl.exp2(row_max - new_max)
    p = tl.exp2(scores - new_max[:, None])
    row_sum = row_sum * correction + tl.sum(p, 1)
    acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, new_max, row_sum


@triton.jit
def _forward_list(
    acc,
    row_max,
    row_sum,
    tiles,
    count,
    q,
    query_index,
    k_base,
    v_base,
    end_base,
    n,
    stride_kn,
    qk_scale,
    offs_n,
    offs_d,
    query_pos,
    pos_base,
    window,
    softcap,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """:func:`_forward_tile` over the ``count`` key blocks listed at ``tiles``: all full (``MASKED`` False)
    or all partial, so the loop body has no branch."""
    for index in range(0, count):
        acc, row_max, row_sum = _forward_tile(
            acc,
            row_max,
            row_sum,
            q,
            query_index,
            k_base,
            v_base,
            end_base,
            tl.load(tiles + index) * BLOCK_N,
            n,
            stride_kn,
            qk_scale,
            offs_n,
            offs_d,
            query_pos,
            pos_base,
            window,
            softcap,
            MASKED,
            INTERPRET_BF16,
            DOT_PRECISION,
            HAS_WINDOW,
            HAS_SOFTCAP,
        )
    return acc, row_max, row_sum


@triton.jit
def _forward_kernel(
    Q,
    K,
    V,
    KV_END,
    BLOCK_MAX_END,
    BLOCK_MIN_END,
    FULL_TILES,
    FULL_COUNTS,
    PARTIAL_TILES,
    PARTIAL_COUNTS,
    list_width,
    OUT,
    LSE,
    POSITIONS,
    QUERY_MAX_POS,
    QUERY_MIN_POS,
    KEY_MAX_POS,
    KEY_MIN_POS,
    window,
    softcap,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_ob,
    stride_oh,
    stride_on,
    n,
    heads_q,
    group,
    num_key_blocks,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    TILE_LIST: tl.constexpr,
):
    query_start = tl.program_id(0) * BLOCK_M
    batch = tl.program_id(1) // heads_q
    head = tl.program_id(1) % heads_q
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    query_index = query_start + offs_m
    q = _load_rows(Q + batch * stride_qb + head * stride_qh, query_index, n, stride_qn, offs_d, True, INTERPRET_BF16)
    k_base = K + batch * stride_kb + (head // group) * stride_kh
    v_base = V + batch * stride_kb + (head // group) * stride_kh
    end_base = KV_END + batch * n
    bounds = batch * num_key_blocks
    pos_base = POSITIONS + batch * n
    query_pos = _load_positions(pos_base, query_index, n, HAS_WINDOW)
    query_max_pos, query_min_pos = _query_block_positions(
        QUERY_MAX_POS, QUERY_MIN_POS, batch * tl.num_programs(0) + tl.program_id(0), HAS_WINDOW
    )

    row_max = tl.full([BLOCK_M], -1.0e30, tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if TILE_LIST:  # two branch-free loops: the full tiles unmasked, then the partial ones masked
        row = batch * tl.num_programs(0) + tl.program_id(0)
        offset = row * list_width
        acc, row_max, row_sum = _forward_list(
            acc,
            row_max,
            row_sum,
            FULL_TILES + offset,
            tl.load(FULL_COUNTS + row),
            q,
            query_index,
            k_base,
            v_base,
            end_base,
            n,
            stride_kn,
            qk_scale,
            offs_n,
            offs_d,
            query_pos,
            pos_base,
            window,
            softcap,
            BLOCK_N,
            False,
            INTERPRET_BF16,
            DOT_PRECISION,
            HAS_WINDOW,
            HAS_SOFTCAP,
        )
        acc, row_max, row_sum = _forward_list(
            acc,
            row_max,
            row_sum,
            PARTIAL_TILES + offset,
            tl.load(PARTIAL_COUNTS + row),
            q,
            query_index,
            k_base,
            v_base,
            end_base,
            n,
            stride_kn,
            qk_scale,
            offs_n,
            offs_d,
            query_pos,
            pos_base,
            window,
            softcap,
            BLOCK_N,
            True,
            INTERPRET_BF16,
            DOT_PRECISION,
            HAS_WINDOW,
            HAS_SOFTCAP,
        )
    else:  # the loop schedule: every key block up to the diagonal, classified per tile
        last_key_block = (tl.minimum(query_start + BLOCK_M, n) - 1) // BLOCK_N
        for key_block in range(0, last_key_block + 1):
            key_start = key_block * BLOCK_N
            visible = tl.load(BLOCK_MAX_END + bounds + key_block) > query_start
            if HAS_WINDOW:  # no pair in the window: the shallowest query is too deep for the deepest key
                visible = visible & (query_min_pos - tl.load(KEY_MAX_POS + bounds + key_block) < window)
            if visible:
                min_end = tl.load(BLOCK_MIN_END + bounds + key_block)
                full = _tile_is_full(key_start, query_start, min_end, BLOCK_M, BLOCK_N)
                if HAS_WINDOW:  # every pair in the window: the deepest query reaches the shallowest key
                    full = full & (query_max_pos - tl.load(KEY_MIN_POS + bounds + key_block) < window)
                if full:
                    acc, row_max, row_sum = _forward_tile(
                        acc,
                        row_max,
                        row_sum,
                        q,
                        query_index,
                        k_base,
                        v_base,
                        end_base,
                        key_start,
                        n,
                        stride_kn,
                        qk_scale,
                        offs_n,
                        offs_d,
                        query_pos,
                        pos_base,
                        window,
                        softcap,
                        False,
                        INTERPRET_BF16,
                        DOT_PRECISION,
                        HAS_WINDOW,
                        HAS_SOFTCAP,
                    )
                else:
                    acc, row_max, row_sum = _forward_tile(
                        acc,
                        row_max,
                        row_sum,
                        q,
                        query_index,
                        k_base,
                        v_base,
                        end_base,
                        key_start,
                        n,
                        stride_kn,
                        qk_scale,
                        offs_n,
                        offs_d,
                        query_pos,
                        pos_base,
                        window,
                        softcap,
                        True,
                        INTERPRET_BF16,
                        DOT_PRECISION,
                        HAS_WINDOW,
                        HAS_SOFTCAP,
                    )

    # Rows past n never saw a key; keep them finite (they are not stored).
    row_sum = tl.where(row_sum > 0, row_sum, 1.0)
    out = acc / row_sum[:, None]
    in_range = query_index < n
    out_pointers = OUT + batch * stride_ob + head * stride_oh + query_index[:, None] * stride_on + offs_d[None, :]
    tl.store(out_pointers, _to_storage(out, OUT.dtype.element_ty, INTERPRET_BF16), mask=in_range[:, None])
    tl.store(LSE + (batch * heads_q + head) * n + query_index, row_max + tl.log2(row_sum), mask=in_range)


@triton.jit
def _delta_kernel(
    OUT,
    GRAD_OUT,
    DELTA,
    stride_ob,
    stride_oh,
    stride_on,
    n,
    heads_q,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """``delta = rowsum(dO * O)`` in fp32: the softmax-backward term shared by dQ and dK."""
    query_index = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    batch = tl.program_id(1) // heads_q
    head = tl.program_id(1) % heads_q
    offset = batch * stride_ob + head * stride_oh
    offs_d = tl.arange(0, HEAD_DIM)
    out = _load_rows(OUT + offset, query_index, n, stride_on, offs_d, True, False).to(tl.float32)
    grad_out = _load_rows(GRAD_OUT + offset, query_index, n, stride_on, offs_d, True, False).to(tl.float32)
    tl.store(DELTA + (batch * heads_q + head) * n + query_index, tl.sum(out * grad_out, 1), mask=query_index < n)


@triton.jit
def _key_value_tile(
    grad_k,
    grad_v,
    k,
    v,
    key_index,
    key_end,
    q_base,
    do_base,
    lse_base,
    delta_base,
    query_start,
    n,
    stride_qn,
    stride_on,
    qk_scale,
    offs_m,
    offs_d,
    key_pos,
    pos_base,
    window,
    softcap,
    MASKED: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """Add one query block's contribution to dK and dV, in transposed ``[keys, queries]`` form."""
    query_index = query_start + offs_m
    q = _load_rows(q_base, query_index, n, stride_qn, offs_d, MASKED, INTERPRET_BF16)
    grad_out = _load_rows(do_base, query_index, n, stride_on, offs_d, MASKED, INTERPRET_BF16)
    if MASKED:
        lse = tl.load(lse_base + query_index, mask=query_index < n, other=0.0)
        delta = tl.load(delta_base + query_index, mask=query_index < n, other=0.0)
    else:
        lse = tl.load(lse_base + query_index)
        delta = tl.load(delta_base + query_index)
    scores_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
    if HAS_SOFTCAP:
        scores_t, tanh_t = _soft_cap(scores_t, softcap)
    p_t = tl.exp2(scores_t - lse[None, :])
    if MASKED:
        query_pos = _load_positions(pos_base, query_index, n, HAS_WINDOW)
        visible = _visible(
            query_index[None, :],
            key_index[:, None],
            key_end[:, None],
            query_pos[None, :],
            key_pos[:, None],
            window,
            HAS_WINDOW,
        )
        p_t = tl.where(visible, p_t, 0.0)
    grad_v += tl.dot(p_t.to(grad_out.dtype), grad_out, input_precision=DOT_PRECISION)
    grad_p_t = tl.dot(v, tl.trans(grad_out), input_precision=DOT_PRECISION)
    grad_s_t = p_t * (grad_p_t - delta[None, :])
    if HAS_SOFTCAP:  # through the cap: d(cap * tanh(s / cap)) / ds = 1 - tanh^2
        grad_s_t = grad_s_t * (1.0 - tanh_t * tanh_t)
    grad_k += tl.dot(grad_s_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return grad_k, grad_v


@triton.jit
def _key_value_block(
    full,
    grad_k,
    grad_v,
    k,
    v,
    key_index,
    key_end,
    q_base,
    do_base,
    lse_base,
    delta_base,
    query_start,
    n,
    stride_qn,
    stride_on,
    qk_scale,
    offs_m,
    offs_d,
    key_pos,
    pos_base,
    window,
    softcap,
    INTERPRET_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """:func:`_key_value_tile` without the element mask when the tile is ``full``, with it otherwise."""
    if full:
        grad_k, grad_v = _key_value_tile(
            grad_k,
            grad_v,
            k,
            v,
            key_index,
            key_end,
            q_base,
            do_base,
            lse_base,
            delta_base,
            query_start,
            n,
            stride_qn,
            stride_on,
            qk_scale,
            offs_m,
            offs_d,
            key_pos,
            pos_base,
            window,
            softcap,
            False,
            INTERPRET_BF16,
            DOT_PRECISION,
            HAS_WINDOW,
            HAS_SOFTCAP,
        )
    else:
        grad_k, grad_v = _key_value_tile(
            grad_k,
            grad_v,
            k,
            v,
            key_index,
            key_end,
            q_base,
            do_base,
            lse_base,
            delta_base,
            query_start,
            n,
            stride_qn,
            stride_on,
            qk_scale,
            offs_m,
            offs_d,
            key_pos,
            pos_base,
            window,
            softcap,
            True,
            INTERPRET_BF16,
            DOT_PRECISION,
            HAS_WINDOW,
            HAS_SOFTCAP,
        )
    return grad_k, grad_v


@triton.jit
def _key_value_list(
    grad_k,
    grad_v,
    tiles,
    count,
    k,
    v,
    key_index,
    key_end,
    q_base,
    do_base,
    lse_base,
    delta_base,
    n,
    stride_qn,
    stride_on,
    qk_scale,
    offs_m,
    offs_d,
    key_pos,
    pos_base,
    window,
    softcap,
    BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """:func:`_key_value_tile` over the ``count`` query blocks listed at ``tiles``, all full or all partial."""
    for index in range(0, count):
        grad_k, grad_v = _key_value_tile(
            grad_k,
            grad_v,
            k,
            v,
            key_index,
            key_end,
            q_base,
            do_base,
            lse_base,
            delta_base,
            tl.load(tiles + index) * BLOCK_M,
            n,
            stride_qn,
            stride_on,
            qk_scale,
            offs_m,
            offs_d,
            key_pos,
            pos_base,
            window,
            softcap,
            MASKED,
            INTERPRET_BF16,
            DOT_PRECISION,
            HAS_WINDOW,
            HAS_SOFTCAP,
        )
    return grad_k, grad_v


@triton.jit
def _key_value_kernel(
    Q,
    K,
    V,
    GRAD_OUT,
    LSE,
    DELTA,
    KV_END,
    BLOCK_MAX_END,
    BLOCK_MIN_END,
    FULL_TILES,
    FULL_COUNTS,
    PARTIAL_TILES,
    PARTIAL_COUNTS,
    list_width,
    GRAD_K,
    GRAD_V,
    POSITIONS,
    QUERY_MAX_POS,
    QUERY_MIN_POS,
    KEY_MAX_POS,
    KEY_MIN_POS,
    window,
    softcap,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_ob,
    stride_oh,
    stride_on,
    n,
    heads_q,
    heads_kv,
    group,
    num_key_blocks,
    scale,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    TILE_LIST: tl.constexpr,
):
    key_block = tl.program_id(0)
    batch = tl.program_id(1) // heads_kv
    head_kv = tl.program_id(1) % heads_kv
    key_start = key_block * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    key_index = key_start + tl.arange(0, BLOCK_N)
    kv_offset = batch * stride_kb + head_kv * stride_kh
    k = _load_rows(K + kv_offset, key_index, n, stride_kn, offs_d, True, INTERPRET_BF16)
    v = _load_rows(V + kv_offset, key_index, n, stride_kn, offs_d, True, INTERPRET_BF16)
    key_end = tl.load(KV_END + batch * n + key_index, mask=key_index < n, other=0)
    max_end = tl.load(BLOCK_MAX_END + batch * num_key_blocks + key_block)
    min_end = tl.load(BLOCK_MIN_END + batch * num_key_blocks + key_block)
    pos_base = POSITIONS + batch * n
    key_pos = _load_positions(pos_base, key_index, n, HAS_WINDOW)
    key_max_pos = 0
    key_min_pos = 0
    if HAS_WINDOW:
        key_max_pos = tl.load(KEY_MAX_POS + batch * num_key_blocks + key_block)
        key_min_pos = tl.load(KEY_MIN_POS + batch * num_key_blocks + key_block)
    num_query_blocks = tl.cdiv(n, BLOCK_M)

    grad_k = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    grad_v = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    # Only queries in [key_start, max_end) see this key block; max_end > key_start always.
    first_query_block = key_start // BLOCK_M
    last_query_block = (max_end - 1) // BLOCK_M
    for member in range(0, group):
        head = head_kv * group + member
        q_base = Q + batch * stride_qb + head * stride_qh
        do_base = GRAD_OUT + batch * stride_ob + head * stride_oh
        lse_base = LSE + (batch * heads_q + head) * n
        delta_base = DELTA + (batch * heads_q + head) * n
        if TILE_LIST:
            row = batch * num_key_blocks + key_block
            offset = row * list_width
            grad_k, grad_v = _key_value_list(
                grad_k,
                grad_v,
                FULL_TILES + offset,
                tl.load(FULL_COUNTS + row),
                k,
                v,
                key_index,
                key_end,
                q_base,
                do_base,
                lse_base,
                delta_base,
                n,
                stride_qn,
                stride_on,
                qk_scale,
                offs_m,
                offs_d,
                key_pos,
                pos_base,
                window,
                softcap,
                BLOCK_M,
                False,
                INTERPRET_BF16,
                DOT_PRECISION,
                HAS_WINDOW,
                HAS_SOFTCAP,
            )
            grad_k, grad_v = _key_value_list(
                grad_k,
                grad_v,
                PARTIAL_TILES + offset,
                tl.load(PARTIAL_COUNTS + row),
                k,
                v,
                key_index,
                key_end,
                q_base,
                do_base,
                lse_base,
                delta_base,
                n,
                stride_qn,
                stride_on,
                qk_scale,
                offs_m,
                offs_d,
                key_pos,
                pos_base,
                window,
                softcap,
                BLOCK_M,
                True,
                INTERPRET_BF16,
                DOT_PRECISION,
                HAS_WINDOW,
                HAS_SOFTCAP,
            )
        else:
            for query_block in range(first_query_block, last_query_block + 1):
                query_start = query_block * BLOCK_M
                query_max_pos, query_min_pos = _query_block_positions(
                    QUERY_MAX_POS, QUERY_MIN_POS, batch * num_query_blocks + query_block, HAS_WINDOW
                )
                full = _tile_is_full(key_start, query_start, min_end, BLOCK_M, BLOCK_N)
                if HAS_WINDOW:
                    full = full & (query_max_pos - key_min_pos < window)
                    if query_min_pos - key_max_pos < window:  # else no pair of the tile is in the window
                        grad_k, grad_v = _key_value_block(
                            full,
                            grad_k,
                            grad_v,
                            k,
                            v,
                            key_index,
                            key_end,
                            q_base,
                            do_base,
                            lse_base,
                            delta_base,
                            query_start,
                            n,
                            stride_qn,
                            stride_on,
                            qk_scale,
                            offs_m,
                            offs_d,
                            key_pos,
                            pos_base,
                            window,
                            softcap,
                            INTERPRET_BF16,
                            DOT_PRECISION,
                            HAS_WINDOW,
                            HAS_SOFTCAP,
                        )
                else:
                    grad_k, grad_v = _key_value_block(
                        full,
                        grad_k,
                        grad_v,
                        k,
                        v,
                        key_index,
                        key_end,
                        q_base,
                        do_base,
                        lse_base,
                        delta_base,
                        query_start,
                        n,
                        stride_qn,
                        stride_on,
                        qk_scale,
                        offs_m,
                        offs_d,
                        key_pos,
                        pos_base,
                        window,
                        softcap,
                        INTERPRET_BF16,
                        DOT_PRECISION,
                        HAS_WINDOW,
                        HAS_SOFTCAP,
                    )

    in_range = (key_index < n)[:, None]
    pointers = kv_offset + key_index[:, None] * stride_kn + offs_d[None, :]
    # dS is the gradient of the scaled scores, so dK picks up the softmax scale once here.
    tl.store(GRAD_K + pointers, _to_storage(grad_k * scale, GRAD_K.dtype.element_ty, INTERPRET_BF16), mask=in_range)
    tl.store(GRAD_V + pointers, _to_storage(grad_v, GRAD_V.dtype.element_ty, INTERPRET_BF16), mask=in_range)


@triton.jit
def _query_tile(
    grad_q,
    q,
    grad_out,
    lse,
    delta,
    query_index,
    k_base,
    v_base,
    end_base,
    key_start,
    n,
    stride_kn,
    qk_scale,
    offs_n,
    offs_d,
    query_pos,
    pos_base,
    window,
    softcap,
    MASKED: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """Add one key block's contribution to dQ."""
    key_index = key_start + offs_n
    k = _load_rows(k_base, key_index, n, stride_kn, offs_d, MASKED, INTERPRET_BF16)
    v = _load_rows(v_base, key_index, n, stride_kn, offs_d, MASKED, INTERPRET_BF16)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if HAS_SOFTCAP:
        scores, tanh_s = _soft_cap(scores, softcap)
    p = tl.exp2(scores - lse[:, None])
    if MASKED:
        key_end = tl.load(end_base + key_index, mask=key_index < n, other=0)
        key_pos = _load_positions(pos_base, key_index, n, HAS_WINDOW)
        visible = _visible(
            query_index[:, None],
            key_index[None, :],
            key_end[None, :],
            query_pos[:, None],
            key_pos[None, :],
            window,
            HAS_WINDOW,
        )
        p = tl.where(visible, p, 0.0)
    grad_p = tl.dot(grad_out, tl.trans(v), input_precision=DOT_PRECISION)
    grad_s = p * (grad_p - delta[:, None])
    if HAS_SOFTCAP:  # through the cap: d(cap * tanh(s / cap)) / ds = 1 - tanh^2
        grad_s = grad_s * (1.0 - tanh_s * tanh_s)
    return grad_q + tl.dot(grad_s.to(k.dtype), k, input_precision=DOT_PRECISION)


@triton.jit
def _query_list(
    grad_q,
    tiles,
    count,
    q,
    grad_out,
    lse,
    delta,
    query_index,
    k_base,
    v_base,
    end_base,
    n,
    stride_kn,
    qk_scale,
    offs_n,
    offs_d,
    query_pos,
    pos_base,
    window,
    softcap,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """:func:`_query_tile` over the ``count`` key blocks listed at ``tiles``, all full or all partial."""
    for index in range(0, count):
        grad_q = _query_tile(
            grad_q,
            q,
            grad_out,
            lse,
            delta,
            query_index,
            k_base,
            v_base,
            end_base,
            tl.load(tiles + index) * BLOCK_N,
            n,
            stride_kn,
            qk_scale,
            offs_n,
            offs_d,
            query_pos,
            pos_base,
            window,
            softcap,
            MASKED,
            INTERPRET_BF16,
            DOT_PRECISION,
            HAS_WINDOW,
            HAS_SOFTCAP,
        )
    return grad_q


@triton.jit
def _query_kernel(
    Q,
    K,
    V,
    GRAD_OUT,
    LSE,
    DELTA,
    KV_END,
    BLOCK_MAX_END,
    BLOCK_MIN_END,
    FULL_TILES,
    FULL_COUNTS,
    PARTIAL_TILES,
    PARTIAL_COUNTS,
    list_width,
    GRAD_Q,
    POSITIONS,
    QUERY_MAX_POS,
    QUERY_MIN_POS,
    KEY_MAX_POS,
    KEY_MIN_POS,
    window,
    softcap,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_ob,
    stride_oh,
    stride_on,
    n,
    heads_q,
    group,
    num_key_blocks,
    scale,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    TILE_LIST: tl.constexpr,
):
    query_start = tl.program_id(0) * BLOCK_M
    batch = tl.program_id(1) // heads_q
    head = tl.program_id(1) % heads_q
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    query_index = query_start + tl.arange(0, BLOCK_M)
    in_range = query_index < n
    q_offset = batch * stride_qb + head * stride_qh
    q = _load_rows(Q + q_offset, query_index, n, stride_qn, offs_d, True, INTERPRET_BF16)
    do_base = GRAD_OUT + batch * stride_ob + head * stride_oh
    grad_out = _load_rows(do_base, query_index, n, stride_on, offs_d, True, INTERPRET_BF16)
    row = (batch * heads_q + head) * n + query_index
    lse = tl.load(LSE + row, mask=in_range, other=0.0)
    delta = tl.load(DELTA + row, mask=in_range, other=0.0)
    k_base = K + batch * stride_kb + (head // group) * stride_kh
    v_base = V + batch * stride_kb + (head // group) * stride_kh
    end_base = KV_END + batch * n
    bounds = batch * num_key_blocks
    pos_base = POSITIONS + batch * n
    query_pos = _load_positions(pos_base, query_index, n, HAS_WINDOW)
    query_max_pos, query_min_pos = _query_block_positions(
        QUERY_MAX_POS, QUERY_MIN_POS, batch * tl.num_programs(0) + tl.program_id(0), HAS_WINDOW
    )

    grad_q = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if TILE_LIST:
        row = batch * tl.num_programs(0) + tl.program_id(0)
        offset = row * list_width
        grad_q = _query_list(
            grad_q,
            FULL_TILES + offset,
            tl.load(FULL_COUNTS + row),
            q,
            grad_out,
            lse,
            delta,
            query_index,
            k_base,
            v_base,
            end_base,
            n,
            stride_kn,
            qk_scale,
            offs_n,
            offs_d,
            query_pos,
            pos_base,
            window,
            softcap,
            BLOCK_N,
            False,
            INTERPRET_BF16,
            DOT_PRECISION,
            HAS_WINDOW,
            HAS_SOFTCAP,
        )
        grad_q = _query_list(
            grad_q,
            PARTIAL_TILES + offset,
            tl.load(PARTIAL_COUNTS + row),
            q,
            grad_out,
            lse,
            delta,
            query_index,
            k_base,
            v_base,
            end_base,
            n,
            stride_kn,
            qk_scale,
            offs_n,
            offs_d,
            query_pos,
            pos_base,
            window,
            softcap,
            BLOCK_N,
            True,
            INTERPRET_BF16,
            DOT_PRECISION,
            HAS_WINDOW,
            HAS_SOFTCAP,
        )
    else:
        last_key_block = (tl.minimum(query_start + BLOCK_M, n) - 1) // BLOCK_N
        for key_block in range(0, last_key_block + 1):
            key_start = key_block * BLOCK_N
            visible = tl.load(BLOCK_MAX_END + bounds + key_block) > query_start
            if HAS_WINDOW:
                visible = visible & (query_min_pos - tl.load(KEY_MAX_POS + bounds + key_block) < window)
            if visible:
                min_end = tl.load(BLOCK_MIN_END + bounds + key_block)
                full = _tile_is_full(key_start, query_start, min_end, BLOCK_M, BLOCK_N)
                if HAS_WINDOW:
                    full = full & (query_max_pos - tl.load(KEY_MIN_POS + bounds + key_block) < window)
                if full:
                    grad_q = _query_tile(
                        grad_q,
                        q,
                        grad_out,
                        lse,
                        delta,
                        query_index,
                        k_base,
                        v_base,
                        end_base,
                        key_start,
                        n,
                        stride_kn,
                        qk_scale,
                        offs_n,
                        offs_d,
                        query_pos,
                        pos_base,
                        window,
                        softcap,
                        False,
                        INTERPRET_BF16,
                        DOT_PRECISION,
                        HAS_WINDOW,
                        HAS_SOFTCAP,
                    )
                else:
                    grad_q = _query_tile(
                        grad_q,
                        q,
                        grad_out,
                        lse,
                        delta,
                        query_index,
                        k_base,
                        v_base,
                        end_base,
                        key_start,
                        n,
                        stride_kn,
                        qk_scale,
                        offs_n,
                        offs_d,
                        query_pos,
                        pos_base,
                        window,
                        softcap,
                        True,
                        INTERPRET_BF16,
                        DOT_PRECISION,
                        HAS_WINDOW,
                        HAS_SOFTCAP,
                    )

    pointers = GRAD_Q + q_offset + query_index[:, None] * stride_qn + offs_d[None, :]
    tl.store(pointers, _to_storage(grad_q * scale, GRAD_Q.dtype.element_ty, INTERPRET_BF16), mask=in_range[:, None])


def _dot_options(dtype: torch.dtype) -> dict:
    return {
        "INTERPRET_BF16": INTERPRET and dtype == torch.bfloat16,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }


def _window_and_cap_arguments(kv_end, positions, window, block_m, block_n, softcap) -> tuple[list, dict]:
    """``POSITIONS, QUERY_MAX_POS, QUERY_MIN_POS, KEY_MAX_POS, KEY_MIN_POS, window, softcap`` and the
    ``HAS_WINDOW`` and ``HAS_SOFTCAP`` switches; without a window ``kv_end`` stands in for the unused
    pointers, without a cap 0.0 for the unused ``softcap``."""
    switches = {"HAS_WINDOW": window is not None, "HAS_SOFTCAP": softcap is not None}
    cap = [0.0 if softcap is None else float(softcap)]
    if window is None:
        return [kv_end] * 5 + [0] + cap, switches
    query_bounds = block_position_bounds(positions, block_m)
    key_bounds = block_position_bounds(positions, block_n)
    return [positions, *query_bounds, *key_bounds, window] + cap, switches


def _list_arguments(lists: TileLists | None, placeholder: torch.Tensor) -> tuple:
    """The kernels' ``FULL_TILES, FULL_COUNTS, PARTIAL_TILES, PARTIAL_COUNTS, list_width``; under the
    loop schedule (``lists`` None) ``placeholder`` stands in for the unused pointers."""
    return (placeholder,) * 4 + (1,) if lists is None else lists.kernel_arguments()


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_end: torch.Tensor,
    scale: float,
    positions: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    tile_schedule: str = DEFAULT_SCHEDULE,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ``[B, N, Hq, D]`` and log2-domain log-sum-exp ``[B, Hq, N]`` (fp32).

    q ``[B, Hq, N, D]``, k/v ``[B, Hkv, N, D]``, all contiguous with D a power of two >= 16;
    kv_end ``[B, N]`` int32 contiguous; with a ``window``, positions ``[B, N]`` int32 contiguous;
    ``softcap`` (> 0, or None) caps the scaled scores at ``softcap * tanh(s / softcap)``.
    ``tile_schedule`` is one of ``tile_lists.SCHEDULES``; ``config`` (tile shapes, warps, stages as
    :func:`block_sizes` returns them) defaults to :func:`launch_config`.
    """
    batch, heads_q, n, head_dim = q.shape
    config = config or launch_config(head_dim, q.dtype, n, tile_schedule)
    block_m, block_n = config["forward"]
    max_end, min_end = key_block_end_bounds(kv_end, block_n)
    lists = query_tile_lists(kv_end, block_m, block_n, positions, window) if tile_schedule == "list" else None
    extra_arguments, switches = _window_and_cap_arguments(kv_end, positions, window, block_m, block_n, softcap)
    out = torch.empty(batch, n, heads_q, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads_q, n, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(n, block_m), batch * heads_q)
    _forward_kernel[grid](
        q,
        k,
        v,
        kv_end,
        max_end,
        min_end,
        *_list_arguments(lists, kv_end),
        out,
        lse,
        *extra_arguments,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        out.stride(0),
        out.stride(2),
        out.stride(1),
        n,
        heads_q,
        heads_q // k.shape[1],
        max_end.shape[1],
        scale * LOG2E,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        **_dot_options(q.dtype),
        **switches,
        TILE_LIST=lists is not None,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return out, lse


def backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kv_end: torch.Tensor,
    scale: float,
    positions: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    tile_schedule: str = DEFAULT_SCHEDULE,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` shaped like q, k, v; grad_out and out are ``[B, N, Hq, D]``.

    Same layout requirements and options as :func:`forward`; ``out`` and ``lse`` are what it
    returned (with the same ``window`` and ``softcap``; the schedule and config may differ).
    """
    batch, heads_q, n, head_dim = q.shape
    heads_kv = k.shape[1]
    config = config or launch_config(head_dim, q.dtype, n, tile_schedule)
    block_m, block_n = config["backward"]
    max_end, min_end = key_block_end_bounds(kv_end, block_n)
    query_lists = key_lists = None
    if tile_schedule == "list":
        query_lists, key_lists = backward_tile_lists(kv_end, block_m, block_n, positions, window)
    extra_arguments, switches = _window_and_cap_arguments(kv_end, positions, window, block_m, block_n, softcap)
    launch = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    out_strides = (out.stride(0), out.stride(2), out.stride(1))
    delta = torch.empty_like(lse)
    _delta_kernel[(triton.cdiv(n, block_m), batch * heads_q)](
        out, grad_out, delta, *out_strides, n, heads_q, BLOCK_M=block_m, HEAD_DIM=head_dim, **launch
    )

    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), *out_strides)
    constants = {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "HEAD_DIM": head_dim,
        **_dot_options(q.dtype),
        **switches,
        "TILE_LIST": tile_schedule == "list",
    }
    grad_k = torch.empty_like(k)
    grad_v = torch.empty_like(v)
    _key_value_kernel[(max_end.shape[1], batch * heads_kv)](
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        kv_end,
        max_end,
        min_end,
        *_list_arguments(key_lists, kv_end),
        grad_k,
        grad_v,
        *extra_arguments,
        *strides,
        n,
        heads_q,
        heads_kv,
        heads_q // heads_kv,
        max_end.shape[1],
        scale,
        scale * LOG2E,
        **constants,
        **launch,
    )
    grad_q = torch.empty_like(q)
    _query_kernel[(triton.cdiv(n, block_m), batch * heads_q)](
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        kv_end,
        max_end,
        min_end,
        *_list_arguments(query_lists, kv_end),
        grad_q,
        *extra_arguments,
        *strides,
        n,
        heads_q,
        heads_q // heads_kv,
        max_end.shape[1],
        scale,
        scale * LOG2E,
        **constants,
        **launch,
    )
    return grad_q, grad_k, grad_v
