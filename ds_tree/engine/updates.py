"""The policy's optimizer updates (docs/DESIGN.md section 3): each update's backward, the update itself,
and what a step whose loss or gradient is not finite does (``optimizer.non_finite``).

An objective runs each update's items with :meth:`Updates.backward_for` as their ``backward`` and then
calls :meth:`Updates.apply`; the counts of discarded and untrained steps live here and go into every
checkpoint (the trainer's ``client_state``).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist

from ds_tree.run import checkpoint

logger = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm is not finite and ``optimizer.non_finite`` is ``stop``."""


class Updates:
    """The updates of one DeepSpeed engine under one non-finite policy (module docstring)."""

    def __init__(
        self, engine, non_finite: str, checkpoint_dir: Path, *, skipped_steps: int = 0, untrained_steps: int = 0
    ) -> None:
        self.engine = engine
        self.non_finite = non_finite
        """``optimizer.non_finite``: ``stop`` or ``skip``."""
        self.checkpoint_dir = checkpoint_dir
        """Where the run's checkpoints are (an error names the newest complete one)."""
        self.skipped_steps = skipped_steps
        """Steps whose update was discarded (``optimizer.non_finite: skip``), this run and the ones it resumed."""
        self.untrained_steps = untrained_steps
        """Steps without a trained token (every loss weight 0)."""

    def backward_for(self, n_rows: int):
        """``backward(loss)`` for each of ``n_rows`` micro-batches of one optimizer update.

        DeepSpeed's division by the accumulation steps is skipped (``scale_wrt_gas=False``) and its
        average over data-parallel ranks cancelled (the loss times the world size); the last row
        marks the accumulation boundary.

        ZeRO-3 counts micro-steps when a forward follows a backward (its optimizer's
        ``clear_backward_seen_flag``, called by ``engine.forward``) and overwrites the gradient
        partitions in micro-step 0 instead of adding to them. The dfs walk's held forwards make
        backward calls with no forward between them: at a step's start each overwrote the one before
        (a 2-rank step walked in 16-token chunks lost 17% of its gradient). So every backward call is
        preceded by that call, as a forward would; after a forward it changes nothing.
        """
        engine = self.engine
        scale = float(dist.get_world_size())
        remaining = [n_rows]
        stage3 = engine.zero_optimization_stage() == 3

        def backward(loss: torch.Tensor) -> None:
            remaining[0] -= 1
            engine.set_gradient_accumulation_boundary(remaining[0] == 0)
            if stage3:
                engine.optimizer.clear_backward_seen_flag()
            engine.backward(loss * scale, scale_wrt_gas=False)

        return backward

    def apply(self, step: int, local_loss: float) -> tuple[float, float | None]:
        """The optimizer update after a full accumulation: (global loss, gradient norm), or an error.

        The loss is all-reduced first, so every rank sees the same sum and decides alike.
        """
        loss = torch.tensor([local_loss], dtype=torch.float64)
        dist.all_reduce(loss)
        loss = float(loss.item())
        if not math.isfinite(loss) and self.non_finite == "stop":
            raise NonFiniteError(self._stopped(step, f"the loss is {loss}"))
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()  # of the gradient this update applied
        grad_norm = float(grad_norm) if grad_norm is not None else None
        self._check_applied(step, loss, grad_norm)
        return loss, grad_norm

    def _check_applied(self, step: int, loss: float, grad_norm: float | None) -> None:
        """Stop, or count a discarded step, when the loss or the gradient was not finite.

        DeepSpeed (ZeRO stages 1-3, bf16) discards a step whose gradient norm is not finite on
        every rank alike: the gradients are zeroed, the parameters, optimizer state and
        learning-rate schedule left as they were. A non-finite loss has non-finite gradients.
        """
        applied = self.engine.was_step_applied()
        finite_norm = grad_norm is None or math.isfinite(grad_norm)
        if applied and math.isfinite(loss) and finite_norm:
            return
        if not math.isfinite(loss):
            what = f"the loss is {loss}"
        else:
            what = "the gradient is not finite" if finite_norm else f"the gradient norm is {grad_norm}"
        if applied:
            raise NonFiniteError(
                f"step {step}: {what}, and DeepSpeed applied the update (it discards such steps only under ZeRO "
                f"stages 1-3 and bf16): the model is no longer finite. {self._last_good()}"
            )
        self.discard(step, what)

    def discard(self, step: int, what: str) -> None:
        """A non-finite step whose update was not applied: stop (``optimizer.non_finite=stop``), or count it."""
        if self.non_finite == "stop":
            raise NonFiniteError(self._stopped(step, what))
        self.skipped_steps += 1
        logger.warning(
            "step %d: %s; its update is discarded (optimizer.non_finite=skip; %d step(s) skipped)",
            step,
            what,
            self.skipped_steps,
        )

    def count_untrained(self, step: int) -> None:
        """``step`` trains no token (every loss weight 0): warned about once, counted."""
        self.untrained_steps += 1
        if self.untrained_steps == 1:
            logger.warning(
                "step %d has no trained token (every loss weight is 0): its loss and gradient are 0; "
                "further such steps are counted and reported at the end",
                step,
            )

    def _stopped(self, step: int, what: str) -> str:
        return (
            f"step {step}: {what}; stopped without applying its update (optimizer.non_finite=stop). "
            f"{self._last_good()} Lower optimizer.lr, check the data, or set optimizer.non_finite=skip to discard "
            "such steps"
        )

    def _last_good(self) -> str:
        tags = checkpoint.complete_tags(self.checkpoint_dir)
        return f"Nothing was saved: {tags[-1]} stays the newest checkpoint." if tags else "Nothing was saved."
