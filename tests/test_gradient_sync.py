"""Gradient sync with accumulation: delayed all-reduce and last-microbatch-only equal the default schedule.

HSDP(2x2) and FSDP(4), 3 microbatches, fp32: the full gradients after one accumulated step and the
loss curve match the default schedule, and the collectives that are skipped really are skipped.
"""

from collections import Counter

import pytest
import torch

from helpers import run_distributed, tiny_argv

pytestmark = pytest.mark.slow  # multi-process (gloo) or torchrun tests

MODES = ["every_microbatch", "delay_all_reduce", "last_microbatch_only"]


def _argv(tmp, replicate, mode, *extra):
    # 3 microbatches of 1 sequence per rank at dp degree 4
    argv = tiny_argv(
        tmp,
        "--training.local_batch_size",
        "1",
        "--training.global_batch_size",
        "12",
        "--training.steps",
        "4",
        "--parallelism.data_parallel_replicate_degree",
        str(replicate),
        *extra,
    )
    if mode == "delay_all_reduce":
        return argv + ["--parallelism.hsdp_delay_all_reduce"]  # the shorthand users and configs use
    return argv + ["--parallelism.gradient_sync", mode]


def _collective_counter():
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCollectives(TorchDispatchMode):
        """Counts c10d collectives by op name (FSDP2 calls them through the dispatcher)."""

        def __init__(self):
            super().__init__()
            self.counts = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                self.counts[func.__name__.split(".")[0]] += 1
            return func(*args, **(kwargs or {}))

    return CountCollectives()


def _run_mode(argv):
    """Train 4 steps: the full gradients seen by the first optimizer step, the collectives, the losses."""
    from titanlite.config import load
    from titanlite.trainer import Trainer

    t = Trainer(load(argv))
    captured = {}
    step = t.optimizer.step

    def capture_then_step(*a, **kw):
        if not captured:
            captured.update({n: p.grad.full_tensor() for n, p in t.model.named_parameters()})
        return step(*a, **kw)

    t.optimizer.step = capture_then_step
    with _collective_counter() as counter:
        losses = t.train()
    return dict(
        grads=captured,
        counts=dict(counter.counts),
        losses=losses,
        mode=t.gradient_sync,
        groups=t.num_sharded,
        grad_accum=t.grad_accum,
    )


def _all_modes(tmp):
    import torch.distributed as dist

    out = {
        (rep, mode): _run_mode(_argv(tmp, rep, mode))
        for rep in (2, 1)
        for mode in MODES
        if (rep, mode) != (1, "delay_all_reduce")
    }
    return out if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def world4_results(tmp_path_factory):
    return run_distributed(_all_modes, 4, tmp_path_factory.mktemp("gsync"))[0]


@pytest.mark.parametrize(
    "replicate, mode", [(2, "delay_all_reduce"), (2, "last_microbatch_only"), (1, "last_microbatch_only")]
)
def test_gradients_and_losses_equal_default(world4_results, replicate, mode):
    ref, got = world4_results[(replicate, "every_microbatch")], world4_results[(replicate, mode)]
    assert got["mode"] == mode and got["grad_accum"] == 3
    assert ref["grads"].keys() == got["grads"].keys() and len(ref["grads"]) > 0
    for name, g in ref["grads"].items():
        assert g.dtype == torch.float32 and g.abs().max() > 0, name
        torch.testing.assert_close(got["grads"][name], g, rtol=0, atol=1e-6, msg=name)
    assert sorted(got["losses"]) == sorted(ref["losses"]) == [1, 2, 3, 4]
    for step, loss in ref["losses"].items():
        assert abs(got["losses"][step] - loss) < 1e-6, (step, got["losses"][step], loss)
    assert ref["losses"][4] < ref["losses"][1]  # it trains


