"""[float8] with tensor parallelism: torchao's float8 styles (tensorwise) and the plain ones (rowwise) give one
process's float8 losses at TP(2) and FSDP(2) x TP(2), for Llama, Qwen3 (q/k norms) and DeepSeek-V3 (latent
attention, MoE), with their activations all-gathered in float8, and resume.

On the CPU (CI) the ranks use torch's CPU float8 matmul and gloo. gloo has no float8 dtype, so here its all-gathers
carry the float8 bytes as uint8 (`_float8_over_gloo`); NCCL carries them as float8. titanlite still refuses [float8]
on a CPU for users (tests/test_bad_inputs.py); these tests lift that check inside their own processes. Where
TITANLITE_TEST_DEVICE=cuda (the GPU check) every rank computes on the one GPU, with gloo moving the tensors through
the host (NCCL wants a GPU per rank), and without sequence parallelism: torch 2.11's gloo crashes (SIGSEGV) on the
sequence-parallel collectives of CUDA tensors, with or without float8.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from helpers import TEST_DEVICE, make_trainer, run_distributed, tiny_argv

pytest.importorskip("torchao")
if TEST_DEVICE == "cuda":
    from titanlite.parallel.float8 import MIN_CAPABILITY

    pytestmark = pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < MIN_CAPABILITY,
        reason="float8 on a GPU needs compute capability 8.9+",
    )

ROWWISE = ("--float8.recipe", "rowwise")
MLA = ("--model.name", "deepseek_v3")  # latent attention: its latent projections stay whole under tp
QK_NORM = ("--model.name", "qwen3")  # per-head q/k norms on the float8 projections' outputs
NO_SP = ("--parallelism.enable_sequence_parallel", "false", "--parallelism.enable_loss_parallel", "false")
SP = TEST_DEVICE != "cuda"  # (see the module's docstring)
TP2 = ("--parallelism.tensor_parallel_degree", "2", *(() if SP else NO_SP))
FIRST_RTOL = (2e-5, 1e-4)  # loss, gradient norm of the first step: the same weights, reductions in another order
# A value that order moves across an e4m3 rounding boundary moves by up to 1/16: Qwen3's debug model (logits large at
# init) moves its first loss by 1.1e-4 for that (Llama's: 2e-6); its gradient norm by under 1e-5
QK_NORM_FIRST_RTOL = (2e-4, 1e-4)
# A TP(2) checkpoint's first step on one GPU: trained weights, other kernels for the unsplit shapes (its loss moved by
# 2.8e-5 and 1.3e-4 in two H200 runs)
RESUMED_FIRST_RTOL = FIRST_RTOL if TEST_DEVICE == "cpu" else (5e-4, 5e-4)
LATENT_NORM_RTOL = 5e-3  # the MoE's shared experts float8 on one process, bf16 under tp: another computation
CURVE_RTOL = 1.5e-3  # e4m3 keeps 3 mantissa bits: a value that the reductions' order moves across a rounding
# boundary moves by up to 1/16, and training carries that on (4e-4 at most over these steps)


def _argv(tmp, *extra):
    """6 fp32 float8 steps of the debug model (every block linear splits over tp 2 into multiples of 16) at seq 64."""
    return tiny_argv(
        tmp,
        "--model.flavor",
        "debugmodel",
        "--training.seq_len",
        "64",
        "--training.steps",
        "6",
        "--training.global_batch_size",
        "4",
        "--training.local_batch_size",
        "4",
        "--float8.enable",
        "true",
        *extra,
    )


class _Float8AllGathers:
    """Counts the all-gathers of float8 tensors; over gloo, which has no float8 dtype, they carry the bytes as
    uint8 (torchao's own all-gather, but for the dtype the collective sees)."""

    def __init__(self):
        self.count = 0

    def install(self, table: dict) -> None:
        from torchao.float8.float8_training_tensor import Float8TrainingTensor

        def all_gather_bytes(op, args, kwargs=None):
            self.count += 1
            x = args[0]
            out = op(x._data.contiguous().view(torch.uint8), *args[1:], **(kwargs or {}))
            return Float8TrainingTensor(
                out.view(x._data.dtype), x._scale, x._orig_dtype, x._linear_mm_config, x._gemm_input_role
            )

        for op, fn in list(table.items()):
            if fn.__name__ == "allgather_fp8":
                table[op] = all_gather_bytes


def _float8_here(setattr_, setitem) -> _Float8AllGathers:
    """Let [float8] run on this machine's device (the CPU too) and count its float8 all-gathers."""
    from torchao.float8 import float8_ops

    from titanlite.parallel import float8

    check = float8.problem
    setattr_(float8, "problem", lambda cfg, dims, args=None, device_type=None, inference=False: check(cfg, dims, args))
    gathers = _Float8AllGathers()
    table = dict(float8_ops.FLOAT8_OPS_TABLE)
    gathers.install(table)
    for op, fn in table.items():
        setitem(float8_ops.FLOAT8_OPS_TABLE, op, fn)
    return gathers


def _record_norms(trainer) -> list[float]:
    """The gradient norm of each step the trainer takes from now on (a list it fills)."""
    norms, step = [], trainer.train_step

    def recorded_step(*args, **kwargs):
        result = step(*args, **kwargs)
        norms.append(result.grad_norm.item())
        return result

    trainer.train_step = recorded_step
    return norms


def _train(tmp, runs, gathers) -> dict:
    """Per run (name, argv): the losses, the float8 linears (and how many have weights split over tp) and the
    float8 all-gathers during training."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, argv in runs:
        trainer = make_trainer(_argv(f"{tmp}/{name}", *argv))
        float8 = [m for m in trainer.model.modules() if type(m).__name__ == "Float8Linear"]
        split = [m for m in float8 if isinstance(m.weight, DTensor) and "tp" in (m.weight.device_mesh.mesh_dim_names)]
        norms = _record_norms(trainer)
        before = gathers.count
        losses = trainer.train()
        out[name] = dict(
            losses=losses, norms=norms, float8=len(float8), split=len(split), gathers=gathers.count - before
        )
    return out


def _ranks(tmp, runs, device) -> dict:
    """A rank of a spawned world: the runs with float8 allowed here, on `device`."""
    import torch.distributed as dist

    if device == "cuda":  # every rank on the one GPU, through gloo (see the module's docstring)
        os.environ.update(TITANLITE_DEVICE="cuda", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        dist.init_process_group("gloo")
    gathers = _float8_here(setattr, lambda d, k, v: d.__setitem__(k, v))
    return _train(tmp, runs, gathers)


def _assert_close(run: dict, ref: dict, name: str, ref_steps=None, first_rtol=FIRST_RTOL) -> None:
    """run's first step (the same weights) within first_rtol (loss, gradient norm) of ref's at that step, every step
    within CURVE_RTOL; ref_steps: ref's steps that run trained (all of them by default)."""
    steps = sorted(run["losses"])
    assert steps == (ref_steps or sorted(ref["losses"])), name
    loss, ref_loss = run["losses"][steps[0]], ref["losses"][steps[0]]
    norm, ref_norm = run["norms"][0], ref["norms"][steps[0] - 1]
    assert abs(loss - ref_loss) <= first_rtol[0] * ref_loss, (name, loss, ref_loss)
    assert abs(norm - ref_norm) <= first_rtol[1] * ref_norm, (name, norm, ref_norm)
    for step in steps:
        assert abs(run["losses"][step] - ref["losses"][step]) <= CURVE_RTOL * ref["losses"][step], (name, step)


@pytest.mark.slow
def test_float8_under_tp_matches_one_process_and_resumes(tmp_path, monkeypatch):
    """TP(2) with and without sequence parallelism, tensorwise and rowwise, and FSDP(2) x TP(2) with FSDP's float8
    all-gathers, each against one process of the same recipe; a TP(2) checkpoint resumes exactly at TP(2) and
    within the curve's tolerance on one process."""
    ckpt = ("--checkpoint.enable", "--checkpoint.interval", "3")
    saved = str(tmp_path / "two/tensorwise")
    two = run_distributed(
        _ranks,
        2,
        str(tmp_path / "two"),
        [
            ("tensorwise", [*TP2, *ckpt]),
            ("tp_resumed", [*TP2, *ckpt, "--job.dump_folder", saved, "--checkpoint.load_step", "3"]),
            ("rowwise", [*TP2, *ROWWISE]),
            ("tensorwise_no_sp", [*TP2, *NO_SP]),
            ("latent_attention", [*TP2, *MLA]),
            ("qk_norm", [*TP2, *QK_NORM]),
        ],
        TEST_DEVICE,
    )[0]
    resumed_tp = two.pop("tp_resumed")
    shutil.copytree(f"{saved}/checkpoint/step-3", tmp_path / "one_resumed/checkpoint/step-3")
    four = run_distributed(
        _ranks,
        4,
        str(tmp_path / "four"),
        [("fsdp_tensorwise", [*TP2, "--training.local_batch_size", "2"])],
        TEST_DEVICE,
    )[0]
    _float8_here(monkeypatch.setattr, monkeypatch.setitem)
    one = _train(
        tmp_path,
        [
            ("tensorwise", []),
            ("rowwise", [*ROWWISE]),
            ("latent_attention", [*MLA]),
            ("qk_norm", [*QK_NORM]),
            ("one_resumed", [*ckpt]),
            ("plain", ["--float8.enable", "false", "--training.steps", "1"]),  # its first gradient
        ],
        _Float8AllGathers(),
    )
    n = 7 * 6  # q, k, v, o, w1, w2, w3 of each of the 6 blocks
    assert one["tensorwise"]["float8"] == one["qk_norm"]["float8"] == n and one["plain"]["float8"] == 0
    # float8 is in effect: its first gradient is farther from fp32's, and from rowwise's, than the ranks may be
    first_norm = {name: one[name]["norms"][0] for name in ("tensorwise", "rowwise", "plain")}
    for other in ("plain", "rowwise"):
        assert abs(first_norm[other] - first_norm["tensorwise"]) > 5 * FIRST_RTOL[1] * first_norm[other], first_norm
    for name, run in {**two, "fsdp_tensorwise": four["fsdp_tensorwise"]}.items():
        ref = one[name if name in ("rowwise", "latent_attention", "qk_norm") else "tensorwise"]
        if name == "latent_attention":  # its latent projections are float8 too, sharded on the dp ranks only (and
            # under tp an MoE's shared experts stay bf16)
            assert ref["float8"] > run["float8"] > run["split"] > 0, (name, run["float8"], run["split"])
            _assert_close(run, ref, name, first_rtol=(CURVE_RTOL, LATENT_NORM_RTOL))  # not the same float8 linears
            continue
        assert run["float8"] == run["split"] == ref["float8"] > 0, (name, run)  # every float8 linear split over tp
        _assert_close(run, ref, name, first_rtol=QK_NORM_FIRST_RTOL if name == "qk_norm" else FIRST_RTOL)
    # tensorwise with sequence parallelism: the attention's and the FFN's inputs are all-gathered in float8, once
    # per block and microbatch each (and their gradients' all-gathers in backward); rowwise gathers bf16/fp32
    if SP:
        assert two["tensorwise"]["gathers"] >= 2 * 6 * 6 and four["fsdp_tensorwise"]["gathers"] >= 2 * 6 * 6
    assert two["rowwise"]["gathers"] == 0
    assert resumed_tp["losses"] == {s: two["tensorwise"]["losses"][s] for s in (4, 5, 6)}  # exact at TP(2)
    _assert_close(one["one_resumed"], two["tensorwise"], "one_resumed", [4, 5, 6], RESUMED_FIRST_RTOL)


def test_float8_scales_follow_every_change_of_the_weights(tmp_path, monkeypatch):
    """The run state says that the weights were replaced at the load, after each optimizer step, and after a heal or a
    DiLoCo sync that the replica-group policy made, and at no other time; the trainer hands that event to float8's
    listener (listen_for_new_weights)."""
    import titanlite.trainer as trainer_module
    from titanlite.parallel.ft import Next, NoReplicaGroups
    from titanlite.run_state import HEALED, SYNCED

    class Moves(NoReplicaGroups):  # weights replaced at the quorum before step 2 and at the sync after step 3
        def before_step(self, state):
            if state.step == 1:
                state.weights_replaced(HEALED)
            return Next.GO_ON

        def after_step(self, state, committed):
            if state.step == 3:
                state.weights_replaced(SYNCED)
            return Next.GO_ON

    events = []
    monkeypatch.setattr(
        trainer_module,
        "listen_for_new_weights",
        lambda state, model, cfg: state.on_weights_replaced(lambda why: events.append((state.step, why))),
    )
    trainer = make_trainer(tiny_argv(tmp_path, "--training.steps", "4"))
    trainer.replicas = Moves()
    trainer.train()
    assert events == [
        (0, "loaded"),
        (1, "optimizer step"),
        (1, "healed"),
        (2, "optimizer step"),
        (3, "optimizer step"),
        (3, "synced"),
        (4, "optimizer step"),
    ]


def test_float8_refreshes_its_scales_at_once_or_after_a_load_at_the_first_forward():
    """float8's listener: after a load the scales are computed at the model's next forward (after FSDP's set-up of
    it), once; after any other replacement of the weights, at once."""
    from titanlite.parallel.float8 import scale_refresher

    model, refreshes = torch.nn.Linear(2, 2), []
    listener = scale_refresher(model, lambda: refreshes.append(1))
    listener("loaded")
    assert refreshes == []
    model(torch.zeros(1, 2))
    model(torch.zeros(1, 2))
    assert refreshes == [1]
    listener("optimizer step")
    assert refreshes == [1, 1]
