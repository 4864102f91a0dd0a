"""The transformers backend (model.name = "transformers"): tiny random models of the architectures people fine-tune
now, saved by transformers, give transformers' own logits, the same losses at 1 process and FSDP(2) (and HSDP 2x2),
an exact resume on another topology, an HF export transformers loads with equal logits, LoRA and QLoRA by the
models' own linear names, and one-line refusals."""

from __future__ import annotations

import dataclasses
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from helpers import make_trainer, run_distributed, tiny_argv

transformers = pytest.importorskip("transformers")

VOCAB = 300  # above the built-in byte tokenizer's
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=96, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
LINEAR = dict(
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention"], head_dim=16,
)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
DSA = dict(
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8,
    first_k_dense_replace=1, index_topk=4, index_head_dim=16, index_n_heads=2, num_key_value_heads=4,
)  # fmt: skip
SLIDING = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
# Qwen3.5's vision tower (its default is 27 layers of 1152: 1.6 GB to build, save, carry into exports and load)
QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=COMMON["hidden_size"])

# name -> (model_type, config keywords, whether the folder is a multimodal model's)
CASES = {
    "qwen3_5": ("qwen3_5", dict(text_config=dict(**COMMON, **LINEAR), vision_config=QWEN_VISION), True),
    "qwen3_5_moe": ("qwen3_5_moe", dict(text_config=dict(**COMMON, **MOE, **LINEAR), vision_config=QWEN_VISION), True),
    "gemma3": ("gemma3", dict(text_config=dict(**COMMON, head_dim=16, **SLIDING), vision_config=VISION), True),
    "olmo3": ("olmo3", dict(**COMMON, **SLIDING), False),
    "llama4_text": (
        "llama4_text",
        dict(
            **COMMON,
            head_dim=16,
            intermediate_size_mlp=96,
            num_local_experts=4,
            num_experts_per_tok=1,
            attention_chunk_size=8,
            no_rope_layer_interval=2,
            interleave_moe_layer_step=1,
        ),
        False,
    ),  # fmt: skip
    "phi3": ("phi3", dict(COMMON), False),
    "deepseek_v32": ("deepseek_v32", {**COMMON, **DSA}, False),
}


def hf_folder(root, name: str):
    """A random transformers model of CASES[name], weights moved far from their init (a wrong name, layout or
    renaming shows in the logits), saved as transformers saves it; (folder, the model)."""
    model_type, kw, multimodal = CASES[name]
    config = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(0)
    auto = transformers.AutoModelForImageTextToText if multimodal else transformers.AutoModelForCausalLM
    model = auto.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    folder = root / name
    model.save_pretrained(folder)
    return folder, model


def config_folder(root, name: str):
    """A folder with only CASES[name]'s config.json (a backend model's shape; weights drawn from the seed)."""
    model_type, kw, _ = CASES[name]
    folder = root / f"{name}_config"
    transformers.AutoConfig.for_model(model_type, **kw).save_pretrained(folder)
    return folder


def _backend_from(folder, attention="causal"):
    from titanlite.models.transformers_backend.args import backend_args
    from titanlite.models.transformers_backend.model import BackendModel

    args = backend_args(folder, 258, 64, attention, None)
    with torch.device("meta"):
        model = BackendModel(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    model.load_hf_folder(folder)
    return model.eval()


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_folder_transformers_saved_gives_transformers_logits(tmp_path, name):
    """Built on the meta device as transformers' own class (the text model of a multimodal folder), filled by
    transformers' loader into the parameters titanlite made: the logits of transformers' model, to 1e-5."""
    folder, reference = hf_folder(tmp_path, name)
    ours = _backend_from(folder)
    assert list(ours.state_dict())[0] == "model.embed_tokens.weight"  # transformers' names: exports need no mapping
    x = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=x).logits
        assert expected.std() > 0.1
        assert (ours(x) - expected).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["gemma3", "phi3", "llama4_text", "olmo3"])
def test_a_packed_row_equals_each_document_alone(tmp_path, name):
    """model.attention = block_causal: documents packed in one row, their positions restarting, give each document's
    own logits (sliding-window and chunked attention layers included), through transformers' masks."""
    folder, _ = hf_folder(tmp_path, name)
    ours = _backend_from(folder, "block_causal")
    docs = [torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in (7, 9, 5)]
    row = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(d.shape[1]) for d in docs]).unsqueeze(0)
    with torch.no_grad():
        packed, start = ours(row, positions), 0
        for doc in docs:
            alone = ours(doc, torch.arange(doc.shape[1]).unsqueeze(0))
            assert (packed[:, start : start + doc.shape[1]] - alone).abs().max() < 1e-5, name
            start += doc.shape[1]
        assert (ours(row, torch.arange(row.shape[1]).unsqueeze(0)) - packed).abs().max() > 1e-3  # (it matters)


