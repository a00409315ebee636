"""Run as one process (no launcher needed): a checkpoint write that runs out of disk space.

Trains one step (``max_steps=1`` in the config: checkpoint ``step_0000001`` at the end), then saves
step 2 on a full disk: ``--fill`` fills the output directory's filesystem (a small tmpfs the test
mounts) with a ballast file first, so DeepSpeed's own writes fail; ``--simulate`` makes DeepSpeed's
save write part of a file and then raise ``OSError(ENOSPC)``, for machines where no tmpfs can be
mounted. Writes the error message, ``latest`` and the complete checkpoints after the failure to
``--out`` as JSON.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from ds_tree.run import checkpoint
from ds_tree.train import exit_now
from tests.distributed.common import check_arguments, started_trainer


def fill(directory: Path) -> None:
    """Write a ballast file until the filesystem refuses more."""
    chunk = b"\0" * (1 << 20)
    with open(directory / "ballast", "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(chunk)
        except OSError as error:
            assert error.errno == errno.ENOSPC, error
    for size in (1 << 16, 1 << 12, 1):  # the last partial chunk too
        try:
            with open(directory / "ballast", "ab", buffering=0) as handle:
                while True:
                    handle.write(b"\0" * size)
        except OSError:
            pass


def main() -> None:
    args, config = check_arguments((("--mode",), {"choices": ["fill", "simulate"], "required": True}))
    trainer = started_trainer(config)
    trainer.train()
    if args.mode == "fill":
        fill(trainer.output_dir)
    else:

        def out_of_space(save_dir: str, tag: str, **kwargs) -> None:
            (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
            (Path(save_dir) / tag / "mp_rank_00_model_states.pt").write_bytes(b"part of a checkpoint")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        trainer.engine.save_checkpoint = out_of_space
    try:
        trainer.save(2)
        message = None
    except checkpoint.CheckpointError as error:
        message = str(error)
    report = {
        "message": message,
        "latest": (trainer.checkpoint_dir / checkpoint.LATEST).read_text(),
        "complete": checkpoint.complete_tags(trainer.checkpoint_dir),
    }
    (trainer.output_dir / "ballast").unlink(missing_ok=True)
    Path(args.out).write_text(json.dumps(report))
    trainer.close()


if __name__ == "__main__":
    main()
    exit_now(0)  # as the trainer leaves: past the finalisers that abort a rank now and then (ds_tree/train.py)
