"""`python -m titanlite.cli.launch TORCHRUN_ARGS ...`: torchrun, as run_train.sh starts it, with titanlite's endings
(also for `python -m titanlite.generate --nproc N`, and usable in place of `torchrun` for any titanlite module).

It runs torchrun's own entry point (`torch.distributed.run.main`) in this process; what changes is how a failed
job ends. When a worker recorded a user error (titanlite.runtime.exit_status), its message is printed once and the exit
status is 2, with no ChildFailedError dump and no closing-signal log lines; when a run failed (a non-finite loss)
or the watch found the job hung, the message is printed once and the exit status is 1; any other failure prints
torchrun's failure table (which rank, exit code, signal) without torchrun's own traceback, and exits 1. A stop
signal (Ctrl-C, a scheduler's SIGTERM) ends with status 0 when the workers saved a checkpoint after it, else with
one line and 128 + the signal.

This process also watches its workers' progress (titanlite.runtime.hang_watch.LauncherWatch): a worker that
freezes cannot stop a watch that runs here, so a hung job (a one-process one too) ends with its report, and a
fault-tolerant group with a frozen rank leaves the job so that the other groups go on.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import tempfile

from titanlite.runtime.exit_status import ENV, LOST_PEER, read_outcome  # no torch import: see _quiet_cpp_log

# Seconds torchrun's agent waits for the other nodes' agents once its own workers are done (torch's default: 300).
EXIT_BARRIER_ENV = "TITANLITE_EXIT_BARRIER_TIMEOUT"


class _HideAfterUserError(logging.Filter):
    """Drops torchrun's log lines about failed and closed workers once a worker recorded why it ended, and once
    torchrun got a stop signal (its workers' own lines say what they did about it)."""

    stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("Error waiting on exit barrier"):  # a node stopped by a signal left at once
            record.msg, record.args, record.exc_info, record.exc_text = (
                "another node's launcher left before torchrun's exit barrier (a node stopped by a signal leaves at "
                "once); this node's workers had finished",
                (),
                None,
                None,
            )
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            return True
        if record.levelno < logging.WARNING or not record.name.startswith("torch.distributed.elastic"):
            return True
        if "death signal" in record.getMessage():
            self.stopping = True
        return not (self.stopping or read_outcome(os.environ.get(ENV)).failures)


def _stopped(e) -> int:
    """The exit status and one line for torchrun stopped by a signal: 0 when the workers saved and exited after
    it (rank 0 recorded 'stopped'); else 128 + the signal, saying that they saved nothing."""
    if read_outcome(os.environ.get(ENV)).status in ("stopped", "finished"):
        return 0  # the workers logged the step they saved (or finished; the signal came in the exit barrier)
    name = signal.Signals(e.sigval).name
    print(
        f"titanlite: stopped by {name}; the workers saved no checkpoint after it (it came during start-up, or "
        f"checkpointing is off)",
        file=sys.stderr,
    )
    return 128 + int(e.sigval)


def _failed(table, argv: list[str] | None = None) -> int:
    """The exit status and message of a failed job: what a worker recorded (a user error: 2; a failed run, a lost
    node or a hang found by the watch: 1; a lost node that hosted the rendezvous: that), else torchrun's failure
    table (status 1), also when a rank of this node crashed without a record while the others only lost it."""
    outcome = read_outcome(os.environ.get(ENV))
    failure = outcome.first_failure()
    crashed = [r for r in getattr(table, "failures", {}) if r not in outcome.failures]
    if failure is None or (failure.get("status") == LOST_PEER and crashed):
        print(f"torchrun: a worker failed\n{table}", file=sys.stderr)
        return 1
    if failure.get("status") == LOST_PEER and argv is not None and _rendezvous_gone(argv):
        return _lost_rendezvous(argv, "its ranks are gone too")
    where = f" (rank {failure['rank']})" if failure["rank"] else ""
    if failure.get("status") == "config_error":
        print(f"config error{where}: {failure['message']}", file=sys.stderr)
        return 2
    print(f"error{where}: {failure['message']}", file=sys.stderr)
    return 1


def _seconds(text: str, default: float) -> float:
    """A positive number of seconds from an environment variable's text, else the default."""
    try:
        value = float(text)
    except ValueError:
        return default
    return value if value > 0 else default


def _option(argv: list[str], name: str, default: str) -> str:
    """The value of torchrun's --name=value or --name value in argv."""
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if flag in spellings:
            return value if value else (argv[i + 1] if i + 1 < len(argv) else default)
    return default


def _rendezvous_timeout(argv: list[str]) -> int:
    """One line for a node that waited in vain for the others at the rendezvous (exit status 1)."""
    conf = _option(argv, "rdzv_conf", "")
    timeout = conf.split("join_timeout=")[1].split(",")[0] if "join_timeout=" in conf else "600"
    print(
        f"error: not every node reached the rendezvous within {timeout} s (RDZV_JOIN_TIMEOUT): NNODES="
        f"{_option(argv, 'nnodes', '1')} nodes were to meet at RDZV_ENDPOINT={_option(argv, 'rdzv_endpoint', '?')} "
        f"(RDZV_ID={_option(argv, 'rdzv_id', 'none')}); start run_train.sh on every node with the same NNODES, "
        "RDZV_ENDPOINT and RDZV_ID, and check that the endpoint's host can be reached from every node",
        file=sys.stderr,
    )
    return 1


def _rendezvous_gone(argv: list[str]) -> bool:
    """Whether nothing answers at RDZV_ENDPOINT any more (the node that hosted the rendezvous ended or cannot be
    reached); False on one node (an endpoint of port 0) and when the endpoint cannot be read."""
    host, _, port = _option(argv, "rdzv_endpoint", "").rpartition(":")
    if not host or not port.isdigit() or int(port) == 0:
        return False
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=3).close()
    except OSError:
        return True
    return False


