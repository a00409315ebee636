"""A tau-bench-style environment (docs/ENVIRONMENTS.md): tools over a small in-memory shop database and
a scripted user with a goal; the reward is whether the database ends in the state the goal asks for.

The shape of a real agent task: the user's opening message states the goal loosely, the agent looks
things up with tools (``find_orders``, ``get_order``) and acts (``cancel_order``, ``change_address``);
when the agent answers without a tool call, the scripted user replies (restating the goal while it is
not met, thanking and leaving once it is, giving up after ``PATIENCE`` replies), and the episode ends
when the user leaves. Tool results and user replies are deterministic functions of the database and
the turns, so the environment forks by ``replay`` (a fresh instance replays the recorded turns and
must answer them the same), as an environment wrapping a real service would.

Tasks (``rollout.prompts`` lines): ``{"id": ..., "user": "u1", "goal": {"cancel": "W1"}}`` or
``{"goal": {"address": ["W2", "5 Elm St"]}}``. Use ``rollout.env.path: ds_tree.envs.tau_shop:ShopEnv``.
"""

from __future__ import annotations

import copy

from ds_tree.rollout.env import StepResult, ToolEnvironment, Turn

DATABASE = {
    "users": {"u1": {"name": "Ada", "orders": ["W1", "W2"]}, "u2": {"name": "Bo", "orders": ["W3"]}},
    "orders": {
        "W1": {"status": "pending", "item": "lamp", "address": "1 Oak St"},
        "W2": {"status": "pending", "item": "desk", "address": "1 Oak St"},
        "W3": {"status": "delivered", "item": "chair", "address": "9 Pine Rd"},
    },
}
SYSTEM = "You are a shop agent. Use the tools to look up and change orders; only act on the user's own orders."
PATIENCE = 2
"""User replies before a user whose goal is not met gives up."""


class ShopEnv(ToolEnvironment):
    fork_mode = "replay"

    def __init__(self) -> None:
        self.tools = [self.find_orders, self.get_order, self.cancel_order, self.change_address]

    # -- tools (their docstrings are their schemas)
    def find_orders(self, user_id: str) -> list:
        """Lists the order ids of a user.

        Args:
            user_id: the user's id
        """
        return self.db["users"][user_id]["orders"]

    def get_order(self, order_id: str) -> dict:
        """Shows an order's status, item and address.

        Args:
            order_id: the order's id, such as W1
        """
        return self.db["orders"][order_id]

    def cancel_order(self, order_id: str) -> str:
        """Cancels a pending order.

        Args:
            order_id: the order's id
        """
        order = self.db["orders"][order_id]
        if order["status"] != "pending":
            return f"error: order {order_id} is {order['status']}, only pending orders can be cancelled"
        order["status"] = "cancelled"
        return f"order {order_id} cancelled"

    def change_address(self, order_id: str, address: str) -> str:
        """Changes the delivery address of a pending order.

        Args:
            order_id: the order's id
            address: the new address
        """
        self.db["orders"][order_id]["address"] = address
        return f"order {order_id} will go to {address}"

    # -- the episode
    def reset(self, task: dict) -> list[dict]:
        self.db = copy.deepcopy(DATABASE)
        self.user, self.goal, self.replies = task["user"], task["goal"], 0
        name = DATABASE["users"][self.user]["name"]
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Hi, I'm {name} ({self.user}). {self.ask()}"},
        ]

    def ask(self) -> str:
        if "cancel" in self.goal:
            return f"Please cancel my {DATABASE['orders'][self.goal['cancel']]['item']} order."
        order, address = self.goal["address"]
        return f"My {DATABASE['orders'][order]['item']} should go to {address} instead."

    def expected(self) -> dict:
        """The database the goal asks for."""
        db = copy.deepcopy(DATABASE)
        if "cancel" in self.goal:
            db["orders"][self.goal["cancel"]]["status"] = "cancelled"
        else:
            order, address = self.goal["address"]
            db["orders"][order]["address"] = address
        return db

    def step(self, turn: Turn) -> StepResult:
        if turn.tool_calls:
            return super().step(turn)
        met = self.db == self.expected()
        self.replies += 1
        if met or self.replies > PATIENCE:
            return StepResult(messages=[{"role": "user", "content": "Thanks, bye."}], reward=float(met), done=True)
        return StepResult(messages=[{"role": "user", "content": f"That's not done yet. {self.ask()}"}])
