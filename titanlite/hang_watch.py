"""A job that stops making progress ends with a report instead of hanging silently.

Each rank says what it is doing (`HangWatch.phase`, a string set by the training loop). A thread of each rank
writes that phase, with when it began, to `<dump_folder>/.progress/rank-N.json` every few seconds (and the loop
itself at most once a second, so that a rank's last phase is on file when it freezes). A rank blocked inside a
collective keeps refreshing its file, so a rank that froze (a stopped, frozen or lost process) is one whose file
went stale.

The judge is titanlite's launcher (`titanlite.cli.launch`, which run_train.sh runs): a worker that freezes cannot
stop a watch that runs in another process, so a one-process job ends too. The launcher reads the files of its own
workers and ends them all, with one report (which ranks stopped answering, what each was doing) recorded for
itself to print (exit_status), when
- a rank stays in one phase longer than `training.hang_timeout_seconds`: the job is hung; or
- in a fault-tolerant replica group, a rank is silent longer than `leave_when_silent`'s seconds (a quarter of
  `fault_tolerance.quorum_timeout_seconds`): the group leaves the job, so that the lighthouse drops it and the
  live groups go on (a group whose rank 0 still heartbeats would otherwise block their quorum).
Under a plain torchrun (no titanlite launcher) each rank's thread judges the same way over this host's ranks.

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
from collections.abc import Callable
from pathlib import Path

from titanlite.exit_status import ENV, record_failure

logger = logging.getLogger("titanlite")

FOLDER = ".progress"
PUBLISH_EVERY = 1.0  # seconds: at most this often from the training loop itself (one small file write)
LAUNCHER_ENV = "TITANLITE_LAUNCHER_WATCH"  # set by titanlite.cli.launch: it judges its workers' progress files


def _attempt() -> str:
    """This launch attempt (torchrun's run id and restart count): files of earlier attempts are stale."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def refresh_period(timeout_s: float, leave_after_s: float = 0.0) -> float:
    """How often a rank rewrites its progress file: a file older than 3 periods belongs to a silent rank."""
    limits = [10.0] + [timeout_s / 6] * (timeout_s > 0) + [leave_after_s / 3] * (leave_after_s > 0)
    return max(0.5, min(limits))


def spec_path(status_file: str) -> Path:
    """Where the workers tell their launcher what to watch (next to the exit status file it gave them)."""
    return Path(f"{status_file}.watch")


class HangWatch:
    """The rank's current phase, published for the watch, and a thread that keeps it fresh (and judges, when no
    titanlite launcher does)."""

    def __init__(self, dump_folder: str, rank: int, world: int, timeout_s: float):
        self.folder = Path(dump_folder) / FOLDER
        self.rank, self.world, self.timeout = rank, world, timeout_s
        self.leave_after, self.replica_id = 0.0, None
        self.refresh = refresh_period(timeout_s)
        self._phase, self._since = "starting", time.time()
        self._watching, self._published = False, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="titanlite-hang-watch", daemon=True)
        self._judge: Watcher | None = None

    def leave_when_silent(self, seconds: float, replica_id: int) -> None:
        """Fault tolerance: a rank of this group silent for `seconds` ends the group (before start)."""
        self.leave_after, self.replica_id = max(seconds, 1.5), replica_id
        self.refresh = refresh_period(self.timeout, self.leave_after)

    def phase(self, what: str) -> None:
        """The rank now does `what` (e.g. 'step 12: forward/backward, microbatch 1 of 2')."""
        self._phase, self._since = what, time.time()
        if self._watching and self._since - self._published > PUBLISH_EVERY:
            self._publish()  # so that a rank that freezes is seen in its last phase, not in one of a while ago

    def spec(self) -> dict:
        """What a watch of this job needs to know."""
        return {
            "folder": str(self.folder.resolve()),
            "world": self.world,
            "ranks": _this_nodes_ranks(self.rank),
            "timeout": self.timeout,
            "leave_after": self.leave_after,
            "replica_id": self.replica_id,
            "refresh": self.refresh,
        }

    def start(self) -> HangWatch:
        """Start publishing and watching (nothing happens when neither rule is on)."""
        if self.timeout <= 0 and self.leave_after <= 0:
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        self._watching = True
        self._publish()
        if os.environ.get(LAUNCHER_ENV) and os.environ.get(ENV):
            if os.environ.get("LOCAL_RANK", "0") == "0":
                _write_json(spec_path(os.environ[ENV]), self.spec())
        else:  # a plain torchrun: this host's ranks judge each other (a one-process job cannot)
            self._judge = Watcher(self.spec(), _sibling, end_all=False)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the end of training): the last record says so, so that the time this rank then spends
        on its way out (a final save, waiting for its peers) is not taken for silence."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._watching:
            self._watching = False
            _write_json(self.folder / f"rank-{self.rank}.json", self._record() | {"ended": True})

    def _record(self) -> dict:
        return {
            "attempt": _attempt(),
            "phase": self._phase,
            "since": self._since,
            "updated": time.time(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }

    def _publish(self) -> None:
        self._published = time.time()
        _write_json(self.folder / f"rank-{self.rank}.json", self._record())

    def _run(self) -> None:
        while not self._stop.wait(self.refresh):
            self._publish()
            verdict = self._judge.check({self.rank: self._record()}) if self._judge else None
            if verdict and not self._stop.is_set():
                self._end(*verdict)

    def report(self) -> str:
        """What every rank was doing, the silent ones first (read from the progress files)."""
        first = hung_line(self.rank, time.time() - self._since, self._phase, self.timeout)
        return describe(read_records(self.folder, self.world, _attempt()), first, self.refresh, [], self.folder)

    def _end(self, report: str, rank: int, pids: list[int]) -> None:
        if not record_failure("hung", report, rank):  # else the launcher prints it, once
            logger.error(report)
        kill(p for p in pids if p != os.getpid())
        logging.shutdown()
        os._exit(1)


class Watcher:
    """Judges the progress files of the ranks whose processes it may end (`mine(record)`), on a clock that stands
    still while the watcher itself did not run (a job suspended as a whole and resumed is not hung)."""

    def __init__(self, spec: dict, mine: Callable[[dict], bool], end_all: bool):
        self.spec, self.mine, self.end_all = spec, mine, end_all  # end_all: every rank it may end, not the frozen
        self.folder = Path(spec["folder"])
        self.refresh = float(spec["refresh"])
        self._phases: dict[int, tuple] = {}  # rank -> ((pid, since), clock when first seen, age then)
        self._updates: dict[int, tuple] = {}  # rank -> ('updated', clock when first seen)
        self._paused, self._last = 0.0, time.monotonic()
        self.ended: set[int] = set()  # pids already ended

    def _clock(self) -> float:
        now = time.monotonic()
        overrun = now - self._last - self.refresh
        if overrun > max(2.0, self.refresh):  # this watcher was stopped or starved: that time does not count
            self._paused += overrun
        self._last = now
        return now - self._paused

    def check(self, own: dict[int, dict] | None = None) -> tuple[str, int, list[int]] | None:
        """(report, the rank it is about, the pids to end) when the job is hung or the group must leave, else
        None; `own`: records this process knows better than its files."""
        clock, now = self._clock(), time.time()
        # This node's files only (every node's launcher reads its own): all of them only for a report.
        records = {rank: _read_json(self.folder / f"rank-{rank}.json") for rank in self.spec["ranks"]} | (own or {})
        mine = {
            rank: r
            for rank, r in records.items()
            if r and not r.get("ended") and self.mine(r) and r["pid"] not in self.ended
        }
        stuck, silent = [], []
        for rank, r in mine.items():
            key = (r["pid"], r["since"])
            if self._phases.get(rank, (None,))[0] != key:
                self._phases[rank] = (key, clock, max(0.0, now - r["since"]))
            if self._updates.get(rank, (None,))[0] != r["updated"]:
                self._updates[rank] = (r["updated"], clock)
            _, seen, age = self._phases[rank]
            stuck.append((age + clock - seen, rank))
            silent.append((clock - self._updates[rank][1], rank))
        leave_after, timeout = float(self.spec["leave_after"]), float(self.spec["timeout"])
        quiet, rank = max(silent, default=(0.0, None))
        if leave_after > 0 and quiet > leave_after:
            first = leave_line(rank, quiet, mine[rank]["phase"], self.spec["replica_id"])
            return self._verdict(mine, first, rank, list(mine.values()))
        age, rank = max(stuck, default=(0.0, None))
        if timeout > 0 and age > timeout:
            frozen = [mine[r] for q, r in silent if q > 3 * self.refresh or self.end_all]
            return self._verdict(mine, hung_line(rank, age, mine[rank]["phase"], timeout), rank, frozen)
        return None

    def _verdict(self, mine: dict, first: str, rank: int, ending: list[dict]) -> tuple[str, int, list[int]]:
        pids = [r["pid"] for r in ending]
        self.ended.update(pids)
        ended_ranks = [k for k, r in mine.items() if r["pid"] in pids and r["pid"] != os.getpid()]
        attempt = mine[rank]["attempt"]  # the launcher knows it from its workers only
        records = read_records(self.folder, self.spec["world"], attempt) | mine
        return describe(records, first, self.refresh, ended_ranks, self.folder), rank, pids


class LauncherWatch:
    """The watch of titanlite's launcher over its workers (they write `spec_path(status_file)` when they start):
    when the job is hung or a fault-tolerant group must leave, it records the report for the launcher to print and
    ends every worker of this launcher (torchrun then ends the job as for a failed worker)."""

    def __init__(self, status_file: str, poll: float = 0.5):
        self.status_file, self.poll = status_file, poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="titanlite-launcher-watch", daemon=True)

    def start(self) -> LauncherWatch:
        os.environ[LAUNCHER_ENV] = "1"  # the workers inherit it: they publish, this process judges
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        os.environ.pop(LAUNCHER_ENV, None)

    def _run(self) -> None:
        watcher, spec = None, None
        while not self._stop.wait(watcher.refresh if watcher else self.poll):
            latest = _read_json(spec_path(self.status_file))
            if latest != spec:  # the workers started (or torchrun restarted them)
                spec = latest
                watcher = Watcher(spec, _my_worker, end_all=True) if spec else None
            verdict = watcher.check() if watcher else None
            if verdict:
                report, rank, _ = verdict
                if not record_failure("hung", report, rank):
                    logger.error(report)
                kill(_children(os.getpid()))  # every worker: the job (or this group) ends anyway


