"""`python -m titanlite.train`: load the config, build the Trainer, train; exit 0, 1 (diverged) or 2 (config error)."""

from __future__ import annotations

import logging
import os

from titanlite.config import load, to_toml
from titanlite.errors import CheckpointSaveError, ConfigError, DataReadError, NonFiniteLossError, ReplicaGroupsError
from titanlite.observe.metrics import setup_logging
from titanlite.runtime.distributed import exit_process, lost_peer, nodes_from_env, shutdown
from titanlite.runtime.exit_status import (
    ENV,
    LOST_PEER,
    read_outcome,
    record_failure,
    report_failure,
    report_user_error,
)
from titanlite.runtime.hang_watch import restarts_left
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
    """The rank that recorded a user error, a failed run or a hang for run_train.sh's launcher, if any did (a rank
    that only lost another node's ranks is not the story)."""
    failure = read_outcome(os.environ.get(ENV)).first_failure()
    return None if failure is None or failure["status"] == LOST_PEER else failure["rank"]


def peer_lost(error: Exception, step: int | None) -> int | None:
    """Exit status 1 with one message when a collective failed because the processes of another node are gone (a
    node that was killed ends the job on the others within seconds); None for any other error, and on one node (a
    crashed rank there is torchrun's failure table's story)."""
    address = lost_peer(error) if nodes_from_env() > 1 else None
    if address is None:
        return None
    when = f"in step {step}" if step is not None else "during start-up"
    message = (
        f"lost contact with the ranks at {address} {when} ({str(error).strip().splitlines()[0][:160]}): a node of "
        f"this job ended or cannot be reached, so this one stops too; relaunch run_train.sh on every node (NNODES="
        f"{nodes_from_env()}) to resume from the newest complete checkpoint"
    )
    # Recorded before the process group is torn down (which may wait on the dead peer); with torchrun restarts left
    # the job goes on, and a record would outlive this attempt.
    if restarts_left() > 0 or not record_failure(LOST_PEER, message, int(os.environ.get("RANK", "0"))):
        logger.error(message)
    shutdown()
    return 1


def main(argv: list[str] | None = None) -> int:
    """Train as the config says; returns the exit status."""
    setup_logging()
    try:
        cfg = load(argv)
        trainer = Trainer(cfg)
    except ConfigError as e:
        return user_error(e)
    except Exception as e:
        if (ended := peer_lost(e, None)) is None:
            raise
        return ended
    try:
        if cfg.job.print_config and trainer.env.rank == 0:
            print(to_toml(cfg))
        trainer.train()
    except ConfigError as e:  # data that turns out bad mid-run (a malformed record, ...)
        return user_error(e)
    except (NonFiniteLossError, CheckpointSaveError, ReplicaGroupsError, DataReadError) as e:
        report_failure(str(e))  # printed once by run_train.sh's launcher, without torchrun's failure table
        shutdown()
        return 1
    except Exception as e:
        shutdown()
        if (peer := failed_peer()) is None:
            if (ended := peer_lost(e, trainer.step)) is not None:
                return ended
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
