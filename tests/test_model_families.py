"""Model families (Llama 3, Qwen3, Qwen2, Mistral): logits equal to transformers' own classes, weights in and
out of HF folders at any topology, the same losses at every topology, exact resume, KV-cache generation."""

import json

import pytest
import torch

from helpers import ckpt_argv, make_trainer, run_distributed, tiny_argv

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

VOCAB = 300


def _hf_config(family: str, tied: bool):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        bos_token_id=256,
        eos_token_id=257,
    )
    if family == "llama3":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)
    if family == "qwen3":  # a head_dim of its own: 32, not 64 / 4
        return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**common, head_dim=32)
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**common)
    if family == "mistral":  # a head_dim of its own as well (24), and no sliding window
        return transformers.MistralForCausalLM, transformers.MistralConfig(**common, head_dim=24, sliding_window=None)
    raise KeyError(family)


def hf_family_model(folder, family: str, tied: bool = False, shard: str = "60KB", seed: int = 0):
    """A random transformers model of the family, saved with save_pretrained in several files: sharp attention,
    norms away from 1 and random biases, so that a wrong mapping or layout shows in the logits."""
    torch.manual_seed(seed)
    cls, config = _hf_config(family, tied)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)  # sharp attention: RoPE positions and head layout matter
    model.save_pretrained(folder, max_shard_size=shard)
    return model


FAMILIES = ["llama3", "qwen3", "qwen2", "mistral"]


def _titanlite_from(folder):
    from titanlite.checkpoint.hf_io import load_hf_weights
    from titanlite.models.decoder import Transformer
    from titanlite.models.registry import hf_args

    model = Transformer(hf_args(folder))
    load_hf_weights(model, folder)
    return model


