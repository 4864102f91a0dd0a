"""DeepSeek-V3 (Kimi K2, Moonlight) and GLM-4.5 in one process: logits of random folders saved by transformers equal
DeepseekV3ForCausalLM's and Glm4MoeForCausalLM's (multi-head latent attention with and without q_lora_rank, DeepSeek's
YaRN softmax scale, decisive group-limited sigmoid routing with a non-zero correction bias, shared experts, dense
first blocks, partial rotary, q/k/v biases, q/k norms), exports load back, greedy generation (KV cache and not) is
transformers'; Qwen3-MoE's dense blocks (mlp_only_layers, decoder_sparse_step); multi-token-prediction weights
not loaded; the published shapes and counts. The parity at every topology is in test_moe_parallel.py."""

import json
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

VOCAB = 300
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}  # fmt: skip


def hf_frontier_model(folder, family: str, seed: int = 0, **sizes):
    """A random transformers model of the family saved in several files: decisive routers, a non-zero correction
    bias, norms away from 1 and non-zero biases, so that a wrong mapping or routing shows in the logits."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  max_position_embeddings=512, bos_token_id=256, eos_token_id=257, num_experts_per_tok=2,
                  intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                  first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=4, topk_group=2)  # fmt: skip
    if family == "deepseek_v3":
        config = dict(num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=12, rope_parameters={"rope_type": "default",
                      "rope_theta": 10000.0}) | sizes  # fmt: skip
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**common | config))
    elif family == "glm4_moe":
        config = dict(num_key_value_heads=2, head_dim=16, attention_bias=True, use_qk_norm=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                       "partial_rotary_factor": 0.5}) | sizes  # fmt: skip
        model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**common | config))
    else:  # qwen3_moe with dense blocks among the MoE ones
        config = dict(num_key_value_heads=2, head_dim=16, num_experts=8, intermediate_size=96,
                      moe_intermediate_size=32, num_hidden_layers=4, rope_parameters={"rope_type": "default",
                      "rope_theta": 10000.0}) | sizes  # fmt: skip
        qwen = {k: v for k, v in common.items() if k not in ("n_routed_experts", "n_shared_experts",
                "first_k_dense_replace", "routed_scaling_factor", "n_group", "topk_group")}  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**qwen | config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.eval().save_pretrained(folder, max_shard_size="60KB")
    return model


def _titanlite_from(folder):
    from titanlite.checkpoint.hf_io import load_hf_weights
    from titanlite.models.decoder import Transformer
    from titanlite.models.registry import hf_args

    model = Transformer(hf_args(folder))
    load_hf_weights(model, folder)
    return model.eval()


CASES = {
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3_q_lora_rank_null": ("deepseek_v3", {"q_lora_rank": None}),
    "deepseek_v3_yarn_mscale": ("deepseek_v3", {"rope_parameters": YARN}),
    # 0 is transformers' "not set": no softmax scaling (mscale_all_dim), attention_factor from factor alone (mscale)
    "deepseek_v3_yarn_mscale_all_dim_0": ("deepseek_v3", {"rope_parameters": YARN | {"mscale_all_dim": 0}}),
    "deepseek_v3_yarn_mscale_0": ("deepseek_v3", {"rope_parameters": YARN | {"mscale": 0}}),
    # transformers saves the shared expert of n_shared_experts = 0 as empty (0, 64) tensors
    "deepseek_v3_no_shared_experts": ("deepseek_v3", {"n_shared_experts": 0}),
    "glm4_moe": ("glm4_moe", {}),
    "glm4_moe_air_no_qk_norm": ("glm4_moe", {"use_qk_norm": False}),
    "qwen3_moe_mlp_only_layers": ("qwen3_moe", {"mlp_only_layers": [0, 2]}),
    "qwen3_moe_decoder_sparse_step": ("qwen3_moe", {"decoder_sparse_step": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_generation_and_export_equal_transformers(tmp_path, case):
    from titanlite.checkpoint.hf_io import save_hf_sharded
    from titanlite.data.tokenizers import ByteTokenizer
    from titanlite.generation import generate

    family, sizes = CASES[case]
    hf = hf_frontier_model(tmp_path / "hf", family, **sizes)
    ours = _titanlite_from(tmp_path / "hf")
    a = ours.args
    dense = {"qwen3_moe_mlp_only_layers": (0, 2), "qwen3_moe_decoder_sparse_step": (0, 2)}.get(case, (0,))
    assert (a.family, a.dense_layers, a.mla) == (family, dense, family == "deepseek_v3")
    if family != "qwen3_moe":
        assert (a.score_func, a.n_group, a.topk_group, a.routed_scaling_factor, a.n_shared_experts) == (
            "sigmoid", 4, 2, 2.5, sizes.get("n_shared_experts", 1),
        )  # fmt: skip
        bias = ours.layers[1].feed_forward.expert_bias
        assert torch.equal(bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)  # the folder's own
    x = torch.randint(0, VOCAB, (2, 150), generator=torch.Generator().manual_seed(1))  # past YaRN's original 64
    with torch.no_grad():
        expected = hf(x).logits
        assert expected.std() > 0.1
        assert (ours(x) - expected).abs().max() < 1e-5
    prompt = [1, 2, 3, 4, 5]
    tokens = generate(ours, prompt, 12)
    assert tokens == generate(ours, prompt, 12, kv_cache=False)
    with torch.no_grad():
        assert tokens == hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 5:].tolist()

    save_hf_sharded(ours, tmp_path / "out", torch.float32, ByteTokenizer(), max_file_bytes=60_000)
    back, info = type(hf).from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]  # n_shared_experts = 0: its empty tensors too
    back.eval()
    with torch.no_grad():
        assert (back(x).logits - expected).abs().max() < 1e-5


def test_multi_token_prediction_weights_are_not_loaded_with_one_line(tmp_path, caplog):
    """DeepSeek-V3's folder stores its MTP layer as model.layers.61.*, which DeepseekV3ForCausalLM ignores: so does
    titanlite's model, saying so once (an export carries them: test_hf_mtp.py)."""
    from safetensors.torch import save_file

    hf_frontier_model(tmp_path / "hf", "deepseek_v3")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(64, 128), "model.layers.3.enorm.weight": torch.ones(64)},
              str(tmp_path / "hf" / "mtp.safetensors"))  # fmt: skip
    with caplog.at_level(logging.INFO, logger="titanlite"):
        model = _titanlite_from(tmp_path / "hf")
    assert model.args.n_layers == 3
    assert "num_nextn_predict_layers = 1: the multi-token-prediction layer's weights are not trained" in caplog.text


