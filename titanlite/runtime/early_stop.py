"""A stop signal before a run can save anything ends the process quietly, with status 128 + the signal.

Installed first thing by the `python -m titanlite.train` shim (before torch is imported, which takes seconds): a
Ctrl-C or a scheduler's SIGTERM during start-up would otherwise end every worker with a KeyboardInterrupt
traceback, or none at all. Once a run can save, the checkpoint manager's StopSignals take over (run_control.py);
under torchrun, titanlite's launcher prints the one line about the stop.
"""

from __future__ import annotations

import os
import signal
import sys


def _quiet_stop(signum, frame) -> None:
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # under torchrun the launcher says it once for every worker
        print(f"titanlite: stopped by {signal.Signals(signum).name}; nothing was saved", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def install() -> None:
    """Quiet exits on SIGINT and SIGTERM until something else takes the signals over (main thread only)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # a signal ignored on purpose stays ignored
            signal.signal(sig, _quiet_stop)
