"""LoRA at every topology (gloo, CPU): adapters start so that the model equals its base, the same losses (fp32,
6 steps, 1e-5) and adapter gradients in one process, FSDP(2), HSDP(2x2) with accumulation and the delayed
all-reduce, and TP(2); exact resume, resume at another topology, resume on another base refused; PEFT export
loaded by peft onto transformers' model equals the merged HF export and titanlite's own forward."""

import json
import shutil

import pytest
import torch
import torch.distributed as dist

from helpers import ckpt_argv, make_trainer, run_distributed, run_module, tiny_argv

pytestmark = pytest.mark.slow  # spawned gloo ranks

TP2 = ("--parallelism.tensor_parallel_degree", "2")
REPLICATE2 = ("--parallelism.data_parallel_replicate_degree", "2")


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _make_base(tmp):
    """A trained base: 3 steps of the tiny model, as DCP checkpoints (steps 1 to 3: each is another base) and a HF
    folder."""
    argv = ckpt_argv(
        f"{tmp}/base", "--training.steps", "3", "--checkpoint.interval", "1", "--checkpoint.last_save_in_hf"
    )
    make_trainer(argv).train()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_base")
    run_distributed(_make_base, 1, str(tmp))
    return tmp / "base" / "checkpoint"


def lora_argv(tmp, base_path, *extra):
    return tiny_argv(
        tmp,
        "--lora.enable",
        "true",
        "--lora.rank",
        "4",
        "--checkpoint.initial_load_path",
        str(base_path),
        "--training.global_batch_size",
        "8",
        "--training.steps",
        "6",  # the suite's time budget; a test that saves and resumes sets its own
        *extra,
    )


def _train(tmp, base_path, runs):
    """Per run (name, argv): logged losses, step-0 logits against the base's, every adapter's gradient of one more
    step (its optimizer step left out), and which parameters train."""
    out = {}
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    for name, argv in runs:
        t = make_trainer(lora_argv(f"{tmp}/{name}", base_path, *argv))
        with torch.no_grad():
            logits = _full(t.model(tokens)).clone()
        trainable = sorted(n for n, p in t.model.named_parameters() if p.requires_grad)
        losses = t.train()
        t.optimizer.step, t.optimizer.zero_grad = (lambda *a, **k: None), (lambda *a, **k: None)
        data = t.dataloader.next_step()
        t.train_step(data.microbatches, data.global_valid_tokens)
        grads = {n: _full(p.grad).clone() for n, p in t.model.named_parameters() if p.grad is not None}
        out[name] = (losses, logits, grads, trainable)
    return out


RUNS = [
    (2, "fsdp2", ("--training.local_batch_size", "4")),
    (2, "tp2", ("--training.local_batch_size", "8", *TP2)),
    (4, "hsdp2x2_accum_delay",
     ("--training.local_batch_size", "1", *REPLICATE2, "--parallelism.gradient_sync", "delay_all_reduce")),
    (2, "fsdp2_full_ac_compiled",
     ("--training.local_batch_size", "4", "--activation_checkpoint.mode", "full", "--compile.enable",
      "--compile.backend", "aot_eager")),
]  # fmt: skip
DROPOUT = [(2, "tp2_dropout", ("--training.local_batch_size", "8", *TP2, "--lora.dropout", "0.1"))]


def _one_process(tmp, base_path, runs):
    """_train's results, and the base's own logits (a run without LoRA from the same weights)."""
    out = _train(tmp, base_path, runs)
    t = make_trainer(tiny_argv(f"{tmp}/base_only", "--checkpoint.initial_load_path", str(base_path)))
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return out, _full(t.model(tokens)).clone()


def test_same_losses_at_every_topology_and_the_base_at_step_0(tmp_path, base):
    step3 = base / "step-3"
    one = [("one", ("--training.local_batch_size", "8"))]
    results, base_logits = run_distributed(_one_process, 1, str(tmp_path / "one"), step3, one)[0]
    for world in (2, 4):
        runs = [(name, argv) for w, name, argv in RUNS + DROPOUT if w == world]
        results.update(run_distributed(_train, world, str(tmp_path / str(world)), step3, runs)[0])
    ref_losses, ref_logits, ref_grads, trainable = results["one"]
    assert torch.equal(ref_logits, base_logits)  # B = 0: the adapted model is its base
    assert trainable and all(".lora_" in n for n in trainable)
    assert sorted(ref_losses) == list(range(1, 7)) and ref_losses[6] < ref_losses[1]
    dropped = results["tp2_dropout"][0]  # dropout draws its own masks: it trains, but not to the same numbers
    assert all(abs(dropped[s] - ref_losses[s]) < 0.5 for s in ref_losses) and dropped[6] != ref_losses[6]
    for _, name, _ in RUNS:
        losses, logits, grads, names = results[name]
        assert names == trainable, name
        torch.testing.assert_close(logits, base_logits, rtol=0, atol=1e-5)
        for step in ref_losses:
            assert abs(losses[step] - ref_losses[step]) < 1e-5, (name, step, losses[step], ref_losses[step])
        assert grads.keys() == ref_grads.keys(), name
        for n in grads:
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=f"{name}: {n}")