def _shape(argv_extra=(), name="phi3", root=None, folder=None):
    """validate_for_world of a backend run of CASES[name]'s folder (or `folder`) with these overrides."""
    from titanlite.config import load
    from titanlite.plan import validate_for_world

    folder = folder or root / name
    if not folder.exists():
        hf_folder(root, name)
    argv = tiny_argv(root / "run", "--model.flavor", "hf", "--checkpoint.initial_load_path", str(folder), *argv_extra)
    return validate_for_world(load(argv), 2, device_type=None)


def test_a_folder_no_family_implements_goes_to_the_backend_and_a_config_alone_is_enough(tmp_path, caplog):
    """A Phi-3 folder (no native family) is built by the backend by itself, with a log line; a folder with only a
    config.json gives the shape (model.name = transformers), counted from the model built on the meta device."""
    caplog.set_level("INFO", logger="titanlite")
    plan = _shape(root=tmp_path)
    assert plan.model_args.family == "transformers" and "is not one of titanlite's families" in caplog.text
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(tmp_path / "phi3" / "config.json", config_only)
    from titanlite.config import load
    from titanlite.plan import validate_for_world

    argv = tiny_argv(tmp_path / "run2", "--model.name", "transformers", "--model.flavor", "hf",
                     "--checkpoint.initial_load_path", str(config_only))  # fmt: skip
    args = validate_for_world(load(argv), 1, device_type=None).model_args
    reference = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(config_only))
    assert args.param_counts()["total"] == sum(p.numel() for p in reference.parameters())
    assert args.flops_per_token(32) > 6 * args.param_counts()["active_non_embedding"]


REFUSALS = [
    (
        ["--parallelism.tensor_parallel_degree", "2"],
        r"tensor_parallel_degree = 2: tensor parallelism of model.name = "
        r"'transformers' \(phi3\) follows its config's base_model_tp_plan, which has no sequence parallelism .* set "
        r"parallelism.enable_sequence_parallel = false",
    ),
    (["--parallelism.context_parallel_degree", "2"], r"context parallelism is not available .* native families"),
    (
        ["--parallelism.pipeline_parallel_degree", "2", "--checkpoint.last_save_in_hf", "true"],
        r"pipeline parallelism of model.name = 'transformers' \(phi3\) writes no HF folder at the end .* export",
    ),
    (
        ["--lora.enable", "true", "--lora.targets", "qkv_proj,q_proj"],
        r"q_proj: phi3's decoder layers have no nn.Linear "
        r"of that name .* valid targets for it: o_proj, qkv_proj, gate_up_proj, down_proj",
    ),
    (["--float8.enable", "true"], r"float8.enable = true is not available"),
    (["--parallelism.expert_parallel_degree", "2"], r"expert_parallel_degree = 2: expert parallelism is not "),
    (["--model.vocab_size", "512"], r"model.vocab_size = 512: the transformers backend takes it from .*config.json"),
]


@pytest.mark.parametrize("name", ["phi3", "qwen3_5", "olmo3"])
def test_greedy_generation_equals_transformers_generate(tmp_path, name):
    """titanlite's generation loop on a backend model, with the model's own cache (Qwen3.5's: linear-attention
    states beside the keys and values; OLMo 3's: sliding-window layers), gives transformers' greedy generate; so
    does `python -m titanlite.generate` on the folder."""
    from titanlite.cli.generate import run
    from titanlite.data.tokenizers import ByteTokenizer
    from titanlite.generation import generate

    folder, reference = hf_folder(tmp_path, name)
    ours, prompt = _backend_from(folder), [5, 17, 42, 99, 7, 3, 250]
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert generate(ours, prompt, 12) == expected[0, len(prompt) :].tolist()
    tokenizer = ByteTokenizer()
    ids = tokenizer.with_bos(tokenizer.encode("The cat"))
    expected = reference.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    text = run(["--checkpoint", str(folder), "--prompt", "The cat", "--max-new-tokens", "8", "--temperature", "0"])
    assert text == tokenizer.decode(expected[0, len(ids) :].tolist())


