"""The multimodal multi-turn example's task (docs/ENVIRONMENTS.md, "Image observations"): read a screen.

A GUI-like task with screenshots. Every episode starts from the phone's home screen (one image,
shared by every trial of every task: the episode tree's root); the policy calls the ``screenshot``
tool, whose answer is an image, the app's screen: a title bar over a field of one of five colours,
the task's. Then it answers the number of the button to tap, the colour's index (0 red, 1 green,
2 blue, 3 yellow, 4 white); reward 1 for the right one, else 0. The colour is only in the pixels: a
policy that does not read the screenshot scores about 0.2 (one in five). With
``rollout.env.turn_branching: [1, 16]`` the screenshot is shared by the 16 answers below it.

The tool is named in the system message rather than a schema block (a random-init model that learns
the call format from demonstrations does not read one; as ``LoudSecretToolEnv``). Its
:meth:`GuiScreensEnv.demonstration` writes the warm-up's demonstrations: the call, the screenshot,
and an answer drawn independently of the colour, so none shows the screen being read: that is what
RL has to learn. Use it as ``rollout.env.path: ds_tree.envs.gui_screens:GuiScreensEnv``;
``python -m ds_tree.envs.gui_screens --tasks OUT`` writes a tasks file.
"""

from __future__ import annotations

import random

import numpy as np

from ds_tree.envs.tasks_file import write_tasks_main
from ds_tree.rollout.env import ToolEnvironment, Turn

COLOURS = ((230, 25, 25), (25, 200, 40), (30, 60, 230), (235, 220, 30), (245, 245, 245))
"""Red, green, blue, yellow, white: the answer is the index."""
SYSTEM = "Call screenshot, then answer the button number for the screen's colour."
QUESTION = "Which button?"
SIDE = 112
"""Screen side in pixels: 8 x 8 patches of 14, 16 image tokens for Qwen2.5-VL (merged 2 x 2)."""
BAR = 14
"""The title bar's height (one patch row)."""


def home_screen() -> np.ndarray:
    """The home screen: a grey grid of app icons (56 x 56 pixels, 4 tokens), the same for every task."""
    screen = np.full((56, 56, 3), 90, dtype=np.uint8)
    screen[::14, :] = screen[:, ::14] = 160
    return screen


def app_screen(colour: int) -> np.ndarray:
    """The app's screen: a dark title bar over a field of ``COLOURS[colour]``."""
    screen = np.empty((SIDE, SIDE, 3), dtype=np.uint8)
    screen[:] = COLOURS[colour]
    screen[:BAR] = 40
    return screen


class GuiScreensEnv(ToolEnvironment):
    """One tool returning a screenshot of the task's screen; the final answer is scored against its colour."""

    fork_mode = "copy"

    def __init__(self) -> None:
        self.colour = 0
        self.looked = False
        self.tools = [self.screenshot]

    def screenshot(self):
        """Returns a screenshot of the phone's screen."""
        self.looked = True
        return app_screen(self.colour)

    def reset(self, task: dict) -> list[dict]:
        self.colour, self.looked = int(task["colour"]), False
        user = [{"type": "text", "text": QUESTION}, {"type": "image", "image": home_screen()}]
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]

    def reward(self, turn: Turn) -> float:
        """1 for the colour's number after a screenshot (an answer without looking is a guess: 0)."""
        return float(self.looked and turn.text.strip() == str(self.colour))

    def tool_schemas(self) -> list[dict]:
        return []

    def demonstration(self, task: dict, rng: random.Random) -> list[dict]:
        """One warm-up demonstration: the call, the screenshot, and an answer drawn from ``rng``
        independently of the screen (it never shows the screenshot being read)."""
        call = {"id": "call_1_0", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
        return [
            *self.reset(task),
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1_0", "content": [{"type": "image", "image": self.screenshot()}]},
            {"role": "assistant", "content": str(rng.randrange(len(COLOURS)))},  # independent of the screen
        ]


def tasks(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"screen-{index}", "colour": rng.randrange(len(COLOURS))} for index in range(count)]


def main(argv: list[str] | None = None) -> int:
    return write_tasks_main(__doc__.split("\n")[0], tasks, argv)


if __name__ == "__main__":
    raise SystemExit(main())
