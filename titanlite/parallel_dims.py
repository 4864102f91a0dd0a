"""Data-parallel degrees -> validated dimensions -> DeviceMesh.

replicate 1 gives FSDP on a 1-D ("dp_shard",) mesh; replicate > 1 gives a 2-D
("dp_replicate", "dp_shard") mesh: HSDP when shard > 1, plain replication (DDP-like) when shard is 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import init_device_mesh

from titanlite.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    """Resolved data-parallel degrees for one world size."""

    dp_replicate: int
    dp_shard: int
    world_size: int

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> ParallelDims:
        """Resolve -1 and check that replicate x shard equals the world size."""
        replicate = parallelism.data_parallel_replicate_degree
        shard = parallelism.data_parallel_shard_degree
        if shard == -1:
            if world_size % replicate:
                raise ConfigError(
                    f"parallelism.data_parallel_replicate_degree = {replicate} does not divide the world size "
                    f"{world_size}, so data_parallel_shard_degree = -1 cannot fill the rest; valid replicate "
                    f"degrees: {', '.join(str(d) for d in _divisors(world_size))}"
                )
            shard = world_size // replicate
        if replicate * shard != world_size:
            raise ConfigError(
                f"parallelism.data_parallel_replicate_degree = {replicate} x data_parallel_shard_degree = {shard} "
                f"= {replicate * shard}, but the world size is {world_size}; the product must equal the world size "
                f"(set data_parallel_shard_degree = -1 to fill the rest)"
            )
        return cls(dp_replicate=replicate, dp_shard=shard, world_size=world_size)

    @property
    def dp_degree(self) -> int:
        """Ranks that see different data (all of them: there is no tensor or pipeline parallelism)."""
        return self.dp_replicate * self.dp_shard

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
    def mesh_dim_names(self) -> tuple[str, ...]:
        return ("dp_replicate", "dp_shard") if self.dp_replicate > 1 else ("dp_shard",)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.dp_replicate, self.dp_shard) if self.dp_replicate > 1 else (self.dp_shard,)

    def describe(self) -> str:
        """The log line that says which data parallelism this is."""
        if self.hsdp:
            return f"HSDP: replicate_size={self.dp_replicate}, shard_size={self.dp_shard}"
        if self.replicate_only:
            return f"Replicate-only (DDP-like): replicate_size={self.dp_replicate}, shard_size=1"
        return f"FSDP: shard_size={self.dp_shard}"

    def build_mesh(self, device_type: str):
        """The DeviceMesh over all ranks (the process group must exist)."""
        return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.mesh_dim_names)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
