"""`python -m titanlite.cli.own_session PARENT_PID CMD ...`: run CMD in a session of its own that still ends
when the process PARENT_PID (the launcher) dies, however it dies.

run_train.sh starts torchrun in its own session so that a terminal's Ctrl-C reaches only the script, which
passes each signal on once. A session of its own also means that nothing stops torchrun when the script is
killed with SIGKILL; the kernel's parent-death signal (Linux prctl PR_SET_PDEATHSIG, kept across exec) does:
torchrun is killed with its launcher, and its workers, which watch torchrun, exit within a second.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str] | None = None) -> int:
    """Become a session leader, arm the parent-death signal, then exec the command (never returns on success)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python -m titanlite.cli.own_session PARENT_PID CMD [ARG ...]", file=sys.stderr)
        return 2
    parent, cmd = int(argv[0]), argv[1:]
    os.setsid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the launcher died before the signal was armed
            return 1
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main())
