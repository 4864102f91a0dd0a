"""DiLoCo across fault-tolerant replica groups (fault_tolerance.mode = "diloco"; docs/fault_tolerance.md).

Each group takes fault_tolerance.sync_every inner steps on its own part of each global batch with its own optimizer
(FSDP, TP, EP, CP, PP and LoRA inside it as usual), without a collective across groups. Then the groups meet in a
quorum, average their pseudo-gradients (the global weights minus their own, summed over the groups that trained the
round and divided by their number) and every group applies the same outer step, Nesterov SGD on the global weights
(Douillard et al. 2023, arXiv:2311.08105), so that all hold the same weights again. A job's last step is a sync too.

A group that joins (started or restarted) meets the others at their next sync: it heals there from a live peer
(global weights, outer momentum, inner optimizer, schedule, step, data position), adds nothing to that sync's average
(its part of the rounds it missed is counted as skipped) and goes on from the new global weights with the others. A
sync that fails (a group died during it) is retried with the live groups; the round's inner steps are kept.

torchft's own DiLoCo (torchft.local_sgd) starts the quorum in an optimizer hook and loses a round when a sync fails;
titanlite keeps its per-group quorum, healing, settings and weights checks (parallel/ft/groups.py) and the outer state
in its checkpoints, so the rounds are counted here, on torchft's Manager.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanlite.compat import quorum_id
from titanlite.parallel.ft.checks import TOKENS, weights_fingerprint
from titanlite.parallel.ft.groups import ReplicaGroups
from titanlite.parallel.ft.heal import local
from titanlite.parallel.ft.protocol import Next
from titanlite.run_state import SYNCED, RunState

logger = logging.getLogger("titanlite")


class OuterOptimizer:
    """The global weights (this rank's shards of every trainable parameter, as of the last outer step) and the outer
    Nesterov SGD over them; checkpointed inside the optimizer part (`state_dict`), so that a resume, also on another
    topology, goes on mid-round exactly."""

    PARTS = frozenset({"global", "momentum", "synced_step"})

    def __init__(self, model: torch.nn.Module, ft_cfg):
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.frozen = [p for p in model.parameters() if not p.requires_grad]  # compared across groups, never moved
        self.globals = {n: local(p).detach().clone() for n, p in self.params.items()}
        momentum = ft_cfg.outer_momentum
        self.sgd = torch.optim.SGD(
            list(self.globals.values()), lr=ft_cfg.outer_lr, momentum=momentum, nesterov=momentum > 0
        )
        if momentum > 0:  # SGD's first step sets the buffer to the gradient: from zeros, the same
            for g in self.globals.values():
                self.sgd.state[g]["momentum_buffer"] = torch.zeros_like(g)
        self.synced_step = 0  # the step at which the global weights were set (a sync, or the start)
        # the parts the checkpoint being loaded holds (a sync-mode one: none; one without momentum: no momentum);
        # what it lacks starts afresh
        self.in_checkpoint = self.PARTS
        self.loaded = False

    def _momentum(self, g: torch.Tensor) -> torch.Tensor | None:
        return self.sgd.state.get(g, {}).get("momentum_buffer")

    # ---------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """The global weights and momentum as DTensors placed like their parameters (DCP reshards them), and the
        step of the last sync."""
        out = {"global": {}, "momentum": {}, "synced_step": self.synced_step}
        for n, p in self.params.items():
            out["global"][n] = _placed_like(p, self.globals[n])
            if (buf := self._momentum(self.globals[n])) is not None:
                out["momentum"][n] = _placed_like(p, buf)
        return {k: v for k, v in out.items() if k in self.in_checkpoint and v != {}}

    def load_state_dict(self, state: dict) -> None:
        """Take the state DCP loaded into `state_dict()`'s tensors (they share this object's storage)."""
        if "global" not in state:
            return
        with torch.no_grad():
            for n, g in self.globals.items():
                g.copy_(local(state["global"][n]))
                if n in state.get("momentum", {}):
                    self._momentum(g).copy_(local(state["momentum"][n]))
        self.synced_step = int(state["synced_step"])
        self.loaded = True

    def after_load(self, step: int) -> str | None:
        """After the run's weights are loaded: a state not found in the checkpoint starts from them (global = the
        weights, momentum 0, as of `step`); a message saying so, or None."""
        if self.loaded:
            return None
        self.reset(step)
        if step == 0:
            return None
        return (
            f"DiLoCo: the checkpoint of step {step} holds no outer state (saved with fault_tolerance.mode = 'sync', "
            "or checkpoint.exclude_from_loading has optimizer): the global weights start from its weights, the "
            "outer momentum from zero"
        )

    def reset(self, step: int) -> None:
        """Global weights = the model's, momentum zero, as of `step`."""
        with torch.no_grad():
            for n, p in self.params.items():
                self.globals[n].copy_(local(p))
                if (buf := self._momentum(self.globals[n])) is not None:
                    buf.zero_()
        self.synced_step = step

    # ---------------------------------------------------------------- healing

    def local_state(self) -> dict:
        """What a live peer sends to a group that heals: this rank's shards."""
        return {
            "global": {n: g for n, g in self.globals.items()},
            "momentum": {n: m for n, g in self.globals.items() if (m := self._momentum(g)) is not None},
            "synced_step": self.synced_step,
        }

    def take(self, state: dict) -> None:
        """Take a peer's local_state, and start from its global weights."""
        self.load_state_dict(state)
        with torch.no_grad():
            for n, p in self.params.items():
                local(p).copy_(self.globals[n])

    # ---------------------------------------------------------------- the outer step

    def pseudo_gradients(self) -> list[torch.Tensor]:
        """The global weights minus this group's, one flat buffer per dtype (this rank's shards)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for n, p in self.params.items():
            by_dtype.setdefault(self.globals[n].dtype, []).append(self.globals[n] - local(p).detach())
        return [torch.cat([t.reshape(-1) for t in ts]) for ts in by_dtype.values()]

    def outer_step(self, summed: list[torch.Tensor], contributors: int, step: int) -> None:
        """The outer Nesterov step with the mean of `contributors` groups' pseudo-gradients (summed, in
        pseudo_gradients' layout); then every parameter takes the new global weights."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in self.globals.values():
            by_dtype.setdefault(g.dtype, []).append(g)
        for gs, flat in zip(by_dtype.values(), summed):
            for g, part in zip(gs, flat.split([g.numel() for g in gs])):
                g.grad = part.view_as(g).to(g.device) / contributors
        self.sgd.step()
        self.sgd.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, p in self.params.items():
                local(p).copy_(self.globals[n])
        self.synced_step = step

    def fingerprint(self) -> int:
        """A hash of the global weights and the frozen ones (the same in every group at a sync)."""
        return weights_fingerprint([*self.globals.values(), *(local(p) for p in self.frozen)])

    def payload_bytes(self) -> int:
        """The bytes of pseudo-gradients this rank all-reduces at each outer step."""
        return sum(g.numel() * g.element_size() for g in self.globals.values())


