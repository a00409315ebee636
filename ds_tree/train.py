"""Entry point: ``python -m ds_tree.train --config configs/X.yaml [key=value ...]``.

Runs under ``deepspeed --num_gpus N --module ds_tree.train``, ``torchrun`` and ``srun`` alike.
``--dry-run`` validates the config, the data, the model's layer types, the DeepSpeed JSON, the
output directory and what a resume would load, without starting anything.

Exit codes: 0 done; 2 a config, data or checkpoint error found before any process group starts
(every rank finds the same); 1 a failure after that, which each failing rank reports with its
rank before exiting, so the one that failed first is named even when the others then fail
waiting for it; 75 stopped by a preemption signal (``checkpoint.preempt_signals``, SIGTERM and
SIGUSR1 by default) after saving the checkpoint of the step it was in: the same command resumes;
128 + the signal's number: a second signal, or ``checkpoint.preempt_grace_s`` passed, before that
checkpoint was complete (:mod:`ds_tree.run.preemption`).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys
import time
import warnings

if not __package__:  # run as a file (torchrun ds_tree/train.py): its own folder must not shadow top-level packages
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from ds_tree.config import ConfigError, load_config
from ds_tree.data.jsonl import json_text
from ds_tree.engine.self_check import SelfCheckError
from ds_tree.engine.trainer import Trainer
from ds_tree.engine.updates import NonFiniteError
from ds_tree.errors import DataError, RolloutError
from ds_tree.models.token_mixing import UnsupportedModelError
from ds_tree.run import checkpoint, failures
from ds_tree.run.checkpoint import CheckpointError
from ds_tree.run.console import setup_console
from ds_tree.run.preemption import EXIT_PREEMPTED, Preempted, PreemptionHandler
from ds_tree.sampling.interface import EngineError

logger = logging.getLogger("ds_tree.train")

# Failures the project raises on purpose, whose message says everything: one message, no traceback.
EXPLAINED = (
    ConfigError,
    DataError,
    CheckpointError,
    NonFiniteError,
    SelfCheckError,
    UnsupportedModelError,
    EngineError,
    RolloutError,
)


def main(argv: list[str] | None = None) -> int:
    # DeepSpeed 0.19 calls collectives torch 2.13 has renamed: one warning per call, every step.
    warnings.filterwarnings(
        "ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning
    )
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="training YAML")
    parser.add_argument("--dry-run", action="store_true", help="validate everything, print the resolved configs")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = parser.parse_args(argv)
    started = time.time()  # another rank's failure message written before this is from an earlier launch
    setup_console(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    try:
        config = load_config(args.config, args.overrides)
        trainer = Trainer(config)
        trainer.prepare(lock=not args.dry_run)  # a run locks its output_dir; a dry run checks it is free
    except CheckpointError as error:
        logger.error("checkpoint error: %s", error)
        return 2
    except (ValueError, FileNotFoundError) as error:  # ConfigError, DataError, malformed model JSON
        logger.error("config error: %s", error)
        return 2
    if args.dry_run:
        resolved = {"world_size": trainer.world_size, "attention_engine": trainer.attention_engine}
        print(json_text({**resolved, "deepspeed": trainer.ds_config}, indent=2))
        return 0
    if already_finished(trainer):
        return 0
    preemption = PreemptionHandler(config.checkpoint.preempt_signals, config.checkpoint.preempt_grace_s)
    rank = int(os.environ.get("RANK", "0"))
    if trainer.world_size > 1:
        failures.clear(trainer.output_dir, rank)
    try:
        with preemption:  # from here on a signal stops the run at a step boundary
            trainer.setup()
            preemption.before_first_step(trainer)
            trainer.preemption = preemption
            trainer.train()
    except Preempted as stop:
        logger.warning("%s", stop)
        return EXIT_PREEMPTED
    except Exception as error:  # noqa: BLE001 - every rank names its own failure before exiting
        report_failure(trainer, rank, started, error)
        return 1
    finally:
        trainer.close()
    return 0


def report_failure(trainer: Trainer, rank: int, started: float, error: Exception) -> None:
    """Log this rank's failure, once. A collective broken by another rank's failure reports that rank's
    message (:mod:`ds_tree.run.failures`); a failure of this rank's own is left for the others to read.
    Errors the project raises on purpose are one message; others keep their traceback."""
    several = trainer.world_size > 1
    if several and not isinstance(error, EXPLAINED) and failures.is_broken_collective(error):
        found = failures.others(trainer.output_dir, rank, started)
        if found:
            other, message = found[0]
            cause = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
            logger.error(
                "error: rank %d failed: %s (this rank stopped at a collective waiting for it: %s)",
                other,
                message,
                cause,
            )
            return
    if several:  # a timeout nobody explained is recorded too: it may be this rank's own (a request, a hang)
        failures.record(
            trainer.output_dir, rank, str(error) if isinstance(error, EXPLAINED) else f"{type(error).__name__}: {error}"
        )
    if isinstance(error, EXPLAINED):
        logger.error("error: %s", error)
        return
    logger.error("error: %s: %s", type(error).__name__, error, exc_info=True)
    if "timed out" in str(error).lower() and several:  # one process has no other rank
        logger.error(
            "error: a collective waited distributed.timeout_s=%g s for another rank, which stopped answering "
            "(its own error, if it reported one, is above)",
            trainer.config.distributed.timeout_s,
        )


def already_finished(trainer: Trainer) -> bool:
    """True (and says so) when the checkpoint this run would resume from is at ``max_steps`` and
    its export is there: a re-run would train 0 steps and export the same weights again."""
    config = trainer.config
    tag = trainer.resume_from
    if tag is None and int(os.environ.get("RANK", "0")) != 0:  # rank 0 alone planned the resume: read it alike
        try:
            tag = checkpoint.resume_tag(trainer.checkpoint_dir, config.checkpoint.resume)
        except CheckpointError:
            return False  # rank 0 reported it and stopped
    step = checkpoint.step_of(tag) if tag else None
    if step is None or step < config.max_steps:
        return False
    export = trainer.output_dir / "hf"
    saved = (trainer.checkpoint_dir / tag / checkpoint.RECORD).stat().st_mtime
    if config.checkpoint.export_hf and not (export.is_dir() and export.stat().st_mtime >= saved):
        return False  # no export of that checkpoint yet (the run stopped before it): train 0 steps, export
    logger.warning(
        "%s already reached max_steps=%d (checkpoint %s): nothing to train%s. To train further from it, "
        "raise max_steps (e.g. max_steps=%d); to start a new run, set another output_dir",
        trainer.output_dir,
        config.max_steps,
        tag,
        f", and its export {export} is up to date" if config.checkpoint.export_hf else "",
        2 * config.max_steps,
    )
    return True


def exit_now(code: int) -> None:
    """Leave without running interpreter and C++ static finalisers.

    Everything the run writes is flushed and closed by then (logs, TensorBoard, checkpoints,
    export; the process group is destroyed). Ranks still aborted at interpreter exit now and then
    ("terminate called without an active exception", status -6) after a complete run, which a
    launcher reports as a failed job; skipping the finalisers avoids it.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    faulthandler.enable()  # a native abort (SIGABRT, SIGSEGV) still prints every thread's Python stack
    exit_now(main())
