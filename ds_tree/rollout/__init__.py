"""Rollouts: the online loop (``online``, ``ahead`` for sampling ahead of training), multi-turn episodes
(``multiturn``, the environment interface ``env`` and the chat ``render``ing), prompts, rewards and the
sampler's settings. Sampling engines live in :mod:`ds_tree.rollout.engines`, example environments and
rewards in :mod:`ds_tree.rollout.envs`.
"""
