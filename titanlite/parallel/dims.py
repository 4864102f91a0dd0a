"""Parallel degrees -> validated dimensions -> DeviceMesh.

replicate 1 gives FSDP on a 1-D ("dp_shard",) mesh; replicate > 1 gives a 2-D
("dp_replicate", "dp_shard") mesh: HSDP when shard > 1, plain replication (DDP-like) when shard is 1.
Tensor parallelism (tp > 1) adds "tp" as the innermost dimension: the tp ranks of one data-parallel
rank are neighbours (rank = dp_rank * tp + tp_rank), inside a node; FSDP runs on the data-parallel
sub-mesh and the TP plan on the "tp" one. Context parallelism (cp > 1) sits between them (rank =
(dp_rank * cp + cp_rank) * tp + tp_rank): the cp ranks of a data-parallel rank read its batch and each take
a part of every sequence; FSDP shards over the shard and cp ranks together ("dp_shard_cp"), and attention
gathers keys and values over a mesh of their own (build_cp_mesh). Pipeline parallelism (pp > 1) is the
outermost dimension (rank = pp_rank * world / pp + the rank inside its stage group): each "pp" slice of the mesh
holds one pipeline stage (or several: parallel/pp.py) and is a whole data/tensor-parallel mesh of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.device_mesh import init_device_mesh

from titanlite.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    """Resolved parallel degrees for one world size."""

    dp_replicate: int
    dp_shard: int
    world_size: int
    tp: int = 1
    ep: int = 1  # expert parallelism: ranks borrowed from dp_shard x tp (MoE models)
    cp: int = 1  # context parallelism: each sequence split over cp ranks
    pp: int = 1  # pipeline parallelism: the blocks split over pp stage groups (outermost)

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> ParallelDims:
        """Resolve -1 and check that pp x replicate x shard x cp x tp equals the world size."""
        pp = getattr(parallelism, "pipeline_parallel_degree", 1)
        if world_size % pp:
            raise ConfigError(
                f"parallelism.pipeline_parallel_degree = {pp} does not divide the world size {world_size}; valid: "
                f"{', '.join(str(d) for d in _divisors(world_size))}"
            )
        ranks = f"the world size {world_size}" + (
            f" / pipeline_parallel_degree {pp} = {world_size // pp}" if pp > 1 else ""
        )
        dims = cls._from_stage_world(parallelism, world_size // pp, ranks)
        return cls(dims.dp_replicate, dims.dp_shard, world_size, dims.tp, dims.ep, dims.cp, pp)

    @classmethod
    def _from_stage_world(cls, parallelism, world_size: int, ranks: str) -> ParallelDims:
        """The degrees inside one pipeline stage group (world_size: the ranks of one; the whole world without pp)."""
        replicate = parallelism.data_parallel_replicate_degree
        shard = parallelism.data_parallel_shard_degree
        tp = getattr(parallelism, "tensor_parallel_degree", 1)
        cp = getattr(parallelism, "context_parallel_degree", 1)
        if world_size % cp:
            raise ConfigError(
                f"parallelism.context_parallel_degree = {cp} does not divide {ranks}; valid: "
                f"{', '.join(str(d) for d in _divisors(world_size))}"
            )
        with_tp = (f" x context_parallel_degree = {cp}" if cp > 1 else "") + (
            f" x tensor_parallel_degree = {tp}" if tp > 1 else ""
        )
        if world_size % (tp * cp):
            raise ConfigError(
                f"parallelism.tensor_parallel_degree = {tp} does not divide {ranks}"
                + (f" / context_parallel_degree {cp}" if cp > 1 else "")
                + f"; valid: {', '.join(str(d) for d in _divisors(world_size // cp))}"
            )
        tp = tp * cp  # below: the ranks a data-parallel rank spans (cp x tp)
        if shard == -1:
            if (world_size // tp) % replicate:
                raise ConfigError(
                    f"parallelism.data_parallel_replicate_degree = {replicate}{with_tp} does not divide "
                    f"{ranks}, so data_parallel_shard_degree = -1 cannot fill the rest; valid replicate "
                    f"degrees: {', '.join(str(d) for d in _divisors(world_size // tp))}"
                )
            shard = world_size // tp // replicate
        if replicate * shard * tp != world_size:
            raise ConfigError(
                f"parallelism.data_parallel_replicate_degree = {replicate} x data_parallel_shard_degree = {shard}"
                f"{with_tp} = {replicate * shard * tp}, but {ranks.replace('the world size', 'the world size is', 1)}; "
                f"the product must equal it (set data_parallel_shard_degree = -1 to fill the rest)"
            )
        tp //= cp
        ep = getattr(parallelism, "expert_parallel_degree", 1)
        if (shard * cp * tp) % ep:
            borrowed = shard * cp * tp
            raise ConfigError(
                f"parallelism.expert_parallel_degree = {ep} does not divide the {borrowed} ranks it is drawn from "
                f"(data_parallel_shard_degree {shard}{with_tp}); valid: "
                f"{', '.join(str(d) for d in _divisors(borrowed))}"
            )
        return cls(dp_replicate=replicate, dp_shard=shard, world_size=world_size, tp=tp, ep=ep, cp=cp)

    @property
    def dp_degree(self) -> int:
        """Ranks that see different data: every rank but the tp ranks of one data-parallel rank, which share it."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of a global rank (cp, then tp, are the innermost mesh dimensions; pp the
        outermost: the stages of one data-parallel rank read the same batches)."""
        return rank % (self.world_size // self.pp) // (self.tp * self.cp)

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def replicate_only(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard == 1

    @property
    def fsdp(self) -> bool:
        return self.dp_replicate == 1

    @property
    def dp_mesh_dim_names(self) -> tuple[str, ...]:
        shard = "dp_shard_cp" if self.cp > 1 else "dp_shard"  # FSDP shards over the cp ranks too
        return ("dp_replicate", shard) if self.dp_replicate > 1 else (shard,)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return (("pp",) if self.pp > 1 else ()) + self.dp_mesh_dim_names + (("tp",) if self.tp > 1 else ())

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        shard = self.dp_shard * self.cp
        dp = (self.dp_replicate, shard) if self.dp_replicate > 1 else (shard,)
        return ((self.pp,) if self.pp > 1 else ()) + dp + ((self.tp,) if self.tp > 1 else ())

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP averages gradients over inside a replica group (shard x cp)."""
        return self.dp_shard * self.cp

    def build_sequence_mesh(self, device_type: str):
        """The 1-D mesh of the cp x tp ranks that share this rank's sequences (None unless cp > 1 and tp > 1: then
        the cp or tp mesh is it): an MoE sums its load-balancing statistics over them."""
        if self.cp == 1 or self.tp == 1:
            return None
        names, shape = self._with_pp(("dp", "seq"), (self.dp_degree, self.cp * self.tp))
        return init_device_mesh(device_type, shape, mesh_dim_names=names)["seq"]

    def _with_pp(self, names: tuple, shape: tuple) -> tuple[tuple, tuple]:
        """A stage group's mesh dimensions with "pp" outermost when there is pipeline parallelism (each pipeline
        stage's ranks are a whole mesh of their own)."""
        return (("pp",) + names, (self.pp,) + shape) if self.pp > 1 else (names, shape)

    def build_cp_mesh(self, device_type: str):
        """The 1-D "cp" mesh of this rank's context-parallel group (None without cp): over it attention gathers
        keys and values."""
        if self.cp == 1:
            return None
        names, shape = ("dp", "cp"), (self.dp_degree, self.cp)
        if self.tp > 1:
            names, shape = names + ("tp",), shape + (self.tp,)
        names, shape = self._with_pp(names, shape)
        return init_device_mesh(device_type, shape, mesh_dim_names=names)["cp"]

    def describe(self) -> str:
        """The log line that says which data parallelism this is."""
        pp = f"PP: pipeline_parallel_size={self.pp}; " if self.pp > 1 else ""
        return pp + self._describe_dp()

    def _describe_dp(self) -> str:
        cp = f", context_parallel_size={self.cp} (FSDP over shard x cp)" if self.cp > 1 else ""
        if self.hsdp or (self.dp_replicate > 1 and self.cp > 1):
            return f"HSDP: replicate_size={self.dp_replicate}, shard_size={self.dp_shard}{cp}"
        if self.replicate_only:
            return f"Replicate-only (DDP-like): replicate_size={self.dp_replicate}, shard_size=1"
        return f"FSDP: shard_size={self.dp_shard}{cp}"

    def describe_tp(self, sequence_parallel: bool, loss_parallel: bool) -> str | None:
        """The log line that says how tensor parallelism runs; None without it."""
        if self.tp == 1:
            return None
        on = [
            name for name, flag in (("sequence parallel", sequence_parallel), ("loss parallel", loss_parallel)) if flag
        ]
        return f"TP: tensor_parallel_size={self.tp}" + (f" ({', '.join(on)})" if on else "")

    def build_mesh(self, device_type: str):
        """The DeviceMesh over all ranks (the process group must exist)."""
        return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.mesh_dim_names)

    def build_meshes(self, device_type: str, moe: bool = False) -> Meshes:
        """Every mesh a run of these degrees uses, in one call (the process group must exist). moe: the model has
        experts (their own mesh, and the ranks that share a sequence's load statistics)."""
        return Meshes(
            world=self.build_mesh(device_type),
            expert=self.build_expert_mesh(device_type) if moe else None,
            cp=self.build_cp_mesh(device_type),
            sequence=self.build_sequence_mesh(device_type) if moe else None,
        )

    @property
    def expert_fsdp(self) -> int:
        """The ranks each expert is FSDP-sharded over inside a replica group: dp_shard x cp x tp / ep."""
        return self.dp_shard * self.cp * self.tp // self.ep

    def build_expert_mesh(self, device_type: str):
        """The mesh of an MoE model's experts, over the same ranks (None when it would be the data-parallel one:
        ep 1 and tp 1): ("dp_replicate",) "efsdp", "ep", from the ranks of dp_shard x tp, ep innermost (a tp group's
        ranks route their own shares of the tokens, so they count as data-parallel ranks for the experts)."""
        if self.ep == 1 and self.tp == 1:  # (with cp: the data-parallel mesh, "dp_shard_cp", holds them)
            return None
        names = (("dp_replicate",) if self.dp_replicate > 1 else ()) + ("efsdp", "ep")
        shape = ((self.dp_replicate,) if self.dp_replicate > 1 else ()) + (self.expert_fsdp, self.ep)
        names, shape = self._with_pp(names, shape)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        return mesh[names[1:]] if self.pp > 1 else mesh  # this rank's stage group's part

    def describe_ep(self, n_experts: int) -> str:
        """The start-up line about the experts' parallelism."""
        where = f"EP={self.ep} ({n_experts // self.ep} experts per rank)" if self.ep > 1 else "no EP"
        return f"{where}, experts FSDP-sharded over {self.expert_fsdp} rank(s)" + (
            f" x {self.dp_replicate} replicas" if self.dp_replicate > 1 else ""
        )


