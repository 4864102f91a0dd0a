"""Context parallelism (gloo, CPU): every sequence split over cp ranks, two chunks each (one from each end), keys
and values gathered in attention. The same losses (fp32, 6 steps, 1e-5) and gradients as one process, causal and
block-causal with documents crossing the chunk boundaries, at CP(2), FSDP(2) x CP(2), CP(2) x TP(2) and HSDP
(2 replicas) x CP(2) with accumulation and the delayed all-reduce; exact resume, and checkpoints that resume at
another cp degree."""

import shutil

import pytest
import torch

from titanlite.loss import microbatch_loss

from helpers import ckpt_argv, make_trainer, run_distributed, tiny_argv

pytestmark = pytest.mark.slow  # spawned gloo ranks

CP = ("--parallelism.context_parallel_degree",)
BLOCK = ("--model.attention", "block_causal")
MOE = ("--model.name", "qwen3_moe", "--moe.load_balance", "aux_loss")  # statistics summed over the cp (x tp) ranks
EP2 = ("--parallelism.expert_parallel_degree", "2")
GPT_OSS = ("--model.name", "gpt_oss", "--moe.load_balance", "aux_loss", *BLOCK)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(tmp, runs):
    """Per run (name, argv): logged losses, and every parameter's gradient of one more step (optimizer left out)."""
    out = {}
    for name, argv in runs:
        val = ("--validation.enable", "--validation.freq", "3", "--validation.steps", "2")
        steps = ("--training.steps", "6")  # the suite's time budget
        t = make_trainer(tiny_argv(f"{tmp}/{name}", "--training.global_batch_size", "8", *steps, *val, *argv))
        if name in ("one", "one_block"):  # the documents of a batch cross the 2 x cp chunk boundaries (chunks of 8)
            positions = t.dataloader.next_step().microbatches[0][2]
            t.dataloader.load_state_dict({**t.dataloader.state_dict(), "sequence_index": 0})
            assert (positions[:, 8::8] != 0).any()
        losses = t.train()
        t.optimizer.step, t.optimizer.zero_grad = (lambda *a, **k: None), (lambda *a, **k: None)
        data = t.dataloader.next_step()
        t.train_step(data.microbatches, data.global_valid_tokens)
        out[name] = (losses, {n: _full(p.grad).clone() for n, p in t.model.named_parameters()}, t.val_losses)
    return out


RUNS = [  # (reference, world, name, argv)
    ("one", 2, "cp2", ("--training.local_batch_size", "8", *CP, "2")),
    ("one", 2, "cp2_full_ac_compiled", ("--training.local_batch_size", "8", *CP, "2", "--activation_checkpoint.mode",
                                        "full", "--compile.enable", "--compile.backend", "aot_eager")),
    ("one_block", 2, "cp2_block", ("--training.local_batch_size", "8", *CP, "2", *BLOCK)),
    ("one", 4, "fsdp2_cp2", ("--training.local_batch_size", "4", *CP, "2")),
    ("one_block", 4, "fsdp2_cp2_block", ("--training.local_batch_size", "4", *CP, "2", *BLOCK)),
    ("one_block", 4, "cp2_tp2_block", ("--training.local_batch_size", "8", *CP, "2",
                                        "--parallelism.tensor_parallel_degree", "2", *BLOCK)),
    ("one_moe", 2, "cp2_moe", ("--training.local_batch_size", "8", *CP, "2", *MOE)),
    ("one_moe", 2, "cp2_ep2_moe", ("--training.local_batch_size", "8", *CP, "2", *MOE, *EP2)),
    ("one_moe", 4, "fsdp2_cp2_ep2_moe", ("--training.local_batch_size", "4", *CP, "2", *MOE, *EP2)),
    ("one_moe", 4, "cp2_tp2_moe", ("--training.local_batch_size", "8", *CP, "2", *MOE,
                                   "--parallelism.tensor_parallel_degree", "2")),
    # gpt-oss: sliding windows of 4 across the chunk boundaries, sinks, block-causal, experts split over the cp ranks
    ("one_gpt_oss", 2, "cp2_ep2_gpt_oss_block", ("--training.local_batch_size", "8", *CP, "2", *GPT_OSS, *EP2)),
    ("one", 4, "cp2_tp2", ("--training.local_batch_size", "8", *CP, "2", "--parallelism.tensor_parallel_degree", "2")),
    ("one_block", 4, "hsdp2_cp2_block", ("--training.local_batch_size", "4", *CP, "2", *BLOCK,
                                         "--parallelism.data_parallel_replicate_degree", "2")),
    ("one", 4, "hsdp2_cp2_accum_delay", ("--training.local_batch_size", "2", *CP, "2",
                                         "--parallelism.data_parallel_replicate_degree", "2",
                                         "--parallelism.gradient_sync", "delay_all_reduce")),
]  # fmt: skip


