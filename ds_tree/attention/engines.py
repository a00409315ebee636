"""The attention engines and what each can do: :data:`ds_tree.registries.ATTENTION_ENGINES`'s entries.

An engine is one :class:`AttentionEngine`: the function that computes it, named ``package.module:function``
and imported on its first call (FlexAttention, Triton and flash-attn load only when used), and its
capabilities. Callers ask the capabilities, never the name: the config's dry run
(``models.loading.check_model_settings``), the commands' option checks, the benchmarks and ``verify``'s
choice of what to compare. Reading them imports nothing heavy (this module needs neither torch nor the
kernels), so a command can check its options before it imports the library.

Every engine's function has the contract of :func:`ds_tree.attention.registry.tree_attention`:
``(query, key, value, kv_end, scale=None, *, positions=None, window=None, softcap=None) -> [B, N, Hq, D]``.
A project adds its own with ``ATTENTION_ENGINES.register("mine", AttentionEngine(...))`` before the config
is loaded; it is then offered by ``model.attention`` and ``--attention`` and registered with transformers
as ``tree_mine``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ds_tree.registries import ATTENTION_ENGINES
from ds_tree.registry import import_attribute

DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class AttentionEngine:
    """One engine: where its function is, and what it can do (module docstring)."""

    target: str
    """``package.module:function``, imported on the first call."""
    devices: tuple[str, ...] = DEVICE_TYPES
    """Device types it has a kernel on (a forward)."""
    backward: tuple[str, ...] = DEVICE_TYPES
    """Device types it has a backward on: where it can train, and where ``verify`` checks gradients."""
    interpreted_off_cuda: bool = False
    """Off CUDA it runs only under Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    flat_rows_only: bool = False
    """It runs flat rows only (independent sequences: the flat baseline), never a tree row."""
    dtypes: tuple[str, ...] = ()
    """The model dtypes it takes, the one to train in first (empty: any)."""
    auto_on: tuple[str, ...] = ()
    """Device types where ``model.attention: auto`` picks it (the CPU's pick serves any other type)."""
    oracle: bool = False
    """The dense reference: every test's oracle, for small inputs; never a benchmark's engine."""
    block_plan: bool = False
    """It tiles a row by :func:`ds_tree.attention.blocksparse.block_plan`: it takes the block and hub options,
    and the plan counts the scores it computes."""
    tile_schedules: tuple[str, ...] = ()
    """The tile schedules it can run (``$DS_TREE_TRITON_TILES``), its default first: gpu-check checks each."""
    cpu_limit: str = ""
    """Why it cannot run, or cannot train, on the CPU (for the messages that refuse it there)."""

    @functools.cached_property
    def function(self):
        return import_attribute(self.target)

    def runs_on(self, device_type: str) -> bool:
        """Whether it has a kernel on ``device_type`` (``cpu``, ``cuda``)."""
        return device_type in self.devices

    def trains_on(self, device_type: str) -> bool:
        """Whether it has a backward on ``device_type``."""
        return device_type in self.backward and self.runs_on(device_type)

    @property
    def tree_rows(self) -> bool:
        """Whether it runs tree rows (what training, ``verify`` and the tree benchmarks need)."""
        return not self.flat_rows_only


REFERENCE = AttentionEngine("ds_tree.attention.reference:tree_attention_reference", oracle=True)
"""The dense mask in any dtype, float64 included: the oracle of every test (``reference.py``)."""
TORCH = AttentionEngine("ds_tree.attention.blocksparse:blocksparse_tree_attention", auto_on=("cpu",), block_plan=True)
"""Block-sparse on torch ops, autograd backward: the CPU engine (``blocksparse.py``)."""
TRITON = AttentionEngine(
    "ds_tree.kernel.function:triton_tree_attention",
    interpreted_off_cuda=True,
    tile_schedules=("loop", "list"),  # ds_tree.kernel.tile_lists.SCHEDULES (tests/test_tile_lists.py)
    cpu_limit="Triton compiles its kernels for GPUs; TRITON_INTERPRET=1 runs them in its CPU interpreter",
)
"""FlashAttention-2 style kernels, forward and backward (:mod:`ds_tree.kernel`)."""
FLEX = AttentionEngine(
    "ds_tree.attention.flex:flex_tree_attention",
    backward=("cuda",),
    auto_on=("cuda",),
    cpu_limit="torch's FlexAttention does not support backward on CPU (it has a forward only there)",
)
"""PyTorch's FlexAttention on the tree mask (``flex.py``): forward only on the CPU."""
VARLEN = AttentionEngine(
    "ds_tree.attention.varlen:varlen_attention",
    devices=("cuda",),
    backward=("cuda",),
    flat_rows_only=True,
    dtypes=("bfloat16", "float16"),
    cpu_limit="flash kernels have no CPU implementation",
)
"""The flat baseline on flash kernels (``varlen.py``): flat rows, CUDA, float16/bfloat16 only."""


def registered() -> list[tuple[str, AttentionEngine]]:
    """Every registered engine with its name, in registration order (an entry that is no
    :class:`AttentionEngine` has no capabilities to read, and is left out)."""
    return [(name, engine) for name, engine in ATTENTION_ENGINES.items() if isinstance(engine, AttentionEngine)]


def auto_engine(device_type: str) -> str:
    """The engine ``auto`` picks on ``device_type``: the one whose ``auto_on`` names it (the CPU's pick for a
    type none names)."""
    picks = {on: name for name, engine in registered() for on in engine.auto_on}
    return picks.get(device_type, picks["cpu"])


def cpu_engines() -> tuple[str, ...]:
    """The engines with a native CPU kernel (the interpreter's and the oracle aside): what
    ``ds-tree bench-attention --engine`` times."""
    return tuple(
        name
        for name, engine in registered()
        if engine.runs_on("cpu") and not engine.interpreted_off_cuda and not engine.oracle
    )
