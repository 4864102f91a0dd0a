"""LoRA in one process: for every family, adapters written in peft's format load with peft onto transformers'
model and give titanlite's logits; merged weights give them too; a peft folder reads back; adapters start so
that the model is its base; what trains and what the memory estimate counts."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 300
FAMILIES = ["llama3", "qwen3", "qwen2", "mistral", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss"]
# adapted projections per block: attention (q_a, q_b, kv_a, kv_b, o for latent attention) and a dense FFN
ROLES = {"qwen3_moe": 4, "deepseek_v3": 5, "glm4_moe": 4, "gpt_oss": 4}


def _lora_model(family, *extra, seed=0):
    """A tiny model of the family with adapters on every target, B random so that they matter."""
    from titanlite.config import load
    from titanlite.model_builder import build_model
    from titanlite.models.registry import model_args

    cfg = load(["--model.name", family, "--model.flavor", "tiny", "--lora.enable", "true", "--lora.rank", "4",
                "--training.mixed_precision_param", "float32", *extra])  # fmt: skip
    args = model_args(cfg.model, VOCAB, 64)
    model = build_model(cfg, args, None, inference=True).model
    model.to_empty(device="cpu")
    model.init_weights(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_b." in name:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return cfg, model.eval()


EXPERTS = ("--lora.targets", "q_proj,k_proj,v_proj,o_proj,experts.gate_up_proj,experts.down_proj")


# variants the full suite checks; the fast loop keeps one expert case
VARIANTS = ["qwen3_moe+experts", *(pytest.param(v, marks=pytest.mark.slow) for v in ("qwen3+rslora", "mixtral+experts",
            "gpt_oss+experts"))]  # fmt: skip


@pytest.mark.parametrize("family", [*FAMILIES, *VARIANTS])
def test_peft_export_equals_titanlite_and_merged_and_reads_back(tmp_path, family):
    from titanlite.checkpoint.hf_io import save_hf_sharded
    from titanlite.checkpoint.lora_io import load_peft_adapter, write_peft
    from titanlite.data.tokenizers import ByteTokenizer
    from titanlite.models.lora import merge_adapters

    family, _, variant = family.partition("+")
    extra = {
        "rslora": ("--lora.use_rslora", "true", "--lora.alpha", "16"),  # alpha / sqrt(r)
        "experts": EXPERTS,  # peft's target_parameters on transformers' fused expert tensors
    }.get(variant, ())
    cfg, model = _lora_model(family, *extra)
    if variant == "rslora":
        assert model.layers[0].attention.wq.scaling == cfg.lora.alpha / 2  # rank 4
    if variant == "experts":  # A drawn as peft's lora_A [r * experts, in]: Kaiming's bound 1 / sqrt(in)
        a = model.layers[0].feed_forward.experts.gate_up_proj.lora_a.weight
        assert 0.8 < a.abs().max() * a.shape[1] ** 0.5 <= 1
    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(x)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}
    assert len(adapters) == 2 * (6 if variant == "experts" else ROLES.get(family, 7)) * model.args.n_layers
    save_hf_sharded(model, tmp_path / "base", torch.float32, ByteTokenizer())  # the base only
    write_peft(tmp_path / "peft", adapters, model.args, cfg.lora, str(tmp_path / "base"))

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = hf(x).logits
        assert (base_logits - ours).abs().max() > 1e-3  # the adapters matter
        by_peft = peft.PeftModel.from_pretrained(hf, tmp_path / "peft").eval()(x).logits
    assert (by_peft - ours).abs().max() < 1e-5

    _, again = _lora_model(family, *extra, seed=0)
    with torch.no_grad():
        for name, p in again.named_parameters():
            if ".lora_" in name:
                p.zero_()
    load_peft_adapter(again, tmp_path / "peft", cfg.lora)
    with torch.no_grad():
        assert torch.equal(again(x), ours)
        merge_adapters(model)
        assert (model(x) - ours).abs().max() < 1e-5


def test_peft_expert_adapter_reads_whatever_the_order_of_its_target_parameters(tmp_path):
    """peft nests its two expert wrappers in the experts module's registration order (gate_up_proj inner) and writes
    target_parameters in a set's order: down_proj first under some hash seeds. Such a folder, saved by peft itself,
    reloads in peft and in titanlite with the same logits."""
    import json

    from titanlite.checkpoint.hf_io import save_hf_sharded
    from titanlite.checkpoint.lora_io import load_peft_adapter
    from titanlite.data.tokenizers import ByteTokenizer

    cfg, model = _lora_model("qwen3_moe", *EXPERTS)
    save_hf_sharded(model, tmp_path / "base", torch.float32, ByteTokenizer())
    experts = ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=cfg.lora.alpha, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             target_parameters=experts)  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    trained = peft.get_peft_model(hf, config)
    with torch.no_grad():
        for i, (name, p) in enumerate(trained.named_parameters()):
            if "lora_B" in name:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(i))
    trained.save_pretrained(tmp_path / "peft")
    saved = json.loads((tmp_path / "peft/adapter_config.json").read_text())
    saved["target_parameters"] = experts  # as peft writes it under PYTHONHASHSEED=1, whatever this process's seed
    (tmp_path / "peft/adapter_config.json").write_text(json.dumps(saved))

    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = hf(x).logits
        by_peft = peft.PeftModel.from_pretrained(hf, tmp_path / "peft").eval()(x).logits
        load_peft_adapter(model, tmp_path / "peft", cfg.lora)
        ours = model(x)
    assert (by_peft - base_logits).abs().max() > 1e-3  # the adapters matter
    assert (ours - by_peft).abs().max() < 1e-5


def test_adapters_start_as_the_base_and_only_they_train():
    from titanlite.models.lora import LoRALinear

    _, model = _lora_model("llama3")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_b." in name:
                p.zero_()
        x = torch.randint(0, VOCAB, (1, 16))
        with_b0 = model(x)
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_a.weight.zero_()
        assert torch.equal(model(x), with_b0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    a = model.layers[0].attention.wq.lora_a.weight
    assert a.shape == (4, model.args.dim) and model.layers[0].attention.wq.scaling == 32 / 4


def test_adapters_are_drawn_by_name_and_base_dtype_casts_only_the_base():
    from titanlite.config import load
    from titanlite.model_builder import build_model
    from titanlite.models.registry import model_args

    _, one = _lora_model("qwen3", seed=7)
    _, two = _lora_model("qwen3", seed=7)
    a1 = dict(one.named_parameters())["layers.1.attention.wk.lora_a.weight"]
    assert torch.equal(a1, dict(two.named_parameters())["layers.1.attention.wk.lora_a.weight"])
    assert a1.abs().max() <= 1 / one.args.dim**0.5 + 1e-6  # Kaiming-uniform(a=sqrt 5) bound: 1/sqrt(fan_in)
    cfg = load(["--model.flavor", "tiny", "--lora.enable", "true", "--lora.base_dtype", "bfloat16",
                "--lora.targets", "q_proj,down_proj"])  # fmt: skip
    model = build_model(cfg, model_args(cfg.model, VOCAB, 64), None).model
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}
    assert sorted({n.split(".")[3] for n in dtypes if ".lora_" in n}) == ["w2", "wq"]


def test_validation_and_generation_run_without_dropout_and_training_keeps_it(tmp_path):
    """LoRA dropout 0.3 on adapters that matter: validation and greedy generation give what dropout 0 gives, every
    time, and training goes on in train mode (issue 41, item 1)."""
    import torch.distributed as dist

    from titanlite.checkpoint.hf_io import save_hf_sharded
    from titanlite.data.tokenizers import ByteTokenizer
    from titanlite.generation import generate
    from titanlite.models.lora import LoRALinear

    from helpers import make_trainer, tiny_argv

    _, base = _lora_model("llama3")
    save_hf_sharded(base, tmp_path / "base", torch.float32, ByteTokenizer())
    argv = tiny_argv(tmp_path / "run", "--lora.enable", "true", "--lora.rank", "4", "--lora.dropout", "0.3",
                     "--checkpoint.initial_load_path", str(tmp_path / "base"), "--validation.enable", "true",
                     "--validation.steps", "1", "--model.flavor", "hf")  # fmt: skip
    try:
        trainer = make_trainer(argv)
        model = trainer.model
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_b." in name:
                    p.normal_(0.0, 0.5)
        adapters = [m for m in model.modules() if isinstance(m, LoRALinear)]
        assert adapters and all(isinstance(m.lora_dropout, torch.nn.Dropout) for m in adapters)
        prompt = [1, 5, 9, 17, 33]
        losses = [trainer.validate() for _ in range(3)]
        tokens = [generate(model, prompt, 8, seed=seed) for seed in (0, 1)]
        assert model.training and all(m.training for m in model.modules())  # training resumes in train mode
        x = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
        assert not torch.equal(model(x), model(x))  # dropout is on in training
        for m in adapters:
            m.lora_dropout.p = 0.0
        assert losses == [trainer.validate()] * 3
        assert tokens == [generate(model, prompt, 8)] * 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _safetensors_folder(folder, n=4):
    """A folder with one safetensors file of n 256 KiB tensors."""
    from safetensors.torch import save_file

    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file({f"w{i}": torch.randn(256, 256, generator=g) for i in range(n)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text("{}")
    return folder / "model.safetensors"


def test_the_base_fingerprint_sees_every_byte_and_caches_by_file_state(tmp_path, monkeypatch):
    import os
    import time

    from titanlite.checkpoint import base_identity
    from titanlite.checkpoint.base_identity import check_same_base, fingerprint
    from titanlite.errors import ConfigError

    weights = _safetensors_folder(tmp_path / "base")
    saved = fingerprint(tmp_path / "base")
    with open(weights, "r+b") as f:  # one tensor changed in place: same size, 8 KiB that sampling skips
        f.seek(weights.stat().st_size // 2 + 8192)
        f.write(bytes(8192))
    with pytest.raises(ConfigError, match="is another base .*its weights differ: model.safetensors"):
        check_same_base(saved, fingerprint(tmp_path / "base"), "step-3")

    monkeypatch.setattr(base_identity, "RACY_SECONDS", -1.0)  # cache even a file written a moment ago
    now = fingerprint(tmp_path / "base")
    monkeypatch.setattr(base_identity, "_hash_file", lambda *a: pytest.fail("an unchanged file was read again"))
    assert fingerprint(tmp_path / "base") == now  # from the cache
    st = weights.stat()
    time.sleep(0.05)  # past the file system's timestamp tick
    with open(weights, "r+b") as f:  # rewritten in place with its mtime put back: its ctime still moves
        f.seek(100_000)
        f.write(b"x")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    monkeypatch.undo()
    changed = fingerprint(tmp_path / "base")
    assert changed["tensors"] != now["tensors"]

    from helpers import capture_logs

    monkeypatch.setenv("TITANLITE_CACHE", str(weights / "cache"))  # below a file: the cache cannot be written
    logs = capture_logs()
    assert fingerprint(tmp_path / "base") == fingerprint(tmp_path / "base") == changed  # hashed, not cached
    assert sum("cannot be written" in m and "set TITANLITE_CACHE" in m for m in logs) == 1  # said once


def test_a_checkpoint_with_the_sampled_fingerprint_of_older_versions_still_resumes(tmp_path):
    from titanlite.checkpoint.base_identity import _sampled_fingerprint, check_same_base, fingerprint

    _safetensors_folder(tmp_path / "base")
    now = fingerprint(tmp_path / "base")
    old = {"path": now["path"], "config": now["config"], "tensors": _sampled_fingerprint(tmp_path / "base")}
    check_same_base(old, now, "step-3")


def _peft_adapter(tmp_path, name, **lora_kw):
    """A tiny Llama HF base and a peft adapter on it saved by peft itself; the base's titanlite ModelArgs."""
    from titanlite.models.registry import hf_args

    base = tmp_path / "base"
    if not base.exists():
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        transformers.LlamaForCausalLM(cfg).save_pretrained(base)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, **lora_kw)).save_pretrained(tmp_path / name)
    return tmp_path / name, hf_args(base)


