"""Mixture of Experts at every topology (gloo, CPU): the same weights at step 0 and the same losses (fp32, 6 steps,
1e-5) in one process, under FSDP, EP, HSDP x EP with accumulation and the delayed all-reduce, TP x EP, with each
load-balancing mode, causal and block-causal, for Qwen3-MoE, DeepSeek-V3, GLM-4.5 and gpt-oss; exact resume with the
routing bias (DeepSeek-V3's correction bias), and resume at another EP degree; HF import, export and generation under
EP."""

from dataclasses import replace

import pytest
import torch

from helpers import assert_same_hf_weights, ckpt_argv, make_trainer, run_distributed, tiny_argv

pytestmark = pytest.mark.slow  # spawned gloo ranks

EP2 = ("--parallelism.expert_parallel_degree", "2")
TP2 = ("--parallelism.tensor_parallel_degree", "2")
REPLICATE2 = ("--parallelism.data_parallel_replicate_degree", "2")
STEPS = ("--training.steps", "6")  # the routing and the bias have moved by then (the suite's time budget)
BLOCK = ("--model.attention", "block_causal")


def _mode(name):
    return ("--moe.load_balance", name)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(tmp, runs):
    """Per run (name, argv): the logged losses, the step-0 full weights, the routing biases at the end, and every
    parameter's gradient of one more step (its optimizer step left out; Adam would hide a wrongly scaled gradient)."""
    out = {}
    for name, argv in runs:
        t = make_trainer(
            tiny_argv(f"{tmp}/{name}", "--model.name", "qwen3_moe", "--training.global_batch_size", "8", *STEPS, *argv)
        )
        init = {k: _full(v).clone() for k, v in t.model.state_dict().items()}
        losses = t.train()
        bias = {k: v.clone() for k, v in t.model.state_dict().items() if k.endswith("expert_bias")}
        t.optimizer.step, t.optimizer.zero_grad = (lambda *a, **k: None), (lambda *a, **k: None)
        data = t.dataloader.next_step()
        t.train_step(data.microbatches, data.global_valid_tokens)
        grads = {n: _full(p.grad).clone() for n, p in t.model.named_parameters()}
        out[name] = (losses, init, bias, grads)
    return out


# (reference, world, name, argv): every run's losses equal its reference's, one process with the same mode and mask
RUNS = [
    ("aux_loss", 2, "fsdp2", ("--training.local_batch_size", "4")),
    ("aux_free", 2, "ep2", ("--training.local_batch_size", "4", *EP2)),
    ("none", 2, "ep2_none", ("--training.local_batch_size", "4", *EP2)),
    ("aux_loss", 2, "tp2_ep2", ("--training.local_batch_size", "8", *TP2, *EP2)),
    ("block_causal", 2, "ep2_block_causal", ("--training.local_batch_size", "4", *EP2)),
    ("aux_loss", 4, "hsdp2x2_ep2_accum_delay",
     ("--training.local_batch_size", "1", *EP2, *REPLICATE2, "--parallelism.hsdp_delay_all_reduce")),
    ("none", 4, "fsdp2_tp2_ep2", ("--training.local_batch_size", "2", *TP2, *EP2)),
    # DeepSeek-V3 (multi-head latent attention, a dense first block, a shared expert, group-limited sigmoid routing
    # with a correction bias and a scaling factor) and GLM-4.5 (partial rotary, q/k/v biases, q/k norms)
    ("deepseek", 2, "deepseek_ep2", ("--training.local_batch_size", "4", *EP2)),
    ("deepseek", 2, "deepseek_tp2_ep2", ("--training.local_batch_size", "8", *TP2, *EP2)),
    ("glm", 2, "glm_tp2_ep2", ("--training.local_batch_size", "8", *TP2, *EP2)),
    ("deepseek", 4, "deepseek_fsdp4_ep2_accum", ("--training.local_batch_size", "1", *EP2)),
    ("deepseek", 4, "deepseek_hsdp2x2_ep2_accum_delay",
     ("--training.local_batch_size", "1", *EP2, *REPLICATE2, "--parallelism.hsdp_delay_all_reduce")),
    ("glm", 4, "glm_fsdp2_tp2_ep2", ("--training.local_batch_size", "2", *TP2, *EP2)),
    # gpt-oss (attention sinks, sliding-window and full blocks, q/k/v/o biases, a router with a bias, biased experts
    # with the clamped SwiGLU)
    ("gpt_oss", 2, "gpt_oss_ep2", ("--training.local_batch_size", "4", *EP2)),
    ("gpt_oss", 2, "gpt_oss_tp2_ep2", ("--training.local_batch_size", "8", *TP2, *EP2)),
    ("gpt_oss", 4, "gpt_oss_fsdp4_ep2_accum", ("--training.local_batch_size", "1", *EP2)),
    ("gpt_oss", 4, "gpt_oss_hsdp2x2_ep2_accum_delay",
     ("--training.local_batch_size", "1", *EP2, *REPLICATE2, "--parallelism.hsdp_delay_all_reduce")),
    ("block_causal", 4, "fsdp2_tp2_ep4_no_sp",
     ("--training.local_batch_size", "2", *TP2, "--parallelism.expert_parallel_degree", "4",
      "--parallelism.enable_sequence_parallel", "false")),
]  # fmt: skip
REFERENCES = {
    "aux_loss": _mode("aux_loss"),
    "aux_free": _mode("aux_free"),
    "none": _mode("none"),
    "block_causal": (*_mode("aux_loss"), *BLOCK),
    "deepseek": ("--model.name", "deepseek_v3", *_mode("aux_free")),
    "glm": ("--model.name", "glm4_moe", *_mode("aux_loss")),
    "gpt_oss": ("--model.name", "gpt_oss", *_mode("aux_loss")),
}


