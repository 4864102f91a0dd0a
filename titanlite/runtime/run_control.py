"""What keeps a long job safe on a shared cluster: one job per dump folder, no orphans, clean stops.

- `FolderLock`: `<folder>/.titanlite.lock` (host, pid, run id, start time, a heartbeat) taken by rank 0 on
  the dump folder and on the checkpoint folder (wherever it is); a second job on either is refused, naming the
  first; a lock whose holder is gone (dead pid on this host, or no heartbeat for `STALE_AFTER` seconds) is
  taken over with a warning. In object storage, which has no file locks, it is a lease: an object created only
  if none is there (S3's conditional write), written again as its heartbeat, its age the store's LastModified.
- `die_with_launcher`: under torchrun (Linux), the kernel kills a worker the moment its launcher dies, a frozen
  worker too; `LauncherWatchdog`: a thread that notices when the process's parent (torchrun) is gone and ends
  the process at once, without a checkpoint, instead of training on as an orphan (where the kernel cannot).
- `StopSignals`: SIGTERM, SIGUSR1, SIGHUP and SIGINT ask for a save at the end of the step and a clean
  exit; a second Ctrl-C (SIGINT more than a second after the first) exits at once.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from titanlite.errors import ConfigError
from titanlite.storage import age, create_exclusive, describe_failure, is_remote, location, replace_text

logger = logging.getLogger("titanlite")

LOCK_NAME = ".titanlite.lock"
STALE_AFTER = 600.0  # seconds without a heartbeat after which another host's lock is taken over
HEARTBEAT_EVERY = 60.0
TAKEOVER_SETTLE = 2.0  # seconds between taking over a stale lock and reading it back
LOCK_LOST = threading.Event()  # set when another job took over a lock this process held (the loop stops then)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT)
PR_SET_PDEATHSIG = 1  # Linux prctl
LAUNCHER_PID_ENV = "TITANLITE_LAUNCHER_PID"  # set by titanlite.cli.launch (torchrun's process) for its workers


def die_with_launcher() -> None:
    """Under torchrun on Linux: the kernel SIGKILLs this worker the moment its launcher dies, however it dies, even
    while the worker is frozen (a stopped process runs no thread: the LauncherWatchdog cannot end it). A launcher
    that died before (during this worker's imports) ends it here."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return  # the watchdog still ends a live orphan
    if os.getppid() != launcher or _launcher_gone():  # it died before the signal was armed
        os._exit(1)


def _launcher_gone() -> bool:
    """Whether the launcher named by titanlite.cli.launch has died (this process was then handed to another parent;
    a named launcher that is alive but not the parent is another job's, its name inherited: not ours)."""
    try:
        named = int(os.environ.get(LAUNCHER_PID_ENV, ""))
    except ValueError:
        return False
    return named != os.getppid() and not pid_alive(named)


def _run_id() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID", "")


def pid_alive(pid: int) -> bool:
    """Whether a process of this host is running (a zombie is not; another user's process is)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    # A zombie has exited (only its exit status waits for a parent to collect it): an orphaned worker stays one
    # until init reaps it, which some inits do late.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (not Linux): os.kill's answer stands
        return True


def read_lock(folder: Path) -> dict | None:
    """The lock's holder ({host, pid, run_id, started}) and its age in seconds, or None."""
    path = location(folder) / LOCK_NAME
    try:
        holder = json.loads(path.read_text())
        holder["age"] = age(path)
        return holder
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        if is_remote(path) and not isinstance(e, ValueError):
            raise  # object storage that cannot be asked: not the same as no lease (the caller says why)
        return None


def holder_alive(holder: dict) -> bool:
    """Whether the job that wrote a lock may still be running."""
    if holder.get("host") == socket.gethostname():
        return holder.get("pid") == os.getpid() or pid_alive(int(holder.get("pid", 0)))
    return holder.get("age", 0.0) < STALE_AFTER


def describe_holder(holder: dict) -> str:
    """'host h, pid p, run r, started 2026-11-23 12:00:00' for messages."""
    return (
        f"host {holder.get('host')}, pid {holder.get('pid')}, run {holder.get('run_id') or '-'}, "
        f"started {holder.get('started')}"
    )


def _mine(holder: dict | None) -> bool:
    """Whether a lock was written by this very process."""
    return holder is not None and (holder.get("host"), holder.get("pid")) == (socket.gethostname(), os.getpid())


def _other_job(holder: dict | None) -> bool:
    """Whether a lock was written by another job: not this process, and not an earlier attempt of this run (its run
    id, on another host: torchrun moved rank 0 there; on this host an earlier attempt's process is dead, and a live
    one with the same run id is another job started with the same RDZV_ID)."""
    if holder is None or _mine(holder):
        return False
    same_run = bool(_run_id()) and holder.get("run_id") == _run_id()
    if same_run and holder.get("host") == socket.gethostname():
        return pid_alive(int(holder.get("pid", 0)))
    return not same_run


def _in_use(folder: Path, holder: dict, key: str) -> ConfigError:
    return ConfigError(
        f"{key} = {str(folder)!r} is in use by another titanlite job ({describe_holder(holder)}); "
        f"wait for it to end, stop it, or choose another {key}"
    )


def check_lock_free(folder: Path, key: str = "job.dump_folder") -> None:
    """ConfigError naming the job that holds the folder's lock, if one is alive (no lock is taken); key: the
    config key that named the folder."""
    holder = read_lock(folder)
    if _other_job(holder) and holder_alive(holder):
        raise _in_use(folder, holder, key)


class FolderLock:
    """The lock of one job on a folder it writes (take it on rank 0 only); key: the config key naming it."""

    def __init__(self, folder: str | Path, key: str = "job.dump_folder"):
        self.folder, self.key = location(folder), key
        self.path = self.folder / LOCK_NAME
        self.held = False
        self.text = ""  # what this job wrote into the lock

    def acquire(self) -> None:
        """Take the lock; ConfigError when a live job holds it or it cannot be taken; a stale lock is taken over
        with a warning."""
        try:
            self._acquire()
        except ConfigError:
            raise
        except Exception as e:  # object storage that refuses or cannot be reached; a local folder that cannot be used
            if not is_remote(self.folder):
                raise ConfigError(f"{self.key} = {str(self.folder)!r}: its lock cannot be taken: {e}") from None
            raise ConfigError(describe_failure(self.folder, self.key, e)) from None

    def _acquire(self) -> None:
        LOCK_LOST.clear()  # a new lock of this process: nothing of it is lost yet
        if not is_remote(self.folder):  # object storage has no folders to make (and may not let the job try)
            self.folder.mkdir(parents=True, exist_ok=True)
        holder = read_lock(self.folder)
        if _other_job(holder):
            if holder_alive(holder):
                raise _in_use(self.folder, holder, self.key)
            logger.warning(
                f"Taking over the lock of a titanlite job that is gone ({describe_holder(holder)}) in {self.folder}"
            )
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "run_id": _run_id(),
            "started": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
        }
        text = self.text = json.dumps(me)
        if holder is not None:  # taken over from a job that is gone, or this run's own from an earlier attempt
            replace_text(self.path, text)
            time.sleep(
                TAKEOVER_SETTLE if is_remote(self.folder) else 0.1
            )  # two jobs taking over one stale lock at once: the later write stands
            now = read_lock(self.folder)
            if now is not None and (now.get("host"), now.get("pid")) != (me["host"], me["pid"]):
                raise _in_use(self.folder, now, self.key)
        elif not create_exclusive(self.path, text):  # of two jobs that start at the same moment, exactly one wins
            holder = read_lock(self.folder)
            if holder is not None:
                raise _in_use(self.folder, holder, self.key)
            logger.warning(f"Replacing the unreadable lock file {self.path}")
            replace_text(self.path, text)
        self.held = True

    def heartbeat(self) -> None:
        """Show that the holder is alive (the lock written again, or its modification time); a lock that another
        job took over (this one's heartbeat was late) is given up with an error."""
        if not self.held:
            return
        try:
            holder = read_lock(self.folder)
            if holder is not None and not _mine(holder):
                logger.error(
                    f"{self.key} = {str(self.folder)!r}: the lock was taken over by another job "
                    f"({describe_holder(holder)}) after {STALE_AFTER:.0f} s without a heartbeat of this one; this "
                    "job stops at the end of its step without saving"
                )
                self.held = False
                LOCK_LOST.set()
                return
            if is_remote(self.path):
                replace_text(self.path, self.text)  # written whole again: its LastModified is the heartbeat
            else:
                os.utime(self.path)
        except Exception as e:  # a heartbeat must never end the job (a storage hiccup); the next one tries again
            logger.warning(f"The heartbeat of the lock on {self.key} = {str(self.folder)!r} failed: {e}")

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        if self.held:
            self.held = False
            try:
                holder = read_lock(self.folder)
                if holder and holder.get("pid") == os.getpid():
                    self.path.unlink(missing_ok=True)
            except Exception as e:  # the job's own end must not fail on it: the lease goes stale instead
                logger.warning(f"The lock on {self.key} = {str(self.folder)!r} could not be removed: {e}")


