"""QLoRA (lora.base_dtype = "nf4", torchao's NF4 tensor) on the CPU with gloo: the same losses and adapter gradients
(fp32, 1e-5) in one process, FSDP(2) from a DCP or a HF base, plain replication (2) and PP(2); exact resume; the
4-bit base differs from the full-precision one, by little; the merged HF export dequantizes it."""

import importlib.util
import json

import pytest
import torch

from helpers import ckpt_argv, make_trainer, run_distributed, run_module, tiny_argv

if importlib.util.find_spec("torchao") is None:  # the test extra installs it; an import here would be noisy
    pytest.skip("torchao is not installed", allow_module_level=True)

# The tiny model's smallest weight (k: 32 x 64) split over 2 ranks holds 1024 weights: blocks of 16 x 8 divide it.
NF4 = ("--lora.base_dtype", "nf4", "--lora.nf4_block_size", "16", "--lora.nf4_scaler_block_size", "8")
TOKENS = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_nf4_bits_and_what_is_quantized():
    from titanlite.config import load
    from titanlite.model_builder import build_model
    from titanlite.models.nf4 import local_nf4
    from titanlite.models.registry import model_args
    from titanlite.sizing.memory import nf4_bits

    assert abs(nf4_bits(64, 256, 4) - 4.127) < 1e-3  # QLoRA's figure for blocks of 64 and 256, fp32 factors
    cfg = load(["--model.name", "qwen3_moe", "--model.flavor", "tiny", "--lora.enable", "true", *NF4])
    args = model_args(cfg.model, 256, 32)
    model = build_model(cfg, args, None).model
    nf4 = {n for n, p in model.named_parameters() if local_nf4(p) is not None}
    assert nf4 and all(n.startswith("layers.") and n.endswith(".weight") for n in nf4)
    assert not any("router" in n or "lora_" in n or "norm" in n for n in nf4)
    assert "layers.0.attention.wq.weight" in nf4
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert nf4 <= frozen and all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)


def _llama_688():
    """Llama args whose MLP weights are [688 x 256] and [256 x 688]: no multiple of QLoRA's 64 x 256 weights."""
    from titanlite.models.args import ModelArgs

    return ModelArgs(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=258, multiple_of=16)


def test_default_nf4_blocks_fit_a_688_x_256_weight_from_its_shape_alone():
    from titanlite.models.nf4 import nf4_block_table, nf4_blocks, nf4_problem
    from titanlite.models.registry import model_class

    args = _llama_688()
    assert args.ffn_hidden_dim == 688
    with torch.device("meta"):
        model = model_class("llama3")(args)
    for shards in (1, 2, 4, 8, 16):  # every rank holds whole rows and whole scaler blocks of the same sizes
        assert nf4_problem(model, shards, 64, 256) is None, shards
    table = nf4_block_table(model, 64, 256)
    assert table["layers.0.feed_forward.w1.weight"] == [64, 172]  # 16 scaler blocks of 172 blocks of 64
    assert table["layers.0.feed_forward.w2.weight"] == [64, 43]
    assert nf4_blocks(4096, 4096, 64, 256) == (64, 256)  # QLoRA's sizes where they fit
    assert "[256 x 256]" in nf4_problem(model, 3, 64, 256) and "its 256 rows do not divide by 3" in nf4_problem(
        model, 3, 64, 256
    )


def _codes_and_losses(tmp, base, *extra):
    """A QLoRA run at the default block sizes on a HF base: this rank's NF4 codes of every weight, its losses, and
    (one process) the refusal of its resume once its lora_base.json records other sizes for the MLP's up weight."""
    from titanlite.errors import ConfigError
    from titanlite.models.nf4 import local_nf4

    argv = tiny_argv(tmp, "--model.flavor", "hf", "--checkpoint.initial_load_path", str(base), "--lora.enable", "true",
                     "--lora.rank", "4", "--lora.base_dtype", "nf4", "--training.steps", "2", "--checkpoint.enable",
                     "--checkpoint.interval", "2", "--training.global_batch_size", "8", *extra)  # fmt: skip
    t = make_trainer(argv)
    codes = {}
    for n, p in t.model.named_parameters():
        if (q := local_nf4(p)) is not None:
            inner = (q.quantized_data, q.quantized_scalers, q.quantization_factor, q.scaler_mean)
            codes[n] = ((q.block_size, q.scaler_block_size), *(x.clone() for x in inner))
    losses, refusal = t.train(), None
    if torch.distributed.get_world_size() == 1:
        record = json.loads((tmp / "checkpoint/step-2/lora_base.json").read_text())
        record["nf4_blocks"]["layers.0.feed_forward.w3.weight"] = [64, 86]
        (tmp / "checkpoint/step-2/lora_base.json").write_text(json.dumps(record))
        try:
            make_trainer([*argv, "--training.steps", "3"])
        except ConfigError as e:
            refusal = str(e)
    return codes, losses, refusal