@dataclass(frozen=True)
class Meshes:
    """Every DeviceMesh of a run (ParallelDims.build_meshes)."""

    world: Any  # all ranks: ("pp",) data-parallel dimensions ("tp",)
    expert: Any = None  # an MoE's experts: ("dp_replicate",) "efsdp", "ep"; None: the data-parallel mesh holds them
    cp: Any = None  # this rank's context-parallel group (attention gathers keys and values over it); None without cp
    sequence: Any = None  # the cp x tp ranks sharing this rank's sequences (an MoE's load statistics); or None

    @property
    def data_parallel(self):
        """The data-parallel sub-mesh FSDP shards over (of this rank's pipeline stage group)."""
        return split_mesh(self.world)[0]

    @property
    def tp(self):
        """The "tp" sub-mesh, or None without tensor parallelism."""
        return split_mesh(self.world)[1]

    @property
    def pp(self):
        """The 1-D "pp" sub-mesh, or None without pipeline parallelism."""
        return pipeline_mesh(self.world)


def split_mesh(mesh):
    """(the data-parallel sub-mesh, the "tp" sub-mesh or None) of a mesh built by ParallelDims.build_mesh (with
    pp: of this rank's pipeline stage group)."""
    names = tuple(mesh.mesh_dim_names)
    if "tp" not in names and "pp" not in names:
        return mesh, None
    dp = tuple(n for n in names if n not in ("tp", "pp"))
    return mesh[dp], mesh["tp"] if "tp" in names else None


def pipeline_mesh(mesh):
    """The 1-D "pp" sub-mesh of a mesh built by ParallelDims.build_mesh (None without pipeline parallelism)."""
    return mesh["pp"] if mesh is not None and "pp" in mesh.mesh_dim_names else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