class LauncherWatchdog:
    """Ends this process when its launcher (the parent process) is gone; beats the locks' heartbeats."""

    def __init__(self, locks: list[FolderLock] = (), period: float = 1.0):
        self.parent, self.locks, self.period = os.getppid(), list(locks), period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="titanlite-watchdog")

    def start(self) -> LauncherWatchdog:
        self._thread.start()
        return self

    def _run(self) -> None:
        last_beat = time.monotonic()
        while not self._stop.wait(self.period):
            if os.getppid() != self.parent:
                logger.error(
                    f"The launcher (pid {self.parent}) is gone: exiting now, without a checkpoint (the "
                    f"newest complete one is where a relaunch resumes)"
                )
                logging.shutdown()
                os._exit(1)
            if self.locks and time.monotonic() - last_beat > HEARTBEAT_EVERY:
                for lock in self.locks:
                    lock.heartbeat()
                last_beat = time.monotonic()

    def stop(self) -> None:
        self._stop.set()


class StopSignals:
    """Turns stop signals into a request to save at the end of the step; a second Ctrl-C exits at once."""

    def __init__(self):
        self.requested = False
        self._first_sigint: float | None = None
        self._old = {}

    def install(self) -> None:
        """Take over the stop signals (main thread only; a no-op elsewhere)."""
        if not self._old and threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._old[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}

    def _on_signal(self, signum, frame) -> None:
        now = time.monotonic()
        if signum == signal.SIGINT and self._first_sigint is not None and now - self._first_sigint > 1.0:
            logger.warning("Second Ctrl-C: exiting at once, without saving")
            logging.shutdown()
            os._exit(130)
        if signum == signal.SIGINT and self._first_sigint is None:
            self._first_sigint = now  # within a second: the same Ctrl-C seen twice (terminal and torchrun)
        if not self.requested:
            logger.warning(
                f"Received {signal.Signals(signum).name}: saving at the end of this step, then exiting "
                f"(Ctrl-C again to exit at once)"
            )
        self.requested = True


def guard_run(folders: dict[str, str | Path], rank: int, world: int):
    """Take the lock of each folder (config key -> folder) on rank 0 (every rank raises the ConfigError when
    another job holds one; none is kept then) and start the launcher watchdog; returns (locks, watchdog)."""
    locks, box = [], [None]
    if rank == 0:
        try:
            for key, folder in folders.items():
                locks.append(FolderLock(folder, key))
                locks[-1].acquire()
        except ConfigError as e:
            box[0] = str(e)
            release_all(locks)
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise ConfigError(box[0])
    return locks, LauncherWatchdog(locks).start()


def release_all(locks: list[FolderLock]) -> None:
    """Release every lock this process holds."""
    for lock in locks:
        lock.release()
