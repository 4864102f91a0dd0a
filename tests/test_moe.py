"""Mixture of Experts in one process: Qwen3-MoE and Mixtral logits and load-balancing loss equal to transformers' own
classes, HF folders in and out with per-expert names, the published shapes, active-parameter FLOPs, the routing bias,
KV-cache generation. The parity at every topology is in test_moe_parallel.py."""

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

VOCAB = 300


def hf_moe_model(folder, family: str, norm_topk_prob: bool = True, seed: int = 0, shard: str = "60KB", **sizes):
    """A random transformers MoE model saved with save_pretrained in several files: decisive routers (router weights
    far from zero) and norms away from 1, so that a wrong mapping or a wrong routing shows in the logits. sizes
    override the config's (a Qwen3-MoE head_dim=None: none in config.json, as transformers writes by default)."""
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
        qwen = dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8, head_dim=16) | sizes
        if qwen["head_dim"] is None:
            del qwen["head_dim"]
        config = transformers.Qwen3MoeConfig(**common | qwen, norm_topk_prob=norm_topk_prob, router_aux_loss_coef=0.004)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        mixtral = dict(intermediate_size=48, num_local_experts=4, sliding_window=None) | sizes
        config = transformers.MixtralConfig(**common | mixtral)
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


def test_config_json_as_transformers_writes_it_without_head_dim_and_with_the_num_experts_alias(tmp_path):
    """transformers 5.24's Qwen3MoeConfig has no head_dim (its attention takes hidden_size / heads) and writes none;
    MixtralConfig reads num_experts as an alias of num_local_experts: both folders load, with transformers' logits."""
    x = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    hf = hf_moe_model(tmp_path / "qwen", "qwen3_moe", hidden_size=96, head_dim=None)  # 96 / 4 heads = 24, not 128
    assert "head_dim" not in json.loads((tmp_path / "qwen" / "config.json").read_text())
    ours = _titanlite_from(tmp_path / "qwen")
    assert ours.args.head_dim == 24
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max() < 1e-5
    hf = hf_moe_model(tmp_path / "mixtral", "mixtral")
    config = json.loads((tmp_path / "mixtral" / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")
    (tmp_path / "mixtral" / "config.json").write_text(json.dumps(config))
    assert type(hf).from_pretrained(tmp_path / "mixtral").config.num_local_experts == 4  # transformers' alias
    ours = _titanlite_from(tmp_path / "mixtral")
    assert ours.args.n_experts == 4
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max() < 1e-5


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
    from titanlite.models.qwen3_moe import QWEN3_MOE_FLAVORS
    from titanlite.sizing.flops import flops_per_token

    a = QWEN3_MOE_FLAVORS["30B-A3B"]
    per_token = flops_per_token(a, 8192)  # the sequence length of that measurement
    every_expert = 6 * a.param_counts()["non_embedding"]
    assert per_token < every_expert / 4
    assert abs(per_token / 37.6e9 - 1) < 0.1, per_token  # TorchTitan's native figure for 30B-A3B


@pytest.mark.parametrize("hidden", [24, 33], ids=["grouped_mm", "rows_grouped_mm_cannot_align"])
def test_grouped_experts_equal_a_loop_over_experts(hidden):
    """Tokens sorted by expert: each expert's SwiGLU on its own tokens (fp32), outputs and gradients; torch._grouped_mm
    computes them where it takes the sizes, one expert after another where not (hidden 33: rows of 132 bytes, not a
    multiple of its 16, crashed with 'strides should be multiple of 16 bytes')."""
    import torch.nn.functional as F

    from titanlite.models.moe import GroupedExperts, grouped_mm_takes

    assert grouped_mm_takes(16, hidden, torch.float32) == (hidden == 24)
    g = torch.Generator().manual_seed(0)
    experts = GroupedExperts(4, 16, hidden)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 16, generator=g)
    out = experts(x, counts)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in (experts.w1, experts.w3, experts.w2)]
    experts.zero_grad()
    start, refs = 0, []
    for e, n in enumerate(counts.tolist()):
        xe = x[start : start + n]
        refs.append((F.silu(xe @ experts.w1[e]) * (xe @ experts.w3[e])) @ experts.w2[e])
        assert torch.allclose(out[start : start + n], refs[-1], atol=1e-5), e
        start += n
    torch.cat(refs).square().sum().backward()
    for got, p in zip(grads, (experts.w1, experts.w3, experts.w2)):
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-4)