def test_a_folder_without_architectures_loads_by_its_model_type(tmp_path):
    """transformers loads a config.json without `architectures` by its model_type; titanlite does the same."""
    hf_family_model(tmp_path, "qwen3")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ours = _titanlite_from(tmp_path)
    assert ours.args.family == "qwen3"
    x = torch.randint(0, VOCAB, (1, 40))
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max() < 1e-5


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_import_gives_transformers_logits_and_export_loads_back(tmp_path, family, tied):
    from titanlite.checkpoint.hf_io import save_hf_sharded
    from titanlite.data.tokenizers import ByteTokenizer

    hf = hf_family_model(tmp_path / "hf", family, tied)
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    ours = _titanlite_from(tmp_path / "hf")
    a = ours.args
    assert (a.family, a.qk_norm, a.qkv_bias, a.tie_embeddings) == (
        family,
        family == "qwen3",
        family == "qwen2",
        tied,
    )
    assert a.head_dim == {"qwen3": 32, "mistral": 24}.get(family, 16)
    x = torch.randint(0, VOCAB, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(x).logits
        assert expected.std() > 0.1  # far above the 1e-5 tolerance: a wrong weight would show
        assert (ours(x) - expected).abs().max() < 1e-5

    save_hf_sharded(ours, tmp_path / "out", torch.float32, ByteTokenizer(), max_file_bytes=60_000)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [type(hf).__name__] and config["head_dim"] == a.head_dim
    back = type(hf).from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (back(x).logits - expected).abs().max() < 1e-5


def _init_and_train(tmp, families):
    out = {}
    for family in families:
        t = make_trainer(tiny_argv(f"{tmp}/{family}", "--model.name", family, "--training.steps", "6"))
        params = {n: p.full_tensor().detach().clone() for n, p in t.model.named_parameters()}
        out[family] = (params, t.train())
    return out


@pytest.mark.slow
def test_family_init_is_by_name_and_trains(tmp_path):
    """The built-in small flavors of each family build, initialise (biases zero, norms one) and learn."""
    res = run_distributed(_init_and_train, 1, str(tmp_path), ["qwen3", "qwen2", "mistral"])[0]
    assert torch.equal(res["qwen3"][0]["layers.0.attention.q_norm.weight"], torch.ones(32))
    assert torch.equal(res["qwen2"][0]["layers.1.attention.wk.bias"], torch.zeros(32))
    for family, (_, losses) in res.items():
        assert losses[6] < losses[1], family


def _import_sharded(root, families):
    import torch.distributed as dist

    from titanlite.runtime.distributed import init_distributed

    init_distributed()
    world = dist.get_world_size()
    out = {}
    for family in families:
        replicate = 2 if world == 4 else 1
        argv = tiny_argv(
            root / f"run-{family}",
            "--model.name",
            family,
            "--model.flavor",
            "hf",
            "--checkpoint.initial_load_path",
            str(root / family),
            "--parallelism.data_parallel_replicate_degree",
            str(replicate),
            "--training.global_batch_size",
            "4",
            "--training.local_batch_size",
            "1",
        )
        t = make_trainer(argv)
        full = {k: v.full_tensor() for k, v in t.model.state_dict().items()}
        rows = t.model.layers[0].attention.wq.weight.to_local().shape[0]
        out[family] = (full if dist.get_rank() == 0 else None, rows)
    return out


@pytest.mark.slow
def test_import_under_fsdp_and_hsdp_is_bit_identical_to_one_process(tmp_path):
    families = ["qwen3", "qwen2"]
    refs = {}
    for family in families:
        hf_family_model(tmp_path / family, family)
        refs[family] = _titanlite_from(tmp_path / family).state_dict()
    for world in (2, 4):
        res = run_distributed(_import_sharded, world, tmp_path, families)[0]
        for family in families:
            full, rows = res[family]
            assert rows == refs[family]["layers.0.attention.wq.weight"].shape[0] // 2  # really sharded (shard 2)
            assert full.keys() == refs[family].keys()
            for k, v in refs[family].items():
                assert torch.equal(full[k], v), (world, family, k)


QWEN3 = ("--model.name", "qwen3", "--model.flavor", "tiny")


def _train_and_resume(tmp, local, save):
    """Losses of 6 steps of Qwen3 tiny, with checkpoints into 'a' when save, and the losses of steps 4-6
    resumed from a/step-3; also the initial full weights."""
    base = ckpt_argv(tmp, *QWEN3, "--training.local_batch_size", str(local))
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world == 4:
        base += ["--parallelism.data_parallel_replicate_degree", "2"]
    t = make_trainer(
        base
        + (["--checkpoint.folder", "a", "--checkpoint.interval", "3"] if save else ["--checkpoint.enable", "false"])
    )
    state = t.model.state_dict()
    init = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in state.items()}
    losses = t.train()
    if save:
        return {"init": init, "losses": losses}
    resumed = make_trainer(base + ["--checkpoint.folder", "a", "--checkpoint.load_step", "3"]).train()
    return {"init": init, "losses": losses, "resumed": resumed}


@pytest.mark.slow
def test_qwen3_same_losses_at_every_topology_and_resume_anywhere(tmp_path):
    fsdp2 = run_distributed(_train_and_resume, 2, str(tmp_path), 2, True)[0]  # FSDP(2), 2 microbatches
    single = run_distributed(_train_and_resume, 1, str(tmp_path), 8, False)[0]
    hsdp = run_distributed(_train_and_resume, 4, str(tmp_path), 2, False)[0]  # HSDP(2x2)
    ref = single["losses"]
    assert ref[6] < ref[1]
    for name, run in (("fsdp2_accum2", fsdp2), ("hsdp2x2", hsdp)):
        for k, v in single["init"].items():
            assert torch.equal(run["init"][k], v), (name, k)
        for step in ref:
            assert abs(run["losses"][step] - ref[step]) < 1e-5, (name, step)
    for name, run in (("one process", single), ("hsdp2x2", hsdp)):  # resumed from the FSDP(2) step-3
        assert sorted(run["resumed"]) == [4, 5, 6]
        for step in (4, 5, 6):
            assert abs(run["resumed"][step] - ref[step]) < 1e-5, (name, step)


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_greedy_equals_no_cache_for_every_family(family):
    from titanlite.generation import generate
    from titanlite.models.decoder import Transformer
    from titanlite.models.registry import FAMILIES as REGISTRY

    args = REGISTRY[family].flavors["tiny"].with_overrides(vocab_size=VOCAB, max_seq_len=128)
    model = Transformer(args)
    model.init_weights(seed=3)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    cached = generate(model, prompt, 64, temperature=0.0)
    plain = generate(model, prompt, 64, temperature=0.0, kv_cache=False)
    assert cached == plain and len(cached) == 64


