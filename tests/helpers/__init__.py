"""What the tests share; every module under ``tests/`` named ``test_*.py`` holds only tests.

- :mod:`~tests.helpers.data`: token files a run reads (a forest with real sharing, online-RL prompts);
  :mod:`~tests.helpers.rollouts`: RL groups; :mod:`~tests.helpers.strategies`: hypothesis forests;
  :mod:`~tests.helpers.shared_data`: the optional real data sets.
- :mod:`~tests.helpers.configs`: training configs and DeepSpeed JSONs written for a test.
- :mod:`~tests.helpers.launch`: launchers and ranks (torchrun, the deepspeed launcher), their environment;
  :mod:`~tests.helpers.processes`: the process groups they run in, never left behind.
- :mod:`~tests.helpers.runs`: a trainer prepared in-process, the dry run.

A test that starts processes through :mod:`~tests.helpers.processes` (every launcher here does) is marked
``distributed``; ``tests/conftest.py`` fails it otherwise.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository."""
