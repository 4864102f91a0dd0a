"""Fault-tolerant HSDP ([fault_tolerance], torchft): each replica group is its own job with FSDP (and TP) inside it;
across groups, the gradients are averaged over the groups that are alive, through torchft's Manager and a process
group it rebuilds at every quorum. A group that dies is dropped at the next quorum (or the commit fails and the step
is retried without it); a restarted group receives the weights, optimizer state, schedule, step and data position
of a live peer (rank r from rank r) and trains on from there. docs/fault_tolerance.md.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import socket
import time
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanlite.errors import ConfigError

logger = logging.getLogger("titanlite")

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
LIGHTHOUSE_COMMAND = (
    "torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 --quorum_tick_ms 100 --bind [::]:29510"
)
# The settings every group must share: they decide the model, the data each rank reads and the update.
SHARED_SECTIONS = ("model", "training", "data", "optimizer", "lr_scheduler", "parallelism", "moe", "lora", "float8")


def lighthouse_address(ft_cfg) -> str:
    """The lighthouse's address: fault_tolerance.lighthouse, else $TORCHFT_LIGHTHOUSE ('' when neither)."""
    return ft_cfg.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")


def _unsupported(cfg, dims) -> str | None:
    if dims.dp_replicate > 1:
        return (
            f"parallelism.data_parallel_replicate_degree = {dims.dp_replicate} inside a fault-tolerant group: the "
            "replicate dimension is across groups (fault_tolerance.group_count); set it to 1"
        )
    for value, key in ((dims.cp, "context_parallel_degree"), (dims.ep, "expert_parallel_degree")):
        if value > 1:
            return f"parallelism.{key} = {value} is not supported with fault_tolerance.enable = true yet; set it to 1"
    if cfg.model.name in ("qwen3_moe", "mixtral"):
        return f"model.name = {cfg.model.name!r}: Mixtures of Experts are not supported with fault tolerance yet"
    if cfg.lora.enable:
        return "lora.enable = true is not supported with fault_tolerance.enable = true yet"
    return None


