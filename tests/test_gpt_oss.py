"""gpt-oss in one process: logits of random folders saved by transformers equal GptOssForCausalLM's (attention sinks,
sliding-window blocks past their window, q/k/v/o biases, a router with a bias, biased experts with the clamped
SwiGLU, YaRN), greedy generation (KV cache and not) is transformers', exports load back; the MXFP4 experts of
published folders dequantize as transformers' own dequantization and load to the same logits; attention with sinks
equals the softmax with a sink column (values and gradients); the published shapes and counts. The parity at every
topology is in test_moe_parallel.py."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

from test_frontier_moe import _titanlite_from  # noqa: E402  (after the skips: it needs transformers too)

VOCAB = 300
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}  # fmt: skip


def hf_gpt_oss(folder, seed: int = 0, **sizes):
    """A random GptOssForCausalLM saved in several files: decisive routers, and norms, biases and sinks away from
    their init, so that a wrong mapping, mask or routing shows in the logits."""
    torch.manual_seed(seed)
    config = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                  max_position_embeddings=256, rope_parameters=YARN, bos_token_id=256, eos_token_id=257,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"]) | sizes  # fmt: skip
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.5)
    model.eval().save_pretrained(folder, max_shard_size="60KB")
    return model


CASES = {
    "gpt_oss": {},
    "all_full_attention": {"layer_types": ["full_attention"] * 3},
}


@pytest.mark.parametrize(
    "case",
    ["gpt_oss", pytest.param("all_full_attention", marks=pytest.mark.slow)],  # the fast loop: one case
)
def test_logits_generation_and_export_equal_transformers(tmp_path, case):
    from titanlite.checkpoint.hf_io import save_hf_sharded
    from titanlite.data.tokenizers import ByteTokenizer
    from titanlite.generation import generate

    hf = hf_gpt_oss(tmp_path / "hf", **CASES[case])
    ours = _titanlite_from(tmp_path / "hf")
    a = ours.args
    sliding = () if case == "all_full_attention" else (0, 2)
    assert (a.family, a.sliding_layers, a.sliding_window, a.attention_sinks, a.out_bias) == (
        "gpt_oss", sliding, 4, True, True,
    )  # fmt: skip
    x = torch.randint(0, VOCAB, (2, 90), generator=torch.Generator().manual_seed(1))  # past the window and YaRN's 64
    with torch.no_grad():
        expected = hf(x).logits
        assert expected.std() > 0.1
        assert (ours(x) - expected).abs().max() < 1e-5
    prompt = [1, 2, 3, 4, 5, 6, 7]
    tokens = generate(ours, prompt, 12)  # the cache grows past the window
    assert tokens == generate(ours, prompt, 12, kv_cache=False)
    with torch.no_grad():
        assert tokens == hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 7:].tolist()

    save_hf_sharded(ours, tmp_path / "out", torch.float32, ByteTokenizer(), max_file_bytes=60_000)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["layer_types"] == hf.config.layer_types
    back = type(hf).from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (back(x).logits - expected).abs().max() < 1e-5


def test_the_per_expert_loop_equals_the_grouped_matmuls(monkeypatch):
    """Biased experts with the clamped SwiGLU, one expert after another (sizes torch._grouped_mm does not take):
    the grouped matmuls' logits and gradients."""
    from titanlite.models import moe
    from titanlite.models.decoder import Transformer
    from titanlite.models.registry import FAMILIES

    model = Transformer(FAMILIES["gpt_oss"].flavors["tiny"].with_overrides(vocab_size=VOCAB))
    model.init_weights(0)
    for m in moe.moe_layers(model):
        for b in (m.experts.b1, m.experts.b3, m.experts.b2):
            b.data.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(b.numel()))
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for grouped in (True, False):
        monkeypatch.setattr(moe, "grouped_mm_takes", lambda *a, grouped=grouped: grouped)
        model.zero_grad()
        logits = model(tokens)
        logits.square().mean().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = results
    assert (a - b).abs().max() < 1e-5
    for name, g in ga.items():
        assert (g - gb[name]).abs().max() <= 1e-5 * max(g.abs().max(), 1e-3), name


def _with_sink_column(q, k, v, sinks, mask):
    """transformers' eager attention with sinks: the sink's logit appended to each row, dropped after the softmax."""
    k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1] @ v


@pytest.mark.parametrize("kind", ["causal", "sliding_mask", "one_cached_query"])
def test_attention_with_sinks_equals_the_softmax_with_a_sink_column(kind):
    """Values and the gradients of q, k, v and the sinks (SDPA's virtual sink key, models/sinks.py)."""
    from titanlite.models.args import ModelArgs
    from titanlite.models.layer_masks import layer_masks
    from titanlite.models.sinks import attend_with_sinks

    g = torch.Generator().manual_seed(0)
    n = 1 if kind == "one_cached_query" else 12
    q = torch.randn(2, 4, n, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 12, 16, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=g, requires_grad=True)
    queries = torch.arange(12 - n, 12)[:, None]
    near = torch.arange(12)[None, :] <= queries
    if kind == "sliding_mask":
        args = ModelArgs(sliding_window=5, sliding_layers=(0,), attention_sinks=True)
        near &= torch.arange(12)[None, :] > queries - 5
        ours = attend_with_sinks(q, k, v, sinks, layer_masks(args, None, torch.arange(12), 12, torch.float32).sliding)
    else:
        ours = attend_with_sinks(q, k, v, sinks, causal=kind == "causal")
    expected = _with_sink_column(q, k, v, sinks, near)
    assert (ours - expected).abs().max() < 1e-6
    probe = torch.randn(expected.shape, generator=g)
    grads = torch.autograd.grad((ours * probe).sum(), (q, k, v, sinks))
    for got, want in zip(grads, torch.autograd.grad((expected * probe).sum(), (q, k, v, sinks)), strict=True):
        assert (got - want).abs().max() < 1e-5


