"""Preemption: a signal makes every rank finish its step, save a checkpoint and exit with :data:`EXIT_PREEMPTED`.

SLURM preemption, ``scancel``, ``timeout`` and the launch scripts send SIGTERM (or SIGUSR1, the
signal ``launch/slurm.sbatch`` asks for ``GRACE`` seconds before its time limit). Each of
``checkpoint.preempt_signals`` then only sets a flag; at the next step boundary the ranks
all-reduce it (MAX), so a signal that reached one rank stops all of them at the same step. They
save that step as a complete checkpoint and leave with :data:`EXIT_PREEMPTED`; re-running the same
command resumes from it (``checkpoint.resume: auto``).

The signal's arrival is watched by a thread reading the interpreter's wakeup file descriptor
(:func:`signal.set_wakeup_fd`), which the C-level handler writes at once even while the main
thread waits inside a collective for a rank that will never answer. That thread ends the process
at once (``os._exit(128 + signal)``, the status a shell gives a process killed by the signal;
the last complete checkpoint stays as it was) when

- a second signal arrives, :data:`REPEAT_WINDOW_S` or more after the first: one signal delivered
  both directly and forwarded by a launcher (``kill`` of a process group, ``scancel``, torchrun)
  arrives twice within milliseconds and counts once;
- ``checkpoint.preempt_grace_s`` pass after the first signal before the rank has exited.

Once the preemption checkpoint is complete, any further signal or the deadline exits with
:data:`EXIT_PREEMPTED` instead: nothing is lost by then.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import threading
import time

logger = logging.getLogger(__name__)

EXIT_PREEMPTED = 75
"""Exit code of a run stopped by a preemption signal after saving the checkpoint of its current step
(``EX_TEMPFAIL`` of sysexits.h: try again; the same command resumes)."""

REPEAT_WINDOW_S = 2.0
"""A signal within this many seconds of the first one is the same delivery, not a second signal."""

SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")
"""The names ``checkpoint.preempt_signals`` accepts."""


class Preempted(Exception):
    """The run stopped at a step boundary for a preemption signal; its checkpoint is saved."""

    def __init__(self, signal_name: str, step: int, tag: str | None) -> None:
        saved = f"checkpoint {tag} saved" if tag else "before the first step, nothing new to save"
        super().__init__(
            f"stopped by {signal_name} after step {step}: {saved}; "
            f"run the same command again to resume (exit code {EXIT_PREEMPTED})"
        )
        self.signal_name = signal_name
        self.step = step
        self.tag = tag


def _write_stderr(message: str) -> None:
    """A line on stderr without the logging module's locks (the main thread may hold them)."""
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    try:
        os.write(2, f"{prefix}{message}\n".encode())
    except OSError:
        pass


class PreemptionHandler:
    """Signal handling of one rank for :meth:`ds_tree.engine.trainer.Trainer.train` (a context manager).

    ``requested()`` is collective: every rank calls it once per step boundary and gets the same answer.
    """

    def __init__(self, signal_names: list[str], grace_s: float) -> None:
        self.signals = [signal.Signals[name] for name in signal_names]
        self.grace_s = grace_s
        self.received: signal.Signals | None = None
        """The first preemption signal this rank received."""
        self.first_at: float | None = None
        self.saved = False
        """The preemption checkpoint is complete: any exit from now on is :data:`EXIT_PREEMPTED`."""
        self._previous: dict[signal.Signals, object] = {}
        self._previous_wakeup_fd = -1
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PreemptionHandler:
        if not self.signals or threading.current_thread() is not threading.main_thread():
            return self
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        # The C handler writes each signal's number here at once; the Python handler does nothing.
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._python_handler)
        self._thread = threading.Thread(target=self._watch, name="ds_tree-preemption", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._thread is None or self.saved:  # saved: leaving with EXIT_PREEMPTED, whatever comes now
            return
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        self._closing.set()
        try:
            self._writer.send(b"\0")  # wakes the thread (0 is no signal)
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._reader.close()
        self._writer.close()
        self._thread = None

    @staticmethod
    def _python_handler(number: int, frame) -> None:
        """Nothing: the watcher thread has the wakeup byte (the handler only replaces the default action)."""

    def _watch(self) -> None:
        while not self._closing.is_set():
            timeout = None
            if self.first_at is not None:
                timeout = max(0.0, self.first_at + self.grace_s - time.monotonic())
            ready, _, _ = select.select([self._reader], [], [], timeout)
            if self._closing.is_set():
                return
            if not ready:  # the deadline
                self._exit_now(
                    f"checkpoint.preempt_grace_s={self.grace_s:g} s passed since {self.received.name} without the "
                    "preemption checkpoint being complete"
                )
            for number in self._reader.recv(64):
                if number in self.signals:
                    self._on_signal(signal.Signals(number))

    def _on_signal(self, number: signal.Signals) -> None:
        now = time.monotonic()
        if self.first_at is None:
            self.received, self.first_at = number, now
            _write_stderr(
                f"warning: {number.name} received: stopping after the current step with a checkpoint "
                f"(a second signal, or checkpoint.preempt_grace_s={self.grace_s:g} s, exits at once)"
            )
        elif now - self.first_at >= REPEAT_WINDOW_S:
            self._exit_now(f"a second signal ({number.name}) arrived")

    def _exit_now(self, why: str) -> None:
        if self.saved:
            _write_stderr(f"warning: {why}; the preemption checkpoint is complete: exiting ({EXIT_PREEMPTED})")
            code = EXIT_PREEMPTED
        else:
            code = 128 + int(self.received or signal.SIGTERM)
            _write_stderr(
                f"error: {why}: exiting at once ({code}) without a checkpoint of the current step; "
                "the last complete checkpoint is unchanged"
            )
        os._exit(code)

    def requested(self) -> bool:
        """Whether any rank received a preemption signal (collective: an all-reduce of one flag)."""
        import torch  # here: the module itself loads in a blink (its tests start processes)
        import torch.distributed as dist

        flag = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def before_first_step(self, trainer) -> None:
        """After set-up: when any rank was signalled during it, raise :class:`Preempted` (nothing new to save)."""
        if self.requested():
            self.saved = True
            raise Preempted(self.signal_name(), trainer.start_step, None)

    def at_step_boundary(self, trainer, step: int) -> None:
        """After ``step`` (not the last): when any rank was signalled, save ``step`` and raise :class:`Preempted`.

        Every rank calls this at every step boundary (it all-reduces the flag).
        """
        if not self.requested():
            return
        from ds_tree.run import checkpoint

        every = trainer.config.checkpoint.every
        if not (every and step % every == 0):  # else the loop saved this step just now
            trainer.save(step)
        self.saved = True
        raise Preempted(self.signal_name(), step, checkpoint.tag_for(step))

    def signal_name(self) -> str:
        """The signal this rank received, or how it learned of another rank's."""
        return self.received.name if self.received is not None else "a signal to another rank"
