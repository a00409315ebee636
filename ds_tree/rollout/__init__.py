"""Rollouts: the online loop (``online``, ``ahead`` for sampling ahead of training), multi-turn episodes
(``multiturn``, the environment interface ``env`` and the chat ``render``ing), prompts and rewards, on the
sampling engines of :mod:`ds_tree.sampling`; example environments and rewards in
:mod:`ds_tree.rollout.envs`.
"""