@pytest.mark.slow
def test_qlora_at_default_blocks_quantizes_a_688_x_256_weight_alike_at_one_process_and_fsdp2(tmp_path):
    transformers = pytest.importorskip("transformers")
    args = _llama_688()
    config = transformers.LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=688,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    one, losses, refusal = run_distributed(_codes_and_losses, 1, tmp_path / "one", tmp_path / "base")[0]
    two = run_distributed(_codes_and_losses, 2, tmp_path / "two", tmp_path / "base", "--training.local_batch_size", "4")
    w1 = "layers.0.feed_forward.w1.weight"
    assert one[w1][0] == (64, 172) and one["layers.0.feed_forward.w2.weight"][0] == (64, 43)
    assert one.keys() == two[0][0].keys() == two[1][0].keys() and len(one) == 7
    for name, (blocks, data, scalers, factors, mean) in one.items():
        (b0, *half0), (b1, *half1) = two[0][0][name], two[1][0][name]
        assert b0 == b1 == blocks, name
        for whole, a, b in zip((data, scalers, factors), half0, half1):  # each rank: its rows' codes, whole blocks
            assert torch.equal(torch.cat([a, b]), whole), name
        assert torch.equal(half0[3], mean) and torch.equal(half1[3], mean), name
    for step in losses:
        assert abs(two[0][1][step] - losses[step]) < 1e-5, (step, two[0][1][step], losses[step])
    recorded = json.loads((tmp_path / "two/checkpoint/step-2/lora_base.json").read_text())["nf4_blocks"]
    assert recorded[w1] == [64, 172] and len(recorded) == 7
    assert "quantized layers.0.feed_forward.w3.weight in blocks of [64, 86]" in refusal, refusal
    assert "this version quantizes it in blocks of [64, 172]" in refusal, refusal


def _make_base(tmp):
    make_trainer(
        ckpt_argv(f"{tmp}/base", "--training.steps", "3", "--checkpoint.interval", "3", "--checkpoint.last_save_in_hf")
    ).train()


def _argv(tmp, base, *extra):
    return tiny_argv(
        tmp, "--lora.enable", "true", "--lora.rank", "4", "--checkpoint.initial_load_path", str(base),
        "--training.global_batch_size", "8", "--training.steps", "6", *extra,
    )  # fmt: skip


def _runs(tmp, base, runs, resume=()):
    """Per run (name, argv): losses, step-0 logits and every adapter's gradient of one more step; with resume (the
    argv of a run): its losses saving at 3 and 6, and again from step 3."""
    out = {}
    for name, argv in runs:
        t = make_trainer(_argv(f"{tmp}/{name}", base, *argv))
        logits = None
        if not getattr(t.model, "pipeline_part", False):  # a pipeline rank's model holds its stages only
            with torch.no_grad():
                logits = _full(t.model(TOKENS)).clone()
        losses = t.train()
        t.optimizer.step, t.optimizer.zero_grad = (lambda *a, **k: None), (lambda *a, **k: None)
        data = t.dataloader.next_step()
        t.train_step(data.microbatches, data.global_valid_tokens)
        grads = {n: _full(p.grad).clone() for n, p in t.model.named_parameters() if p.grad is not None}
        out[name] = (losses, logits, grads)
    if resume:
        ckpt = ("--checkpoint.enable", "--checkpoint.interval", "3", *resume)
        out["first"] = make_trainer(_argv(f"{tmp}/resume", base, *ckpt)).train()
        out["again"] = make_trainer(_argv(f"{tmp}/resume", base, *ckpt, "--checkpoint.load_step", "3")).train()
        from titanlite.errors import ConfigError

        try:  # the adapters on a full-precision base: another model under them
            make_trainer(_argv(f"{tmp}/resume", base, *ckpt, "--lora.base_dtype", "float32"))
            out["refusal"] = None
        except ConfigError as e:
            out["refusal"] = str(e)
    return out


