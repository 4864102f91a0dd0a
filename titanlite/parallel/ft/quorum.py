"""Waiting for a quorum of replica groups (fault tolerance, docs/fault_tolerance.md): torchft's Manager for this
rank, quorum requests bounded so that a stop signal is acted on between them, a lighthouse that stops answering
waited for at its address, and, when the group cannot go on or a stop signal comes while it waits, the last
committed step saved before it stops. The groups of the lighthouse's last quorum tell a restarted group that its
peers left at the job's last step.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import time
from datetime import timedelta

import torch.distributed as dist

from titanlite.compat import forget_failed_quorum
from titanlite.errors import ConfigError, ReplicaGroupsError
from titanlite.parallel.ft.checks import (
    LIGHTHOUSE_COMMAND,
    LIGHTHOUSE_ERRORS,
    any_rank,
    is_lighthouse,
    lighthouse_address,
    lighthouse_status,
    previous_quorum,
    quorum_request_seconds,
)
from titanlite.run_state import HEALED, RunState

logger = logging.getLogger("titanlite")


def torchft_manager(cfg, env, load_state_dict, state_dict):
    """torchft's Manager for this rank of this group, with a process group across the groups (gloo on CPU, NCCL on
    GPUs) that it rebuilds at every quorum."""
    ft = cfg.fault_tolerance
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's manager logs every quorum at info
    for name in ("torchft", "torchft_quorums", "torchft_commits"):
        logging.getLogger(name).setLevel(logging.WARNING)
    torchft = importlib.import_module("torchft")  # optional: imported only by a fault-tolerant run
    timeout = timedelta(seconds=ft.timeout_seconds)
    gloo = env.device.type == "cpu"
    pg = torchft.ProcessGroupGloo(timeout=timeout) if gloo else torchft.ProcessGroupNCCL(timeout=timeout)
    return torchft.Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=ft.min_replicas,
        use_async_quorum=False,  # a healing group loads its peer's state before its forward
        timeout=timeout,
        quorum_timeout=timedelta(seconds=ft.quorum_timeout_seconds),
        connect_timeout=timeout,
        rank=env.rank,
        world_size=env.world_size,
        lighthouse_addr=lighthouse_address(ft),
        replica_id=f"titanlite_{ft.replica_id}",  # (torchft appends a fresh uuid)
        init_sync=False,  # every group initialises the same weights from the seed (topology-invariant init)
    )


class QuorumWaits:
    """A group's waits for a quorum of live groups, and its save and stop when it gets none.

    `state` is the run (run_state.RunState); `checkpointer` saves the last committed step (after `check_finite`);
    `manager` is torchft's Manager (torchft_manager(cfg, env, self._load, self._state) when None: a subclass heals
    in `_load` and sends its state from `_state`).
    """

    _moved: str | None = None  # why this group's weights were replaced since last said (run_state: HEALED, SYNCED)

    def __init__(self, cfg, state: RunState, env, *, checkpointer, check_finite, manager=None):
        ft = cfg.fault_tolerance
        self.cfg, self.ft, self.state, self.env = cfg, ft, state, env
        self.checkpointer, self.check_finite = checkpointer, check_finite
        self.name = f"titanlite_{ft.replica_id}"  # torchft's replica id (it appends a fresh uuid)
        self.manager = manager or torchft_manager(cfg, env, self._load, self._state)
        # A group resumed from disk is at its checkpoint's step: a group behind it heals from it.
        self.manager.load_state_dict({"step": state.step, "batches_committed": state.step})
        self.live = ft.group_count  # the groups of the last quorum
        self.resumed_step = state.step  # its checkpoint holds that step already
        self.finished_peers = self._peers_at_the_end()  # groups of the lighthouse's last quorum (before ours)

    def _state(self) -> dict:
        raise NotImplementedError

    def _load(self, state: dict) -> None:
        raise NotImplementedError

    def _quorum_step(self, manager_step: int) -> int:
        """The training step a quorum at this manager step was for: the next one (a quorum comes before it)."""
        return manager_step + 1

    def _await_quorum(self) -> bool:
        """A quorum of at least min_replicas live groups (this group heals in it when it is behind); True when a
        stop signal came while waiting (what was committed is saved)."""
        waiting_since = None
        while True:  # with fewer live groups than min_replicas, wait for more instead of computing a lost step
            if self._quorum():
                return True
            self.live = self.manager.num_participants()
            if self.live >= self.ft.min_replicas:
                break
            waiting_since = waiting_since or time.monotonic()
            late = time.monotonic() - waiting_since > self.ft.quorum_timeout_seconds
            stop, late = any_rank(self._stop_requested(), late)
            if stop:
                return self._stop(f"while waiting for fault_tolerance.min_replicas = {self.ft.min_replicas} groups")
            if late:
                self._fail(
                    f"only {self.live} of the fault_tolerance.min_replicas = {self.ft.min_replicas} replica "
                    f"groups are live after fault_tolerance.quorum_timeout_seconds = {self.ft.quorum_timeout_seconds:g}"
                    f"{self._peers_note()}"
                )
            time.sleep(0.1)
        return False

    def _quorum(self) -> bool:
        """manager.start_quorum() in requests of at most QUORUM_CALL_SECONDS, for up to quorum_timeout_seconds in all,
        a stop signal checked between them; a lighthouse that stops answering is waited for at its address. True when
        a stop signal came meanwhile (what was committed is saved)."""
        since, self._warned = time.monotonic(), False
        while True:
            left = self.ft.quorum_timeout_seconds - (time.monotonic() - since)
            error = self._ask_quorum(max(1.0, min(quorum_request_seconds(self.ft), left)))
            failed, moved = any_rank(error is not None, self._moved is not None)  # (a heal is applied by now)
            if not failed:  # else a rank got no quorum as the others got one: ask again
                # the group's ranks agree: what listens to the weights (float8's scales) acts on all of them or none
                self._moved = (self._moved or HEALED) if moved else None
                return False
            if self._wait_for_lighthouse(error or "another rank of this group got no quorum", since):
                return True

    def _ask_quorum(self, seconds: float) -> str | None:
        """One quorum request of at most `seconds`; what went wrong, or None."""
        try:
            self.manager.start_quorum(timeout=timedelta(seconds=seconds))
        except ConfigError:
            raise  # a healing group whose settings differ from its peer's
        except Exception as e:  # torchft raises TimeoutError or RuntimeError
            forget_failed_quorum(self.manager)
            return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        return None

    def _wait_for_lighthouse(self, error: str, since: float) -> bool:
        """After a request without a quorum: stop (True), fail after quorum_timeout_seconds, or return False to ask
        again once the lighthouse answers (at once when it does)."""
        address, timeout = lighthouse_address(self.ft), self.ft.quorum_timeout_seconds
        while True:
            waited = time.monotonic() - since
            silent, stop, late = any_rank(not self._lighthouse_answers(), self._stop_requested(), waited > timeout)
            if stop:
                return self._stop("while waiting for a quorum")
            if late:
                what = "gave no quorum" if not silent else "did not answer"
                self._fail(
                    f"the lighthouse at {address} {what} for fault_tolerance.quorum_timeout_seconds = {timeout:g} "
                    f"({error}); restart it at the same address (`{LIGHTHOUSE_COMMAND}`) and relaunch the groups: "
                    "they resume from their checkpoints"
                )
            if not self._warned and (silent or waited >= quorum_request_seconds(self.ft)):  # not for a join wait
                self._warned = True
                logger.warning(
                    f"Fault tolerance: no quorum before step {self.state.step + 1} after {waited:.0f} s ({error}); "
                    f"waiting up to fault_tolerance.quorum_timeout_seconds = {timeout:g} for the lighthouse at "
                    f"{address} to {'answer' if silent else 'give one'}"
                )
            if not silent:
                time.sleep(0.1)  # a request that failed at once is not repeated in a busy loop
                return False
            time.sleep(0.5)

    def _lighthouse_answers(self) -> bool:
        try:
            return is_lighthouse(lighthouse_status(lighthouse_address(self.ft), timeout=2))
        except LIGHTHOUSE_ERRORS:
            return False

    def _stop_requested(self) -> bool:
        signals = getattr(self.checkpointer, "signals", None)
        return bool(getattr(signals, "requested", False))

    def _save_committed(self) -> tuple[bool, str]:
        """Save the last committed step unless a checkpoint holds it already: whether one holds it, and what."""
        ckpt, step = self.checkpointer, self.state.step
        if not ckpt.enabled:
            return False, "nothing was saved (checkpoint.enable = false)"
        if step == 0:
            return False, "no step was committed: nothing was saved"
        pending = getattr(ckpt, "_pending", None)
        saved = step in ckpt.saved_steps or step == self.resumed_step or (pending is not None and pending[0] == step)
        if not saved:
            self.check_finite()  # never save NaNs
            ckpt.save(step)
        return True, f"the checkpoint of step {step} (the last committed one) is saved"

    def _stop(self, when: str) -> bool:
        """A stop signal came while waiting (every rank knows): True once the last committed step is saved (exit
        status 0: a relaunch resumes); with nothing to save, the process ends as a stop during start-up does
        (128 + the signal)."""
        saved, what = self._save_committed()
        if saved:
            self.checkpointer.preempted = True
            logger.warning(f"Stopped by a stop signal {when}: {what}; exiting with status 0 (a relaunch resumes)")
            return True
        code = 128 + self._stop_signal()
        logger.warning(f"Stopped by a stop signal {when}: {what}; exiting with status {code}")
        raise SystemExit(code)  # the trainer's cleanup runs; rank 0 records no 'stopped' (nothing to resume from)

    def _stop_signal(self) -> int:
        signals = getattr(self.checkpointer, "signals", None)
        if getattr(signals, "signum", None):
            return int(signals.signum)
        return signal.SIGINT if getattr(signals, "_first_sigint", None) is not None else signal.SIGTERM

    def _fail(self, message: str) -> None:
        raise ReplicaGroupsError(f"fault tolerance: {message}; {self._save_committed()[1]}")

    def _peers_at_the_end(self) -> list[tuple[str, int]]:
        """The other groups of the lighthouse's last quorum that were at the job's last step (rank 0 reads the
        lighthouse's page; the group's ranks share what it read)."""
        box = [[]]
        if self.env.rank == 0:
            try:
                quorum = previous_quorum(lighthouse_status(lighthouse_address(self.ft), timeout=2))
            except LIGHTHOUSE_ERRORS:
                quorum = []
            others = [(rid.split(":")[0], self._quorum_step(s)) for rid, s in quorum if rid.split(":")[0] != self.name]
            box[0] = [(rid, s) for rid, s in others if s >= self.cfg.training.steps > self.state.step]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def _peers_note(self) -> str:
        if not self.finished_peers:
            return ""
        who = ", ".join(f"{rid} at step {s}" for rid, s in self.finished_peers)
        return (
            f"; the lighthouse's last quorum before this group came had {who} of training.steps = "
            f"{self.cfg.training.steps}: they reached the job's end and left (finished, or died at the last step)"
        )