def read_records(folder: Path, world: int, attempt: str | None = None) -> dict[int, dict | None]:
    """Every rank's progress record (of this attempt, when given; None where there is none)."""
    out = {}
    for rank in range(world):
        r = _read_json(folder / f"rank-{rank}.json")
        out[rank] = r if r and (attempt is None or r.get("attempt") == attempt) else None
    return out


def hung_line(rank: int, seconds: float, phase: str, timeout: float) -> str:
    return (
        f"the job is hung: rank {rank} made no progress for {seconds:.0f} s in '{phase}' "
        f"(training.hang_timeout_seconds = {timeout:g})"
    )


def leave_line(rank: int, seconds: float, phase: str, replica_id) -> str:
    return (
        f"rank {rank} stopped answering {seconds:.0f} s ago in '{phase}' (a stopped, frozen or lost process): this "
        f"replica group (fault_tolerance.replica_id = {replica_id}) leaves the job so that the live groups go on; run "
        f"its command again to rejoin (it heals from a live group)"
    )


def describe(records: dict[int, dict | None], first: str, refresh: float, ended: list[int], folder: Path) -> str:
    """`first`, then which ranks stopped answering (a file older than 3 refreshes), which were ended, which still
    run and where, and which never reported."""
    now = time.time()
    silent, waiting, unknown = [], [], []
    for rank, r in records.items():
        if r is None:
            unknown.append(rank)
            continue
        where = f"rank {rank} ({r['host']}, pid {r['pid']}): '{r['phase']}' for {now - r['since']:.0f} s"
        if now - r["updated"] > 3 * refresh and not r.get("ended"):
            silent.append(f"{where}, silent for {now - r['updated']:.0f} s")
        else:
            waiting.append(where)
    lines = [first]
    if silent:
        lines.append("stopped answering (stopped, frozen or lost process): " + "; ".join(silent[:8]))
    if ended:
        lines.append(
            f"ended at once: rank(s) {_ranges(sorted(ended))} on this host (a frozen worker answers no SIGTERM: "
            f"torchrun would wait 30 s before killing it)"
        )
    if waiting:
        lines.append("still running: " + "; ".join(waiting[:8]) + (" ..." if len(waiting) > 8 else ""))
    if unknown:
        lines.append(
            f"no progress report from rank(s) {_ranges(unknown)} in {folder} (another node's dump folder, if it "
            f"is not shared)"
        )
    return "\n  ".join(lines)


def _this_nodes_ranks(rank: int) -> list[int]:
    """The global ranks of this node's workers (torchrun numbers them consecutively on each node)."""
    first = rank - int(os.environ.get("LOCAL_RANK", "0"))
    return list(range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def kill(pids) -> None:
    """SIGKILL each process (a frozen one answers nothing else)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _write_json(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        pass  # a full or unreachable folder: the watch then sees this rank as silent


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _sibling(record: dict) -> bool:
    """Whether a record is of this process or another worker of its launcher on this host, in this attempt."""
    same_host = record["host"] == socket.gethostname() and record.get("attempt") == _attempt()
    return same_host and _parent(record["pid"]) == os.getppid()


def _my_worker(record: dict) -> bool:
    """Whether a record is of a worker of this launcher process."""
    return record["host"] == socket.gethostname() and _parent(record["pid"]) == os.getpid()


def _children(pid: int) -> list[int]:
    """The child processes of pid (Linux's /proc)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(x) for x in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return kids


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
