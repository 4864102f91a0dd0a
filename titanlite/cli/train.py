"""`python -m titanlite.train`: load the config, build the Trainer, train; exit 0, 1 (diverged) or 2 (config error)."""

from __future__ import annotations

import logging
import os

from titanlite.config import load, to_toml
from titanlite.errors import CheckpointSaveError, ConfigError, NonFiniteLossError, ReplicaGroupsError
from titanlite.observe.metrics import setup_logging
from titanlite.runtime.distributed import exit_process, shutdown
from titanlite.runtime.exit_status import ENV, read_outcome, report_failure, report_user_error
from titanlite.trainer import Trainer

logger = logging.getLogger("titanlite")


def entry() -> None:
    """`python -m titanlite.train` and `titanlite-train`: main(), then the exit (see distributed.exit_process)."""
    exit_process(main())


def user_error(e: ConfigError) -> int:
    """Report a user error once (to run_train.sh's launcher, which prints it, or else on stderr); exit status 2."""
    report_user_error(str(e))
    shutdown()
    return 2


def failed_peer() -> int | None:
    """The rank that recorded a user error or a hang for run_train.sh's launcher, if any did."""
    failure = read_outcome(os.environ.get(ENV)).first_failure()
    return None if failure is None else failure["rank"]


def main(argv: list[str] | None = None) -> int:
    """Train as the config says; returns the exit status."""
    setup_logging()
    try:
        cfg = load(argv)
        trainer = Trainer(cfg)
    except ConfigError as e:
        return user_error(e)
    try:
        if cfg.job.print_config and trainer.env.rank == 0:
            print(to_toml(cfg))
        trainer.train()
    except ConfigError as e:  # data that turns out bad mid-run (a malformed record, ...)
        return user_error(e)
    except (NonFiniteLossError, CheckpointSaveError, ReplicaGroupsError) as e:
        report_failure(str(e))  # printed once by run_train.sh's launcher, without torchrun's failure table
        shutdown()
        return 1
    except Exception as e:
        shutdown()
        if (peer := failed_peer()) is None:
            raise
        # A peer ended with a user error or found the job hung (the launcher prints why): this rank's broken
        # collective is only the echo of that, not a second story to tell.
        logger.info(f"stopping: rank {peer} ended the job ({type(e).__name__} here as a result)")
        return 1
    except BaseException:
        shutdown()
        raise
    shutdown(wait_for_peers=True)
    return 0