def _greedy_per_family(tmp, sharded):
    """Greedy 64 tokens of each family's tiny flavor (seed 3), with and without the KV cache; FSDP over every rank
    when sharded, else a plain model."""
    import torch.distributed as dist

    from titanlite.config import load
    from titanlite.generation import generate, inference_model
    from titanlite.parallel.dims import ParallelDims

    mesh = None
    if sharded:
        from titanlite.runtime.distributed import init_distributed

        init_distributed()
        mesh = ParallelDims(dp_replicate=1, dp_shard=dist.get_world_size(), world_size=dist.get_world_size())
        mesh = mesh.build_meshes("cpu", True)
    out = {}
    for family in FAMILIES:
        cfg = load(tiny_argv(tmp, "--model.name", family, "--training.seq_len", "128"))
        model = inference_model(cfg, VOCAB, torch.device("cpu"), mesh)
        model.init_weights(3)
        prompt = [1, 2, 3, 4, 5, 6, 7]
        out[family] = (generate(model, prompt, 64, temperature=0.0), generate(model, prompt, 64, kv_cache=False))
    return out


@pytest.mark.slow
def test_kv_cache_greedy_equals_no_cache_sharded_for_every_family(tmp_path):
    plain = _greedy_per_family(str(tmp_path), sharded=False)
    for per_rank in run_distributed(_greedy_per_family, 2, str(tmp_path), True):
        for family in FAMILIES:
            cached, no_cache = per_rank[family]
            assert cached == no_cache == plain[family][0], family
            assert len(cached) == 64


def test_qwen3_published_shapes():
    """The released shapes: parameter counts as published (0.6B exactly, the others as the model cards round
    them), tied embeddings up to 4B, head_dim 128 whatever dim / heads is."""
    from titanlite.models.qwen3 import QWEN3_FLAVORS

    totals = {k: a.param_counts()["total"] for k, a in QWEN3_FLAVORS.items() if k[0].isdigit()}
    assert totals["0.6B"] == 596_049_920
    for name, billions in (("1.7B", 1.7), ("4B", 4.0), ("8B", 8.2), ("14B", 14.8), ("32B", 32.8)):
        assert round(totals[name] / 1e9, 1) == billions, name
    assert [a.tie_embeddings for k, a in QWEN3_FLAVORS.items() if k[0].isdigit()] == [True] * 3 + [False] * 3
    assert {a.head_dim for k, a in QWEN3_FLAVORS.items() if k[0].isdigit()} == {128}


def test_generate_chat_from_a_qwen3_folder_with_its_tokenizer(tmp_path, capsys):
    """A Qwen3 folder as transformers saves it, with Qwen's tokenizer files: generate --chat needs no other flag
    (family, shape, tokenizer and ChatML template all come from the folder) and prints the reply."""
    from test_chat_families import QWEN3_TEMPLATE, _qwen

    from titanlite.cli.generate import main

    folder = tmp_path / "qwen3"
    tok = _qwen(folder, QWEN3_TEMPLATE)
    torch.manual_seed(0)
    _, config = _hf_config("qwen3", tied=True)
    config.vocab_size = tok.vocab_size
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    code = main(["--checkpoint", str(folder), "--chat", "--prompt", "Hi?", "--max-new-tokens", "5"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert f"Loaded {folder}: qwen3, 2 blocks, dim 64" in out.err and out.out.strip()
