"""gpu-check's section "the real trainer": ``bash launch/train.sh CONFIG key=value ...`` as a user runs it.

:func:`trainer_check` builds its inputs in ``workdir`` (the project tokenizer; synthetic agentic trees,
whose trajectories carry 0/1 rewards and so serve as GRPO rollouts too), writes its configs there and
runs, each launch from the repository root with its output in ``workdir/logs/NAME.log``:

1. SFT, uninterrupted to ``max_steps``: the self-check every 5 steps, checkpoints, the export;
2. SFT, the same config in another output_dir: SIGTERM to train.sh once a checkpoint exists (the
   ranks finish their step, save it and exit 75), then the same command again, which resumes to
   ``max_steps``. Its per-step losses must equal run 1's exactly: the weights, optimizer and
   schedule come back from the checkpoint, the step's trees from ``(data.seed, step)``, and a step
   is the same computation in both runs;
3. GRPO for a few steps on the same trees (self-check every step, a KL reference, two mini-batches);
4. run 1's export (``output_dir/hf``) loaded by plain transformers, one forward with finite logits.

``smoke=False``: one CUDA rank (DeepSpeed picks NCCL), bf16, ``bench_llama``, ZeRO-3, attention
``auto`` (flex on CUDA). ``smoke=True``: 2 gloo ranks on the CPU (``DS_ACCELERATOR=cpu``), float32,
``tiny_llama``, the torch engine, a few steps (enough that SIGTERM lands mid-run after the first
checkpoint). The launches inherit the environment (``DEEPSPEED``, ``PYTHON``,
``TORCH_EXTENSIONS_DIR``: launch/train.sh's variables). A launch that fails or runs past its
timeout ends the check: the result's ``errors`` name it with its log's last lines, and nothing is
raised.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import yaml

from ds_tree.config import REPOSITORY
from ds_tree.run.preemption import EXIT_PREEMPTED

TRAIN_SH = REPOSITORY / "launch" / "train.sh"
SELF_CHECK_EVERY = 5
TAIL_LINES = 30
EXPORT_IDS = [1, 12, 40, 300, 7, 2]
"""Token ids of the export's forward (bos, a few content ids, eos)."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What the check runs: model, data, steps and limits."""

    model: str
    dtype: str
    attention: str
    ranks: int
    cpu: bool
    """Ranks on DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``: gloo; not tried where a GPU is visible)."""
    groups: int
    """Synthetic trees in the data."""
    max_tokens: int
    """Longest synthetic trajectory."""
    groups_per_step: int
    budget: int
    sft_steps: int
    checkpoint_every: int
    grpo_steps: int
    timeout_s: float
    """Per launch, DeepSpeed's start-up included."""


GPU = Sizes(
    model="configs/models/bench_llama.json",
    dtype="bfloat16",
    attention="auto",
    ranks=1,
    cpu=False,
    groups=32,
    max_tokens=512,
    groups_per_step=8,
    budget=2048,
    sft_steps=20,
    checkpoint_every=5,
    grpo_steps=3,
    timeout_s=240,
)
SMOKE = Sizes(
    model="configs/models/tiny_llama.json",
    dtype="float32",
    attention="torch",
    ranks=2,
    cpu=True,
    groups=8,
    max_tokens=128,
    groups_per_step=2,
    budget=1024,
    sft_steps=8,
    checkpoint_every=2,
    grpo_steps=2,
    timeout_s=180,
)


class LaunchFailed(Exception):
    """A launch that exited with another code than the one expected, or ran past its timeout."""


# ------------------------------------------------------------------------------------------ inputs
def make_inputs(workdir: Path, sizes: Sizes) -> tuple[Path, Path, dict]:
    """The project tokenizer and the synthetic trees (``ds-tree make-tokenizer``, ``make-synthetic``)."""
    from ds_tree.data.synthetic import SyntheticConfig, write_synthetic
    from ds_tree.vocab.tokenizer import save_tokenizer

    tokenizer = save_tokenizer(workdir / "tokenizer")
    data = workdir / "data" / "synthetic.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    summary = write_synthetic(SyntheticConfig(groups=sizes.groups, por=0.7, max_tokens=sizes.max_tokens), data)
    return tokenizer, data, summary


