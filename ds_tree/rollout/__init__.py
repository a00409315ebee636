"""Rollouts: the online loop's step (``loop``; ``ahead`` samples ahead of training), single-turn trees
(``online``, scored by ``rewards``), multi-turn episodes (``multiturn`` on ``episodes``: the episode tree,
its runner, tasks and records; the environment interface ``env``, the chat ``render``ing and image
observations ``images``), on the sampling engines of :mod:`ds_tree.sampling` and the turn formats of
:mod:`ds_tree.turn_formats`; example environments and rewards in :mod:`ds_tree.envs` (above this package).
"""
