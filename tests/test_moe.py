"""Mixture of Experts in one process: Qwen3-MoE and Mixtral logits and load-balancing loss equal to transformers' own
classes, HF folders in and out with per-expert names, the published shapes, active-parameter FLOPs, the routing bias,
KV-cache generation. The parity at every topology is in test_moe_parallel.py."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

VOCAB = 300


def hf_moe_model(folder, family: str, norm_topk_prob: bool = True, seed: int = 0, shard: str = "60KB"):
    """A random transformers MoE model saved with save_pretrained in several files: decisive routers (router weights
    far from zero) and norms away from 1, so that a wrong mapping or a wrong routing shows in the logits."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        bos_token_id=256,
        eos_token_id=257,
        num_experts_per_tok=2,
    )
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, num_experts=8, head_dim=16,
            norm_topk_prob=norm_topk_prob, router_aux_loss_coef=0.004,
        )  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(**common, intermediate_size=48, num_local_experts=4, sliding_window=None)
        model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.eval().save_pretrained(folder, max_shard_size=shard)
    return model


def _titanlite_from(folder):
    from titanlite.checkpoint.hf_io import load_hf_weights
    from titanlite.models.decoder import Transformer
    from titanlite.models.registry import hf_args

    model = Transformer(hf_args(folder))
    load_hf_weights(model, folder)
    return model.eval()


@pytest.mark.parametrize(
    "family, norm_topk_prob", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)], ids=str
)
def test_logits_and_aux_loss_equal_transformers_and_export_loads_back(tmp_path, family, norm_topk_prob):
    from titanlite.checkpoint.hf_io import save_hf_sharded
    from titanlite.data.tokenizers import ByteTokenizer

    hf = hf_moe_model(tmp_path / "hf", family, norm_topk_prob)
    names = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(names.values())) > 1 and any(".experts.1." in n for n in names)  # per expert, several files
    ours = _titanlite_from(tmp_path / "hf")
    a = ours.args
    assert (a.family, a.n_experts, a.top_k, a.norm_topk_prob) == (
        family, 8 if family == "qwen3_moe" else 4, 2, norm_topk_prob,
    )  # fmt: skip
    x = torch.randint(0, VOCAB, (2, 120), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(x).logits
        assert expected.std() > 0.1
        assert (ours(x) - expected).abs().max() < 1e-5
    # the load-balancing loss of one sequence is transformers' (ours is taken per sequence: see models/moe.py)
    ours.set_load_balance("aux_loss")
    ref = hf(x[:1], output_router_logits=True).aux_loss
    ours(x[:1])
    assert abs(ours.aux_loss_sum.item() - ref.item()) < 1e-5 * ref.item()
    assert a.router_aux_loss_coef == (0.004 if family == "qwen3_moe" else hf.config.router_aux_loss_coef)

    save_hf_sharded(ours, tmp_path / "out", torch.float32, ByteTokenizer(), max_file_bytes=60_000)
    back = type(hf).from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (back(x).logits - expected).abs().max() < 1e-5


def test_published_shapes_and_parameter_counts():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B active; Qwen3-235B-A22B: 235B, 22B active (Qwen's model cards)."""
    from titanlite.models.qwen3_moe import QWEN3_MOE_FLAVORS

    for flavor, total, active in (("30B-A3B", 30.5e9, 3.3e9), ("235B-A22B", 235e9, 22e9)):
        counts = QWEN3_MOE_FLAVORS[flavor].param_counts()
        assert abs(counts["total"] / total - 1) < 0.01 and abs(counts["active"] / active - 1) < 0.02, (flavor, counts)
    a = QWEN3_MOE_FLAVORS["30B-A3B"]
    assert (a.dim, a.n_layers, a.n_heads, a.kv_heads, a.head_dim, a.n_experts, a.top_k, a.moe_hidden_dim) == (
        2048, 48, 32, 4, 128, 128, 8, 768,
    )  # fmt: skip


def test_flops_count_active_parameters_only():
    """TorchTitan's HF backend counted every expert (192.9e9 FLOPs/token for 30B-A3B against 37.6e9 native, #4300)."""
    from titanlite.flops import flops_per_token
    from titanlite.models.qwen3_moe import QWEN3_MOE_FLAVORS

    a = QWEN3_MOE_FLAVORS["30B-A3B"]
    per_token = flops_per_token(a, 8192)  # the sequence length of that measurement
    every_expert = 6 * a.param_counts()["non_embedding"]
    assert per_token < every_expert / 4
    assert abs(per_token / 37.6e9 - 1) < 0.1, per_token  # TorchTitan's native figure for 30B-A3B


def test_grouped_experts_equal_a_loop_over_experts():
    """torch._grouped_mm over tokens sorted by expert equals each expert's SwiGLU on its own tokens (fp32)."""
    import torch.nn.functional as F

    from titanlite.models.moe import GroupedExperts

    g = torch.Generator().manual_seed(0)
    experts = GroupedExperts(4, 16, 24)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 16, generator=g)
    out = experts(x, counts)
    start = 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start : start + n]
        ref = (F.silu(xe @ experts.w1[e]) * (xe @ experts.w3[e])) @ experts.w2[e]
        assert torch.allclose(out[start : start + n], ref, atol=1e-5), e
        start += n