def write_config(path: Path, sizes: Sizes, data: Path, tokenizer: Path, max_steps: int, **sections: dict) -> Path:
    """A training YAML at ``path``; ``sections`` (objective, checkpoint) complete it. output_dir is
    given per launch."""
    config = {
        "model": {
            "source": str(REPOSITORY / sizes.model),
            "dtype": sizes.dtype,
            "attention": sizes.attention,
            "seed": 0,
            "tokenizer": str(tokenizer),
        },
        "data": {"path": str(data), "groups_per_step": sizes.groups_per_step, "seed": 0},
        "deepspeed": str(REPOSITORY / "configs/ds/zero3.json"),
        "output_dir": str(path.parent / "runs" / path.stem),
        "max_steps": max_steps,
        "packing": {"mode": "tree", "budget": sizes.budget},
        "optimizer": {"lr": 1.0e-3, "warmup_steps": 2, "schedule": "cosine", "grad_clip": 1.0},
        "logging": {"every": 1, "report_to": [], "progress_bar": False},
        **sections,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def sft_config(workdir: Path, sizes: Sizes, data: Path, tokenizer: Path) -> Path:
    objective = {"kind": "sft", "self_check": f"every:{SELF_CHECK_EVERY}"}
    checkpoint = {"every": sizes.checkpoint_every, "keep_last": 2, "export_hf": True}
    return write_config(
        workdir / "sft.yaml", sizes, data, tokenizer, sizes.sft_steps, objective=objective, checkpoint=checkpoint
    )


def grpo_config(workdir: Path, sizes: Sizes, data: Path, tokenizer: Path) -> Path:
    objective = {
        "kind": "grpo",
        "estimator": "grpo",
        "normalise_advantages": True,
        "kl_coef": 0.01,
        "mini_batches": 2,
        "self_check": "every:1",
    }
    checkpoint = {"every": 0, "export_hf": False}
    return write_config(
        workdir / "grpo.yaml", sizes, data, tokenizer, sizes.grpo_steps, objective=objective, checkpoint=checkpoint
    )


# ---------------------------------------------------------------------------------------- launches
@dataclasses.dataclass
class Launch:
    name: str
    process: subprocess.Popen
    log: Path
    started: float
    timeout_s: float


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_environment(sizes: Sizes) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR"):
        env.pop(name, None)
    env["NGPU"] = str(sizes.ranks)
    env["MASTER_PORT"] = str(free_port())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPOSITORY), env.get("PYTHONPATH")]))
    env.setdefault("HF_HUB_OFFLINE", "1")
    if sizes.cpu:
        env["DS_ACCELERATOR"] = "cpu"  # not CUDA_VISIBLE_DEVICES: the launcher sets it for its ranks
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start(name: str, config: Path, output_dir: Path, workdir: Path, sizes: Sizes) -> Launch:
    """``bash launch/train.sh CONFIG output_dir=...`` from the repository root, its own session."""
    log = workdir / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = ["bash", str(TRAIN_SH), str(config), f"output_dir={output_dir}"]
    with open(log, "w") as handle:
        process = subprocess.Popen(
            command,
            cwd=REPOSITORY,
            env=launch_environment(sizes),
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Launch(name, process, log, time.monotonic(), sizes.timeout_s)


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL train.sh and everything under it (the launcher runs in a session of its own)."""
    import psutil

    try:
        members = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        members = []
    process.kill()
    for member in members:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    process.wait()


def log_tail(path: Path, lines: int = TAIL_LINES) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def finish(launch: Launch, expected: int = 0) -> dict:
    """Wait for ``launch`` (killed at its timeout); LaunchFailed unless it exits with ``expected``."""
    left = launch.timeout_s - (time.monotonic() - launch.started)
    try:
        code = launch.process.wait(timeout=max(left, 0.1))
    except subprocess.TimeoutExpired:
        kill_tree(launch.process)
        raise LaunchFailed(
            f"{launch.name}: ran past its {launch.timeout_s:g} s timeout and was killed; {launch.log}, last lines:\n"
            + log_tail(launch.log)
        ) from None
    if code != expected:
        raise LaunchFailed(
            f"{launch.name}: exit code {code}, expected {expected}; {launch.log}, last lines:\n" + log_tail(launch.log)
        )
    return {"name": launch.name, "exit_code": code, "seconds": round(time.monotonic() - launch.started, 1)}


def run(name: str, config: Path, output_dir: Path, workdir: Path, sizes: Sizes, progress: Callable) -> dict:
    progress(f"trainer: {name} ...")
    record = finish(start(name, config, output_dir, workdir, sizes))
    progress(f"trainer: {name}: done in {record['seconds']} s")
    return record


def preempt(launch: Launch, output_dir: Path) -> int:
    """SIGTERM to train.sh once a complete checkpoint exists (``checkpoints/latest``); returns the
    steps logged by then (0 when the run ended or timed out first: :func:`finish` reports it)."""
    latest = output_dir / "checkpoints" / "latest"
    while not latest.exists():
        if launch.process.poll() is not None or time.monotonic() - launch.started > launch.timeout_s:
            return 0
        time.sleep(0.05)
    launch.process.send_signal(signal.SIGTERM)
    return len(read_metrics(output_dir))


# ----------------------------------------------------------------------------------------- results
def read_metrics(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(records: list[dict]) -> list[float | None]:
    """``loss/train`` of steps 1, 2, ... (None where not finite: metrics.jsonl writes null)."""
    return [record.get("loss/train") for record in sorted(records, key=lambda r: r["step"])]


def max_abs_difference(first: list[float | None], second: list[float | None]) -> float | None:
    """Largest |a - b| over the steps; None when the step counts differ or a loss is not finite."""
    if len(first) != len(second) or None in first or None in second:
        return None
    return max((abs(a - b) for a, b in zip(first, second, strict=True)), default=0.0)


def self_check_summary(records: list[dict]) -> dict:
    """The steps the self-check ran on and its largest errors there (``selfcheck/*`` scalars)."""
    checked = [record for record in records if "selfcheck/loss_rel_err" in record]

    def largest(key: str) -> float | None:
        values = [record[key] for record in checked if record.get(key) is not None]
        return max(values) if values else None

    kinds = sorted({key.split("/")[1] for record in checked for key in record if key.endswith("_items")})
    return {
        "steps": [record["step"] for record in checked],
        "max_loss_rel_err": largest("selfcheck/loss_rel_err"),
        "max_abs_logprob_err": largest("selfcheck/max_abs_logprob_err"),
        "max_grad_rel_err": largest("selfcheck/max_grad_rel_err"),
        "item_kinds": kinds,
    }


def rl_summary(records: list[dict]) -> dict[str, list]:
    """Every ``rl/*`` scalar, one value a step."""
    keys = sorted({key for record in records for key in record if key.startswith("rl/")})
    return {key: [record.get(key) for record in records] for key in keys}


def logged(log: Path, pattern: str) -> str | None:
    """The first group of ``pattern``'s first match in a launch's log."""
    match = re.search(pattern, log.read_text(errors="replace"))
    return match.group(1) if match else None


def check_export(hf: Path, device: str) -> dict:
    """Plain ``AutoModelForCausalLM.from_pretrained`` of the export and one forward on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf).to(device).eval()
    with torch.no_grad():
        logits = model(torch.tensor([EXPORT_IDS], device=device)).logits
    return {
        "loaded": True,
        "path": str(hf),
        "device": str(logits.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "logits_shape": list(logits.shape),
        "finite_logits": bool(torch.isfinite(logits).all()),
    }


# ---------------------------------------------------------------------------------------- sections
def sft_section(workdir: Path, config: Path, sizes: Sizes, result: dict, progress: Callable) -> dict:
    """Run A uninterrupted; run B preempted by SIGTERM, then resumed; their losses compared."""
    runs = workdir / "runs"
    uninterrupted, preempted = runs / "sft_uninterrupted", runs / "sft_preempted"
    result["launches"].append(run("sft_uninterrupted", config, uninterrupted, workdir, sizes, progress))

    progress("trainer: sft_preempted: SIGTERM once a checkpoint exists ...")
    launch = start("sft_preempted", config, preempted, workdir, sizes)
    logged_at_signal = preempt(launch, preempted)
    result["launches"].append(finish(launch, expected=EXIT_PREEMPTED))
    saved = (preempted / "checkpoints" / "latest").read_text().strip()
    progress(f"trainer: sft_preempted: SIGTERM after step {logged_at_signal}, exit {EXIT_PREEMPTED}, {saved} saved")
    result["launches"].append(run("sft_resumed", config, preempted, workdir, sizes, progress))

    reference, resumed = losses(read_metrics(uninterrupted)), losses(read_metrics(preempted))
    difference = max_abs_difference(reference, resumed)
    resumed_from = logged(workdir / "logs" / "sft_resumed.log", r"resumed from \S+ at step (\d+)")
    return {
        "steps": sizes.sft_steps,
        "losses_uninterrupted": reference,
        "losses_resumed": resumed,
        "resume_identical": difference == 0.0 and len(reference) == sizes.sft_steps,
        "max_abs_loss_difference": difference,
        "preempt_exit_code": EXIT_PREEMPTED,
        "steps_logged_at_signal": logged_at_signal,
        "checkpoint_saved_at_preemption": saved,
        "resumed_from_step": int(resumed_from) if resumed_from else None,
        "self_check": self_check_summary(read_metrics(uninterrupted)),
        "self_check_resumed_run": self_check_summary(read_metrics(preempted)),
    }


def grpo_section(workdir: Path, config: Path, sizes: Sizes, result: dict, progress: Callable) -> dict:
    output_dir = workdir / "runs" / "grpo"
    result["launches"].append(run("grpo", config, output_dir, workdir, sizes, progress))
    records = read_metrics(output_dir)
    return {
        "steps": len(records),
        "losses": losses(records),
        "rl": rl_summary(records),
        "self_check": self_check_summary(records),
    }


def problems(result: dict, sizes: Sizes) -> list[str]:
    """What the finished sections show wrong (their launches all exited as expected)."""
    found = []
    sft, grpo, export = result["sft"], result["grpo"], result["export"]
    if not sft["resume_identical"]:
        found.append(
            f"sft: the resumed run's losses differ from the uninterrupted run's: {sft['max_abs_loss_difference']}"
        )
    if sft["resumed_from_step"] is None or not 0 < sft["resumed_from_step"] < sizes.sft_steps:
        found.append(f"sft: the re-run did not resume mid-run (resumed_from_step {sft['resumed_from_step']})")
    expected = list(range(1, sizes.sft_steps + 1, SELF_CHECK_EVERY))
    if sft["self_check"]["steps"] != expected:
        found.append(f"sft: the self-check ran on steps {sft['self_check']['steps']}, expected {expected}")
    if grpo["steps"] != sizes.grpo_steps or None in grpo["losses"] or not grpo["rl"]:
        found.append(
            f"grpo: {grpo['steps']} steps of {sizes.grpo_steps}, losses {grpo['losses']}, "
            f"rl/ metrics {sorted(grpo['rl'])}"
        )
    if grpo["self_check"]["steps"] != list(range(1, sizes.grpo_steps + 1)):
        found.append(f"grpo: the self-check ran on steps {grpo['self_check']['steps']}")
    if not export["finite_logits"]:
        found.append(f"export: {export['path']} gives logits that are not finite")
    return found


def run_sections(workdir: Path, sizes: Sizes, result: dict, progress: Callable) -> None:
    progress("trainer: tokenizer and synthetic trees ...")
    tokenizer, data, result["data"] = make_inputs(workdir, sizes)
    sft = sft_config(workdir, sizes, data, tokenizer)
    grpo = grpo_config(workdir, sizes, data, tokenizer)
    result["sft"] = sft_section(workdir, sft, sizes, result, progress)
    log = workdir / "logs" / "sft_uninterrupted.log"
    engine = logged(log, r"attention engine: (\w+)")
    result["attention_engine"] = engine or sizes.attention
    result["attention_engine_from"] = "log" if engine else "config (the log names no engine)"
    result["grpo"] = grpo_section(workdir, grpo, sizes, result, progress)
    progress("trainer: the export in plain transformers ...")
    device = "cpu" if sizes.cpu else "cuda"
    result["export"] = check_export(workdir / "runs" / "sft_uninterrupted" / "hf", device)
    result["errors"].extend(problems(result, sizes))


def trainer_check(workdir: Path, *, smoke: bool, progress: Callable[[str], object] = print) -> dict:
    """The real trainer through launch/train.sh (module docstring); a JSON-able dict, never raises."""
    sizes = SMOKE if smoke else GPU
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    result = {"passed": False, "smoke": smoke, "seconds": 0.0, "sizes": dataclasses.asdict(sizes)}
    result.update(launches=[], errors=[], sft={}, grpo={}, export={"loaded": False}, attention_engine=None)
    try:
        run_sections(workdir, sizes, result, progress)
    except LaunchFailed as failure:
        result["errors"].append(str(failure))
    except Exception as error:  # noqa: BLE001 - the check reports every failure, it never raises
        result["errors"].append(f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=-4)}")
    result["passed"] = not result["errors"]
    result["seconds"] = round(time.monotonic() - started, 1)
    progress(f"trainer: {'passed' if result['passed'] else 'FAILED'} in {result['seconds']} s")
    return result