def test_an_expert_size_grouped_mm_cannot_align_trains_in_bf16_and_keeps_its_shape(tmp_path):
    """A Qwen3-MoE folder with moe_intermediate_size 33 (transformers runs it eagerly): its logits, accepted before
    launch in bf16 too (that refusal advised float32, which crashed the same way), trained in bf16, its checkpoint and
    HF export of the real shape."""
    from titanlite.checkpoint.hf_io import save_hf_sharded
    from titanlite.config import load
    from titanlite.data.tokenizers import ByteTokenizer
    from titanlite.plan import validate_for_world

    from helpers import make_trainer, tiny_argv

    hf = hf_moe_model(tmp_path / "hf", "qwen3_moe", moe_intermediate_size=33)
    hf.set_experts_implementation("eager")  # its default, grouped_mm, crashes on these sizes too
    ours = _titanlite_from(tmp_path / "hf")
    x = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(x).logits
        assert (ours(x) - expected).abs().max() < 1e-5
    save_hf_sharded(ours, tmp_path / "out", torch.float32, ByteTokenizer())
    back = type(hf).from_pretrained(tmp_path / "out", experts_implementation="eager").eval()
    assert back.config.moe_intermediate_size == 33
    with torch.no_grad():
        assert (back(x).logits - expected).abs().max() < 1e-5
    argv = tiny_argv(tmp_path / "run", "--model.name", "qwen3_moe", "--model.flavor", "hf",
                     "--checkpoint.initial_load_path", str(tmp_path / "hf"), "--training.steps", "2",
                     "--training.mixed_precision_param", "bfloat16", "--training.local_batch_size", "2",
                     "--training.global_batch_size", "2")  # fmt: skip
    validate_for_world(load(argv), 1)
    t = make_trainer(argv)
    losses = t.train()
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values())
    assert tuple(t.model.state_dict()["layers.0.feed_forward.experts.w2"].shape) == (8, 33, 64)


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
    from titanlite.observe.metrics import format_step_line

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


def test_the_235b_dry_run_command_of_docs_moe_prints_its_table_row(monkeypatch, capsys):
    """docs/moe.md's Qwen3-235B-A22B dry run (from debug_model.toml, float32 unless the command says bfloat16, as the
    table's jobs are) prints the table's GiB per rank and sequences per rank."""
    import re
    import shlex

    import torch.distributed as dist

    from titanlite.cli.dry_run import main

    from helpers import ROOT

    page = (ROOT / "docs" / "moe.md").read_text()
    job = "Qwen3-235B-A22B on 64 GPUs, FSDP 64 x EP 32, seq 4096, full AC"
    row = re.search(rf"^\| {job} \| ([\d.]+) GiB \| fits; up to (\d+)", page, re.M)
    lines = page.replace("\\\n", " ").splitlines()  # continuation lines joined
    command = [line for line in lines if line.startswith("NGPU=8 NNODES=8 ./run_train.sh --dry-run") and "235B" in line]
    assert row and len(command) == 1, "docs/moe.md's 235B table row or dry-run command moved"
    args = shlex.split(command[0])[3:]  # after NGPU=8 NNODES=8 ./run_train.sh
    args.remove("--dry-run")
    monkeypatch.setenv("NGPU", "8")
    monkeypatch.setenv("NNODES", "8")
    if dist.is_initialized():  # an earlier test's in-process trainer: the dry run sets up its own (fake) group
        dist.destroy_process_group()
    assert main(["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), *args]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    total = re.search(r"total on GPU\s+peak at: \w+\s+([\d.]+)", text)
    largest = re.search(r"largest local batch that fits: (\d+)", text)
    assert total and largest, text[-2000:]
    assert (round(float(total.group(1)), 1), largest.group(1)) == (float(row.group(1)), row.group(2)), text[-2000:]