def test_the_routing_bias_moves_against_the_load_and_chooses_experts():
    """aux_free: the bias of an over-loaded expert goes down, of an idle one up (centred), by the update rate; it
    changes which experts are chosen, not how their outputs are weighted."""
    from titanlite.models.moe import MoE, update_load_balance

    moe = MoE(dim=8, n_experts=4, top_k=1, hidden=8, norm_topk_prob=True)
    moe.tokens_per_expert.copy_(torch.tensor([10.0, 0.0, 3.0, 3.0]))
    stats = update_load_balance([moe], bias_rate=0.01, want_stats=True)
    assert torch.allclose(moe.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]) - 0.005)
    assert torch.equal(moe.tokens_per_expert, torch.zeros(4)) and abs(stats["max_over_mean"].item() - 10 / 4) < 1e-6
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_()
        moe.router.weight.zero_()  # every expert equally likely: the bias alone decides
        moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 1.0, 0.0]))
        moe(torch.randn(1, 5, 8))
    assert moe.last_counts.tolist() == [0, 0, 5, 0]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_kv_cache_greedy_equals_no_cache(family):
    from titanlite.generation import generate
    from titanlite.models.decoder import Transformer
    from titanlite.models.registry import FAMILIES

    model = Transformer(FAMILIES[family].flavors["tiny"].with_overrides(vocab_size=258)).eval()
    model.init_weights(0)
    prompt = [1, 2, 3, 4, 5]
    assert generate(model, prompt, 24) == generate(model, prompt, 24, kv_cache=False)


def test_load_balance_in_the_step_line_and_tensorboard(tmp_path):
    from titanlite.metrics import format_step_line

    from helpers import make_trainer, tiny_argv

    t = make_trainer(
        tiny_argv(tmp_path, "--model.name", "qwen3_moe", "--training.steps", "2", "--metrics.enable_tensorboard")
    )
    data = t.dataloader.next_step()
    out = t.train_step(data.microbatches, data.global_valid_tokens)
    moe = t.balance.report(out.moe)
    assert moe["busiest_over_mean"] >= 1.0 and 0 <= moe["busiest_layer"] < 2 and moe["aux_loss"] > 0
    line = format_step_line(t.metrics.collect(1, 5.0, 1.0, 1e-3, moe))
    assert f"moe: busiest {moe['busiest_over_mean']:.2f}x mean (layer {moe['busiest_layer']})" in line
    assert "aux: " in line
    assert {"moe/busiest_over_mean", "moe/aux_loss"} <= set(t.metrics.collect(1, 5.0, 1.0, 1e-3, moe).scalars())


def test_an_export_says_it_leaves_the_routing_bias_out(tmp_path, caplog):
    """aux_free's bias is not part of Qwen3MoeForCausalLM: the export says so (and writes no such tensor)."""
    import logging

    from safetensors.torch import load_file

    from titanlite.checkpoint.hf_io import save_hf_sharded
    from titanlite.data.tokenizers import ByteTokenizer
    from titanlite.models.decoder import Transformer
    from titanlite.models.qwen3_moe import QWEN3_MOE_FLAVORS

    model = Transformer(QWEN3_MOE_FLAVORS["tiny"].with_overrides(vocab_size=258))
    model.init_weights(0)
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        save_hf_sharded(model, tmp_path / "zero", torch.float32, ByteTokenizer())
    assert "routing bias" not in caplog.text
    model.layers[1].feed_forward.expert_bias[2] = 0.01
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        save_hf_sharded(model, tmp_path / "moved", torch.float32, ByteTokenizer())
    assert "the routing bias learned with [moe] load_balance = 'aux_free'" in caplog.text
    assert not any("bias" in k for f in (tmp_path / "moved").glob("*.safetensors") for k in load_file(f))
