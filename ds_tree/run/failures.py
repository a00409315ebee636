"""What a failing rank tells the others: ``<output_dir>/.failed-rank<R>.txt``.

When one rank of a multi-process run fails, the others find out only through a collective that
breaks: gloo reports "Connection reset by peer" as soon as the failed process exits, and a rank
that hangs instead leaves them waiting ``distributed.timeout_s``. Neither says why. So a rank that
fails for a reason of its own writes its message into the run directory (atomically) before it
exits, and a rank whose collective then breaks looks for such a message and reports it in place of
its own transport error ("rank 1 failed: ..."). Messages older than the reading process are from an
earlier launch and are ignored. Ranks on several nodes see each other's messages when
``output_dir`` is shared (as a resume needs it to be); otherwise the transport error stands.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from ds_tree.atomic import write_text_atomically

NAME = re.compile(r"^\.failed-rank(\d+)\.txt$")
# Transport errors of a collective whose peer is gone or silent (gloo, NCCL, the c10d store).
BROKEN_COLLECTIVE = re.compile(
    r"connection (reset|closed|refused)|broken pipe|socket (closed|timeout)|timed out|timeout|"
    r"nccl (error|communicator)|process group.*(abort|destroyed)|remote (process|peer|worker)|"
    r"peer.*(closed|exited)",
    re.IGNORECASE,
)


def path_for(output_dir: str | Path, rank: int) -> Path:
    return Path(output_dir) / f".failed-rank{rank}.txt"


def record(output_dir: str | Path, rank: int, message: str) -> None:
    """Leave this rank's failure for the others; a write that fails (no directory yet, a full disk) is
    skipped: the message is in this rank's own log either way."""
    try:
        write_text_atomically(path_for(output_dir, rank), message.strip() + "\n")
    except OSError:
        pass


def clear(output_dir: str | Path, rank: int) -> None:
    """Remove this rank's message of an earlier launch (at the start of a run)."""
    try:
        path_for(output_dir, rank).unlink(missing_ok=True)
    except OSError:
        pass


def is_broken_collective(error: BaseException) -> bool:
    """Whether ``error`` is a collective's transport failure, which another rank's failure explains."""
    if isinstance(error, TimeoutError | ConnectionError):
        return True
    name = type(error).__name__
    return (name.startswith("Dist") or isinstance(error, RuntimeError)) and bool(BROKEN_COLLECTIVE.search(str(error)))


def others(output_dir: str | Path, rank: int, since: float, wait_s: float = 5.0) -> list[tuple[int, str]]:
    """The failures the other ranks recorded after ``since`` (a time.time()), earliest first; waits up
    to ``wait_s`` for one to appear (a peer's connection closes a moment after it wrote its message)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        try:
            entries = list(Path(output_dir).iterdir())
        except OSError:
            entries = []
        for path in entries:
            match = NAME.match(path.name)
            if not match or int(match.group(1)) == rank:
                continue
            try:
                written = path.stat().st_mtime
                text = path.read_text(errors="replace").strip()
            except OSError:
                continue
            if written >= since and text:
                found.append((written, int(match.group(1)), text))
        if found or time.monotonic() >= deadline:
            return [(other, text) for _, other, text in sorted(found)]
        time.sleep(0.1)