def fault_tolerance_problem(cfg, dims, check_lighthouse: bool) -> str | None:
    """Why [fault_tolerance] cannot run this group, or None (also when it is off). check_lighthouse: whether the
    lighthouse must answer now (not in the dry run)."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return None
    if ft.replica_id >= ft.group_count:
        return (
            f"fault_tolerance.replica_id = {ft.replica_id} is not below fault_tolerance.group_count = "
            f"{ft.group_count}; valid: 0 to {ft.group_count - 1}"
        )
    if ft.min_replicas > ft.group_count:
        return (
            f"fault_tolerance.min_replicas = {ft.min_replicas} is more than fault_tolerance.group_count = "
            f"{ft.group_count}: no step could ever be taken; valid: 1 to {ft.group_count}"
        )
    problem = _unsupported(cfg, dims)
    if problem or not check_lighthouse:
        return problem
    if importlib.util.find_spec("torchft") is None:
        return (
            "fault_tolerance.enable = true needs torchft, which is not installed: pip install -e '.[ft]' "
            "(or pip install torchft), or set fault_tolerance.enable = false"
        )
    address = lighthouse_address(ft)
    if not address:
        return (
            f"fault_tolerance.lighthouse = '' and {LIGHTHOUSE_ENV} is not set: give the lighthouse's address "
            f"(http://host:port), after starting one: {LIGHTHOUSE_COMMAND}"
        )
    url = urlparse(address if "://" in address else f"http://{address}")
    try:
        socket.create_connection((url.hostname, url.port or 80), timeout=3).close()
    except (OSError, ValueError) as e:
        key = "fault_tolerance.lighthouse" if ft.lighthouse else LIGHTHOUSE_ENV
        return (
            f"{key} = {address!r}: no lighthouse answers there ({type(e).__name__}: {e}); start one first: "
            f"{LIGHTHOUSE_COMMAND}"
        )
    return None


def shared_fingerprint(cfg, world_size: int) -> int:
    """A 48-bit hash of what every group must share (exact in a float64 sum of a few groups)."""
    d = cfg.to_dict()
    shared = {k: d[k] for k in SHARED_SECTIONS} | {"world": world_size, "groups": cfg.fault_tolerance.group_count}
    shared["log_freq"] = cfg.metrics.log_freq  # logged steps sum their loss across the groups
    return int(hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode()).hexdigest()[:12], 16)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


class ReplicaGroups:
    """This group's side of a fault-tolerant job: quorum, cross-group sums and averages, commit, healing.

    `trainer` holds model, optimizer, lr_scheduler, dataloader, step and tokens_seen (the Trainer); they are what a
    restarted group receives from a live one.
    """

    def __init__(self, cfg, trainer, env):
        ft = cfg.fault_tolerance
        self.cfg, self.ft, self.trainer, self.env = cfg, ft, trainer, env
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
            replica_id=f"titanlite_{ft.replica_id}",
            init_sync=False,  # every group initialises the same weights from the seed (topology-invariant init)
        )
        # A group resumed from disk is at its checkpoint's step: a group behind it heals from it.
        self.manager.load_state_dict({"step": trainer.step, "batches_committed": trainer.step})
        self.participants = ft.group_count
        self.fingerprint = shared_fingerprint(cfg, env.world_size)
        self.healed_at: list[int] = []
        self.skipped_sequences = 0

    # ---------------------------------------------------------------- the step

    def begin_step(self) -> None:
        """A new quorum of live groups (a restarted group heals here, before its forward)."""
        before = self.trainer.step
        deadline = time.monotonic() + self.ft.quorum_timeout_seconds
        while True:  # with fewer live groups than min_replicas, wait for more instead of computing a lost step
            self.manager.start_quorum()
            self.participants = self.manager.num_participants()
            if self.participants >= self.ft.min_replicas:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"only {self.participants} of the fault_tolerance.min_replicas = {self.ft.min_replicas} replica "
                    f"groups are live after fault_tolerance.quorum_timeout_seconds = {self.ft.quorum_timeout_seconds:g}"
                )
            time.sleep(0.1)
        if self.trainer.step != before:
            self.healed_at.append(self.trainer.step)
            logger.info(
                f"Fault tolerance: healed from a live group at step {self.trainer.step} (weights, optimizer, "
                f"schedule and data position); {self.participants} of {self.ft.group_count} groups live"
            )

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of `value` over the live groups (float64; meaningless when the step failed: it is retried)."""
        total = value.detach().to(torch.float64).reshape(-1).clone()
        self.manager.allreduce(total, reduce_op=dist.ReduceOp.SUM).wait()
        return total.reshape(value.shape)

    def global_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The counted tokens of the live groups' parts of this step's batch; in the same sum, every group's
        replica_id and a fingerprint of its shared settings, checked (ConfigError) at every step."""
        ft = self.ft
        mine = torch.zeros(ft.group_count + 2, dtype=torch.float64, device=tokens.device)
        mine[0], mine[1 + ft.replica_id], mine[-1] = tokens, 1, self.fingerprint
        total = self.sum(mine)
        if self.manager.errored() is not None:  # a group failed: nothing to check, the step will be retried
            return tokens
        counts = total.cpu()
        if counts[1 + ft.replica_id] > 1:
            raise ConfigError(
                f"fault_tolerance.replica_id = {ft.replica_id} is used by {int(counts[1 + ft.replica_id])} live "
                f"groups; give each group its own id from 0 to {ft.group_count - 1}"
            )
        if counts[-1] != self.fingerprint * self.participants:
            raise ConfigError(
                "the live replica groups differ in their world size or in a setting of "
                f"{', '.join('[' + s + ']' for s in SHARED_SECTIONS)} or metrics.log_freq: every group must run the "
                "same configuration "
                "(only the dump folder, checkpoint folder, logging and fault_tolerance.replica_id may differ)"
            )
        return total[0]

    def average_gradients(self, params) -> None:
        """Average every gradient over the live groups: each rank with the same rank of the other groups (their
        shards are the same slices), one flat buffer per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None:
                g = _local(p.grad)
                by_dtype.setdefault(g.dtype, []).append(g)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.manager.allreduce(flat).wait()  # AVG over the participants
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))

    def commit(self) -> bool:
        """Whether every live group got through this step (else it is dropped and the step retried)."""
        return self.manager.should_commit()

    def count_skipped(self, global_batch_size: int) -> None:
        """A committed step trained only the live groups' parts of its global batch: count the rest."""
        absent = self.ft.group_count - self.participants
        self.skipped_sequences += absent * global_batch_size // self.ft.group_count

    def label(self) -> str:
        """'live/planned' groups, for the step line."""
        return f"{self.participants}/{self.ft.group_count}"

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    # ---------------------------------------------------------------- checks and healing

    def _state(self) -> dict:
        t = self.trainer
        opt = t.optimizer.state_dict()
        return {
            "model": {k: _local(v) for k, v in t.model.state_dict().items()},
            "optimizer": {
                "state": {i: {k: _local(v) for k, v in s.items()} for i, s in opt["state"].items()},
                "param_groups": opt["param_groups"],
            },
            "lr_scheduler": t.lr_scheduler.state_dict(),
            "dataloader": t.dataloader.state_dict(),
            "step": t.step,
            "tokens_seen": t.tokens_seen,
        }

    def _load(self, state: dict) -> None:
        t = self.trainer
        with torch.no_grad():
            for k, v in t.model.state_dict().items():
                _local(v).copy_(state["model"][k])
        params = [p for group in t.optimizer.param_groups for p in group["params"]]
        opt_state = {}
        for i, s in state["optimizer"]["state"].items():
            p = params[int(i)]
            opt_state[int(i)] = {k: self._like(p, v) for k, v in s.items()}
        t.optimizer.load_state_dict({"state": opt_state, "param_groups": state["optimizer"]["param_groups"]})
        t.lr_scheduler.load_state_dict(state["lr_scheduler"])
        t.dataloader.load_state_dict(state["dataloader"])
        t.step, t.tokens_seen = int(state["step"]), int(state["tokens_seen"])

    @staticmethod
    def _like(param, value):
        """An optimizer state tensor received as this rank's local shard, placed like `param`."""
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        local = value.to(_local(param).device)
        if isinstance(param, DTensor):
            return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                      stride=param.stride(), run_check=False)  # fmt: skip
        return local
