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
- in a fault-tolerant replica group, a rank's process is stopped (/proc state T: SIGSTOP, a frozen cgroup, a
  debugger) and silent longer than `leave_when_silent`'s seconds (a quarter of
  `fault_tolerance.quorum_timeout_seconds`, at least LEAVE_FLOOR s): the group leaves the job, so that the
  lighthouse drops it and the live groups go on (a group whose rank 0 still heartbeats would otherwise block their
  quorum). Silence alone is not enough: a write to a shared file system can stall for tens of seconds (all groups
  save at the same step), and a group must not leave for that. The launcher that ends its workers for this writes
  a marker (`leave-group-<replica_id>.json`) beside the progress files, so that the group's launchers on other
  nodes end theirs too (their rank 0 would otherwise heartbeat on, blocked).
Under a plain torchrun (no titanlite launcher), or when the workers cannot write the launcher's spec file, each
rank's thread judges the same way over this host's ranks. With torchrun's --max-restarts left, a verdict is logged
(torchrun restarts the workers), not recorded as the job's end.

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

from titanlite.runtime.exit_status import ENV, record_failure
from titanlite.runtime.hang_report import describe, hung_line, leave_line, left_line

logger = logging.getLogger("titanlite")

FOLDER = ".progress"
PUBLISH_EVERY = 1.0  # seconds: at most this often from the training loop itself (one small file write)
LAUNCHER_ENV = "TITANLITE_LAUNCHER_WATCH"  # set by titanlite.cli.launch: it judges its workers' progress files
LEAVE_FLOOR = 10.0  # seconds: the least silence of a stopped rank that takes its group out
STOP_JOIN = 5.0  # seconds the launcher waits for its watch thread (a read hung on NFS must not block its exit)


def _attempt() -> str:
    """This launch attempt (torchrun's run id and restart count): files of earlier attempts are stale."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def restarts_left() -> int:
    """How many more times torchrun restarts this attempt's workers when they fail (--max-restarts)."""
    done = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return max(0, int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - done)


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
        """Fault tolerance: a stopped rank of this group silent for `seconds` (at least LEAVE_FLOOR and 3 refresh
        periods) ends the group (call before start)."""
        self.refresh = refresh_period(self.timeout, max(seconds, LEAVE_FLOOR))
        self.leave_after, self.replica_id = max(seconds, LEAVE_FLOOR, 3 * self.refresh), replica_id

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
            "restarts_left": restarts_left(),
        }

    def start(self) -> HangWatch:
        """Start publishing and watching (nothing happens when neither rule is on)."""
        if self.timeout <= 0 and self.leave_after <= 0:
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        self._watching = True
        self._publish()
        if not self._tell_launcher():  # this host's ranks judge each other (a one-process job cannot)
            self._judge = Watcher(self.spec(), _sibling, end_all=False)
        self._thread.start()
        return self

    def _tell_launcher(self) -> bool:
        """Whether titanlite's launcher judges this rank: it asked, and got the spec (every local rank writes the
        same one, so that each whose write fails judges itself)."""
        if not (os.environ.get(LAUNCHER_ENV) and os.environ.get(ENV)):
            return False
        path = spec_path(os.environ[ENV])
        if _write_json(path, self.spec()):
            return True
        logger.warning(f"Could not write {path} for the launcher's hang watch: this node's workers watch each other")
        return False

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
        announce(report, rank, restarts_left())
        kill(p for p in pids if p != os.getpid())
        logging.shutdown()
        os._exit(1)


