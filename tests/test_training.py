"""Sharding, topology-invariant init, loss parity across topologies, mixed precision (gloo, CPU)."""

import math

import pytest
import torch

from helpers import make_trainer, run_distributed, tiny_argv, train_all

pytestmark = pytest.mark.slow  # multi-process (gloo) or torchrun tests


def _sharding_facts(argv):
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    t = make_trainer(argv)
    m = t.model
    blocks_sharded = all(isinstance(b, FSDPModule) for b in m.layers) and isinstance(m, FSDPModule)
    local = {n: p.to_local().clone() for n, p in m.named_parameters()}
    full_shape = {n: tuple(p.shape) for n, p in m.named_parameters()}
    all_dtensor = all(isinstance(p, DTensor) for p in m.parameters())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return dict(
        blocks_sharded=blocks_sharded,
        all_dtensor=all_dtensor,
        local_shape={n: tuple(v.shape) for n, v in local.items()},
        full_shape=full_shape,
        gathered=gathered,
        shard=t.dims.dp_shard,
        rank=t.env.rank,
        groups=t.num_sharded,
    )


@pytest.mark.parametrize("replicate", [1, 2])
def test_sharding_world4(tmp_path, replicate):
    res = run_distributed(
        _sharding_facts, 4, tiny_argv(tmp_path, "--parallelism.data_parallel_replicate_degree", str(replicate))
    )
    r0 = res[0]
    shard = r0["shard"]
    assert shard == 4 // replicate
    assert r0["groups"] == 2 + 2  # tok_embeddings, 2 blocks, norm+output
    for r in res:
        assert r["blocks_sharded"] and r["all_dtensor"]
        shard_rank = r["rank"] % shard
        for name, shape in r["full_shape"].items():
            # dim-0 chunks as torch.chunk: ceil(rows / shard) rows each, the last ones shorter (padding)
            chunk = math.ceil(shape[0] / shard)
            rows = max(0, min(chunk, shape[0] - shard_rank * chunk))
            assert r["local_shape"][name] == (rows, *shape[1:]), name
    for name, shape in r0["full_shape"].items():
        assert sum(res[k]["local_shape"][name][0] for k in range(shard)) == shape[0]
    gathered = r0["gathered"]
    if replicate > 1:  # rank r and r + shard are replicas: identical shards
        for r in range(shard):
            for name in gathered[r]:
                assert torch.equal(gathered[r][name], gathered[r + shard][name]), name


def _full_states(argvs):
    """The full step-0 weights of a Trainer for each argv (one spawned world runs them all)."""
    out = []
    for argv in argvs:
        t = make_trainer(argv)
        out.append({k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in t.model.state_dict().items()})
    return out


def test_init_is_topology_invariant(tmp_path):
    argv = tiny_argv(tmp_path)
    ref, other_seed = run_distributed(_full_states, 1, [argv, argv + ["--training.seed", "7"]])[0]
    others = [
        *run_distributed(_full_states, 2, [argv])[0],
        *run_distributed(_full_states, 4, [argv, argv + ["--parallelism.data_parallel_replicate_degree", "2"]])[0],
    ]
    assert len(others) == 3
    for sd in others:
        assert sd.keys() == ref.keys()
        for k in ref:
            assert torch.equal(sd[k], ref[k]), k
    # a different seed gives different weights
    assert not torch.equal(other_seed["layers.0.attention.wq.weight"], ref["layers.0.attention.wq.weight"])


def test_loss_parity_across_topologies(tmp_path):
    base = tiny_argv(tmp_path, "--training.global_batch_size", "8", "--training.steps", "6")
    single, single_tied = run_distributed(
        train_all,
        1,
        [
            base + ["--training.local_batch_size", "8"],
            base + ["--training.local_batch_size", "8", "--model.tie_embeddings"],
        ],
    )[0]
    world4 = run_distributed(
        train_all,
        4,
        [
            base + ["--training.local_batch_size", "2"],  # FSDP(4)
            base + ["--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree", "2"],  # HSDP
            base + ["--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree", "4"],  # DDP
            base
            + [
                "--training.local_batch_size",
                "1",
                "--parallelism.data_parallel_replicate_degree",
                "2",
                "--parallelism.hsdp_delay_all_reduce",
            ],  # HSDP, 2 microbatches, delayed all-reduce
            base + ["--training.local_batch_size", "2", "--parallelism.fsdp_reshard_after_forward", "2"],
            base + ["--training.local_batch_size", "2", "--parallelism.fsdp_reshard_after_forward", "never"],
            base + ["--training.local_batch_size", "2", "--training.enable_cpu_offload"],
            base + ["--training.local_batch_size", "2", "--model.tie_embeddings"],
        ],
    )[0]
    fsdp2_accum = run_distributed(train_all, 2, [base + ["--training.local_batch_size", "2"]])[0][0]
    assert len(single) == 6
    assert single[6] < single[1]  # it trains
    names = [
        "fsdp4",
        "hsdp2x2",
        "replicate4",
        "hsdp_delay",
        "reshard_to_2",
        "reshard_never",
        "cpu_offload",
        "tied",
        "fsdp2_accum2",
    ]
    for name, losses in zip(names, world4 + [fsdp2_accum]):
        ref = single_tied if name == "tied" else single
        for step in ref:
            assert abs(losses[step] - ref[step]) < 1e-5, (name, step, losses[step], ref[step])
    assert single_tied[6] < single_tied[1]


def test_bf16_params_train(tmp_path):
    argv = tiny_argv(
        tmp_path,
        "--training.mixed_precision_param",
        "bfloat16",
        "--training.steps",
        "15",
        "--training.local_batch_size",
        "4",
    )
    losses = run_distributed(train_all, 2, [argv])[0][0]
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[15] < losses[1] - 0.5


def _diverge(argv):
    from titanlite.config import load
    from titanlite.errors import NonFiniteLossError
    from titanlite.trainer import Trainer

    t = Trainer(load(argv))
    try:
        t.train()
    except NonFiniteLossError as e:
        return str(e)
    return None


def test_non_finite_loss_stops_with_step(tmp_path):
    # an absurd learning rate without clipping blows the weights up within a few steps
    msg = run_distributed(
        _diverge,
        1,
        tiny_argv(
            tmp_path,
            "--optimizer.lr",
            "1e12",
            "--training.max_norm",
            "0",
            "--lr_scheduler.warmup_steps",
            "0",
            "--metrics.log_freq",
            "5",
        ),
    )[0]
    assert msg is not None and "non-finite at step" in msg
    step = int(msg.split("non-finite at step ")[1].split()[0])
    assert 1 <= step <= 10
