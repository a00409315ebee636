"""Predicted peak memory per rank: model states under ZeRO, activations of one packed row, the LM head.

Pure arithmetic on the model's shape and the training config (``ds-tree plan``, docs/MEMORY.md).

Model states, ``P`` parameters over ``N`` data-parallel ranks (DeepSpeed's layout):

- parameters in the model dtype (2 bytes bf16, 4 float32), gradients likewise;
- optimizer states: an fp32 master copy of the parameters (DeepSpeed keeps one at stages 1-3 even
  in float32, and bf16 always needs it) and AdamW's two fp32 moments: 12 bytes per parameter
  (stage 0 in float32: 8, the moments only: the torch optimizer updates the parameters in place);
- stage 1 partitions the optimizer states over the ranks, stage 2 the gradients as well, stage 3
  the parameters too, which are then gathered one module at a time (the largest module's full
  parameters are the working set);
- ``offload_optimizer`` moves the optimizer states and (stages 2-3) the gradient partition, kept
  there in fp32, to CPU memory; ``offload_param`` (stage 3) the parameter partition;
- an RL objective with ``kl_coef > 0`` adds the frozen reference model's parameters: whole on every
  rank, or ``1 / N`` of them under ``model.zero_init`` (in CPU memory with ``objective.reference_offload``).

Activations of one row of ``tokens`` tokens, the bytes autograd keeps for the backward, per token
and decoder layer of a Llama-style layer (hidden ``h``, MLP width ``I``, ``Hq`` query and ``Hkv``
key/value heads of width ``d``, ``b`` bytes per element of the model dtype):

- each RMSNorm: its float32 input, the normalised float32 value, the cast and weighted outputs:
  ``12 h`` bytes (float32 and bf16 alike: transformers normalises in float32) + 4 (the rsqrt); with
  per-head query and key norms (Qwen3) ``(8 d + 4) (Hq + Hkv)`` more (their outputs go into RoPE,
  which keeps only cos and sin);
- attention: RoPE'd queries and keys, values, the output and its copy laid out for the output
  projection: ``b (3 Hq d + 2 Hkv d)``, and the float32 log-sum-exp per query head ``4 Hq``;
- the gated MLP: gate and up projections, the activation and the product: ``4 b I``.

A recurrent layer of a hybrid model (Gated DeltaNet: Qwen3.5, Qwen3-Next; Mamba2: Bamba, Falcon-H1)
keeps its mixer's tensors instead of attention's (a Falcon-H1 layer: both), counted tensor by tensor
from ``ds_tree/models/hybrid.py`` and ``ds_tree/scans/linear_scans.py`` in :class:`RecurrentMixer`
(its sizes read off the mixer by the family's memory hook, ``recurrent.sizes``):
per token, per token of the scan (each node padded to a multiple of the scan's chunk) and per scan
chunk of a node (the state it starts from), so a row's nodes matter (:class:`RowNodes`).

With checkpointing (layers ``0, k, 2k, ...``) a checkpointed layer keeps only its input, ``b h`` per
token, and the backward recomputes one layer at a time: its activations and the first gradients of
its backward (:func:`gradient_working_set_per_token`) are live on top of what the layers below keep.

The LM head runs on targets only (tokens with a loss weight): worst case every token of the row.
Per target and vocabulary entry it holds the float32 log-softmax (saved), its gradient and the
logits' gradient at the backward's start (plus the float32 ``exp`` and product of the entropy in
RL); ``head_chunk`` bounds the targets that hold them at once.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
ADAM_STATE_BYTES = 8
"""AdamW's two fp32 moments per parameter."""
MASTER_BYTES = 4
"""DeepSpeed's fp32 master copy of a parameter (ZeRO stages 1-3, and bf16 at any stage)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class RowNodes:
    """How a packed row's tokens fall into tree nodes, for the recurrent layers' tree scan
    (``ds_tree.models.hybrid.scan_levels``): ``nodes`` nodes, and the tokens the scan runs over for a scan
    chunk (each level's nodes batched in groups right-padded to a multiple of the chunk)."""

    nodes: int
    scan_tokens: dict[int, int]
    """Scan chunk -> tokens the scan runs over, padding included (a chunk not listed: :meth:`padded`)."""

    def padded(self, tokens: int, chunk: int) -> int:
        """Tokens scanned at ``chunk``; not listed: the row as one node, ``tokens`` rounded up to the chunk."""
        return self.scan_tokens.get(chunk, -(-tokens // chunk) * chunk)


ONE_NODE = RowNodes(1, {})
"""A row that is one node (a chain; the plan's row of ``packing.budget`` tokens)."""


@dataclass(frozen=True)
class RecurrentMixer:
    """The sizes of a hybrid model's recurrent mixer that decide what its tree forward keeps.

    Per token (``b`` bytes of the model dtype, ``f = 4``: the scans and the gated norm compute in
    float32 for float32 and bf16 models), counted on the autograd graph of
    ``ds_tree/models/hybrid.py`` and ``ds_tree/scans/linear_scans.py`` (every saved tensor, parameters
    and the layer's input excluded: 11780 of 11788 bytes per token for tiny Qwen3.5's mixer, 10637.5 of
    10640 for tiny Bamba's; the rest is the scan's constant ``chunk x chunk`` mask):

    - the tree convolution: its input laid out with ``K - 1`` history inputs before each node, and the
      activation's input: ``b C (2 + (K - 1) nodes / tokens)`` for ``C`` conv channels; four int64
      gather indices and a bool mask (the conv's and the scan's): 33;
    - Gated DeltaNet (``H`` value heads of ``Dk`` / ``Dv``): on the row, q and k and their L2 norms
      before the chunked layout ``2 f H (Dk + 1)``, beta and the decay's softplus ``3 f H``, the gated
      norm ``4 (5 H Dv + H)`` (float32 inside) and ``out_proj``'s input ``b H Dv``; on the scan's padded
      tokens five ``H x chunk`` float32 matrices per token (the decays between positions, the two
      ``k k^T`` and ``q k^T`` products, the solved system, the within-chunk scores), ten ``H Dk`` and
      three ``H Dv`` float32 tensors (keys, queries and their decayed and solved forms, the two batched
      products' copies; values, corrected values, the per-chunk new values) and ``4 f H``; per scan
      chunk of a node its starting state ``f H Dk Dv``;
    - Mamba2 (``H`` heads of ``P``, ``G`` groups of state size ``N``): on the row, ``in_proj``'s whole output
      ``b W`` (the gated norm holds the gate, a view of it), x ``f H P``, the gated norm ``4 (4 H P + G)``,
      ``out_proj``'s input ``b H P``, dt ``3 f H``; on the scan's padded tokens five ``H x chunk`` float32
      matrices (the decays, the scores, the einsums' copies), B and C per head and the einsums' copies
      ``5 f H N``, the carried output ``f H P``, ``2 f H``; per scan chunk the state ``f H P N``.
    """

    kind: str
    """``gated_delta`` or ``mamba2``."""
    heads: int
    """Value heads (Gated DeltaNet) or heads (Mamba2)."""
    key_dim: int
    """Gated DeltaNet: a key head's width ``Dk``; Mamba2: the state size ``N``."""
    value_dim: int
    """Gated DeltaNet: a value head's width ``Dv``; Mamba2: a head's width ``P``."""
    groups: int
    """Mamba2: the groups of B and C (and of the gated norm); Gated DeltaNet: key heads."""
    conv_channels: int
    conv_kernel: int
    chunk: int
    """The scan's chunk (Gated DeltaNet: ``ds_tree.models.hybrid.GATED_DELTA_CHUNK``; Mamba2: ``chunk_size``)."""
    projected: int = 0
    """Mamba2: ``in_proj``'s output width (gate, conv input and dt)."""

    def bytes(self, dtype: str, tokens: int, row: RowNodes = ONE_NODE) -> int:
        """What the mixer keeps for the backward over ``tokens`` tokens in ``row``'s nodes (class docstring)."""
        b, f, h = DTYPE_BYTES[dtype], 4, self.heads
        scanned = row.padded(tokens, self.chunk)
        conv = b * self.conv_channels * (2 * tokens + (self.conv_kernel - 1) * row.nodes) + 33 * tokens
        if self.kind == "gated_delta":
            dk, dv = self.key_dim, self.value_dim
            on_row = 2 * f * h * (dk + 1) + 3 * f * h + 4 * (5 * h * dv + h) + b * h * dv
            on_scan = 5 * f * h * self.chunk + f * h * (10 * dk + 3 * dv) + 4 * f * h
            state = f * h * dk * dv
        else:
            p, n = self.value_dim, self.key_dim
            on_row = b * self.projected + f * h * p + 4 * (4 * h * p + self.groups) + b * h * p + 3 * f * h
            on_scan = 5 * f * h * self.chunk + 5 * f * h * n + f * h * p + 2 * f * h
            state = f * h * p * n
        return conv + on_row * tokens + on_scan * scanned + state * (scanned // self.chunk)


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a decoder-only model's config."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    parameters: int
    """Trainable parameters (embedding and an untied LM head included)."""
    largest_module: int
    """Parameters of the largest module ZeRO-3 gathers at once (an embedding or the LM head)."""
    qk_norm: bool = False
    """Queries and keys are RMS-normalised per head before RoPE (Qwen3)."""
    recurrent: RecurrentMixer | None = None
    """A hybrid model's recurrent mixer (None: attention only)."""
    recurrent_layers: tuple[int, ...] = ()
    """The decoder layers that run the recurrent mixer."""
    attention_free: tuple[int, ...] = ()
    """The recurrent layers without attention (all of them but Falcon-H1's, which run both)."""

    @classmethod
    def of(cls, config) -> ModelShape:
        """From a Hugging Face config (``ds_tree.models.loading.load_config``): parameters counted on
        a model built on the ``meta`` device (no memory), so any architecture is counted exactly."""
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        from ds_tree.models.families import family_of

        vision = getattr(config, "vision_config", None) is not None  # a vision-language model: its tower counted
        recurrent = family_of(config).recurrent  # a hybrid's recurrent mixers, and their memory hook
        with torch.device("meta"):
            model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_config(config)
        if vision:  # the sizes below are the language model's
            config = config.get_text_config()
        parameters = sum(p.numel() for p in model.parameters())
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        qk_norm = any(name.endswith((".q_norm", ".k_norm")) for name, _ in model.named_modules())
        forwards = {} if recurrent is None else recurrent.tree_forwards
        mixers = {m.layer_idx: m for m in model.modules() if type(m).__name__ in forwards}
        attention = {  # the decoder layers with attention (``...layers.<i>.self_attn``)
            int(parts[-2])
            for parts in (name.split(".") for name, _ in model.named_modules())
            if parts[-1] == "self_attn" and len(parts) > 1 and parts[-2].isdigit()
        }
        mixer = RecurrentMixer(**recurrent.sizes(next(iter(mixers.values())))) if mixers else None
        heads = config.num_attention_heads
        return cls(
            vocab=config.vocab_size,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            parameters=parameters,
            largest_module=largest,
            qk_norm=qk_norm,
            recurrent=mixer,
            recurrent_layers=tuple(sorted(mixers)),
            attention_free=tuple(sorted(set(mixers) - attention)),
        )


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes of one rank, on the accelerator and in CPU memory."""

    parameters: int
    gradients: int
    optimizer: int
    gathered: int
    """ZeRO-3: the largest module's parameters, gathered whole for its forward and backward."""
    cpu: int
    """What offload keeps in CPU memory instead (not part of the accelerator's total)."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.gathered


def state_bytes(
    shape: ModelShape,
    dtype: str,
    stage: int,
    world_size: int,
    *,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    trained: int | None = None,
) -> StateBytes:
    """Parameters, gradients and AdamW states per rank under ZeRO ``stage`` (module docstring).
    ``trained``: parameters with gradients and optimizer states (LoRA: the adapters; ``shape.parameters``
    then counts the frozen base and the adapters); None: all of them."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage must be 0-3, got {stage}")
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if offload_param and stage != 3:
        raise ValueError("zero_optimization.offload_param needs ZeRO stage 3")
    if offload_optimizer and stage == 0:
        raise ValueError("zero_optimization.offload_optimizer needs ZeRO stage 1-3")
    count, width = shape.parameters, DTYPE_BYTES[dtype]
    trained = count if trained is None else trained
    master = 0 if stage == 0 and dtype == "float32" else MASTER_BYTES
    parameters = count * width // (world_size if stage == 3 else 1)
    gradients = trained * width // (world_size if stage >= 2 else 1)
    optimizer = trained * (master + ADAM_STATE_BYTES) // (world_size if stage >= 1 else 1)
    gathered = shape.largest_module * width if stage == 3 and (world_size > 1 or offload_param) else 0
    cpu = 0
    if offload_optimizer:  # the fp32 master, the moments and the gradient partition (in fp32) go to CPU memory
        cpu += optimizer + trained * 4 // world_size
        optimizer = 0
        if stage >= 2:
            gradients = 0
    if offload_param:
        cpu += parameters
        parameters = 0
    return StateBytes(parameters, gradients, optimizer, gathered, cpu)


def reference_bytes(shape: ModelShape, dtype: str, world_size: int, *, partitioned: bool, offload: bool) -> StateBytes:
    """The frozen KL reference model's parameters per rank (``ds_tree.engine.reference``): whole on every
    rank, or a ZeRO-3 partition (``model.zero_init``), in CPU memory with ``offload`` (no gradients,
    no optimizer; its gathered module is transient, in no-grad forwards before the training pass)."""
    whole = shape.parameters * DTYPE_BYTES[dtype]
    if not partitioned:
        return StateBytes(whole, 0, 0, 0, 0)
    share = whole // world_size
    return StateBytes(0, 0, 0, 0, share) if offload else StateBytes(share, 0, 0, 0, 0)


def checkpointed_layers(shape: ModelShape, checkpoint_every: int) -> list[bool]:
    """Per decoder layer, whether it is checkpointed: layers ``0, k, 2k, ...`` for ``checkpoint_every = k > 0``
    (transformers' choice), none for 0."""
    return [index % checkpoint_every == 0 if checkpoint_every else False for index in range(shape.layers)]


def layer_bytes_per_token(shape: ModelShape, dtype: str) -> int:
    """Bytes one attention decoder layer keeps for the backward per token (module docstring)."""
    return (
        2 * norm_bytes_per_token(shape)
        + attention_bytes_per_token(shape, dtype)
        + 4 * DTYPE_BYTES[dtype] * shape.intermediate
    )


def attention_bytes_per_token(shape: ModelShape, dtype: str) -> int:
    """What a layer's attention keeps per token: the query/key norms (Qwen3), RoPE'd queries and keys, values,
    the output and its copy, the log-sum-exp (module docstring)."""
    norms = (8 * shape.head_dim + 4) * (shape.heads + shape.kv_heads) if shape.qk_norm else 0
    return norms + DTYPE_BYTES[dtype] * (3 * shape.heads + 2 * shape.kv_heads) * shape.head_dim + 4 * shape.heads


def layer_bytes(shape: ModelShape, dtype: str, index: int, tokens: int, row: RowNodes = ONE_NODE) -> int:
    """What decoder layer ``index`` keeps for the backward of a row of ``tokens`` tokens in ``row``'s nodes:
    a recurrent layer its mixer's tensors (:class:`RecurrentMixer`) in place of attention's (with them, in
    a layer that runs both)."""
    kept = layer_bytes_per_token(shape, dtype) * tokens
    if index not in shape.recurrent_layers:
        return kept
    if index in shape.attention_free:
        kept -= attention_bytes_per_token(shape, dtype) * tokens
    return kept + shape.recurrent.bytes(dtype, tokens, row)


def norm_bytes_per_token(shape: ModelShape) -> int:
    """What one RMSNorm over the hidden state keeps per token (module docstring): ``12 h + 4``, in any dtype."""
    return 12 * shape.hidden + 4


def gradient_working_set_per_token(shape: ModelShape, dtype: str) -> int:
    """What one layer's backward adds per token to its saved activations at its start: the incoming
    hidden-state gradient, and the MLP's two ``I``-wide gradients (of the activation and of the up
    projection), made while the product they come from is still held."""
    return DTYPE_BYTES[dtype] * (2 * shape.intermediate + shape.hidden)


def head_bytes_per_target(shape: ModelShape, entropy: bool = False) -> int:
    """The LM head's float32 tensors of one target at the start of its backward (module docstring)."""
    return 4 * shape.vocab * (3 + (2 if entropy else 0))


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes of one row's forward and backward at the two moments that can be its peak."""

    layers: int
    """What the decoder layers keep for the backward (a checkpointed layer: its input only)."""
    head: int
    """The final norm's and the LM head's tensors at the start of the head's backward, and the head
    weight's new gradient (``vocab x hidden``, made before it is added to the stored one); chunked,
    also two ``targets x hidden`` gradients of the gathered hidden states (each chunk's slice
    gradient comes back full-length and is summed into a buffer)."""
    recompute: int
    """At the recompute of a checkpointed layer, the worst of them (the highest, or a hybrid's recurrent layer):
    what the layers below it keep, its input, its recomputed activations and its backward's first gradients
    (0 without checkpointing)."""

    @property
    def peak(self) -> int:
        # The head's backward runs first, with everything the layers keep; the recomputes come later,
        # once the layers above have released theirs, the highest one with the most still held below it.
        return max(self.layers + self.head, self.recompute)


def activation_bytes(
    shape: ModelShape,
    dtype: str,
    tokens: int,
    *,
    checkpoint_every: int = 0,
    head_chunk: int = 0,
    targets: int | None = None,
    entropy: bool = False,
    row: RowNodes = ONE_NODE,
) -> ActivationBytes:
    """Activation memory of one packed row of ``tokens`` tokens, ``targets`` of them scored (default all).

    ``checkpoint_every = k > 0``: layers ``0, k, 2k, ...`` are checkpointed (transformers' choice).
    ``row``: the row's tree nodes, for a hybrid model's recurrent layers (default: one node)."""
    targets = tokens if targets is None else targets
    width = DTYPE_BYTES[dtype]
    checkpointed = checkpointed_layers(shape, checkpoint_every)
    whole = [layer_bytes(shape, dtype, index, tokens, row) for index in range(shape.layers)]
    kept = [width * shape.hidden * tokens if again else layer for again, layer in zip(checkpointed, whole, strict=True)]
    recompute = 0
    if any(checkpointed):
        # each checkpointed layer's recompute, with what the layers below it keep: the highest one has the
        # most below it, but a hybrid's recurrent layer recomputes more than an attention layer above it
        working = gradient_working_set_per_token(shape, dtype) * tokens
        recompute = max(
            sum(kept[: index + 1]) + whole[index] + working for index in range(shape.layers) if checkpointed[index]
        )
    held = min(targets, head_chunk) if head_chunk else targets
    final_norm = norm_bytes_per_token(shape)
    head = final_norm * tokens + head_bytes_per_target(shape, entropy) * held + width * shape.vocab * shape.hidden
    if head_chunk and targets > head_chunk:  # each chunk's gradient arrives as a whole-length one, summed in a buffer
        head += 2 * width * targets * shape.hidden
    return ActivationBytes(sum(kept), head, recompute)


def largest_budget(
    shape: ModelShape,
    dtype: str,
    free_bytes: int,
    *,
    checkpoint_every: int = 0,
    head_chunk: int = 0,
    entropy: bool = False,
) -> int:
    """The most tokens a row may hold with every token a target and ``free_bytes`` left after the model
    states (0 if not even one token fits). The peak grows linearly with tokens, so halving bisection
    over ``[0, free_bytes]`` finds it exactly."""

    def fits(tokens: int) -> bool:
        plan = activation_bytes(
            shape, dtype, tokens, checkpoint_every=checkpoint_every, head_chunk=head_chunk, entropy=entropy
        )
        return plan.peak <= free_bytes

    high = max(free_bytes, 0) // layer_bytes_per_token(shape, dtype) + 1
    return _last_true(0, high, fits)  # the largest ``tokens`` with fits(tokens); fits(0) holds for free_bytes >= 0


def _last_true(low: int, high: int, test) -> int:
    """The largest ``x`` in ``[low, high]`` with ``test(x)``, by halving bisection: ``test(low)`` holds
    and ``test`` is monotone on ``[low, high]`` (true, then false)."""
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if test(middle) else (low, middle - 1)
    return low


@dataclass(frozen=True)
class DfsActivationBytes:
    """Activation bytes of the dfs walk (:mod:`ds_tree.engine.dfs`) down one root-to-leaf path, at the
    backward of the chunk where it peaks (the deepest one, unless a shorter last chunk makes it another)."""

    held: int
    """What the graphs of the chunk's ancestors on the path keep for their backward (0 with
    ``recompute``: their graphs were not kept). Per chunk of ``n`` tokens on ``P`` context tokens and
    per layer, the packed row's activations without the chunk's own keys and values (the cache holds
    them) plus the ``P + n`` keys and values SDPA saves (concatenated: a copy), or a checkpointed
    layer's input only; once per chunk its ``n x (P + n)`` attention mask; the final norm's input and
    the log-softmax of its targets (a chunked head: their hidden states)."""
    cache: int
    """The path's cached keys and values (with ``recompute`` the chunk's twice: the no-grad forward's
    and the recomputed ones) and the gradients accumulated on the ancestors' (present whenever a
    sibling subtree was walked before)."""
    chunk: int
    """The chunk's own graph, as one of ``held``'s, at the worst moment of its backward: the head's
    (the log-softmax's and the logits' gradients, then the logits' and the head weight's new
    gradient) or a checkpointed layer's recompute (the layers above it released their activations,
    its own made again) or a layer's backward (SDPA's gradients of the ``P + n`` keys and values, the
    MLP's working set)."""

    @property
    def peak(self) -> int:
        return self.held + self.cache + self.chunk


def dfs_activation_bytes(
    shape: ModelShape,
    dtype: str,
    path_tokens: int,
    chunk: int,
    *,
    recompute: bool = False,
    checkpoint_every: int = 0,
    head_chunk: int = 0,
    entropy: bool = False,
    packed_below: bool = False,
    sequence_parallel: int = 1,
) -> DfsActivationBytes:
    """Activation memory of walking a root-to-leaf path of ``path_tokens`` tokens in chunks of ``chunk``
    (the path cut into full chunks, the remainder last), every token a target.

    ``packed_below``: the worst tree with such paths instead, if worse (``ds-tree plan``): a packed chunk
    (:mod:`ds_tree.packing.dfs_chunks`) of ``chunk`` tokens, whole sibling subtrees, below a context of
    ``path_tokens - 1`` tokens held as chain chunks (a chain's remainder is then held too).

    A path whose nodes are shorter than ``chunk`` has more chunks than that: without ``recompute`` each
    holds its own copy of its context's keys and values (``P + n`` per layer), so short nodes cost more.

    ``sequence_parallel`` = S > 1: one rank of a group that walks the path together, each chunk of ``n``
    tokens padded to ``S x L`` and sharded (:mod:`ds_tree.engine.dfs_sequence_parallel`): what a rank
    keeps per token (projections, norms, MLP, the head's targets) is its shard's ``L``; its attention
    runs on the whole padded chunk for ``Hq / S`` query and ``Hkv / S`` key/value heads (one replicated
    head when ``Hkv < S``), so its cached and attended keys and values (and SDPA's gradients of them)
    are those heads' only; the chunk's ``S L x (P + S L)`` attention mask is whole on every rank."""
    if path_tokens < 1 or chunk < 1 or sequence_parallel < 1:
        raise ValueError(
            f"dfs plan: path_tokens, chunk and sequence_parallel must be >= 1, got {path_tokens}, {chunk} and "
            f"{sequence_parallel}"
        )
    # A chunk longer than the path is the path (chunks are cut from the walked trees, whose paths are at
    # most ``path_tokens``): dfs_chunk=1e9 predicted 3.7e9 GiB for a walk measured at 0.57 GB.
    chunk = min(chunk, path_tokens)
    width = DTYPE_BYTES[dtype]
    size = sequence_parallel
    kv = 2 * width * shape.kv_heads * shape.head_dim  # a token's key and value in one layer
    # the keys and values of a token one rank attends to and caches: its share of the key/value heads
    kv_heads_here = shape.kv_heads // size if shape.kv_heads % size == 0 else 1
    kv_here = 2 * width * kv_heads_here * shape.head_dim
    heads_here = shape.heads // size if shape.heads % size == 0 else shape.heads

    def shard(n: int) -> int:
        """Tokens of a rank's shard of an ``n``-token chunk (padded to a multiple of S)."""
        return -(-n // size)

    def padded(n: int) -> int:
        return size * shard(n)

    per_layer = layer_bytes_per_token(shape, dtype)
    checkpointed = checkpointed_layers(shape, checkpoint_every)
    final_norm = norm_bytes_per_token(shape)
    head_weight = width * shape.vocab * shape.hidden  # its new gradient, before it is added to the stored one
    row = head_bytes_per_target(shape, entropy)  # a target's float32 head tensors at the backward's start
    # The path's chunks: ``full`` of ``chunk`` tokens (the k-th on a context of k x chunk), then the rest.
    full, rest = divmod(path_tokens, chunk)
    last = (rest, full * chunk) if rest else (chunk, (full - 1) * chunk)  # the deepest chunk: (n, context)

    attention = attention_bytes_per_token(shape, dtype)
    attending = shape.layers - len(
        shape.attention_free
    )  # the layers with keys and values (not a hybrid's recurrent ones)

    def layer(index: int, n: int, context: int) -> int:
        """What decoder layer ``index``, not checkpointed, keeps for the chunk's backward (a recurrent layer: its
        mixer's scan of the chunk, one node on its parent's state, in place of attention's or beside it)."""
        mixer = shape.recurrent.bytes(dtype, shard(n)) if index in shape.recurrent_layers else 0
        if index in shape.attention_free:
            return (per_layer - attention) * shard(n) + mixer
        return (per_layer - kv) * shard(n) + kv_here * (context + padded(n)) + mixer

    def mask(n: int, context: int) -> int:
        """The chunk's attention mask (made once, shared by its layers; whole on every rank of a group)."""
        return width * padded(n) * (context + padded(n))

    def body(n: int, context: int) -> int:
        """What the decoder layers keep for the chunk's backward, and its attention mask (made once)."""
        kept = [
            width * shape.hidden * shard(n) if again else layer(index, n, context)
            for index, again in enumerate(checkpointed)
        ]
        return sum(kept) + (mask(n, context) if not all(checkpointed) else 0)

    def graph(n: int, context: int) -> int:
        """A held chunk's graph: a chunked head keeps the targets' hidden states, else their log-softmax
        (and with the entropy their probabilities)."""
        saved = width * shape.hidden if head_chunk else 4 * shape.vocab * (2 if entropy else 1)
        return body(n, context) + (final_norm + saved) * shard(n)

    def head(n: int) -> int:
        """The head's tensors at the worst moment of its backward, the saved ones included (``n``: its targets)."""
        if head_chunk and n > head_chunk:  # as a packed row's chunked head (docs/MEMORY.md)
            return width * shape.hidden * n + row * head_chunk + head_weight + 2 * width * n * shape.hidden
        # the saved log-softmax, its gradient and the logits' (measured: a single head chunk peaks alike),
        # then the logits' gradient and the head weight's new one
        return max(row * n, 4 * shape.vocab * n + head_weight)

    def backward(n: int, context: int) -> int:
        moments = [body(n, context) + final_norm * shard(n) + head(shard(n))]
        below = body(n, context)  # the head's backward is done
        # SDPA's gradients of the keys and values it attended to, per query head before the sum over a group
        attended = kv_here * (context + padded(n)) * heads_here // kv_heads_here
        for index in reversed(range(shape.layers)):  # each layer's backward, top first
            working = gradient_working_set_per_token(shape, dtype) * shard(n)
            working += 0 if index in shape.attention_free else attended
            if checkpointed[index]:  # recomputed: its activations (and the mask, if none is held) again
                again = layer(index, n, context) + (mask(n, context) if all(checkpointed) else 0)
                moments.append(below + again + working)
                below -= width * shape.hidden * shard(n)
            else:
                moments.append(below + working)
                below -= layer(index, n, context)
        return max(moments)

    layers = attending  # the caches below hold keys and values of the attention layers

    # The path's first chunk (no context) attends to its keys and values as recorded, uncopied
    # (``attention.cached`` concatenates only onto a context): without recompute the cache's leaves share
    # that storage, which the chunk's graph (``layer``) holds already; with recompute a path of one chunk
    # is childless, forwarded once with grad and never cached, so its cache and their gradients do not exist.
    first_chunk = layers * kv_here * chunk

    if not recompute:
        n, context = last
        ancestors = full if rest else full - 1  # the full chunks above the deepest one
        # a held full chunk's graph grows linearly with its context: the sum over k of graph(chunk, k x chunk)
        first, step = graph(chunk, 0), graph(chunk, chunk) - graph(chunk, 0)
        held = ancestors * first + step * ancestors * (ancestors - 1) // 2
        cache = layers * kv_here * (path_tokens + context) - first_chunk
        plans = [DfsActivationBytes(held, cache, backward(n, context))]
        if packed_below and path_tokens > 1:
            context = path_tokens - 1
            ancestors, rest = divmod(context, chunk)
            held = ancestors * first + step * ancestors * (ancestors - 1) // 2
            held += graph(rest, ancestors * chunk) if rest else 0
            cache = layers * kv_here * (2 * context + chunk) - first_chunk
            plans.append(DfsActivationBytes(held, cache, backward(chunk, context)))
        return max(plans, key=lambda plan: plan.peak)
    # Every term grows with a chunk's size and context, so the peak is at the deepest full chunk or at
    # the shorter last one (the first of them on a tie, as in path order).
    deepest = [(chunk, (full - 1) * chunk)] if full else []
    candidates = deepest + ([last] if rest else []) + ([(chunk, path_tokens - 1)] if packed_below else [])
    plans = [  # a chunk without context is the whole path, one childless chunk: nothing of it is cached
        DfsActivationBytes(0, layers * kv_here * (2 * p + 2 * n) - (0 if p else 2 * first_chunk), backward(n, p))
        for n, p in candidates
    ]
    return max(plans, key=lambda plan: plan.peak)


def largest_dfs_path(
    shape: ModelShape,
    dtype: str,
    free_bytes: int,
    chunk: int,
    *,
    recompute: bool = False,
    checkpoint_every: int = 0,
    head_chunk: int = 0,
    entropy: bool = False,
    packed_below: bool = False,
    sequence_parallel: int = 1,
) -> int:
    """The longest path length ``L`` such that the dfs walk trains every root-to-leaf path of at most ``L``
    tokens in chunks of ``chunk`` within ``free_bytes`` (0 if not even one token fits; ``sequence_parallel``:
    walked by a group of that many ranks, :func:`dfs_activation_bytes`).

    The peak grows with whole chunks (without ``recompute`` quadratically: every held chunk keeps its
    context's keys and values), and within the last chunk with its length, but a path one token past a
    whole number of chunks can peak lower than that number (its last chunk's head is smaller): so the
    whole chunks are bisected first, then the last chunk's length."""

    def fits(tokens: int) -> bool:
        if tokens == 0:
            return True
        options = {"recompute": recompute, "checkpoint_every": checkpoint_every, "head_chunk": head_chunk}
        options.update(packed_below=packed_below, sequence_parallel=sequence_parallel)
        return dfs_activation_bytes(shape, dtype, tokens, chunk, entropy=entropy, **options).peak <= free_bytes

    high = 1
    while fits(high * chunk):  # the peak grows at least linearly with whole chunks, so doubling ends
        high *= 2
    chunks = _last_true(0, high - 1, lambda k: fits(k * chunk))
    return chunks * chunk + _last_true(0, chunk - 1, lambda r: fits(chunks * chunk + r))


def profiled_peak_bytes(run) -> int:
    """Measured counterpart of :attr:`ActivationBytes.peak`: the most bytes torch held at once during
    ``run()`` beyond what it held before (``torch.profiler`` memory events in order). Run it on a step
    whose parameter gradients already exist, so it counts activations only.

    The profiler records the allocations and frees of the thread that runs ``run`` only, but a
    collective's worker thread (gloo) may drop the last reference to a buffer this thread allocated
    (an all-to-all's input), freeing it unseen at a time that varies from run to run. While c10's
    ``caffe2_report_cpu_memory_usage`` flag is set, its CPU allocator counts every thread's allocations
    and frees, and each recorded event carries that running total: the peak is the largest total over
    the events, less the total before the first (:func:`_every_thread_allocations`; the profiler's own
    per-event sizes in order where the flag cannot be reached, which agree on a single thread)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    flag = _every_thread_allocations()
    previous = flag.value if flag is not None else False
    if flag is not None:
        flag.value = True
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            run()
    finally:
        if flag is not None:
            flag.value = previous
    if flag is None:
        import numpy as np

        events = sorted(
            (e.start_ns(), e.nbytes()) for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"
        )
        return int(max(0, np.cumsum([n for _, n in events]).max(initial=0)))

    def nodes(events):
        for event in events:
            yield event
            yield from nodes(event.children)

    events = sorted(
        (event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.total_allocated)
        for event in nodes(profiler.profiler.kineto_results.experimental_event_tree())
        if event.tag == _EventType.Allocation
    )
    if not events:
        return 0
    _, size, total = events[0]
    return int(max(0, max(total for _, _, total in events) - (total - size)))


def _every_thread_allocations():
    """c10's ``FLAGS_caffe2_report_cpu_memory_usage`` (a ``ctypes`` bool), or None where it cannot be found."""
    import ctypes
    import os

    import torch

    library = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    try:
        return ctypes.c_bool.in_dll(ctypes.CDLL(library), "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError):
        return None