class Watcher:
    """Judges the progress files of the ranks whose processes it may end (`mine(record)`), on a clock that stands
    still while the watcher itself did not run (a job suspended as a whole and resumed is not hung)."""

    def __init__(self, spec: dict, mine: Callable[[dict], bool], end_all: bool, started: float | None = None):
        self.spec, self.mine, self.end_all = spec, mine, end_all  # end_all: every rank it may end, not the frozen
        self.started = time.time() if started is None else started  # a leave marker older than this is stale
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
        if leave_after > 0 and mine:
            verdict = self._leave(mine, silent, leave_after)
            if verdict:
                return verdict
        age, rank = max(stuck, default=(0.0, None))
        if timeout > 0 and age > timeout:
            frozen = [mine[r] for q, r in silent if q > 3 * self.refresh or self.end_all]
            return self._verdict(mine, hung_line(rank, age, mine[rank]["phase"], timeout), rank, frozen)
        return None

    def _leave(self, mine: dict, silent: list[tuple], leave_after: float) -> tuple[str, int, list[int]] | None:
        """The group leaves: a rank of this node is stopped and silent past `leave_after` (this watcher then marks
        the group's leave for its other nodes), or another node's launcher marked it."""
        replica_id, left = self.spec["replica_id"], self.spec.get("restarts_left", 0)
        attempt = next(iter(mine.values()))["attempt"]  # the launcher knows it from its workers only
        frozen = [(q, r) for q, r in silent if q > leave_after and process_stopped(mine[r]["pid"])]
        if frozen:
            quiet, rank = max(frozen)
            first = leave_line(rank, quiet, mine[rank]["phase"], replica_id, left)
            marker = {"attempt": attempt, "rank": rank, "host": mine[rank]["host"], "time": time.time()}
            _write_json(self.folder / f"leave-group-{replica_id}.json", marker)
            return self._verdict(mine, first, rank, list(mine.values()))
        marker = _read_json(self.folder / f"leave-group-{replica_id}.json")
        if marker and marker.get("attempt") == attempt and marker.get("time", 0) > self.started:
            first = left_line(marker["rank"], marker["host"], replica_id, left)
            return self._verdict(mine, first, marker["rank"], list(mine.values()))
        return None

    def _verdict(self, mine: dict, first: str, rank: int, ending: list[dict]) -> tuple[str, int, list[int]]:
        pids = [r["pid"] for r in ending]
        self.ended.update(pids)
        ended_ranks = [k for k, r in mine.items() if r["pid"] in pids and r["pid"] != os.getpid()]
        attempt = next(iter(mine.values()))["attempt"]
        records = read_records(self.folder, self.spec["world"], attempt) | mine
        report = describe(records, first, self.refresh, ended_ranks, self.folder)
        left = self.spec.get("restarts_left", 0)
        if left and "torchrun restarts" not in first:
            report += f"\n  torchrun restarts the workers now ({left} restart(s) left of its --max-restarts)"
        return report, rank, pids


class LauncherWatch:
    """The watch of titanlite's launcher over its workers (they write `spec_path(status_file)` when they start):
    when the job is hung or a fault-tolerant group must leave, it records the report for the launcher to print and
    ends every worker of this launcher (torchrun then ends the job as for a failed worker)."""

    def __init__(self, status_file: str, poll: float = 0.5):
        self.status_file, self.poll = status_file, poll
        self.started = time.time()  # a leave marker of an earlier run (the same rdzv id) is older
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="titanlite-launcher-watch", daemon=True)

    def start(self) -> LauncherWatch:
        os.environ[LAUNCHER_ENV] = "1"  # the workers inherit it: they publish, this process judges
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; waits at most STOP_JOIN s for the thread (a daemon: a read hung on NFS dies with us)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=STOP_JOIN)
        os.environ.pop(LAUNCHER_ENV, None)

    def _run(self) -> None:
        watcher, spec = None, None
        while not self._stop.wait(watcher.refresh if watcher else self.poll):
            latest = _read_json(spec_path(self.status_file))
            if latest != spec:  # the workers started (or torchrun restarted them)
                spec = latest
                watcher = Watcher(spec, _my_worker, end_all=True, started=self.started) if spec else None
            verdict = watcher.check() if watcher else None
            if verdict:
                report, rank, _ = verdict
                announce(report, rank, spec.get("restarts_left", 0))
                kill(_children(os.getpid()))  # every worker: the job (or this group) ends anyway


def announce(report: str, rank: int, restarts: int) -> None:
    """A verdict's report: the job's end, recorded for the launcher to print once; or, with torchrun restarts left
    (it restarts the workers: the job goes on), a log line."""
    if restarts > 0 or not record_failure("hung", report, rank):
        logger.error(report)


def read_records(folder: Path, world: int, attempt: str | None = None) -> dict[int, dict | None]:
    """Every rank's progress record (of this attempt, when given; None where there is none)."""
    out = {}
    for rank in range(world):
        r = _read_json(folder / f"rank-{rank}.json")
        out[rank] = r if r and (attempt is None or r.get("attempt") == attempt) else None
    return out


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


def process_stopped(pid: int) -> bool:
    """Whether a process of this host is stopped (Linux /proc state T or t: SIGSTOP, a debugger); not one that
    sleeps or waits on a disk or file system (S, D): that may be a slow save."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _write_json(path: Path, record: dict) -> bool:
    """Write record atomically; False when it could not be written (a full or unreachable folder)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
        return True
    except OSError:
        return False  # a progress file: the watch then sees this rank as silent


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