PUBLISHED = [  # (family, flavor, total, active, the card's count of active: with the embedding and output or not)
    ("deepseek_v3", "671B", 671e9, 37e9, "active"),  # DeepSeek-V3's card (the 14B MTP module not included)
    ("deepseek_v3", "kimi_k2", 1.026e12, 32e9, "active"),  # Kimi K2: 1T total, 32B activated
    ("deepseek_v3", "16B-A3B", 16e9, 3e9, "active"),  # Moonlight: 16B, 3B activated
    ("glm4_moe", "355B", 355e9, 32e9, "active_non_embedding_or_output"),  # GLM-4.5 (its MTP layer in the 355B)
    ("glm4_moe", "Air", 106e9, 12e9, "active_non_embedding_or_output"),  # GLM-4.5-Air
]


@pytest.mark.parametrize("family, flavor, total, active, how", PUBLISHED, ids=[p[1] for p in PUBLISHED])
def test_published_shapes_and_parameter_counts(family, flavor, total, active, how):
    from titanlite.models.registry import FAMILIES

    a = FAMILIES[family].flavors[flavor]
    counts = a.param_counts()
    got = counts["active"] if how == "active" else counts["active"] - 2 * a.vocab_size * a.dim
    assert abs(counts["total"] / total - 1) < 0.01 and abs(got / active - 1) < 0.05, (flavor, counts)


def test_flops_count_latent_attention_and_active_experts():
    """DeepSeek-V3: 6 x 36.6B active non-embedding parameters + attention over q/k head 192 and v head 128."""
    from titanlite.models.registry import FAMILIES
    from titanlite.sizing.flops import flops_per_token

    a = FAMILIES["deepseek_v3"].flavors["671B"]
    per_token = flops_per_token(a, 4096)
    attention = 6 * 61 * 128 * (192 + 128) * 4096
    assert per_token == 6 * a.param_counts()["active_non_embedding"] + attention
    assert per_token < 6 * a.param_counts()["non_embedding"] / 10  # not every expert