OTHER = {  # tiny configs of models the backend refuses, or runs with a change
    "phi": ("phi", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)),
    "gpt2": ("gpt2", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4)),
    "jamba": ("jamba", {**COMMON, "num_experts": 2, "num_experts_per_tok": 1, "attn_layer_period": 2,
                        "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1}),
    "seed_oss": ("seed_oss", {**COMMON, "attention_dropout": 0.1, "residual_dropout": 0.1}),
}  # fmt: skip


def test_what_would_train_silently_wrong_is_refused_or_said(tmp_path, caplog):
    """An output projection with a bias (Phi-2: the chunked loss adds none), a class without the layout the backend
    shards by (GPT-2), packing across Mamba layers (Jamba), quantized weights, pickled weights beside a config:
    refused in one line each; dropout is set to 0 with a line (random draws would depend on the ranks)."""
    from titanlite.errors import ConfigError

    caplog.set_level("INFO", logger="titanlite")
    folders = {}
    for name, (model_type, kw) in OTHER.items():
        folders[name] = tmp_path / name
        transformers.AutoConfig.for_model(model_type, **kw).save_pretrained(folders[name])
    backend = ["--model.name", "transformers"]
    for name, extra, message in (
        ("phi", [], r"PhiForCausalLM's output projection has a bias, which titanlite's chunked loss does not add"),
        ("gpt2", [], r"GPT2LMHeadModel does not have the layout the transformers backend shards by"),
        ("jamba", ["--model.attention", "block_causal"], r"jamba's linear attention layers carry their state"),
    ):
        with pytest.raises(ConfigError, match=message):
            _shape([*backend, *extra], root=tmp_path, folder=folders[name])
    args = _shape(backend, root=tmp_path, folder=folders["seed_oss"]).model_args
    assert args.hf_config["attention_dropout"] == args.hf_config["residual_dropout"] == 0.0
    assert "attention_dropout = 0.1, residual_dropout = 0.1 set to 0" in caplog.text
    quantized = json.loads((folders["seed_oss"] / "config.json").read_text())
    (folders["seed_oss"] / "config.json").write_text(
        json.dumps({**quantized, "quantization_config": {"quant_method": "fp8"}})
    )
    with pytest.raises(ConfigError, match=r"quantization_config \(quant_method 'fp8'\): its weights are stored"):
        _shape(backend, root=tmp_path, folder=folders["seed_oss"])
    (folders["phi"] / "pytorch_model.bin").write_bytes(b"a pickle")
    with pytest.raises(ConfigError, match=r"no \*.safetensors weights .* pickles"):
        _shape(backend, root=tmp_path, folder=folders["phi"])


def test_lora_on_a_backend_model_adapts_its_linears_by_their_own_names(tmp_path):
    """lora.targets names a backend model's linears as peft does (Phi-3's fused qkv_proj and gate_up_proj); 'all' is
    every linear of its decoder layers; the adapters are what a LoRA checkpoint holds."""
    from titanlite.config import load
    from titanlite.errors import ConfigError
    from titanlite.models.lora import resolve_targets
    from titanlite.plan import model_shapes, validate_for_world

    folder, _ = hf_folder(tmp_path, "phi3")
    cfg = load(tiny_argv(tmp_path / "run", "--model.flavor", "hf", "--checkpoint.initial_load_path", str(folder),
                         "--lora.enable", "true", "--lora.targets", "qkv_proj,down_proj"))  # fmt: skip
    args = validate_for_world(cfg, 2, device_type=None).model_args
    assert resolve_targets(["all"], args) == ["o_proj", "qkv_proj", "gate_up_proj", "down_proj"]
    shapes = model_shapes(cfg, args)
    adapters = sorted(n for n in shapes if ".lora_" in n)
    assert adapters[:2] == ["model.layers.0.mlp.down_proj.lora_a.weight", "model.layers.0.mlp.down_proj.lora_b.weight"]
    assert len(adapters) == 2 * 2 * 2 and shapes["model.layers.0.self_attn.qkv_proj.lora_b.weight"] == (128, 16)
    # a folder with a config.json alone: the dry run sizes its LoRA (device_type None); a run is refused (random base)
    bare = load(tiny_argv(tmp_path / "bare", "--model.name", "transformers", "--model.flavor", "hf", "--lora.enable",
                          "true", "--checkpoint.initial_load_path", str(config_folder(tmp_path, "phi3"))))  # fmt: skip
    assert validate_for_world(bare, 2, device_type=None).model_args.linears
    with pytest.raises(ConfigError, match=r"holds a config.json and no weights \(the base would be random weights\)"):
        validate_for_world(bare, 1, device_type="cpu")


@pytest.mark.slow  # about 7 s
def test_qlora_reads_each_base_weight_whole_into_nf4_and_refuses_one_of_another_shape(tmp_path):
    """QLoRA on a backend model: its trained linears (not a router or gate) become NF4 weights, each the whole
    folder weight quantized (its dequantized values within NF4's error of the folder's); a folder whose weight has
    another shape (transposed) is refused by name, not read into the 4 bits."""
    pytest.importorskip("torchao")
    from safetensors.torch import load_file, save_file

    from titanlite.checkpoint.initial import load_initial_weights
    from titanlite.config import load
    from titanlite.errors import ConfigError
    from titanlite.model_builder import build_model
    from titanlite.models.nf4 import local_nf4, materialize_nf4
    from titanlite.plan import validate_for_world

    folder, reference = hf_folder(tmp_path, "phi3")

    def built(base):
        cfg = load(tiny_argv(tmp_path / "run", "--model.flavor", "hf", "--checkpoint.initial_load_path", str(base),
                             "--lora.enable", "true", *NF4))  # fmt: skip
        model = build_model(cfg, validate_for_world(cfg, 1, device_type="cpu").model_args, None).model
        model.to_empty(device="cpu")
        materialize_nf4(model)  # (as the Trainer does)
        model.init_weights(0)
        load_initial_weights(model, base)
        return model

    model = built(folder)
    nf4 = {n: p for n, p in model.named_parameters() if local_nf4(p) is not None}
    assert sorted(nf4)[:2] == ["model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"]
    assert len(nf4) == 8
    for name, p in nf4.items():
        full = reference.get_parameter(name)
        error = (p.get_original_weight().float() - full).abs().max() / full.abs().max()
        assert 0 < error < 0.2, (name, error)
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    key = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[key] = tensors[key].T.contiguous()
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"weights of other shapes: .*model.layers.1.self_attn.qkv_proj.weight"):
        built(broken)