def test_block_causal_with_sliding_windows_and_sinks_is_each_document_alone():
    """Documents packed in one sequence: each one's logits are those of the document run alone."""
    from titanlite.models.decoder import Transformer
    from titanlite.models.registry import FAMILIES

    model = Transformer(FAMILIES["gpt_oss"].flavors["tiny"].with_overrides(vocab_size=VOCAB, attention="block_causal"))
    model.init_weights(0)
    tokens = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(12), torch.arange(8)])[None]
    with torch.no_grad():
        packed = model(tokens, positions)
        alone = torch.cat([model(tokens[:, :12]), model(tokens[:, 12:])], dim=1)
    assert (packed - alone).abs().max() < 1e-5


def _mxfp4(shape, generator):
    """Random MXFP4 blocks and scales for a [experts, rows, cols] weight: every 4-bit code, scales around 2^-4."""
    e, rows, cols = shape
    blocks = torch.randint(0, 256, (e, cols, rows // 32, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(119, 127, (e, cols, rows // 32), generator=generator, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_dequantization_is_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from titanlite.checkpoint.hf_fused_experts import dequantize_mxfp4

    blocks, scales = _mxfp4((3, 64, 48), torch.Generator().manual_seed(0))
    scales[0, 0, 0], scales[1, 2, 1] = 0, 255  # the extreme exponents
    for dtype in (torch.float32, torch.bfloat16):
        expected = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
        ours = dequantize_mxfp4(blocks, scales, dtype)
        assert ours.shape == (3, 64, 48) and ours.dtype == dtype
        assert torch.equal(ours, expected)


def mxfp4_folder(folder, seed: int = 0):
    """A random gpt-oss folder as gpt-oss is published (its experts in MXFP4, quantization_config mxfp4), and the
    transformers model holding the dequantized weights (transformers' own dequantization)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = hf_gpt_oss(folder, seed)
    g = torch.Generator().manual_seed(seed + 1)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    for path in folder.glob("*.safetensors"):
        tensors = load_file(path)
        for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
            blocks, scales = _mxfp4(tensors.pop(name).shape, g)
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            file = index["weight_map"].pop(name)
            index["weight_map"].update({name + "_blocks": file, name + "_scales": file})
            hf.get_parameter(name).data.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
        save_file(tensors, path, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))
    return hf


def test_an_mxfp4_folder_loads_its_experts_dequantized(tmp_path):
    """Its logits are those of the model holding the dequantized weights."""
    hf = mxfp4_folder(tmp_path / "hf")
    ours = _titanlite_from(tmp_path / "hf")
    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(x).logits
        assert (ours(x) - expected).abs().max() < 1e-5


@pytest.mark.parametrize("flavor, total, active", [("20B", 20.9e9, 3.61e9), ("120B", 116.8e9, 5.13e9)])
def test_published_shapes_and_parameter_counts(flavor, total, active):
    """The model cards' counts: 20.9B total / 3.61B active and 116.8B / 5.13B (active: without the embedding)."""
    from titanlite.models.registry import FAMILIES

    a = FAMILIES["gpt_oss"].flavors[flavor]
    counts = a.param_counts()
    assert abs(counts["total"] / total - 1) < 0.005
    assert abs((counts["active"] - a.vocab_size * a.dim) / active - 1) < 0.005
    assert a.sliding_layers == tuple(range(0, a.n_layers, 2)) and a.sliding_window == 128


def test_flops_count_each_sliding_block_over_its_window():
    from titanlite.models.registry import FAMILIES

    a = FAMILIES["gpt_oss"].flavors["20B"]
    attention = 6 * 64 * (64 + 64) * (12 * 4096 + 12 * 128)
    assert a.flops_per_token(4096) == 6 * a.param_counts()["active_non_embedding"] + attention


@pytest.mark.slow  # two trainers and an export process
def test_exact_resume_and_the_export_command_from_a_checkpoint(tmp_path):
    """6 steps saving at 3, resumed from step 3 bit for bit (biased experts, sinks); the export command writes the
    step-6 checkpoint as a folder GptOssForCausalLM loads, with the trained model's logits."""
    import torch.distributed as dist

    from helpers import ckpt_argv, make_trainer, run_module

    argv = ckpt_argv(tmp_path, "--model.name", "gpt_oss", "--checkpoint.interval", "3", "--moe.load_balance",
                     "aux_loss", "--training.local_batch_size", "8")  # fmt: skip
    try:
        first = make_trainer(argv)
        losses = first.train()
        model = first.model
        dist.destroy_process_group()
        again = make_trainer(argv + ["--checkpoint.load_step", "3"]).train()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert sorted(again) == [4, 5, 6] and all(again[s] == losses[s] for s in again)
    out = tmp_path / "export"
    r = run_module("titanlite.checkpoint", "export", "--checkpoint", tmp_path / "checkpoint" / "step-6", "--output",
                   out, "--format", "hf", "--max-shard-size", "60000")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    hf = transformers.GptOssForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, model.args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(x).logits - model.eval()(x)).abs().max() < 1e-5