def test_skipped_collectives_are_skipped(world4_results):
    """Per FSDP group, microbatch and step: default reduce-scatters and all-reduces on each of the 3
    microbatches; delay_all_reduce reduce-scatters on each and all-reduces once; last_microbatch_only
    does each once. Other collectives (token count, grad norm, loss) are the same in every mode."""
    hsdp = {m: world4_results[(2, m)]["counts"] for m in MODES}
    groups = world4_results[(2, "every_microbatch")]["groups"] * 4  # x 4 steps
    assert groups == 4 * 4
    default, delay, last = hsdp["every_microbatch"], hsdp["delay_all_reduce"], hsdp["last_microbatch_only"]
    assert default["_reduce_scatter_base_"] == delay["_reduce_scatter_base_"] == 3 * groups
    assert default["allreduce_"] - delay["allreduce_"] == 2 * groups
    assert last["_reduce_scatter_base_"] == groups and last["allreduce_"] == delay["allreduce_"]
    fsdp_default = world4_results[(1, "every_microbatch")]["counts"]
    fsdp_last = world4_results[(1, "last_microbatch_only")]["counts"]
    assert fsdp_default["_reduce_scatter_base_"] == 3 * groups and fsdp_last["_reduce_scatter_base_"] == groups
    assert fsdp_default["allreduce_"] == fsdp_last["allreduce_"]  # FSDP has no replicate all-reduce to skip


def test_gradient_sync_config():
    from titanlite.config import ConfigError, gradient_sync_mode, load

    assert gradient_sync_mode(load([]).parallelism) == "every_microbatch"
    assert gradient_sync_mode(load(["--parallelism.hsdp_delay_all_reduce"]).parallelism) == "delay_all_reduce"
    assert (
        gradient_sync_mode(load(["--parallelism.gradient_sync", "last_microbatch_only"]).parallelism)
        == "last_microbatch_only"
    )
    with pytest.raises(
        ConfigError, match=r"parallelism.gradient_sync = 'sometimes' is not valid.*last_microbatch_only"
    ):
        load(["--parallelism.gradient_sync", "sometimes"])
    with pytest.raises(ConfigError, match="hsdp_delay_all_reduce = true contradicts parallelism.gradient_sync"):
        load(["--parallelism.hsdp_delay_all_reduce", "--parallelism.gradient_sync", "last_microbatch_only"])


@pytest.mark.parametrize(
    "mode, replicate, shard, accum, applied, needle",
    [
        ("delay_all_reduce", 2, 2, 3, "delay_all_reduce", "last of 3 microbatches"),
        (
            "delay_all_reduce",
            2,
            1,
            2,
            "delay_all_reduce",
            "last of 2 microbatches",
        ),  # replicate-only has the all-reduce too
        ("delay_all_reduce", 1, 4, 3, "every_microbatch", "has no effect"),  # FSDP: no replicas
        ("delay_all_reduce", 2, 2, 1, "every_microbatch", "has no effect"),  # one microbatch
        ("last_microbatch_only", 1, 4, 3, "last_microbatch_only", "unsharded gradients"),
        ("last_microbatch_only", 2, 2, 1, "every_microbatch", "has no effect"),
        ("every_microbatch", 2, 2, 3, "every_microbatch", None),
    ],
)
def test_gradient_sync_plan(mode, replicate, shard, accum, applied, needle):
    from titanlite.parallel.dims import ParallelDims
    from titanlite.parallel.fsdp import gradient_sync_plan

    got, line = gradient_sync_plan(mode, ParallelDims(replicate, shard, replicate * shard), accum)
    assert got == applied
    assert (line is None) if needle is None else (needle in line)


# ---------------------------------------------------------------- resume in the middle


def _train_and_resume(tmp, mode):
    """6 steps in one go; then 3 steps with a checkpoint and a second run that resumes and does 3 more."""
    from titanlite.config import load
    from titanlite.trainer import Trainer

    # constant lr after warmup, so a run of 3 steps has the schedule of a run of 6
    common = ["--lr_scheduler.decay_type", "constant"]
    straight = Trainer(load(_argv(tmp / "straight", 2, mode, "--training.steps", "6", *common))).train()
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.folder", "ckpt", *common]
    first = Trainer(load(_argv(tmp / "resumed", 2, mode, "--training.steps", "3", *ckpt))).train()
    second = Trainer(load(_argv(tmp / "resumed", 2, mode, "--training.steps", "6", *ckpt))).train()
    return straight, first, second


@pytest.mark.parametrize("mode", ["delay_all_reduce", "last_microbatch_only"])
def test_resume_in_the_middle_is_exact(tmp_path, mode):
    straight, first, second = run_distributed(_train_and_resume, 4, tmp_path, mode)[0]
    assert (tmp_path / "resumed" / "ckpt" / "step-3").is_dir()
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5, 6]
    for step in range(1, 7):
        assert (first | second)[step] == straight[step], (step, (first | second)[step], straight[step])
