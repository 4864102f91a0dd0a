"""Fault-tolerant HSDP ([fault_tolerance], torchft): each replica group is its own job with FSDP (and TP, CP, EP, PP,
LoRA) inside it; across groups, the gradients are averaged over the groups that are alive (rank r with rank r: the
groups share one layout), through torchft's Manager and a process group it rebuilds at every quorum. A group that
dies is dropped at the next quorum (or the commit fails and the step is retried without it); a restarted group
receives the weights, optimizer state, schedule, step and data position of a live peer (rank r from rank r;
parallel/ft/heal.py) and trains on from there. An MoE's load balancing sums its expert loads over the live groups
too (moe_balance.LoadBalance.across_groups). A lighthouse that dies is waited for (a restart at its address is
rejoined); a group that cannot go on, or gets a stop signal while it waits, saves its last committed step first.
How a group waits for a quorum is in parallel/ft/quorum.py; what the groups compare at every step (settings, ids,
weights), in parallel/ft/checks.py; what the loop asks of them, in parallel/ft/protocol.py. docs/fault_tolerance.md.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from titanlite.compat import quorum_id
from titanlite.config.compare import describe_difference
from titanlite.errors import ConfigError
from titanlite.parallel.ft.checks import (
    ID_SLOTS,
    IDS,
    KEYS,
    LIVE,
    PRINTS,
    SENIOR,
    TOKENS,
    VECTOR,
    differing_keys,
    settings_slots,
    shared_settings,
    weights_fingerprint,
    weights_verdict,
)
from titanlite.parallel.ft.heal import healed_names, local, peer_state, take_state
from titanlite.parallel.ft.protocol import Next
from titanlite.parallel.ft.quorum import QuorumWaits
from titanlite.run_state import HEALED, RunState

logger = logging.getLogger("titanlite")


class ReplicaGroups(QuorumWaits):
    """This group's side of a fault-tolerant job: quorum, cross-group sums and averages, commit, healing.

    `state` is the run (run_state.RunState): what a restarted group receives from a live one (parallel/ft/heal.py).
    `checkpointer` saves the last committed step when the group must stop (after `check_finite`); `hang` is the run's
    hang watch; `balance` (an MoE's load balancing, moe_balance.LoadBalance), when given, sums the expert loads over
    the live groups too. `manager`: torchft's Manager (quorum.torchft_manager when None).
    """

    def __init__(self, cfg, state: RunState, env, *, checkpointer, hang, check_finite, global_batch_size: int,
                 balance=None, manager=None):  # fmt: skip
        self.hang, self.global_batch_size = hang, global_batch_size
        super().__init__(cfg, state, env, checkpointer=checkpointer, check_finite=check_finite, manager=manager)
        self.participants = self.ft.group_count  # the groups this step's gradients are averaged over
        self.settings = shared_settings(cfg, env.world_size)
        self.slots = torch.tensor(settings_slots(self.settings), dtype=torch.float64)
        self.weights = 0  # this step's fingerprint of the weights + 1 (0: not compared at this step)
        self.quorum_seen = None  # the quorum whose weights were compared last (without an error)
        self.quorum_now = None  # this step's quorum
        self.committed = 0  # steps this process committed with the live groups
        self.healed_at: list[int] = []
        self._healed = healed_names(state.model, cfg.lora.enable)  # what healing sends: a checkpoint's tensors
        self._data_position = None  # the loader's position before this step (a step that fails is taken again)
        self.skipped_sequences = 0
        self.balance = balance  # an MoE's load balancing: over the live groups too
        if balance is not None:
            balance.across_groups(self)
        # A frozen rank must take its group out before the live groups' quorum times out: while this group's rank 0
        # heartbeats, the lighthouse keeps it and refuses them a quorum without it (titanlite.runtime.hang_watch).
        hang.leave_when_silent(self.ft.quorum_timeout_seconds / 4, self.ft.replica_id)

    def unfinished(self, state: RunState, steps: int) -> bool:
        """Whether a step is still to come."""
        return state.step < steps

    # ---------------------------------------------------------------- around the step (parallel/ft/protocol.py)

    def before_step(self, state: RunState) -> Next:
        """A quorum of live groups (a restarted group heals here, and stops when that took it to the job's end);
        STOP when a stop signal came while waiting for it (what was committed is saved)."""
        if self._begin_step():
            return Next.STOP
        if self._reached_the_end():
            return Next.STOP
        self._data_position = state.dataloader.state_dict()
        return Next.GO_ON

    def after_step(self, state: RunState, committed: bool) -> Next:
        """A step that a group failed is taken again with the groups still alive (the step and the data position
        go back); a committed one trained the live groups' parts of the batch only: the rest is counted."""
        if not committed:
            logger.warning(f"Step {state.step} was not committed by every replica group; retrying it")
            state.step -= 1
            state.dataloader.load_state_dict(self._data_position)
            return Next.RETRY
        absent = self.ft.group_count - self.participants
        self.skipped_sequences += absent * self.global_batch_size // self.ft.group_count
        return Next.GO_ON

    def _begin_step(self) -> bool:
        """A new quorum of live groups (a restarted group heals here, before its forward); True when a stop signal
        came while waiting for one: what was committed is saved and the run stops (exit status 0)."""
        before = self.state.step
        self.hang.phase(f"step {before + 1}: waiting for a quorum of replica groups")
        if self._await_quorum():
            return True
        self.participants = self.live  # the gradients are averaged over them
        if self.state.step != before:
            self.healed_at.append(self.state.step)
            logger.info(
                f"Fault tolerance: healed from a live group at step {self.state.step} (weights, optimizer, "
                f"schedule and data position); {self.participants} of {self.ft.group_count} groups live"
            )
        self._after_quorum()
        self._say_if_moved()
        return False

    def _say_if_moved(self) -> None:
        """Tell the run state's listeners when this group's weights were replaced (a heal, a sync): the same on
        every rank of the group."""
        if self._moved is not None:
            why, self._moved = self._moved, None
            self.state.weights_replaced(why)

    def _reached_the_end(self) -> bool:
        """A heal (or DiLoCo: a last sync that a stop had left pending) took this group to the job's last step: True
        once that step is saved, as the others saved it."""
        if self.state.step < self.cfg.training.steps:
            return False
        self.checkpointer.maybe_save(self.state.step, last=True, before_save=self.check_finite)
        return True

    def _after_quorum(self) -> None:
        """After a quorum change: compare the weights at this step (a group that joins must hold the live ones'), and
        say so when this group trains on alone after its peers left at the job's last step."""
        self.quorum_now = quorum_id(self.manager)  # the same for every group of a quorum
        self.weights = 0
        if self.quorum_now is None or self.quorum_now != self.quorum_seen:  # seen: set once a check went through
            self.weights = 1 + weights_fingerprint(local(v) for v in self.state.model.state_dict().values())
        if self.finished_peers and self.live == 1:
            logger.warning(
                f"Fault tolerance: this group trains on alone from step {self.state.step + 1}{self._peers_note()}; "
                f"it writes its own step-{self.cfg.training.steps}, beside theirs; stop it unless that is meant "
                "(raise training.steps to train past the job's end)"
            )
            self.finished_peers = []

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of `value` over the live groups (float64; meaningless when the step failed: it is retried)."""
        total = value.detach().to(torch.float64).reshape(-1).clone()
        self.manager.allreduce(total, reduce_op=dist.ReduceOp.SUM).wait()
        return total.reshape(value.shape)

    def step_vector(self, tokens) -> torch.Tensor:
        """This group's part of the step's sum (parallel/ft/checks.py: a size no setting changes)."""
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
        step, of = self.state.step + 1, "the live replica groups" if any(senior) else "most replica groups"
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
        self.hang.phase(f"step {self.state.step}: averaging the gradients over the live replica groups")
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
        """What this rank sends to the same rank of a group that heals (parallel/ft/heal.py)."""
        return peer_state(self.state, self.settings, self._healed)

    def _load(self, state: dict) -> None:
        """Take a live peer's state (healing); refused, naming the keys, when its shared settings differ."""
        take_state(self.state, state, self.settings, self._healed)
        self._moved = HEALED