def test_same_weights_and_losses_at_every_topology_and_load_balancing_mode(tmp_path):
    single = [(ref, ("--training.local_batch_size", "8", *argv)) for ref, argv in REFERENCES.items()]
    results = run_distributed(_train, 1, str(tmp_path / "one"), single)[0]
    for world in (2, 4):
        runs = [(name, (*argv, *REFERENCES[ref])) for ref, w, name, argv in RUNS if w == world]
        results.update(run_distributed(_train, world, str(tmp_path / str(world)), runs)[0])
    assert results["aux_free"][0] != results["none"][0]  # the modes train differently
    for ref, _, name, _ in RUNS:
        (losses, init, bias, grads), (ref_losses, ref_init, ref_bias, ref_grads) = results[name], results[ref]
        assert ref_losses[6] < ref_losses[1], ref
        for k, v in ref_init.items():
            assert torch.equal(init[k], v), (name, k)  # an expert's weights do not depend on which rank holds it
        for step, loss in ref_losses.items():
            assert abs(losses[step] - loss) <= 1e-5 * loss, (name, step, losses[step], loss)
        for k, v in ref_bias.items():
            assert torch.allclose(bias[k], v, atol=1e-6), (name, k)
        for k, g in ref_grads.items():
            assert (grads[k] - g).abs().max() <= 1e-4 * g.abs().max(), (name, k)
    for moved in ("aux_free", "deepseek"):
        assert all(v.abs().max() > 0 for v in results[moved][2].values()), moved  # the bias moved
    assert all(v.abs().max() == 0 for v in results["none"][2].values())


def _resume(tmp, local, extra, save):
    # DeepSeek-V3 (its correction bias is the routing bias aux_free moves; latent attention; a dense first block)
    base = ckpt_argv(tmp, "--model.name", "deepseek_v3", "--training.local_batch_size", str(local), *_mode("aux_free"),
                     *extra)  # fmt: skip
    out = {}
    if save:
        t = make_trainer(base + ["--checkpoint.folder", "a", "--checkpoint.interval", "3"])
        out["losses"] = t.train()
        out["bias"] = {k: v.clone() for k, v in t.model.state_dict().items() if k.endswith("expert_bias")}
    t = make_trainer(base + ["--checkpoint.folder", "a", "--checkpoint.load_step", "3"])
    out["resumed"] = t.train()
    out["resumed_bias"] = {k: v.clone() for k, v in t.model.state_dict().items() if k.endswith("expert_bias")}
    return out


def _generate_in_one_process(step, caplog, *extra):
    """Greedy `generate --config <step>/job_config.toml --checkpoint <step>` in this process, and what it logged."""
    import logging

    from titanlite.cli.generate import run

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titanlite"):
        text = run(["--config", str(step / "job_config.toml"), "--checkpoint", str(step), "--temperature", "0",
                    "--max-new-tokens", "8", "--prompt", "ab", *extra])  # fmt: skip
    return text, caplog.text


def test_resume_is_exact_with_the_routing_bias_and_at_another_ep_degree(tmp_path, caplog):
    saved = run_distributed(_resume, 2, str(tmp_path), 2, EP2, True)[0]  # EP(2), accumulation 2
    # one process generates from the EP(2) checkpoint with the config it was saved with: EP dropped, saying so
    step = tmp_path / "a" / "step-3"
    text, log = _generate_in_one_process(step, caplog)
    assert "expert_parallel_degree = 2 is a training setting: generation runs without it" in log
    same, without = _generate_in_one_process(step, caplog, "--parallelism.expert_parallel_degree", "1")
    assert text == same and "is a training setting" not in without
    ref = saved["losses"]
    assert saved["resumed"] == {s: ref[s] for s in (4, 5, 6)}  # bit-identical on the same topology
    assert all(torch.equal(saved["resumed_bias"][k], v) for k, v in saved["bias"].items())
    for world, local, extra in ((1, 8, ()), (4, 2, ("--parallelism.expert_parallel_degree", "4")), (2, 4, ())):
        got = run_distributed(_resume, world, str(tmp_path), local, extra, False)[0]
        assert sorted(got["resumed"]) == [4, 5, 6]
        for s in (4, 5, 6):
            assert abs(got["resumed"][s] - ref[s]) <= 1e-5 * ref[s], (world, extra, s)
        for k, v in saved["bias"].items():
            assert torch.allclose(got["resumed_bias"][k], v, atol=1e-6), (world, extra, k)


