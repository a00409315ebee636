"""Several sampling servers behind one engine: which server samples a tree, and what a failed server costs.

A :class:`Fleet` holds the servers of one ``vllm`` engine (``rollout.vllm.url`` as a list, or
``rollout.vllm.servers`` managed ones; docs/ROLLOUTS.md, *Several servers*) and routes by *tree*, not by
request:

- a tree (a prompt's sampled tree, or a multi-turn episode tree) opens a :class:`TreeRoute` on the live
  server with the fewest pending tokens; every request of the tree then goes there, so the server's prefix
  cache holds the prompt and every shared segment when the next round's requests re-send them. A tree's
  pending tokens are its budget, prompt + width x max new tokens, held from its first request to its end:
  a tree between two rounds has no request in flight but sends its next round a moment later, so counting
  only requests in flight would pile the trees a step starts together onto one server;
- ties go to the server after the last one chosen (round robin), starting at ``offset`` (the rank), so
  ranks that start their slots at the same time spread them over the servers from the first tree;
- a server that gives no answer (refused, reset, timed out after the client's retries, a managed server
  that exited) or fails (HTTP 5xx) is marked dead: :meth:`TreeRoute.move` takes the tree to the live server
  with the fewest pending tokens, and counts it (``rollout/resubmitted_trees``); the caller resubmits (a prompt's tree
  from its start with its generator restored, an episode's turn with its seed). With no live server left
  the step fails with an :class:`EngineError` naming every server and why it was dropped;
- a server samples only at the engine's current weight version (:meth:`Fleet.synced`): a weight sync that
  did not reach a server leaves it out until a later sync does (a dead server that answers again at a
  sync is back).

Each sampling process (a rank, its background sampler) routes its own trees; the fleet knows only their
load, not other ranks'. The ranks' slots are alike by construction, so balancing each rank's trees
balances the whole step. Thread-safe: trees are routed from several threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ds_tree.sampling.interface import EngineError


class ServerFailure(EngineError):
    """A server gave no answer (refused, reset, timed out, exited) or failed (HTTP 5xx: a dead engine answers 500
    before its server exits): another server may take its work."""


@dataclass
class FleetServer:
    """One server's routing state."""

    url: str
    version: int = -1
    """The weight version it holds (-1: none yet); it samples only at the fleet's version."""
    pending: int = 0
    """Tokens of the open trees routed to it (each tree's budget)."""
    trees: int = 0
    """Trees routed to it so far (over the run)."""
    dropped: str = ""
    """Why it is out, naming it ('' while it serves)."""


class Fleet:
    """The servers of one engine and the trees routed to them (module docstring)."""

    def __init__(self, urls: list[str], *, offset: int = 0) -> None:
        if not urls:
            raise ValueError("a fleet needs at least one server")
        self.servers = [FleetServer(url) for url in urls]
        self.version = -1
        """The weight version the servers must hold to sample."""
        self.lock = threading.Lock()
        self.cursor = offset % len(urls) - 1
        """The last server chosen (ties go to the one after it)."""
        self.resubmitted = 0
        """Trees moved off a failed server since :meth:`take_resubmitted` last read them."""

    def live(self) -> list[int]:
        """The servers that sample now: not dropped, at the fleet's version."""
        return [i for i, server in enumerate(self.servers) if not server.dropped and server.version == self.version]

    def synced(self, version: int, loaded: dict[int, str | None]) -> None:
        """A weight sync: ``loaded`` maps each server to None (it holds ``version`` now) or why it failed."""
        with self.lock:
            self.version = version
            for index, failure in loaded.items():
                server = self.servers[index]
                server.dropped = failure or ""
                if failure is None:
                    server.version = version

    def open(self, tokens: int) -> TreeRoute:
        """A tree of ``tokens`` pending tokens, on the live server with the fewest (module docstring)."""
        with self.lock:
            index = self._least_pending(self.live())
            self._charge(index, tokens, 1)
            return TreeRoute(self, index, tokens)

    def _least_pending(self, candidates: list[int]) -> int:
        if not candidates:
            raise EngineError(self.nothing_left())
        count = len(self.servers)
        order = sorted(candidates, key=lambda i: (self.servers[i].pending, (i - self.cursor - 1) % count))
        self.cursor = order[0]
        return order[0]

    def _charge(self, index: int, tokens: int, trees: int) -> None:
        self.servers[index].pending += tokens
        self.servers[index].trees += max(trees, 0)

    def nothing_left(self) -> str:
        """The error when no server can sample: every server and why it is out."""
        why = "; ".join(  # a drop's reason names its server (the client's errors do)
            s.dropped or f"{s.url} holds weight version {s.version}, not {self.version}" for s in self.servers
        )
        return f"no vLLM server left to sample on ({why}); check the servers' logs and rollout.vllm.url / servers"

    def drop(self, index: int, why: str) -> None:
        """Take server ``index`` out (no answer): no tree is routed to it until a sync reaches it again."""
        with self.lock:
            self.servers[index].dropped = self.servers[index].dropped or why

    def take_resubmitted(self) -> int:
        """Trees moved since the last call (the metric of one step), reset to 0."""
        with self.lock:
            moved, self.resubmitted = self.resubmitted, 0
            return moved


class TreeRoute:
    """One tree's server: every request of the tree goes to ``server`` until :meth:`move` or :meth:`close`."""

    def __init__(self, fleet: Fleet, server: int, tokens: int) -> None:
        self.fleet = fleet
        self.server = server
        self.tokens = tokens
        self.moves = 0

    @property
    def url(self) -> str:
        return self.fleet.servers[self.server].url

    def move(self, failure: ServerFailure) -> None:
        """The tree's server failed: drop it and take the tree to the live server with the fewest pending
        tokens (counted once per tree and move); an :class:`EngineError` when none is left."""
        fleet = self.fleet
        with fleet.lock:
            failed = fleet.servers[self.server]
            failed.dropped = failed.dropped or str(failure)
            fleet._charge(self.server, -self.tokens, 0)
            try:
                self.server = fleet._least_pending(fleet.live())
            except EngineError:
                self.tokens = 0  # nothing pending anywhere: closing the route changes nothing
                raise
            fleet._charge(self.server, self.tokens, 1)
            fleet.resubmitted += 1
            self.moves += 1

    def close(self) -> None:
        """The tree is done: its tokens are no longer pending."""
        with self.fleet.lock:
            self.fleet._charge(self.server, -self.tokens, 0)
            self.tokens = 0