def test_aux_free_trains_on_from_the_folders_correction_bias(tmp_path):
    """A DeepSeek-V3 folder's e_score_correction_bias is the routing bias aux_free moves: training starts from it and
    an export writes the moved one (fp32, as the HF class keeps it)."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from titanlite.checkpoint.hf_io import save_hf_sharded
    from titanlite.data.tokenizers import ByteTokenizer

    from helpers import make_trainer, tiny_argv

    hf = hf_frontier_model(tmp_path / "hf", "deepseek_v3")
    argv = tiny_argv(tmp_path / "run", "--model.name", "deepseek_v3", "--model.flavor", "hf",
                     "--checkpoint.initial_load_path", str(tmp_path / "hf"), "--moe.load_balance", "aux_free",
                     "--training.steps", "2", "--training.local_batch_size", "2", "--training.global_batch_size", "2",
                     "--model.vocab_size", str(VOCAB))  # fmt: skip
    try:
        t = make_trainer(argv)
        start = hf.model.layers[2].mlp.gate.e_score_correction_bias
        assert torch.equal(t.model.layers[2].feed_forward.expert_bias, start)
        t.train()
        moved = t.model.layers[2].feed_forward.expert_bias.clone()
        assert not torch.equal(moved, start)
        save_hf_sharded(t.model, tmp_path / "out", torch.bfloat16, ByteTokenizer())
        saved = {k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(f).items()}
        written = saved["model.layers.2.mlp.gate.e_score_correction_bias"]
        assert written.dtype == torch.float32 and torch.equal(written, moved)
    finally:  # the in-process trainer's process group: later tests build their own
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_kimi_k2_folder_is_the_deepseek_v3_architecture(tmp_path):
    """Kimi K2's folders say model_type 'kimi_k2' (its own code) with architectures DeepseekV3ForCausalLM."""
    from titanlite.models.registry import family_of_folder

    hf_frontier_model(tmp_path / "hf", "deepseek_v3")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["model_type"] = "kimi_k2"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert family_of_folder(tmp_path / "hf") == "deepseek_v3"


def test_a_pipeline_stage_of_dense_blocks_and_the_aux_loss_over_moe_blocks_only():
    """DeepSeek-V3's first stage may hold its dense blocks only: it passes the aux loss's statistics on; the aux loss
    of the stages averages over the MoE blocks (as the whole model's), and the logged loads cover MoE blocks only."""
    from titanlite.models.decoder import Transformer
    from titanlite.models.moe import LoadTable, moe_layers, update_load_balance
    from titanlite.models.registry import FAMILIES
    from titanlite.models.stage import StageModule

    args = FAMILIES["deepseek_v3"].flavors["tiny"].with_overrides(vocab_size=VOCAB)  # block 0 dense, 1-2 MoE
    model = Transformer(args)
    model.init_weights(0)
    model.set_load_balance("aux_loss")
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(x)
    whole = model.aux_loss_sum.item()
    dense_stage = StageModule(model, range(0, 1), first=True, last=False)
    hidden, carrier = dense_stage(x)
    assert carrier.abs().max() == 0  # nothing to add: no MoE block here
    model.aux_loss_sum = None
    StageModule(model, range(1, 3), first=False, last=True)(hidden, carrier, labels=x)
    assert abs(model.aux_loss_sum.item() - whole) < 1e-5 * whole
    table = LoadTable(3, args.n_experts, (1, 2), torch.device("cpu"))
    stats = update_load_balance(moe_layers(model), 0.0, want_stats=True, table=table)
    assert stats["max_over_mean"].shape == (2,) and (stats["max_over_mean"] >= 1).all()  # no dense block's 0


@pytest.mark.parametrize("value_dim", [12, 40], ids=["v_narrower", "v_wider"])
def test_attention_with_a_value_head_dim_of_its_own_equals_the_plain_softmax(value_dim):
    """Latent attention's v has its own head dim (DeepSeek-V3: 128 against q/k's 192); attention pads to one width for
    the flash kernels, either way round, and keeps the q/k head dim's scale."""
    from titanlite.models.rope_attention import attend

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 9, 24, generator=g), torch.randn(2, 4, 9, 24, generator=g)
    v = torch.randn(2, 4, 9, value_dim, generator=g)
    scores = (q @ k.transpose(-1, -2)) * 24**-0.5
    scores = scores.masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
    expected = scores.softmax(dim=-1) @ v
    assert (attend(q, k, v) - expected).abs().max() < 1e-5
