"""The hybrid models' recurrent scans, with a state per sequence: Gated DeltaNet's chunked delta rule and
Mamba2's chunked scan. ``linear_scans``: torch (the CPU path, computing in float64 for float64 models: the
oracle); ``fla_scan``: flash-linear-attention's Triton kernels (GPU, ``model.recurrent_kernels: fla``).
:mod:`ds_tree.models.hybrid` runs them over a row's tree nodes, one batched call per level.
"""