@pytest.mark.parametrize("extra,message", REFUSALS)
def test_what_the_backend_does_not_run_is_refused_in_one_line(tmp_path, extra, message):
    from titanlite.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        _shape(extra, root=tmp_path)


def test_packing_is_refused_for_layers_that_carry_state_and_bad_folders_in_one_line(tmp_path):
    """Qwen3.5's Gated DeltaNet layers carry their state across packed documents; a config that needs the folder's
    code (auto_map), one of a model that is not a causal LM (a vision transformer) and one transformers cannot read
    are refused."""
    from titanlite.errors import ConfigError

    qwen3_5 = config_folder(tmp_path, "qwen3_5")
    backend = ["--model.name", "transformers"]
    with pytest.raises(ConfigError, match=r"qwen3_5_text's linear attention layers carry their state"):
        _shape([*backend, "--model.attention", "block_causal"], root=tmp_path, folder=qwen3_5)
    deepseek = config_folder(tmp_path, "deepseek_v32")
    with pytest.raises(ConfigError, match=r"deepseek_v32's sparse attention indexer chooses its keys across"):
        _shape([*backend, "--model.attention", "block_causal"], root=tmp_path, folder=deepseek)
    from titanlite.config import load
    from titanlite.models.transformers_backend.support import problem

    # a model with parameters outside its pp plan's parts (DeepSeek-V4's hc_head, say): no stage would hold them
    phi3 = _shape(backend, root=tmp_path, folder=config_folder(tmp_path, "phi3")).model_args
    outside = dataclasses.replace(phi3, counts={"shapes": {"model.layers.0.x": (1,), "model.hc_head": (1,)}})
    pp = load(tiny_argv(tmp_path / "pp", "--parallelism.pipeline_parallel_degree", "2"))
    assert "its parameters model.hc_head are outside the embedding" in problem(pp, SimpleNamespace(pp=2), outside)
    llama4 = config_folder(tmp_path, "llama4_text")  # (its config has no base_model_pp_plan)
    with pytest.raises(ConfigError, match=r"base_model_pp_plan, which lacks embed_tokens, layers, norm \(it has none"):
        _shape([*backend, "--parallelism.pipeline_parallel_degree", "2"], root=tmp_path, folder=llama4)
    tp = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel", "false"]
    plan = json.loads((deepseek / "config.json").read_text())  # a plan style the backend does not apply
    plan["base_model_tp_plan"] = {**transformers.DeepseekV32Config.base_model_tp_plan, "layers.*.mlp.x": "local_params"}
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps(plan))
    with pytest.raises(ConfigError, match=r"base_model_tp_plan, whose entry layers.\*.mlp.x: 'local_params' the "
                       r"backend does not apply"):  # fmt: skip
        _shape([*backend, *tp], root=tmp_path, folder=tmp_path / "odd")
    from titanlite.models.transformers_backend.tp import unsupported_style

    # a module in a list inside the layer (LongCat's self_attn.*.q_b_proj): not one the backend finds by its name
    assert unsupported_style({"layers.*.self_attn.*.q_b_proj": "colwise"}) == "layers.*.self_attn.*.q_b_proj: 'colwise'"
    vit = transformers.ViTConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=96)
    for name, edit, message in (
        ("remote", {"auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}, r"auto_map: its model needs code from"),
        ("vit", vit.to_dict(), r"model_type 'vit' has no causal language model class"),
        ("unknown", {"model_type": "not_a_model"}, r"model_type 'not_a_model' is not one transformers"),
        ("broken", {"text_config": {**COMMON, "layer_types": ["nope"]}}, r"transformers cannot read it: .*layer_types"),
    ):
        folder = tmp_path / name
        shutil.copytree(qwen3_5, folder)
        config = {} if name == "vit" else json.loads((folder / "config.json").read_text())
        config.update(edit)
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError, match=message):
            _shape(backend, root=tmp_path, folder=folder)


# olmo3_config: OLMo 3 from its config.json alone, the weights drawn from the seed; *_lora: LoRA on the folder
# *_qlora: QLoRA, the base's linears in NF4 (blocks small enough for the tiny shapes), read whole from the folder
NF4 = ["--lora.base_dtype", "nf4", "--lora.nf4_block_size", "16", "--lora.nf4_scaler_block_size", "8"]
LORA = {  # name -> its [lora] overrides (peft's names of the model's own linears)
    "phi3_lora": ["--lora.targets", "qkv_proj,gate_up_proj"],
    "qwen3_5_lora": ["--lora.targets", "all"],  # Gated DeltaNet's in_proj_qkv, in_proj_z, ... and attention's
    "phi3_qlora": ["--lora.targets", "qkv_proj,gate_up_proj", *NF4],
}
TRAINED = ["phi3", "gemma3", "qwen3_5", "olmo3", "llama4_text", "deepseek_v32", "qwen3_5_moe", "olmo3_config", *LORA]
# *_tp: TP(2) x FSDP(2) by the config's base_model_tp_plan (Phi-3's fused projections gathered, Gemma 3's per-head
# q/k norms, Qwen3.5-MoE's Gated DeltaNet gathered, its and Llama 4's shared experts split and routed experts whole
# on each rank, DeepSeek-V3.2's latent projection whole with its shared RoPE key's gradient summed over tp; LoRA's
# adapters split with their projections); the embedding and output split over the vocabulary
TP = {
    f"{name}_tp": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel", "false"]
    for name in ("phi3", "gemma3", "phi3_lora", "qwen3_5_moe", "llama4_text", "deepseek_v32")
}
# *_pp: PP(2) by the config's base_model_pp_plan, 1F1B over 4 pipeline microbatches (Gemma 3's tied embedding and
# output projection on the two ranks; Qwen3.5's hybrid layers split between them were checked the same way while
# building it, left out for the suite's time)
PP = {
    f"{name}_pp": [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "1F1B",
        "--training.local_batch_size",
        "4",
    ]  # fmt: skip
    for name in ("phi3", "gemma3")
}
PP_TP = {"phi3_pp_tp": [*PP["phi3_pp"], *TP["phi3_tp"]]}  # PP(2) x TP(2): each stage split over tp
EXPORTED = ["gemma3", "qwen3_5"]
X = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))