def _lost_rendezvous(argv: list[str], cause: str) -> int:
    """One line for a node whose job lost the node that hosted the rendezvous (exit status 1)."""
    endpoint = _option(argv, "rdzv_endpoint", "?")
    print(
        f"error: lost contact with the job's rendezvous at RDZV_ENDPOINT={endpoint} ({cause}): the node that hosts it "
        "(the first to start there) ended, has not started within 60 s, or cannot be reached, so this one stops; "
        f"relaunch run_train.sh on every node (NNODES={_option(argv, 'nnodes', '1')}) to resume from the newest "
        "complete checkpoint",
        file=sys.stderr,
    )
    return 1


def _quiet_cpp_log() -> None:
    """Keep only errors in this process's C++ log: when the node hosting the rendezvous dies, torchrun's store logs a
    warning with a 14-line C++ stack trace before the one line that says so. torch reads the level once, when it is
    loaded; the workers get the user's own setting."""
    if "torch" in sys.modules or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with these arguments; returns the job's exit status (0, 1, or 2 for a user error)."""
    _quiet_cpp_log()
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
    from torch.distributed.run import main as torchrun

    from titanlite.compat import set_exit_barrier_timeout, stop_signal_once
    from titanlite.runtime.hang_watch import LauncherWatch
    from titanlite.runtime.run_control import LAUNCHER_PID_ENV

    argv = list(sys.argv[1:] if argv is None else argv)
    if not os.environ.get(ENV):  # not from run_train.sh: a status file of its own, for this job only
        with tempfile.TemporaryDirectory(prefix="titanlite-exit-") as folder:
            os.environ[ENV] = os.path.join(folder, "status")
            try:
                return main(argv)
            finally:
                del os.environ[ENV]
    hide = _HideAfterUserError()
    torch_loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith("torch")]
    for handler in {h for logger in [logging.getLogger(), *torch_loggers] for h in logger.handlers}:
        handler.addFilter(hide)
    watch = LauncherWatch(os.environ[ENV]).start()
    before = os.environ.get(LAUNCHER_PID_ENV)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # a worker whose launcher died during its imports sees it
    set_exit_barrier_timeout(_seconds(os.environ.get(EXIT_BARRIER_ENV, ""), 30.0))
    stop_signal_once()
    try:
        torchrun(argv)
    except RendezvousTimeoutError:
        return _rendezvous_timeout(argv)
    except RendezvousError as e:  # the node that hosted the rendezvous (RDZV_ENDPOINT) is gone
        failure = read_outcome(os.environ.get(ENV)).first_failure()
        if failure is not None and failure.get("status") != LOST_PEER:
            return _failed("")  # a worker's own story (a user error, a failed run): the lost node is its echo
        return _lost_rendezvous(argv, type(e).__name__)
    except SignalException as e:  # a user's or scheduler's stop: one line and its own status, no traceback
        return _stopped(e)
    except ChildFailedError as e:
        return _failed(e, argv)
    finally:
        watch.stop()
        if before is None:
            os.environ.pop(LAUNCHER_PID_ENV, None)
        else:
            os.environ[LAUNCHER_PID_ENV] = before
    return 0


if __name__ == "__main__":
    sys.exit(main())
