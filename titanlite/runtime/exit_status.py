"""How the workers of a run_train.sh job ended, told to the launcher through small files in the temp folder.

run_train.sh sets TITANLITE_EXIT_STATUS_FILE, one per node. Each node's local rank 0 writes there whether the run
finished or stopped after a stop signal (torchrun exits 1 after it forwarded a signal even when every worker saved
and exited 0). A rank that ends with a user error (a ConfigError), a run that failed (a non-finite loss), a lost
node (its collective failed because another node's processes are gone) or a watch that finds the job hung writes
`<file>.<rank>` with its message, so the launcher can print it once and exit 2 (or 1), without torchrun's failure
dump. Nothing here may turn a finished run into a failed one: a status that cannot be written (a full or read-only
temp folder) is a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("titanlite")

ENV = "TITANLITE_EXIT_STATUS_FILE"  # set by run_train.sh


def _write(path: Path, record: dict) -> bool:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({**record, "time": time.time()}))
        os.replace(tmp, path)
        return True
    except OSError as e:
        tmp.unlink(missing_ok=True)
        logger.warning(
            f"could not record how this run ended in {path} ({e.strerror or e}); the launcher reports "
            f"torchrun's own exit status instead"
        )
        return False


LOST_PEER = "lost_peer"  # a rank whose collective failed because another node's processes are gone


def record_end(status: str, step: int) -> None:
    """Local rank 0: the workers 'finished' or 'stopped' (after a stop signal) at this step, when this node's launcher
    asked."""
    path = os.environ.get(ENV)
    if path:
        _write(Path(path), {"status": status, "step": step})


def record_failure(kind: str, message: str, rank: int) -> bool:
    """A rank ends with a user error ('config_error'), a failed run ('failed'), or a watch found the job hung
    ('hung'); False when no launcher asked or the record could not be written (then the caller prints it itself)."""
    path = os.environ.get(ENV)
    if not path:
        return False
    return _write(Path(f"{path}.{rank}"), {"status": kind, "rank": rank, "message": message})


def report_failure(message: str) -> None:
    """Tell why the run failed (a non-finite loss, a checkpoint that could not be saved) once: to the launcher that
    asked (it prints the lowest rank's, without torchrun's failure table), else in the log."""
    if not record_failure("failed", message, int(os.environ.get("RANK", "0"))):
        logger.error(message)


def report_user_error(message: str, every_rank_alike: bool = False) -> None:
    """Tell a user error (a ConfigError's message) once: to the launcher that asked (it prints the lowest rank's),
    else on stderr; every_rank_alike: the error is the same on every rank (generate's), so under a plain torchrun
    only the first rank of this host to get there prints it (torchrun may stop the others before they could)."""
    rank = int(os.environ.get("RANK", "0"))
    if record_failure("config_error", message, rank):
        return
    if every_rank_alike and "TORCHELASTIC_RUN_ID" in os.environ and not _first_to_tell():
        return
    print(f"config error: {message}", file=sys.stderr)


def _first_to_tell() -> bool:
    """Whether this is the first worker of this torchrun job on this host to report an error (a marker file that
    exactly one worker manages to create)."""
    job = "-".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"))
    marker = Path(tempfile.gettempdir()) / f"titanlite-error-{hashlib.sha256(job.encode()).hexdigest()[:16]}"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:  # a temp folder that cannot be written: better twice than never
        return True
    return True


@dataclass
class Outcome:
    """What the workers recorded: this node's end status (its local rank 0's) and every rank's failure."""

    status: str | None = None
    failures: dict[int, dict] = field(default_factory=dict)  # rank -> {"status", "message"}

    def first_failure(self) -> dict | None:
        """The failure of the lowest rank; user errors before hangs (a hang report follows a peer's error)."""
        # user errors first, then failures and hangs, then ranks that only lost another node
        order = {"config_error": 0, LOST_PEER: 2}
        ranked = sorted(self.failures.items(), key=lambda kv: (order.get(kv[1].get("status"), 1), kv[0]))
        return ranked[0][1] | {"rank": ranked[0][0]} if ranked else None


def read_outcome(path: str | None) -> Outcome:
    """The records under path (an Outcome with nothing in it when there are none or they cannot be read)."""
    outcome = Outcome()
    if not path:
        return outcome
    base = Path(path)
    try:
        outcome.status = json.loads(base.read_text() or "{}").get("status")
    except (OSError, ValueError):
        pass
    for record in base.parent.glob(f"{base.name}.*"):
        if record.suffix[1:].isdigit():
            try:
                outcome.failures[int(record.suffix[1:])] = json.loads(record.read_text())
            except (OSError, ValueError):
                continue
    return outcome