@pytest.mark.slow
def test_qlora_same_losses_at_every_topology_exact_resume_and_export(tmp_path):
    run_distributed(_make_base, 1, str(tmp_path))
    dcp_base, hf_base = tmp_path / "base/checkpoint/step-3", tmp_path / "base/checkpoint/hf-step-3"
    half = ("--training.local_batch_size", "4")
    results = run_distributed(_runs, 1, str(tmp_path / "one"), dcp_base, [("lora", ()), ("one", NF4)])[0]
    two = [
        ("fsdp2", (*NF4, *half)),
        ("fsdp2_hf_base", (*NF4, *half, "--checkpoint.initial_load_path", str(hf_base))),
        ("replicate2", (*NF4, *half, "--parallelism.data_parallel_replicate_degree", "2")),
        ("pp2", (*NF4, "--parallelism.pipeline_parallel_degree", "2")),
    ]
    results.update(run_distributed(_runs, 2, str(tmp_path / "two"), dcp_base, two, (*NF4, *half))[0])
    ref_losses, ref_logits, ref_grads = results["one"]
    lora_losses, lora_logits, _ = results["lora"]
    # the 4-bit base is another model than its full-precision self, by little
    assert 1e-5 < (ref_logits - lora_logits).abs().max() < 0.05
    assert all(1e-6 < abs(ref_losses[s] - lora_losses[s]) < 0.01 for s in ref_losses)
    for name, _ in two:
        losses, logits, grads = results[name]
        for step in ref_losses:
            assert abs(losses[step] - ref_losses[step]) < 1e-5, (name, step, losses[step], ref_losses[step])
        if name != "pp2":
            torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
            assert grads.keys() == ref_grads.keys(), name
        for n in grads:
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=f"{name}: {n}")
    first, again = results["first"], results["again"]
    assert sorted(again) == [4, 5, 6] and all(again[s] == first[s] for s in again)
    assert "lora.base_dtype = 'float32'" in results["refusal"] and "lora.base_dtype = 'nf4'" in results["refusal"]

    # export --format hf merges the adapters into the dequantized 4-bit base
    out = tmp_path / "merged"
    step = tmp_path / "two/resume/checkpoint/step-6"
    r = run_module("titanlite.checkpoint", "export", "--checkpoint", step, "--format", "hf", "--output", out)
    assert r.returncode == 0, r.stderr
    assert "nf4" in r.stdout + r.stderr
    merged = run_distributed(_merged_logits, 1, str(tmp_path / "check"), out)[0]
    torch.testing.assert_close(merged, _resumed_logits_reference(tmp_path, dcp_base, step), rtol=0, atol=1e-4)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"

    # generate samples from the 4-bit base + adapters (dequantized as training saw it) as from the merged folder
    greedy = ("--prompt", "The cat", "--max-new-tokens", "12", "--temperature", "0")
    qlora = run_module("titanlite.generate", "--checkpoint", step, "--model.flavor", "tiny", *greedy)
    merged_out = run_module("titanlite.generate", "--checkpoint", out, *greedy)
    assert qlora.returncode == 0 and merged_out.returncode == 0, (qlora.stderr[-2000:], merged_out.stderr[-2000:])
    assert "nf4" in qlora.stderr and qlora.stdout == merged_out.stdout and len(qlora.stdout) > len("The cat")


def _merged_logits(tmp, folder):
    t = make_trainer(tiny_argv(tmp, "--checkpoint.initial_load_path", str(folder), "--model.flavor", "hf"))
    with torch.no_grad():
        return _full(t.model(TOKENS)).clone()


def _resumed_logits_reference(tmp_path, base, step):
    """Logits of the QLoRA model with the adapters of `step` (one process: resumed, no step run)."""
    return run_distributed(_logits_at, 1, str(tmp_path / "ref"), base, step)[0]


def _logits_at(tmp, base, step):
    import shutil

    shutil.copytree(step, f"{tmp}/checkpoint/step-6")
    t = make_trainer(_argv(tmp, base, *NF4, "--checkpoint.enable"))
    with torch.no_grad():
        return _full(t.model(TOKENS)).clone()


DEBUG = [
    "--model.flavor", "debugmodel", "--training.seq_len", "64", "--training.local_batch_size", "4",
    "--training.global_batch_size", "4", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "5",
]  # fmt: skip


def _curves(tmp):
    """The debug model: a base of 30 steps, then 100 steps of LoRA r8 on its bf16 base and on its nf4 base."""
    make_trainer([*DEBUG, "--job.dump_folder", f"{tmp}/base", "--training.steps", "30", "--optimizer.lr", "3e-3",
                  "--checkpoint.enable", "--checkpoint.interval", "30"]).train()  # fmt: skip
    out = {}
    for base_dtype in ("bfloat16", "nf4"):
        out[base_dtype] = make_trainer([
            *DEBUG, "--job.dump_folder", f"{tmp}/{base_dtype}", "--training.steps", "100", "--optimizer.lr", "1e-3",
            "--lora.enable", "true", "--lora.rank", "8", "--training.mixed_precision_param", "bfloat16",
            "--lora.base_dtype", base_dtype, "--checkpoint.initial_load_path", f"{tmp}/base/checkpoint/step-30",
        ]).train()  # fmt: skip
    return out


@pytest.mark.slow
def test_qlora_loss_curve_follows_bf16_lora_over_100_debug_steps(tmp_path):
    """Within 1.5% at every step and 0.5% over the last ten (docs/lora.md says why; measured: 0.33% and 0.03%)."""
    curves = run_distributed(_curves, 1, str(tmp_path))[0]
    bf16, nf4 = curves["bfloat16"], curves["nf4"]
    assert sorted(nf4) == sorted(bf16) == list(range(1, 101))
    for step in bf16:
        assert abs(nf4[step] / bf16[step] - 1) < 0.015, (step, nf4[step], bf16[step])
    last = [s for s in bf16 if s > 90]
    assert abs(sum(nf4[s] for s in last) / sum(bf16[s] for s in last) - 1) < 0.005
    assert nf4 != bf16  # the 4-bit base is not the bf16 one
