"""Example environments and rewards, found by name from a config (``rollout.env.path``,
``rollout.reward``), never imported by the loop: ``secret_tool`` (the multi-turn CPU example),
``gui_screens`` (the multimodal example: screenshots), ``tau_shop`` (a shop with several tools),
``game24`` (the 24 game's checker and the built-in ``game24`` reward) and ``digit_parity`` (the online
RL demo's reward).
"""
