"""A job that stops making progress ends with a report instead of hanging silently.

Each rank says what it is doing (`HangWatch.phase`, a string set by the training loop). A thread of each rank
writes that phase, with when it began, to `<dump_folder>/.progress/rank-N.json` every few seconds (and the loop
itself at most once a second, so that a rank's last phase is on file when it freezes).
When a rank has been in one phase for longer than `training.hang_timeout_seconds`, it reads every rank's file
and reports which ranks stopped answering (their file is no longer refreshed: a stopped, frozen or lost process)
and what each was doing, records the report for the launcher (exit_status), kills the silent ranks that are its
own launcher's workers (a frozen one never answers torchrun's SIGTERM, which waits 30 s before killing it) and
ends the process with status 1; torchrun then ends the other ranks. A rank blocked inside a collective keeps
refreshing its file, so the one that froze is the one whose file went stale.

The timeout must exceed the longest step, save or validation of the job; the process group's own timeout is set
above it (distributed.init_distributed), so the report comes before a bare collective timeout.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

from titanlite.exit_status import record_failure

logger = logging.getLogger("titanlite")

FOLDER = ".progress"
PUBLISH_EVERY = 1.0  # seconds: at most this often from the training loop itself (one small file write)


def _attempt() -> str:
    """This launch attempt (torchrun's run id and restart count): files of earlier attempts are stale."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


class HangWatch:
    """The rank's current phase, published for the other ranks, and a thread that ends a job stuck in one."""

    def __init__(self, dump_folder: str, rank: int, world: int, timeout_s: float):
        self.folder = Path(dump_folder) / FOLDER
        self.rank, self.world, self.timeout = rank, world, timeout_s
        self.refresh = max(0.5, min(10.0, timeout_s / 6))  # a file older than 3 refreshes: the rank stopped
        self._phase, self._since = "starting", time.time()
        self._watching, self._published = False, 0.0
        self._frozen: dict[int, int] = {}  # rank -> pid of this launcher's workers found silent by report()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="titanlite-hang-watch", daemon=True)

    def phase(self, what: str) -> None:
        """The rank now does `what` (e.g. 'step 12: forward/backward, microbatch 1 of 2')."""
        self._phase, self._since = what, time.time()
        if self._watching and self._since - self._published > PUBLISH_EVERY:
            self._publish()  # so that a rank that freezes is seen in its last phase, not in one of a while ago

    def start(self) -> HangWatch:
        """Start watching (nothing happens when the timeout is 0)."""
        if self.timeout > 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._watching = True
            self._publish()
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (a clean end of training)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _file(self, rank: int) -> Path:
        return self.folder / f"rank-{rank}.json"

    def _publish(self) -> None:
        self._published = time.time()
        record = {
            "attempt": _attempt(),
            "phase": self._phase,
            "since": self._since,
            "updated": time.time(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        tmp = self.folder / f".rank-{self.rank}.{os.getpid()}.tmp"
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self._file(self.rank))
        except OSError:
            pass  # a full or unreachable dump folder: the other ranks then see this one as silent

    def _run(self) -> None:
        while not self._stop.wait(self.refresh):
            self._publish()
            if time.time() - self._since > self.timeout and not self._stop.is_set():
                self._end(self.report())

    def report(self) -> str:
        """What every rank was doing, the silent ones first (read from the progress files)."""
        now = time.time()
        silent, waiting, unknown = [], [], []
        for rank in range(self.world):
            try:
                r = json.loads(self._file(rank).read_text())
            except (OSError, ValueError):
                r = None
            if r is None or r.get("attempt") != _attempt():
                unknown.append(rank)
                continue
            where = f"rank {rank} ({r['host']}, pid {r['pid']}): '{r['phase']}' for {now - r['since']:.0f} s"
            if now - r["updated"] > 3 * self.refresh:
                silent.append(f"{where}, silent for {now - r['updated']:.0f} s")
                if r["host"] == socket.gethostname() and _parent(r["pid"]) == os.getppid():
                    self._frozen[rank] = r["pid"]
            else:
                waiting.append(where)
        lines = [
            f"the job is hung: rank {self.rank} made no progress for {now - self._since:.0f} s in '{self._phase}' "
            f"(training.hang_timeout_seconds = {self.timeout:g})"
        ]
        if silent:
            lines.append("stopped answering (stopped, frozen or lost process): " + "; ".join(silent[:8]))
        if self._frozen:
            lines.append(
                f"ended at once: rank(s) {_ranges(sorted(self._frozen))} on this host (a frozen worker does not "
                f"answer torchrun's SIGTERM: it would wait 30 s before killing it)"
            )
        if waiting:
            lines.append("still running: " + "; ".join(waiting[:8]) + (" ..." if len(waiting) > 8 else ""))
        if unknown:
            lines.append(
                f"no progress report from rank(s) {_ranges(unknown)} in {self.folder} (another node's dump "
                f"folder, if it is not shared)"
            )
        return "\n  ".join(lines)

    def _end(self, report: str) -> None:
        if not record_failure("hung", report, self.rank):  # else run_train.sh's launcher prints it, once
            logger.error(report)
        for pid in self._frozen.values():  # this launcher's workers that stopped answering: the job ends anyway
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        logging.shutdown()
        os._exit(1)


def _parent(pid: int) -> int | None:
    """The parent process of pid (Linux's /proc), or None."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], ranks[0]
    for prev, r in zip(ranks, ranks[1:] + [None]):
        if r != prev + 1:
            out.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = r
    return ", ".join(out)
