"""``ds-tree gpu-check``: one command that proves the GPU path on one CUDA GPU (``attention``: engines
against the float64 reference and the kernel table; ``steps``: training steps tree against the flash
flat baseline; ``trainer``: the real trainer under launch/train.sh; ``report``: the JSON and Markdown
report). ``--smoke`` runs the same code at toy sizes on the CPU.
"""
