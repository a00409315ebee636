"""Console output of the ``ds_tree`` loggers on every rank.

Every module logs to ``logging.getLogger(__name__)`` (the ``ds_tree`` namespace) instead of
printing. :func:`setup_console` (called by the entry point) gives the namespace one handler:
information and warnings are printed by rank 0 only (every rank would print the same line);
errors by every rank, with the rank in front when there are several, so the rank that failed is
named even when the others then fail waiting for it. Info lines (the per-step line among them)
are printed as they are, to stdout; warnings (``warning: ...``) and errors to stderr. Lines go
through ``tqdm.write``, which keeps a progress bar intact. The bar (:func:`progress_bar`) is drawn
only on a terminal: in a log file or pipe its carriage-return redraws would share lines with the
per-step lines, which say the same.
"""

from __future__ import annotations

import logging
import sys

NAMESPACE = "ds_tree"


class RankZeroFilter(logging.Filter):
    """Lets everything through on rank 0, and only errors on the other ranks."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.ERROR


class ConsoleFormatter(logging.Formatter):
    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__("%(message)s")
        self.rank_label = f"[rank {rank}] " if world_size > 1 else ""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        if record.levelno >= logging.ERROR:
            return self.rank_label + message
        if record.levelno >= logging.WARNING:
            return f"warning: {message}"
        return message


class ConsoleHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
            tqdm.write(self.format(record), file=stream)
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own convention: report, never raise
            self.handleError(record)


def setup_console(rank: int, world_size: int) -> logging.Logger:
    """Route the ``ds_tree`` loggers to the console for this rank (replaces an earlier set-up)."""
    logger = logging.getLogger(NAMESPACE)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in [h for h in logger.handlers if isinstance(h, ConsoleHandler)]:
        logger.removeHandler(handler)
    handler = ConsoleHandler()
    handler.setFormatter(ConsoleFormatter(rank, world_size))
    handler.addFilter(RankZeroFilter(rank))
    logger.addHandler(handler)
    return logger


def progress_bar(total: int, initial: int, stream=None):
    """A tqdm bar on ``stream`` (stderr) if it is a terminal, else None (logs get the step lines only)."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if isatty is None or not isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, file=stream)
