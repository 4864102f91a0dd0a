"""LoRA in one process: for every family, adapters written in peft's format load with peft onto transformers'
model and give titanlite's logits; merged weights give them too; a peft folder reads back; adapters start so
that the model is its base; what trains and what the memory estimate counts."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 300
FAMILIES = ["llama3", "qwen3", "qwen2", "mistral", "qwen3_moe"]


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


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_export_equals_titanlite_and_merged_and_reads_back(tmp_path, family):
    from titanlite.checkpoint.hf_io import save_hf_sharded
    from titanlite.checkpoint.lora_io import load_peft_adapter, write_peft
    from titanlite.data.tokenizers import ByteTokenizer
    from titanlite.models.lora import merge_adapters

    cfg, model = _lora_model(family)
    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(x)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}
    assert len(adapters) == 2 * (4 if family == "qwen3_moe" else 7) * model.args.n_layers
    save_hf_sharded(model, tmp_path / "base", torch.float32, ByteTokenizer())  # the base only
    write_peft(tmp_path / "peft", adapters, model.args, cfg.lora, str(tmp_path / "base"))

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = hf(x).logits
        assert (base_logits - ours).abs().max() > 1e-3  # the adapters matter
        by_peft = peft.PeftModel.from_pretrained(hf, tmp_path / "peft").eval()(x).logits
    assert (by_peft - ours).abs().max() < 1e-5

    _, again = _lora_model(family, seed=0)
    with torch.no_grad():
        for name, p in again.named_parameters():
            if ".lora_" in name:
                p.zero_()
    load_peft_adapter(again, tmp_path / "peft", cfg.lora)
    with torch.no_grad():
        assert torch.equal(again(x), ours)
        merge_adapters(model)
        assert (model(x) - ours).abs().max() < 1e-5


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