TOKENS = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))


def _resume_runs(tmp, base_path, other_base):
    """FSDP(2): 6 steps saving at 3 and 6; again from step 3 (exact resume); from step 3 under TP(2) (another
    topology); and on another base (refused). Returns the losses, the message of the refusal and the final
    logits of the first run."""
    from titanlite.errors import ConfigError

    ckpt = ("--checkpoint.enable", "--checkpoint.interval", "3", "--training.steps", "6")
    first = make_trainer(lora_argv(f"{tmp}/a", base_path, *ckpt, "--training.local_batch_size", "4"))
    losses = {"first": first.train()}
    with torch.no_grad():
        logits = _full(first.model(TOKENS)).clone()
    again = make_trainer(
        lora_argv(f"{tmp}/a", base_path, *ckpt, "--training.local_batch_size", "4", "--checkpoint.load_step", "3")
    )
    losses["again"] = again.train()
    for name in ("tp", "other_base"):
        if dist.get_rank() == 0:
            shutil.copytree(f"{tmp}/a/checkpoint/step-3", f"{tmp}/{name}/checkpoint/step-3")
        dist.barrier()
    losses["tp"] = make_trainer(
        lora_argv(f"{tmp}/tp", base_path, *ckpt, "--training.local_batch_size", "8", *TP2)
    ).train()
    try:
        make_trainer(lora_argv(f"{tmp}/other_base", other_base, *ckpt, "--training.local_batch_size", "4"))
        refusal = None
    except ConfigError as e:
        refusal = str(e)
    return losses, refusal, logits


def _start_from_peft(tmp, base_path, adapters):
    """Step-0 logits of an FSDP run whose adapters start from a peft folder (lora.initial_adapter_path)."""
    t = make_trainer(
        lora_argv(tmp, base_path, "--lora.initial_adapter_path", str(adapters), "--training.local_batch_size", "4")
    )
    with torch.no_grad():
        return _full(t.model(TOKENS)).clone()