def test_peft_adapters_saved_with_all_linear_or_a_regex_read_as_their_roles(tmp_path):
    from titanlite.checkpoint.lora_io import peft_settings

    folder, args = _peft_adapter(tmp_path, "all", target_modules="all-linear")  # saved as expanded module paths
    assert peft_settings(folder, args) == {"rank": 4, "alpha": 8, "use_rslora": False, "targets": ["all"]}
    folder, args = _peft_adapter(tmp_path, "regex", target_modules=r".*\.(q_proj|v_proj)")
    assert peft_settings(folder, args) == {"rank": 4, "alpha": 8, "use_rslora": False, "targets": ["q_proj", "v_proj"]}


@pytest.mark.parametrize(
    "kw, named",
    [
        (dict(lora_bias=True), "lora_bias = True"),
        (dict(trainable_token_indices=[1, 2]), "trainable_token_indices = [1, 2]"),
        (dict(bias="all"), "bias = 'all'"),
        (dict(bias="lora_only"), "bias = 'lora_only'"),
        (dict(exclude_modules=["model.layers.0.self_attn.q_proj"]), "exclude_modules = ['model.layers.0.self_attn"),
    ],
    ids=["lora_bias", "trainable_token_indices", "bias_all", "bias_lora_only", "exclude_modules"],
)
def test_peft_settings_titanlite_cannot_honour_are_named(tmp_path, kw, named):
    from titanlite.checkpoint.lora_io import peft_settings
    from titanlite.errors import ConfigError

    folder, args = _peft_adapter(tmp_path, "adapter", target_modules=["q_proj", "v_proj"], **kw)
    with pytest.raises(ConfigError, match="does not support") as e:
        peft_settings(folder, args)
    assert named in str(e.value) and "valid:" in str(e.value), str(e.value)