def _base(name: str) -> str:
    """The folder a run of `name` starts from (phi3_qlora_tp: phi3)."""
    return name.removesuffix("_tp").removesuffix("_pp").removesuffix("_qlora").removesuffix("_lora")


def _argv(root, name, run, *extra):
    adapters = LORA.get(name.removesuffix("_tp"))
    lora = ["--lora.enable", "true", "--lora.rank", "4", "--optimizer.lr", "1e-2", *adapters] if adapters else []
    base = root / _base(name)
    return tiny_argv(
        root / run / name, "--model.flavor", "hf", "--checkpoint.initial_load_path", str(base), *lora,
        "--training.steps", "4", "--training.global_batch_size", "4", "--training.local_batch_size", "1",
        "--checkpoint.enable", "--checkpoint.interval", "2", *extra,
    )  # fmt: skip


# runs of one process with activation checkpointing per decoder layer, [compile] per decoder layer (Qwen3.5's Gated
# DeltaNet left uncompiled inside its layers), and validation
COMPILED = ["--compile.enable", "true", "--compile.backend", "aot_eager"]
RECOMPUTED = {
    "phi3": ["--activation_checkpoint.mode", "full"],
    "gemma3": [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
        *COMPILED,
    ],  # fmt: skip
    "qwen3_5": ["--activation_checkpoint.mode", "full", *COMPILED],
    "olmo3": ["--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "2"],
}


def _train_each(root, run: str, names, replicate: int = 1):
    """Each model trained 4 steps on this world (global batch 4), saved at steps 2 and 4 (the exported ones also as
    an HF folder); the losses, and the final model's logits on X. At one process, the RECOMPUTED runs too."""
    out = {}
    if run == "one":
        from torch._dynamo.utils import counters

        for name, extra in RECOMPUTED.items():
            graphs = counters["stats"]["unique_graphs"]
            t = make_trainer(_argv(root, name, "recomputed", *extra))
            out[f"{name}-recomputed"] = {"losses": t.train(), "validation": t.val_losses,
                                         "graphs": counters["stats"]["unique_graphs"] - graphs}  # fmt: skip
    for name in names:
        extra = [
            "--parallelism.data_parallel_replicate_degree",
            "1" if name in TP or name in PP_TP else str(replicate),
            *TP.get(name, []),
            *PP.get(name, []),
            *PP_TP.get(name, []),
        ]
        if name in EXPORTED:
            extra += ["--checkpoint.last_save_in_hf", "true"]
        if name.endswith("_config"):
            extra += ["--model.name", "transformers"]
        if name == "phi3":  # its FSDP(2) checkpoints are saved asynchronously (and resumed at one process)
            extra += ["--checkpoint.async_mode", "async"]
        t = make_trainer(_argv(root, name, run, *extra))
        losses = t.train()
        if name in PP or name in PP_TP:  # (each rank holds one stage: no whole model to run)
            out[name] = {"losses": losses}
            continue
        with torch.no_grad():
            logits = t.model.eval()(X)  # (split over the vocabulary under TP's loss parallelism)
            out[name] = {"losses": losses, "logits": logits.full_tensor() if hasattr(logits, "full_tensor") else logits}
    if run == "fsdp2":
        out["sampled"] = _sample_sharded(root)
    return out


SAMPLED = {"phi3": (2, 1), "qwen3_5": (1, 2)}  # greedy generation with the weights replicated over 2, or FSDP(2)
PROMPT = [5, 17, 42, 99, 7, 3, 250]


def _sample_sharded(root):
    """Each SAMPLED folder's greedy continuation of PROMPT, its weights sharded over its (replicate, shard) for
    inference, as `python -m titanlite.generate` under torchrun builds it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from titanlite.config import load
    from titanlite.generation import generate, inference_model, load_weights
    from titanlite.parallel.dims import ParallelDims

    out = {}
    for name, (replicate, shard) in SAMPLED.items():
        cfg = load(_argv(root, name, "sampled"))
        dims = ParallelDims(dp_replicate=replicate, dp_shard=shard, world_size=dist.get_world_size())
        model = inference_model(cfg, VOCAB, torch.device("cpu"), dims.build_meshes("cpu"))
        assert isinstance(model.layers[0], FSDPModule)
        load_weights(model, root / name)
        out[name] = generate(model, PROMPT, 12)
    return out


def _resume_each(root, names):
    """Each model resumed at step 2 from the FSDP(2) run's checkpoint, on this world: the losses of steps 3 and 4."""
    out = {}
    for name in names:
        shutil.copytree(root / "fsdp2" / name / "checkpoint", root / "resumed" / name / "checkpoint")
        out[name] = make_trainer(_argv(root, name, "resumed", "--checkpoint.load_step", "2")).train()
    return out


@pytest.mark.slow
def test_backend_models_train_alike_at_every_topology_resume_exactly_and_export(tmp_path):
    """Seven architectures from their folders and one from its config alone (weights drawn from the seed): the same
    losses (1e-5) at one process (4 microbatches), FSDP(2), HSDP(2x2, four of them), TP(2) x FSDP(2) (six), PP(2)
    and PP(2) x TP(2), and with activation checkpointing per decoder layer (full, selective) and validation at one
    process; the FSDP(2) run's step-2 checkpoint resumed at one process gives its steps 3 and 4; its HF exports (at
    the last step, and of a saved step by the export command) load in transformers with no missing key and the
    trained model's logits."""
    for name in (n for n in TRAINED if n not in LORA):
        config_folder(tmp_path, name[: -len("_config")]) if name.endswith("_config") else hf_folder(tmp_path, name)
    from safetensors.torch import load_file, save_file

    mtp = {"mtp.fc.weight": torch.randn(8, 16), "mtp.norm.weight": torch.randn(16)}  # Qwen3.5's MTP head: untrained
    save_file(mtp, str(tmp_path / "qwen3_5" / "mtp.safetensors"))
    one = run_distributed(_train_each, 1, tmp_path, "one", TRAINED)[0]
    fsdp2 = run_distributed(_train_each, 2, tmp_path, "fsdp2", [*TRAINED, *PP])[0]
    four = ["gemma3", "olmo3_config", "phi3_lora", "phi3_qlora", *TP, *PP_TP]  # HSDP(2x2), TP(2) x FSDP(2), PP x TP
    hsdp = run_distributed(_train_each, 4, tmp_path, "hsdp", four, 2)[0]
    resumed = run_distributed(_resume_each, 1, tmp_path, ["phi3", "qwen3_5", "deepseek_v32", "phi3_lora",
                                                          "phi3_qlora", "phi3_pp"])[0]  # fmt: skip
    # the 4-bit base computes other logits than the full-precision one (by little): it was quantized when read
    assert 1e-4 < abs(one["phi3_qlora"]["losses"][1] - one["phi3_lora"]["losses"][1]) < 0.05
    for name in TRAINED:
        ref = one[name]["losses"]
        assert sorted(ref) == [1, 2, 3, 4] and ref[4] < ref[1], name
        for run in (fsdp2, hsdp):
            if name in run:
                assert all(abs(run[name]["losses"][s] - ref[s]) < 1e-5 for s in ref), (name, run[name], ref)
        assert (fsdp2[name]["logits"] - one[name]["logits"]).abs().max() < 1e-4, name
    for name in TP:  # tensor parallelism composed with FSDP: one process's losses and logits
        ref = one[name.removesuffix("_tp")]
        assert all(abs(hsdp[name]["losses"][s] - ref["losses"][s]) < 1e-5 for s in ref["losses"]), (name, hsdp[name])
        assert (hsdp[name]["logits"] - ref["logits"]).abs().max() < 1e-4, name
    for name in PP:  # pipeline parallelism: one process's losses
        ref = one[_base(name)]["losses"]
        assert all(abs(fsdp2[name]["losses"][s] - ref[s]) < 1e-5 for s in ref), (name, fsdp2[name], ref)
    for name in PP_TP:  # and composed with tensor parallelism
        ref = one[_base(name)]["losses"]
        assert all(abs(hsdp[name]["losses"][s] - ref[s]) < 1e-5 for s in ref), (name, hsdp[name], ref)
    for name in SAMPLED:  # sharded generation: transformers' greedy generate on the folder
        reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert fsdp2["sampled"][name] == expected[0, len(PROMPT) :].tolist(), name
    for name, extra in RECOMPUTED.items():  # compiled: graphs captured (Qwen3.5's checkpointed layers too)
        assert (one[f"{name}-recomputed"]["graphs"] > 0) == ("--compile.enable" in extra), name
    for name in RECOMPUTED:
        assert one[f"{name}-recomputed"]["losses"] == pytest.approx(one[name]["losses"], abs=1e-6), name
    assert sorted(one["olmo3-recomputed"]["validation"]) == [2, 4]
    for name, losses in resumed.items():
        assert sorted(losses) == [3, 4] and all(abs(losses[s] - fsdp2[name]["losses"][s]) < 1e-5 for s in (3, 4))
    from titanlite.cli.checkpoint import main as checkpoint_command

    step = tmp_path / "fsdp2" / "phi3" / "checkpoint" / "step-4"  # exported later, from its checkpoint
    assert checkpoint_command(["export", "--checkpoint", str(step), "--output", str(tmp_path / "phi3-hf"),
                               "--format", "hf"]) == 0  # fmt: skip
    for name, folder in [(n, tmp_path / "fsdp2" / n / "checkpoint" / "hf-step-4") for n in EXPORTED] + [
        ("phi3", tmp_path / "phi3-hf")
    ]:
        back, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
        if name in ("qwen3_5", "gemma3"):  # multimodal folders: exported in their layout, their vision towers (and
            # Qwen3.5's MTP head) carried unchanged; AutoModelForCausalLM opens Gemma 3's as its multimodal class
            index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
            assert json.loads((folder / "config.json").read_text())["model_type"] == name
            source = load_file(str(tmp_path / name / "model.safetensors"))
            assert not set(source) - set(index), sorted(set(source) - set(index))[:5]  # every tensor, by its name
            towers = [k for k in source if k.startswith(("model.visual.", "vision_tower.", "multi_modal_projector."))]
            assert towers and all(torch.equal(load_file(str(folder / index[k]))[k], source[k]) for k in towers)
        if name == "qwen3_5":
            carried = load_file(str(folder / index["mtp.fc.weight"]))
            assert all(torch.equal(carried[k], mtp[k]) for k in mtp)
        with torch.no_grad():
            assert (back.eval()(input_ids=X).logits - fsdp2[name]["logits"]).abs().max() < 1e-4, name
    _check_lora_exports(tmp_path, fsdp2)


def _check_lora_exports(root, fsdp2):
    """Each LoRA run's step-4 adapters exported as a peft folder load with peft onto transformers' model of the base
    folder, merged as an HF folder load in transformers, and read back through lora.initial_adapter_path, with the
    trained model's logits; `generate` on the checkpoint samples what transformers' generate does with the peft
    model."""
    peft = pytest.importorskip("peft")
    from titanlite.cli.checkpoint import main as checkpoint_command
    from titanlite.cli.generate import run
    from titanlite.data.tokenizers import ByteTokenizer

    for name in LORA:
        step = root / "fsdp2" / name / "checkpoint" / "step-4"
        for fmt in ("peft", "hf"):
            argv = ["export", "--checkpoint", str(step), "--output", str(root / f"{name}-{fmt}"), "--format", fmt]
            assert checkpoint_command(argv) == 0, (name, fmt)
        base = transformers.AutoModelForCausalLM.from_pretrained(root / _base(name))
        adapted = peft.PeftModel.from_pretrained(base, root / f"{name}-peft").eval()
        merged, info = transformers.AutoModelForCausalLM.from_pretrained(root / f"{name}-hf", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
        qlora = "--lora.base_dtype" in LORA[name]  # the merged export: the base dequantized as training saw it
        with torch.no_grad():
            if not qlora:  # (peft puts QLoRA's adapters on the full-precision base: not what trained them)
                assert (adapted(input_ids=X).logits - fsdp2[name]["logits"]).abs().max() < 1e-4, name
            assert (merged.eval()(input_ids=X).logits - fsdp2[name]["logits"]).abs().max() < 1e-4, name
        tokenizer = ByteTokenizer()
        ids = tokenizer.with_bos(tokenizer.encode("The cat"))
        expected = (merged if qlora else adapted).generate(
            input_ids=torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None
        )
        own = ["--config", str(step / "job_config.toml"), "--checkpoint", str(step)]
        text = run([*own, "--prompt", "The cat", "--max-new-tokens", "6", "--temperature", "0"])
        assert text == tokenizer.decode(expected[0, len(ids) :].tolist()), name
    for name, logits in run_distributed(_from_peft_folders, 1, root)[0].items():
        assert (logits - fsdp2[name]["logits"]).abs().max() < 1e-4, name


def _from_peft_folders(root):
    """Each LoRA run's model started from its exported peft folder (lora.initial_adapter_path): its logits on X."""
    out = {}
    for name in LORA:
        peft_folder = str(root / f"{name}-peft")
        t = make_trainer(_argv(root, name, "from-peft", "--lora.initial_adapter_path", peft_folder))
        with torch.no_grad():
            out[name] = t.model.eval()(X)
    return out