def _folder_bytes(path):
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_resume_exports_and_peft(tmp_path, base, capsys):
    from titanlite.cli.checkpoint import main as export
    from titanlite.cli.generate import main as generate

    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    losses, refusal, logits = run_distributed(_resume_runs, 2, str(tmp_path), base / "step-3", base / "step-2")[0]
    for step in (4, 5, 6):
        assert losses["again"][step] == losses["first"][step]
        assert abs(losses["tp"][step] - losses["first"][step]) < 1e-5, (step, losses["tp"], losses["first"])
    assert refusal is not None and str(base / "step-2") in refusal and str(base / "step-3") in refusal
    step6 = tmp_path / "a" / "checkpoint" / "step-6"
    assert json.loads((step6 / "lora_base.json").read_text())["path"] == str((base / "step-3").resolve())
    assert _folder_bytes(step6) < 0.35 * _folder_bytes(base / "step-3")  # adapters + their optimizer state only

    for fmt in ("peft", "hf"):  # in this process (as the commands do): no process group
        assert export(["export", "--checkpoint", str(step6), "--format", fmt, "--output", str(tmp_path / fmt)]) == 0
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base / "hf-step-3", torch_dtype=torch.float32)
    with torch.no_grad():
        base_logits = hf_base.eval()(TOKENS).logits
    assert (base_logits - logits).abs().max() > 1e-3  # the adapters changed the model
    adapted = peft.PeftModel.from_pretrained(hf_base, tmp_path / "peft").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    with torch.no_grad():
        by_peft = adapted(TOKENS).logits
        by_merged = merged.eval()(TOKENS).logits
    torch.testing.assert_close(by_peft, logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(by_merged, logits, rtol=0, atol=1e-5)

    # a run that starts from the peft folder starts where the checkpoint ended (FSDP(2): each rank its shards)
    continued = run_distributed(_start_from_peft, 2, str(tmp_path / "from_peft"), base / "step-3", tmp_path / "peft")
    torch.testing.assert_close(continued[0], logits, rtol=0, atol=1e-6)

    # generate samples from base + adapters (unmerged, [lora] read from the checkpoint) as from the merged folder
    greedy = ("--prompt", "The cat", "--max-new-tokens", "12", "--temperature", "0")
    capsys.readouterr()
    assert generate(["--checkpoint", str(step6), "--model.flavor", "tiny", *greedy]) == 0
    lora = capsys.readouterr()
    assert generate(["--checkpoint", str(tmp_path / "hf"), *greedy]) == 0
    merged = capsys.readouterr()
    assert "holds LoRA adapters (rank 4, alpha 32.0)" in lora.err
    assert lora.out == merged.out and len(lora.out) > len("The cat")
    # and under TP(2) on two processes: each adapter follows its projection's split in the inference plan too
    split = run_module("titanlite.generate", "--nproc", "2", "--parallelism.tensor_parallel_degree", "2",
                       "--checkpoint", step6, "--model.flavor", "tiny", *greedy, timeout=300)  # fmt: skip
    assert split.returncode == 0, split.stderr[-3000:]
    assert lora.out.strip() in split.stdout, (split.stdout, lora.out)


def _moe_base_and_reference(tmp, moe):
    """A Qwen3-MoE base (2 steps), and the one-process LoRA run on it."""
    make_trainer(ckpt_argv(f"{tmp}/moe_base", "--model.name", "qwen3_moe", "--training.steps", "2")).train()
    base = f"{tmp}/moe_base/checkpoint/step-2"
    return _train(f"{tmp}/one", base, [("one", (*moe, "--training.local_batch_size", "8"))])


def _train_and_resume(tmp, base_path, runs, resumed):
    """_train's runs, and `resumed`'s argv run 6 steps saving at 3 then again from step 3 (its losses both times)."""
    out = _train(tmp, base_path, runs)
    ckpt = ("--checkpoint.enable", "--checkpoint.interval", "3", *resumed)
    first = make_trainer(lora_argv(f"{tmp}/resume", base_path, *ckpt)).train()
    again = make_trainer(lora_argv(f"{tmp}/resume", base_path, *ckpt, "--checkpoint.load_step", "3")).train()
    return out, (first, again)


def test_moe_expert_adapters_same_losses_under_expert_and_tensor_parallelism(tmp_path):
    """Qwen3-MoE with adapters on q/v and on every expert (grouped low-rank factors of the fused gate/up and the down
    stacks, models/expert_lora.py): the base's logits at step 0, and the same losses and adapter gradients in one
    process, at EP(2), TP(2) x EP(2) and FSDP(2) x EP(2); exact resume at EP(2)."""
    targets = ("--lora.targets", "q_proj,v_proj,experts.gate_up_proj,experts.down_proj")
    moe = ("--model.name", "qwen3_moe", "--moe.load_balance", "aux_free", *targets)
    one = run_distributed(_moe_base_and_reference, 1, str(tmp_path), moe)[0]["one"]
    moe_base = tmp_path / "moe_base" / "checkpoint" / "step-2"
    ep = (*moe, "--parallelism.expert_parallel_degree", "2")
    runs = [("ep2", (*ep, "--training.local_batch_size", "4")),
            ("tp2_ep2", (*ep, "--training.local_batch_size", "8", *TP2))]  # fmt: skip
    results, (first, again) = run_distributed(
        _train_and_resume, 2, str(tmp_path / "two"), moe_base, runs, (*ep, "--training.local_batch_size", "4")
    )[0]
    assert sorted(again) == [4, 5, 6] and all(again[s] == first[s] for s in again)  # bit for bit
    results |= run_distributed(
        _train, 4, str(tmp_path / "four"), moe_base, [("fsdp2_ep2", (*ep, "--training.local_batch_size", "2"))]
    )[0]
    ref, ref_logits, ref_grads, trainable = one
    assert {n.split(".")[2] for n in trainable} == {"attention", "feed_forward"}
    assert any(".experts.gate_up_proj.lora_a." in n for n in trainable)
    assert all(".lora_" in n for n in trainable) and ref[6] < ref[1]
    for name, (losses, logits, grads, names) in results.items():
        assert names == trainable, name
        assert torch.equal(logits, ref_logits) or (logits - ref_logits).abs().max() < 1e-5, name
        for step in ref:
            assert abs(losses[step] - ref[step]) < 1e-5, (name, step, losses[step], ref[step])
        for n in ref_grads:
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=f"{name}: {n}")
