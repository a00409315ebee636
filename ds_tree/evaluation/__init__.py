"""Evaluation on data and tasks a run does not train on (docs/EVAL.md): the held-out loss, task success
(pass@k) on held-out prompts or an environment's tasks, and the component that runs them during training and
in ``ds-tree eval``."""
