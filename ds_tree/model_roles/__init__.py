"""The models an objective runs beside the policy, built on :mod:`ds_tree.models`: on-policy distillation's
frozen teacher (``teacher``), and PPO's value model where there is a critic."""
