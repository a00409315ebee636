"""``ds-tree gpu-check``: proof of the GPU path on one CUDA GPU, section by section.

Each section is a function of a work directory that runs the project's own code (kernels, steps,
the trainer as ``launch/train.sh`` starts it) and returns a JSON-able dict with ``passed`` and
``errors`` instead of raising. ``smoke=True`` runs the same code at toy sizes on the CPU, inside
the test suite. Sections: ``trainer`` (the real trainer: SFT, preemption and resume, GRPO, the
exported model).
"""