def test_peft_settings_titanlite_does_not_know_are_refused(tmp_path):
    """Activated LoRA (adapters after invocation tokens only) and a key of a future peft: refused, not ignored."""
    import json

    from titanlite.checkpoint.lora_io import peft_settings
    from titanlite.errors import ConfigError

    folder, args = _peft_adapter(tmp_path, "alora", target_modules=["q_proj", "v_proj"], alora_invocation_tokens=[5, 6])
    with pytest.raises(ConfigError, match=r"alora_invocation_tokens = \[5, 6\] \(Activated LoRA"):
        peft_settings(folder, args)
    folder, args = _peft_adapter(tmp_path, "future", target_modules=["q_proj", "v_proj"])
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "use_hyper_lora": True}))
    with pytest.raises(ConfigError, match="sets use_hyper_lora = True, a peft setting titanlite does not know"):
        peft_settings(folder, args)
    (folder / "adapter_config.json").write_text(json.dumps({**config, "use_hyper_lora": False}))
    assert peft_settings(folder, args)["rank"] == 4  # unset or false: nothing changes what the adapters compute


@pytest.mark.slow  # a benchmark's smoke test, as in test_benchmarks.py
def test_the_fingerprint_benchmark_runs_at_a_tiny_size(tmp_path):
    from helpers import run_benchmark

    out = run_benchmark("lora_fingerprint.py", "--gb", "0.004", "--files", "2", "--folder", tmp_path)
    assert "from the page cache (hashing alone)" in out and "cached digests (every later start)" in out, out
    assert not (tmp_path / "base").exists()  # it cleans up
