"""TEST ONLY fault injection for titanlite processes started by the tests (torchrun workers included).

A test puts this folder first on PYTHONPATH (helpers.faults_env) and sets TITANLITE_FAULTS; Python
imports this module at start-up and wraps titanlite functions so that the faults happen at named
points. Production code has no hooks for this.

TITANLITE_FAULTS is a comma-separated list, the i-th entry applying to torchrun restart i
(TORCHELASTIC_RESTART_COUNT; an empty entry: no fault in that attempt). An entry is
ACTION:WHERE:STEP:RANK with
  ACTION  kill (SIGKILL this process), stop (SIGSTOP: a frozen process) or config_error (a user error found
          mid-run, e.g. a malformed record)
  WHERE   step (end of the step, before its save decision) or save (a save has begun, before this
          rank writes anything)

TITANLITE_STEP_PAUSE=SECONDS makes every step end with a pause of that many seconds: a test's pace.
"""

import logging
import os
import signal


def _entry():
    spec = os.environ.get("TITANLITE_FAULTS", "")
    entries = spec.split(",")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt >= len(entries) or not entries[attempt]:
        return None
    action, where, step, rank = entries[attempt].split(":")
    return action, where, int(step), int(rank), attempt


def _maybe_fault(where: str, step: int) -> None:
    import torch.distributed as dist

    entry = _entry()
    if entry is None:
        return
    action, fault_where, fault_step, fault_rank, attempt = entry
    if (fault_where, fault_step, fault_rank) != (where, step, dist.get_rank()):
        return
    if action == "stop":
        logging.getLogger("titanlite").warning(f"fault injection: stopping rank {fault_rank} at {where} {step}")
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if action == "config_error":
        from titanlite.errors import ConfigError

        raise ConfigError(f"fault injection: a malformed record at step {step} on rank {fault_rank}")
    if action == "kill":
        logging.getLogger("titanlite").warning(
            f"fault injection: killing rank {fault_rank} at {where} {step} (restart {attempt})"
        )
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


def _install() -> None:
    from titanlite.checkpoint.manager import CheckpointManager

    maybe_save, save = CheckpointManager.maybe_save, CheckpointManager.save

    pause = float(os.environ.get("TITANLITE_STEP_PAUSE", "0"))

    def patched_maybe_save(self, step, last, before_save=None):
        if pause:
            import time

            time.sleep(pause)
        if self.enabled:
            _maybe_fault("step", step)
        return maybe_save(self, step, last, before_save)

    def patched_save(self, step, model_only=False):
        _maybe_fault("save", step)
        return save(self, step, model_only)

    CheckpointManager.maybe_save, CheckpointManager.save = patched_maybe_save, patched_save


if os.environ.get("TITANLITE_FAULTS") or os.environ.get("TITANLITE_STEP_PAUSE"):
    _install()