def _placed_like(param, t: torch.Tensor):
    if isinstance(param, DTensor):
        return DTensor.from_local(t, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(),
                                  run_check=False)  # fmt: skip
    return t


class DilocoGroups(ReplicaGroups):
    """This group's side of a DiLoCo job: inner steps alone, a sync with the live groups at each round's end. The
    run state's `outer` is DiLoCo's outer state (OuterOptimizer)."""

    def __init__(self, cfg, state: RunState, env, **services):
        self.outer: OuterOptimizer = state.outer
        if (note := self.outer.after_load(state.step)) and env.rank == 0:
            logger.warning(note)
        self.synced = False  # whether this process took part in a sync yet (a group that starts joins at once)
        self.round_began = time.monotonic()
        self.warned_round = False
        super().__init__(cfg, state, env, **services)
        self.participants = 1  # each inner step averages its gradients inside the group only
        # aux_free MoE routing biases: each group moves its own during a round; a sync averages them
        self.averaged_buffers = self.balance.routing_biases() if self.balance is not None else []
        self.payload = self.outer.payload_bytes() + sum(b.numel() * 4 for b in self.averaged_buffers)

    # ---------------------------------------------------------------- around the step (parallel/ft/protocol.py)

    def unfinished(self, state: RunState, steps: int) -> bool:
        """Whether a step is still to come, or the last sync (a group resumed at the job's last step whose last
        sync a stop interrupted still owes it)."""
        return state.step < steps or (not self.synced and self._contributes())

    def before_step(self, state: RunState) -> Next:
        """A group that starts (or restarts) syncs before its first step: it heals there when it is behind, and
        stops when that took it to the job's end."""
        if not self.synced and self._sync():
            return Next.STOP
        return Next.STOP if self._reached_the_end() else Next.GO_ON

    def after_step(self, state: RunState, committed: bool) -> Next:
        """After an inner step: at a round's end (and the job's last step), the sync; STOP when a stop signal came
        while waiting for its quorum (what was trained is saved; a relaunch syncs first); REPLACED when this group
        healed there (a peer's step, weights and data position now)."""
        if not self._at_round_end():
            return Next.GO_ON
        self._warn_if_rounds_outlast_the_quorum_wait()
        trained = state.step
        if self._sync():
            return Next.STOP
        if state.step == trained:
            return Next.GO_ON
        return Next.STOP if self._reached_the_end() else Next.REPLACED

    def _at_round_end(self) -> bool:
        step = self.state.step
        return step % self.ft.sync_every == 0 or step == self.cfg.training.steps

    def _warn_if_rounds_outlast_the_quorum_wait(self) -> None:
        seconds = time.monotonic() - self.round_began
        if self.warned_round or seconds <= self.ft.quorum_timeout_seconds or self.env.rank != 0:
            return
        self.warned_round = True
        logger.warning(
            f"DiLoCo: this round took {seconds:.0f} s, more than fault_tolerance.quorum_timeout_seconds = "
            f"{self.ft.quorum_timeout_seconds:g}: a group that restarts mid-round waits for the next sync that long at "
            f"most, then gives up; raise quorum_timeout_seconds (and training.hang_timeout_seconds) above a round's "
            "time"
        )

    def _quorum_step(self, manager_step: int) -> int:
        return manager_step // 2  # (see _sync)

    def global_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """This group's counted tokens: an inner step is a mean over its own part of the batch."""
        return tokens

    def average_gradients(self, params) -> None:
        pass  # inner steps are the group's own

    def commit(self) -> bool:
        """An inner step is always this group's own to take."""
        if self.balance is not None:
            self.balance.step_committed(True)
        return True

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """Inner steps report this group's own loss and loads."""
        return value.detach().to(torch.float64)

    def label(self) -> str:
        return f"{self.live}/{self.ft.group_count}"

    # ---------------------------------------------------------------- the sync

    def _contributes(self) -> bool:
        """Whether this group trained inner steps since its global weights were set, and is at a round's end."""
        return self._at_round_end() and self.state.step > self.outer.synced_step

    def _sync(self) -> bool:
        """Quorum, then the sum of the contributing groups' pseudo-gradients and their count (with the ids,
        settings and weights check), commit; retried with the live groups until it commits. True on a stop."""
        state, before = self.state, self.state.step
        while True:
            self.hang.phase(f"after step {state.step}: DiLoCo sync, waiting for a quorum of replica groups")
            # torchft heals a group whose step is below the others'. The step says where the group is, and whether
            # it made the sync at that step already: a group past it is ahead of one that still owes it.
            position = 2 * state.step + (self.outer.synced_step == state.step)
            self.manager.load_state_dict({"step": position, "batches_committed": position})
            if self._await_quorum():
                return True
            mine = self._contributes()  # (not after healing here: _load)
            self.weights = 1 + self.outer.fingerprint()
            self.hang.phase(f"after step {state.step}: DiLoCo sync, averaging the pseudo-gradients")
            total = self._sum_over_groups(self.step_vector(float(mine)))
            flats = [f.to(self.env.device) if mine else torch.zeros_like(f, device=self.env.device)
                     for f in self._payload()]  # fmt: skip
            for f in flats:
                self.manager.allreduce(f, reduce_op=dist.ReduceOp.SUM).wait()
            if self.manager.errored() is None:
                self._check(total)
            if self.manager.should_commit():
                break
            logger.warning(f"DiLoCo: the sync after step {state.step} failed (a group left); retrying it")
        self.committed += 1
        contributors = int(round(float(total[TOKENS])))
        if state.step != before:
            self.healed_at.append(state.step)
            logger.info(
                f"Fault tolerance: healed from a live group at step {state.step} (global weights, outer momentum, "
                f"optimizer, schedule and data position); {self.live} of {self.ft.group_count} groups live"
            )
        if contributors:  # (none at a sync where every group joins mid-round: the round goes on)
            absent = self.ft.group_count - contributors
            rounds = state.step - self.outer.synced_step
            self.skipped_sequences += absent * rounds * self.global_batch_size // self.ft.group_count
            self._apply(flats, contributors)
        self.synced, self.round_began = True, time.monotonic()
        self.quorum_seen = quorum_id(self.manager)  # compared at this sync: not hashed again
        self._after_quorum()
        self._say_if_moved()
        return False

    def _payload(self) -> list[torch.Tensor]:
        """What a sync sums over the groups: the pseudo-gradients, and the routing biases (their mean is taken)."""
        flats = self.outer.pseudo_gradients()
        if self.averaged_buffers:
            flats.append(torch.cat([b.reshape(-1).float() for b in self.averaged_buffers]))
        return flats

    def _sum_over_groups(self, vector: torch.Tensor) -> torch.Tensor:
        total = vector.to(self.env.device, torch.float64, copy=True)  # (NCCL takes device tensors only)
        self.manager.allreduce(total, reduce_op=dist.ReduceOp.SUM).wait()
        return total.cpu()

    def _apply(self, flats: list[torch.Tensor], contributors: int) -> None:
        step = self.state.step
        if self.averaged_buffers:
            mean = flats.pop() / contributors
            with torch.no_grad():
                for b, part in zip(self.averaged_buffers, mean.split([b.numel() for b in self.averaged_buffers])):
                    b.copy_(part.view_as(b))
        self.outer.outer_step(flats, contributors, step)
        self._moved = SYNCED
        if self.env.rank == 0:
            logger.info(
                f"DiLoCo: outer step after step {step}: the pseudo-gradients of {contributors} of "
                f"{self.ft.group_count} groups averaged ({self.payload / 2**20:.2f} MiB all-reduced per rank)"
            )

    # ---------------------------------------------------------------- healing

    def _state(self) -> dict:
        return {**super()._state(), "diloco": self.outer.local_state()}

    def _load(self, state: dict) -> None:
        """Healing: the peer's state, then the global weights; this group adds nothing to this sync (it trained
        nothing since them), which holds also when the sync is retried or a stop saves it before the sync."""
        super()._load(state)
        self.outer.take(state["diloco"])
        self.outer.synced_step = self.state.step