def test_same_losses_and_gradients_at_every_cp_topology(tmp_path):
    refs = [
        ("one", ("--training.local_batch_size", "8")),
        ("one_block", ("--training.local_batch_size", "8", *BLOCK)),
        ("one_moe", ("--training.local_batch_size", "8", *MOE)),
        ("one_gpt_oss", ("--training.local_batch_size", "8", *GPT_OSS)),
    ]
    results = run_distributed(_train, 1, str(tmp_path / "1"), refs)[0]
    for world in (2, 4):
        runs = [(name, argv) for _, w, name, argv in RUNS if w == world]
        results.update(run_distributed(_train, world, str(tmp_path / str(world)), runs)[0])
    assert results["one"][0] != results["one_block"][0]  # the masks differ
    for ref, _, name, _ in RUNS:
        (losses, grads, val), (ref_losses, ref_grads, ref_val) = results[name], results[ref]
        assert val.keys() == ref_val.keys() == {3, 6}
        for step in ref_val:  # validation splits its sequences over the cp ranks too
            assert abs(val[step] - ref_val[step]) < 1e-5, (name, step, val[step], ref_val[step])
        assert ref_losses[6] < ref_losses[1]
        for step in ref_losses:
            assert abs(losses[step] - ref_losses[step]) < 1e-5, (name, step, losses[step], ref_losses[step])
        for n in ref_grads:
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=f"{name}: {n}")


def _run(tmp, argv):
    return make_trainer(ckpt_argv(tmp, "--checkpoint.interval", "3", *argv)).train()


def _cp_runs(tmp, cp, resume):
    """At this cp degree in tmp: 6 steps saving at 3 and 6, and again from step 3 (exact resume); or (resume) from
    the step-3 checkpoint already in tmp to step 6."""
    argv = (*CP, str(cp), "--training.local_batch_size", "8", *BLOCK)
    if resume:
        return _run(tmp, argv)
    first = _run(tmp, argv)
    t = make_trainer(ckpt_argv(tmp, "--checkpoint.interval", "3", "--checkpoint.load_step", "3", *argv))
    again = t.train()
    # the mask as FlexAttention's block mask (what CUDA runs; forward only: it has no backward on the CPU)
    mb = t.dataloader.next_step().microbatches[0]
    with torch.no_grad():
        by_kernel = {}
        for kernel in ("sdpa", "flex"):
            t.model.attention_kernel = kernel
            by_kernel[kernel] = microbatch_loss(t.model, mb, t.device)[0].item()
    return first, again, by_kernel


def _from_step3(tmp_path, src, name):
    shutil.copytree(src / "checkpoint" / "step-3", tmp_path / name / "checkpoint" / "step-3")
    return str(tmp_path / name)


def test_exact_resume_and_checkpoints_that_do_not_depend_on_cp(tmp_path):
    first, again, by_kernel = run_distributed(_cp_runs, 2, str(tmp_path / "cp2"), 2, False)[0]
    for step in (4, 5, 6):
        assert again[step] == first[step]
    assert abs(by_kernel["flex"] - by_kernel["sdpa"]) < 1e-5 * by_kernel["sdpa"], by_kernel
    one = run_distributed(_cp_runs, 1, _from_step3(tmp_path, tmp_path / "cp2", "one"), 1, True)[0]  # CP(2) -> 1
    cp4 = run_distributed(_cp_runs, 4, _from_step3(tmp_path, tmp_path / "cp2", "cp4"), 4, True)[0]  # CP(2) -> CP(4)
    fresh = run_distributed(_cp_runs, 1, str(tmp_path / "fresh"), 1, False)[0][0]  # a checkpoint of one process
    back = run_distributed(_cp_runs, 2, _from_step3(tmp_path, tmp_path / "fresh", "back"), 2, True)[0]  # 1 -> CP(2)
    for step in (4, 5, 6):
        for name, losses in (("one", one), ("cp4", cp4), ("fresh", fresh), ("back", back)):
            assert abs(losses[step] - first[step]) < 1e-5, (name, step, losses[step], first[step])


def _eager_and_inductor(tmp):
    """CP(2): the losses of 2 steps eager, then with [compile] on inductor."""
    argv = ("--training.steps", "2", "--training.global_batch_size", "8", "--training.local_batch_size", "8", *CP, "2")
    eager = make_trainer(tiny_argv(f"{tmp}/eager", *argv)).train()
    inductor = ("--compile.enable", "--compile.backend", "inductor")
    return eager, make_trainer(tiny_argv(f"{tmp}/inductor", *argv, *inductor)).train()


def test_cp_with_inductor_compile_has_the_eager_losses(tmp_path):
    """CP(2) with [compile] (inductor): the blocks compiled, the loss computed by the model in chunks of this rank's
    tokens (a compiled loss took this rank's half of the logits against the whole sequence's labels: step 1
    crashed); the eager losses."""
    eager, compiled = run_distributed(_eager_and_inductor, 2, str(tmp_path))[0]
    assert eager.keys() == compiled.keys() == {1, 2}
    for step, loss in eager.items():
        assert abs(compiled[step] - loss) <= 1e-5 * abs(loss), (step, compiled[step], loss)
