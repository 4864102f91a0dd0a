"""Mesh: every valid (replicate, shard) for world 4 and rejection of the rest."""

import pytest

from titanlite.config import ConfigError, Parallelism
from titanlite.parallel.dims import ParallelDims

from helpers import run_distributed


@pytest.mark.parametrize(
    "replicate, shard, expect",
    [
        (1, -1, (1, 4)),
        (1, 4, (1, 4)),
        (2, -1, (2, 2)),
        (2, 2, (2, 2)),
        (4, -1, (4, 1)),
        (4, 1, (4, 1)),
    ],
)
def test_valid_world4(replicate, shard, expect):
    d = ParallelDims.from_config(
        Parallelism(data_parallel_shard_degree=shard, data_parallel_replicate_degree=replicate), 4
    )
    assert (d.dp_replicate, d.dp_shard) == expect and d.dp_degree == 4
    assert d.fsdp == (replicate == 1)
    assert d.hsdp == (expect == (2, 2))
    assert d.replicate_only == (expect == (4, 1))
    assert d.mesh_dim_names == (("dp_shard",) if replicate == 1 else ("dp_replicate", "dp_shard"))


@pytest.mark.parametrize(
    "replicate, shard, needles",
    [
        (1, 2, ["data_parallel_replicate_degree = 1", "data_parallel_shard_degree = 2", "world size is 4"]),
        (2, 4, ["= 8", "world size is 4"]),
        (3, -1, ["data_parallel_replicate_degree = 3", "world size 4", "1, 2, 4"]),
        (0, -1, ["data_parallel_replicate_degree = 0"]),
        (1, -2, ["data_parallel_shard_degree = -2"]),
    ],
)
def test_invalid_world4(replicate, shard, needles):
    from titanlite.config import load
    from titanlite.plan import resolve

    with pytest.raises(ConfigError) as e:  # out-of-range degrees fail at load, the rest with the world size
        resolve(
            load(
                [
                    "--parallelism.data_parallel_shard_degree",
                    str(shard),
                    "--parallelism.data_parallel_replicate_degree",
                    str(replicate),
                ]
            ),
            4,
        )
    for n in needles:
        assert n in str(e.value)


def _mesh_info(replicate):
    from titanlite.runtime.distributed import init_distributed

    env = init_distributed()
    dims = ParallelDims.from_config(Parallelism(data_parallel_replicate_degree=replicate), env.world_size)
    mesh = dims.build_mesh("cpu")
    return tuple(mesh.mesh_dim_names), tuple(mesh.shape), mesh.get_coordinate()


@pytest.mark.slow
def test_build_mesh_world4():
    fsdp = run_distributed(_mesh_info, 4, 1)
    assert [r[:2] for r in fsdp] == [(("dp_shard",), (4,))] * 4
    hsdp = run_distributed(_mesh_info, 4, 2)
    assert [r[:2] for r in hsdp] == [(("dp_replicate", "dp_shard"), (2, 2))] * 4
    assert [tuple(r[2]) for r in hsdp] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_each_kind_says_its_problem_and_generation_skips_training_only_ones():
    """plan.check_parallelism loops over every kind's problem(); generation (inference) never trips on a training
    setting: a reshard group that does not divide its shard degree (inference reshards every block)."""
    from types import SimpleNamespace

    from titanlite.parallel import fsdp

    cfg = SimpleNamespace(parallelism=SimpleNamespace(fsdp_reshard_after_forward="2"))
    dims = ParallelDims(dp_replicate=1, dp_shard=3, world_size=3)
    assert "fsdp_reshard_after_forward = 2 must divide the shard degree 3" in fsdp.problem(cfg, dims)
    assert fsdp.problem(cfg, dims, inference=True) is None


def _context_parallel_groups(tmp):
    """The cp group a model built for training and one built for generation get from the same meshes."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from titanlite.config import load
    from titanlite.model_builder import build_model
    from titanlite.models.registry import model_args
    from titanlite.parallel.dims import Meshes
    from titanlite.runtime.distributed import init_distributed

    from helpers import tiny_argv

    init_distributed()
    cfg = load(tiny_argv(tmp))
    world = ParallelDims(dp_replicate=1, dp_shard=1, world_size=1).build_mesh("cpu")
    meshes = Meshes(world, cp=SimpleNamespace(get_group=lambda: dist.group.WORLD))
    args = model_args(cfg.model, 258, cfg.training.seq_len)
    return [build_model(cfg, args, meshes, inference=i).model.cp_group is not None for i in (False, True)]


@pytest.mark.slow
def test_generation_never_splits_sequences_over_context_parallel_ranks(tmp_path):
    """A training config's context_parallel_degree leaves generation's model whole (generate builds every mesh with
    one call; only training wires attention to the cp group)."""
    assert run_distributed(_context_parallel_groups, 1, str(tmp_path))[0] == [True, False]