def _hf_under_ep(folder, out, oss_folder):
    """A Qwen3-MoE HF folder imported under FSDP(2) x EP(2) (the full weights), exported back from there, and greedy
    generation with ep 2 in the config (generation gathers the experts instead); a gpt-oss folder in MXFP4 imported
    under FSDP(2) x EP(2) (each rank dequantizing its experts) and exported from there."""
    import torch.distributed as dist

    from titanlite.checkpoint.hf_io import save_hf_sharded
    from titanlite.config import load
    from titanlite.data.tokenizers import ByteTokenizer
    from titanlite.generation import generate, inference_model, load_weights
    from titanlite.parallel.dims import Meshes, ParallelDims
    from titanlite.runtime.distributed import init_distributed

    init_distributed()
    argv = tiny_argv(f"{out}/run", "--model.name", "qwen3_moe", "--model.flavor", "hf",
                     "--checkpoint.initial_load_path", folder, *EP2)  # fmt: skip
    t = make_trainer(argv + ["--training.local_batch_size", "4", "--training.global_batch_size", "16"])
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in t.model.state_dict().items()}
    save_hf_sharded(t.model, f"{out}/export", torch.float32, ByteTokenizer())
    cfg = load(argv)
    dims = ParallelDims.from_config(cfg.parallelism, dist.get_world_size())
    meshes = Meshes(dims.build_mesh("cpu"), expert=replace(dims, ep=1).build_expert_mesh("cpu"))
    model = inference_model(cfg, 258, torch.device("cpu"), meshes)
    load_weights(model, folder)
    tokens = generate(model, [1, 2, 3, 4, 5], 24)
    oss = make_trainer(tiny_argv(f"{out}/oss", "--model.name", "gpt_oss", "--model.flavor", "hf",
                                 "--checkpoint.initial_load_path", oss_folder, *EP2, "--training.local_batch_size", "4",
                                 "--training.global_batch_size", "16"))  # fmt: skip
    assert oss.model.layers[0].feed_forward.experts.w1.to_local().shape[0] == 1  # 4 experts over ep 2 x fsdp 2
    full_oss = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in oss.model.state_dict().items()}
    save_hf_sharded(oss.model, f"{out}/oss_export", torch.float32, ByteTokenizer())
    return (full, full_oss) if dist.get_rank() == 0 else None, tokens


def test_hf_import_export_and_generation_under_ep(tmp_path):
    from test_gpt_oss import _titanlite_from as gpt_oss_from
    from test_gpt_oss import mxfp4_folder
    from test_moe import _titanlite_from, hf_moe_model

    from titanlite.checkpoint.hf_io import save_hf_sharded
    from titanlite.data.tokenizers import ByteTokenizer
    from titanlite.generation import generate

    transformers = pytest.importorskip("transformers")
    hf_moe_model(tmp_path / "hf", "qwen3_moe")
    ref = _titanlite_from(tmp_path / "hf")
    save_hf_sharded(ref, tmp_path / "export1", torch.float32, ByteTokenizer())
    ref_tokens = generate(ref, [1, 2, 3, 4, 5], 24)
    mxfp4_folder(tmp_path / "oss")
    oss = gpt_oss_from(tmp_path / "oss")
    save_hf_sharded(oss, tmp_path / "oss_export1", torch.float32, ByteTokenizer())
    res = run_distributed(_hf_under_ep, 4, str(tmp_path / "hf"), str(tmp_path), str(tmp_path / "oss"))
    full, full_oss = res[0][0]
    for k, v in ref.state_dict().items():
        assert torch.equal(full[k], v), k
    for k, v in oss.state_dict().items():
        assert torch.equal(full_oss[k], v), k
    assert_same_hf_weights(tmp_path / "oss_export1", tmp_path / "oss_export")
    assert_same_hf_weights(tmp_path / "export1", tmp_path / "export")
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "export").eval()
    x = torch.randint(0, 300, (1, 50))
    with torch.no_grad():
        assert (back(x).logits - ref(x)).abs().max() < 1e-5
    assert all(tokens == ref_tokens for _, tokens in res)


def _eager_and_compiled(tmp, argv):
    out = {}
    for name, extra in (("eager", ()), ("compiled", ("--compile.enable", "--compile.backend", "aot_eager"))):
        torch._dynamo.reset()
        t = make_trainer(
            tiny_argv(f"{tmp}/{name}", "--model.name", "qwen3_moe", "--training.steps", "4", *argv, *extra)
        )
        out[name] = t.train()
    return out


def test_compile_with_experts_equals_eager(tmp_path):
    """[compile] on MoE blocks under TP(2) x EP(2): the experts run eagerly inside the compiled block (torch 2.13
    compiles _grouped_mm in bf16 only: its meta kernel refused fp32 under aot_eager and inductor alike), the losses
    are eager's."""
    argv = ("--training.global_batch_size", "8", "--training.local_batch_size", "8", *TP2, *EP2)
    res = run_distributed(_eager_and_compiled, 2, str(tmp_path), argv)[0]
    for step, loss in res["eager"].items():
        assert abs(res["compiled"][step] - loss) <= 1e-5 * loss, (step, res)
