"""Fault-tolerant HSDP ([fault_tolerance], torchft): each replica group is its own job with FSDP (and TP, CP, EP, PP,
LoRA) inside it; across groups, the gradients are averaged over the groups that are alive (rank r with rank r: the
groups share one layout), through torchft's Manager and a process group it rebuilds at every quorum. A group that
dies is dropped at the next quorum (or the commit fails and the step is retried without it); a restarted group
receives the weights, optimizer state, schedule, step and data position of a live peer (rank r from rank r;
parallel/ft_heal.py) and trains on from there. An MoE's load balancing sums its expert loads over the live groups
too (moe_balance.LoadBalance.across_groups). A lighthouse that dies is waited for (a restart at its address is
rejoined); a group that cannot go on, or gets a stop signal while it waits, saves its last committed step first.
What the groups compare at every step (settings, ids, weights) is in parallel/ft.py. docs/fault_tolerance.md.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from titanlite.compat import forget_failed_quorum, quorum_id
from titanlite.config.compare import describe_difference
from titanlite.errors import ConfigError, ReplicaGroupsError
from titanlite.parallel.ft import (
    ID_SLOTS,
    IDS,
    KEYS,
    LIGHTHOUSE_COMMAND,
    LIGHTHOUSE_ERRORS,
    LIVE,
    PRINTS,
    SENIOR,
    TOKENS,
    VECTOR,
    any_rank,
    differing_keys,
    is_lighthouse,
    lighthouse_address,
    lighthouse_status,
    previous_quorum,
    quorum_request_seconds,
    settings_slots,
    shared_settings,
    weights_fingerprint,
    weights_verdict,
)
from titanlite.parallel.ft_heal import healed_names, local, peer_state, take_state

logger = logging.getLogger("titanlite")


class ReplicaGroups:
    """This group's side of a fault-tolerant job: quorum, cross-group sums and averages, commit, healing.

    `trainer` holds model, optimizer, lr_scheduler, dataloader, step and tokens_seen (the Trainer); they are what a
    restarted group receives from a live one (parallel/ft_heal.py). Its `balance` (an MoE's load balancing,
    moe_balance.LoadBalance), when it has one, sums the expert loads over the live groups too.
    """

    _moved = False  # this group's weights were replaced (a heal; DiLoCo: an outer step) since last asked

    def __init__(self, cfg, trainer, env):
        ft = cfg.fault_tolerance
        self.cfg, self.ft, self.trainer, self.env = cfg, ft, trainer, env
        self.name = f"titanlite_{ft.replica_id}"  # torchft's replica id (it appends a fresh uuid)
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's manager logs every quorum at info
        for name in ("torchft", "torchft_quorums", "torchft_commits"):
            logging.getLogger(name).setLevel(logging.WARNING)
        torchft = importlib.import_module("torchft")  # optional: imported only by a fault-tolerant run
        timeout = timedelta(seconds=ft.timeout_seconds)
        pg = (
            torchft.ProcessGroupGloo(timeout=timeout)
            if env.device.type == "cpu"
            else torchft.ProcessGroupNCCL(timeout=timeout)
        )
        self.manager = torchft.Manager(
            pg=pg,
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=ft.min_replicas,
            use_async_quorum=False,  # a healing group loads its peer's state before its forward
            timeout=timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_seconds),
            connect_timeout=timeout,
            rank=env.rank,
            world_size=env.world_size,
            lighthouse_addr=lighthouse_address(ft),
            replica_id=self.name,
            init_sync=False,  # every group initialises the same weights from the seed (topology-invariant init)
        )
        # A group resumed from disk is at its checkpoint's step: a group behind it heals from it.
        self.manager.load_state_dict({"step": trainer.step, "batches_committed": trainer.step})
        self.participants = ft.group_count  # the groups this step's gradients are averaged over
        self.live = ft.group_count  # the groups of the last quorum
        self.settings = shared_settings(cfg, env.world_size)
        self.slots = torch.tensor(settings_slots(self.settings), dtype=torch.float64)
        self.weights = 0  # this step's fingerprint of the weights + 1 (0: not compared at this step)
        self.quorum_seen = None  # the quorum whose weights were compared last (without an error)
        self.quorum_now = None  # this step's quorum
        self.committed = 0  # steps this process committed with the live groups
        self.finished_peers = self._peers_at_the_end()  # groups of the lighthouse's last quorum (before ours)
        self.resumed_step = trainer.step  # its checkpoint holds that step already
        self.healed_at: list[int] = []
        self._healed = healed_names(trainer.model, cfg.lora.enable)  # what healing sends: a checkpoint's tensors
        self.skipped_sequences = 0
        self.balance = getattr(trainer, "balance", None)  # an MoE's load balancing: over the live groups too
        if self.balance is not None:
            self.balance.across_groups(self)
        # A frozen rank must take its group out before the live groups' quorum times out: while this group's rank 0
        # heartbeats, the lighthouse keeps it and refuses them a quorum without it (titanlite.runtime.hang_watch).
        trainer.hang.leave_when_silent(ft.quorum_timeout_seconds / 4, ft.replica_id)

    # ---------------------------------------------------------------- the step

    def begin_step(self) -> bool:
        """A new quorum of live groups (a restarted group heals here, before its forward); True when a stop signal
        came while waiting for one: what was committed is saved and the run stops (exit status 0)."""
        before = self.trainer.step
        self.trainer.hang.phase(f"step {before + 1}: waiting for a quorum of replica groups")
        if self._await_quorum():
            return True
        self.participants = self.live  # the gradients are averaged over them
        if self.trainer.step != before:
            self.healed_at.append(self.trainer.step)
            logger.info(
                f"Fault tolerance: healed from a live group at step {self.trainer.step} (weights, optimizer, "
                f"schedule and data position); {self.participants} of {self.ft.group_count} groups live"
            )
        self._after_quorum()
        return False

    def end_step(self) -> bool:
        """Nothing after a step: the groups met before it (DiLoCo syncs here; parallel/ft_diloco.py)."""
        return False

    def sync_pending(self) -> bool:
        """Nothing is owed after the last step (DiLoCo: its last sync, when a stop came first)."""
        return False

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
            failed, moved = any_rank(error is not None, self._moved)  # (a heal is applied by now)
            if not failed:  # else a rank got no quorum as the others got one: ask again
                self._moved = moved  # the group's ranks agree: float8 scales are recomputed on all of them or none
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
                    f"Fault tolerance: no quorum before step {self.trainer.step + 1} after {waited:.0f} s ({error}); "
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
        signals = getattr(getattr(self.trainer, "checkpointer", None), "signals", None)
        return bool(getattr(signals, "requested", False))

    def _save_committed(self) -> tuple[bool, str]:
        """Save the last committed step unless a checkpoint holds it already: whether one holds it, and what."""
        ckpt, step = self.trainer.checkpointer, self.trainer.step
        if not ckpt.enabled:
            return False, "nothing was saved (checkpoint.enable = false)"
        if step == 0:
            return False, "no step was committed: nothing was saved"
        pending = getattr(ckpt, "_pending", None)
        saved = step in ckpt.saved_steps or step == self.resumed_step or (pending is not None and pending[0] == step)
        if not saved:
            self.trainer.check_finite()  # never save NaNs
            ckpt.save(step)
        return True, f"the checkpoint of step {step} (the last committed one) is saved"

    def _stop(self, when: str) -> bool:
        """A stop signal came while waiting (every rank knows): True once the last committed step is saved (exit
        status 0: a relaunch resumes); with nothing to save, the process ends as a stop during start-up does
        (128 + the signal)."""
        saved, what = self._save_committed()
        if saved:
            self.trainer.checkpointer.preempted = True
            logger.warning(f"Stopped by a stop signal {when}: {what}; exiting with status 0 (a relaunch resumes)")
            return True
        code = 128 + self._stop_signal()
        logger.warning(f"Stopped by a stop signal {when}: {what}; exiting with status {code}")
        raise SystemExit(code)  # the trainer's cleanup runs; rank 0 records no 'stopped' (nothing to resume from)

    def _stop_signal(self) -> int:
        signals = getattr(self.trainer.checkpointer, "signals", None)
        if getattr(signals, "signum", None):
            return int(signals.signum)
        return signal.SIGINT if getattr(signals, "_first_sigint", None) is not None else signal.SIGTERM

    def _fail(self, message: str) -> None:
        raise ReplicaGroupsError(f"fault tolerance: {message}; {self._save_committed()[1]}")

    def _after_quorum(self) -> None:
        """After a quorum change: compare the weights at this step (a group that joins must hold the live ones'), and
        say so when this group trains on alone after its peers left at the job's last step."""
        self.quorum_now = quorum_id(self.manager)  # the same for every group of a quorum
        self.weights = 0
        if self.quorum_now is None or self.quorum_now != self.quorum_seen:  # seen: set once a check went through
            self.weights = 1 + weights_fingerprint(local(v) for v in self.trainer.model.state_dict().values())
        if self.finished_peers and self.live == 1:
            logger.warning(
                f"Fault tolerance: this group trains on alone from step {self.trainer.step + 1}{self._peers_note()}; "
                f"it writes its own step-{self.cfg.training.steps}, beside theirs; stop it unless that is meant "
                "(raise training.steps to train past the job's end)"
            )
            self.finished_peers = []

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
            box[0] = [(rid, s) for rid, s in others if s >= self.cfg.training.steps > self.trainer.step]
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

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of `value` over the live groups (float64; meaningless when the step failed: it is retried)."""
        total = value.detach().to(torch.float64).reshape(-1).clone()
        self.manager.allreduce(total, reduce_op=dist.ReduceOp.SUM).wait()
        return total.reshape(value.shape)

    def step_vector(self, tokens) -> torch.Tensor:
        """This group's part of the step's sum (parallel/ft.py: a size no setting changes)."""
        mine = torch.zeros(VECTOR, dtype=torch.float64)
        slot = self.ft.replica_id % ID_SLOTS
        mine[TOKENS], mine[LIVE], mine[IDS + slot] = float(tokens), 1, 1
        mine[PRINTS + slot], mine[SENIOR + slot] = self.weights, float(self.committed > 0)
        mine[KEYS:] = self.slots
        return mine

    def known_tokens(self, tokens: int) -> None:
        """None: the step's global token count is that of the live groups, summed in global_tokens."""
        return None

    def global_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The counted tokens of the live groups' parts of this step's batch; in the same sum, every group's
        replica_id, its shared settings and (after a quorum change) its weights, checked (ConfigError) here."""
        total = self.sum(self.step_vector(tokens).to(tokens.device)).cpu()
        if self.manager.errored() is not None:  # a group failed: nothing to check, the step will be retried
            return tokens
        self._check(total)
        self.quorum_seen = self.quorum_now  # compared without an error: not again until the quorum changes
        return total[TOKENS].round().long().to(tokens.device)

    def _check(self, total: torch.Tensor) -> None:
        ft, live = self.ft, int(total[LIVE])
        same = self.ft.group_count <= ID_SLOTS and int(total[IDS + ft.replica_id % ID_SLOTS])
        if same > 1:
            raise ConfigError(
                f"fault_tolerance.replica_id = {ft.replica_id} is used by {same} live groups; give each group its "
                f"own id from 0 to {ft.group_count - 1}"
            )
        differ = (total[KEYS:] != self.slots * live).nonzero().flatten().tolist()
        if differ:
            keys = differing_keys(self.settings, differ)
            raise ConfigError(
                f"the live replica groups differ in {describe_difference(self.settings, keys)}: every group must run "
                "the same configuration (only the dump folder, checkpoint folder, logging and "
                "fault_tolerance.replica_id may differ)"
            )
        if self.ft.group_count <= ID_SLOTS:
            self._check_weights(total)

    def _check_weights(self, total: torch.Tensor) -> None:
        """Only a group whose weights differ from the others' raises (the live groups' when it joins them); all
        raise when no majority says which are right."""
        prints, senior = total[PRINTS:SENIOR].tolist(), total[SENIOR:KEYS].tolist()
        verdict = weights_verdict(prints, senior, self.weights)
        if verdict is None:
            return
        step, of = self.trainer.step + 1, "the live replica groups" if any(senior) else "most replica groups"
        if verdict == "differs":
            raise ConfigError(
                f"this group's weights differ from those of {of} at step {step} (their settings are the same): a "
                "group that joins must start from the live groups' weights; was it resumed from another run's "
                "checkpoint? Start it with an empty checkpoint folder (it then heals from the live groups), or "
                "restart every group from the same checkpoint"
            )
        raise ConfigError(
            f"the live replica groups hold different weights at step {step} (their settings are the same) and "
            "no majority says which are right: were they started from different checkpoints (e.g. one with "
            "checkpoint.initial_load_path, one without)? Restart every group from the same checkpoint"
        )

    def average_gradients(self, params) -> None:
        """Average every gradient over the live groups: each rank with the same rank of the other groups (their
        shards are the same slices), one flat buffer per dtype."""
        self.trainer.hang.phase(f"step {self.trainer.step}: averaging the gradients over the live replica groups")
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None:
                g = local(p.grad)
                by_dtype.setdefault(g.dtype, []).append(g)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.manager.allreduce(flat).wait()  # AVG over the participants
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))

    def commit(self) -> bool:
        """Whether every live group got through this step (else it is dropped and the step retried)."""
        ok = self.manager.should_commit()
        self.committed += bool(ok)
        if self.balance is not None:
            self.balance.step_committed(ok)
        return ok

    def count_skipped(self, global_batch_size: int) -> None:
        """A committed step trained only the live groups' parts of its global batch: count the rest."""
        absent = self.ft.group_count - self.participants
        self.skipped_sequences += absent * global_batch_size // self.ft.group_count

    def label(self) -> str:
        """'live/planned' groups, for the step line."""
        return f"{self.participants}/{self.ft.group_count}"

    def close(self) -> None:
        """Log what the absent groups' parts and the healing were, and leave the job."""
        healed = f"; healed from a live group at step {', '.join(map(str, self.healed_at))}" if self.healed_at else ""
        logger.info(
            f"Fault tolerance: {self.skipped_sequences} sequences of absent replica groups' parts were skipped "
            f"(not trained){healed}"
        )
        self.manager.shutdown(wait=False)

    # ---------------------------------------------------------------- checks and healing

    def _state(self) -> dict:
        """What this rank sends to the same rank of a group that heals (parallel/ft_heal.py)."""
        return peer_state(self.trainer, self.settings, self._healed)

    def _load(self, state: dict) -> None:
        """Take a live peer's state (healing); refused, naming the keys, when its shared settings differ."""
        take_state(self.trainer, state, self.settings, self._healed)
        self._moved = True

    def moved_weights(self) -> bool:
        """Whether this group's weights were replaced (a heal; DiLoCo: an outer step) since the last call; the same
        on every rank of the group."""
        moved, self._moved = self._moved, False
        return moved
