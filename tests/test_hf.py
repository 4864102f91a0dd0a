"""HuggingFace Llama weights in and out, checked against transformers' LlamaForCausalLM (no hub access)."""

import json
import logging
import math
import os
import shutil

import pytest
import torch

from helpers import compute_device, make_trainer, run_distributed, run_module, subprocess_env, tiny_argv

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def hf_model(folder, *, tied=False, scaling=None, kv_heads=2, vocab=300, layers=2, shard="60KB", seed=0):
    """A random-weight LlamaForCausalLM saved with save_pretrained (sharded into several files)."""
    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 10000.0} if scaling is None else {**scaling, "rope_theta": 500000.0}
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        rope_parameters=rope,
        bos_token_id=256,
        eos_token_id=257,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so that a wrong mapping shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, max_shard_size=shard)
    return model


def test_rope_frequencies_equal_transformers_llama3():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from titanlite.models.llama3 import LLAMA3_FLAVORS
    from titanlite.models.rope_attention import rope_frequencies

    for flavor, release, factor in (
        ("3.1-8B", "3.1", 8.0),
        ("3.2-1B", "3.2", 32.0),
        ("3.3-70B", "3.3", 8.0),
        ("405B", "3.1", 8.0),
    ):
        args = LLAMA3_FLAVORS[flavor]
        assert args.release == release and args.rope_scaling.factor == factor and args.context_length == 131072
        s = args.rope_scaling
        config = transformers.LlamaConfig(
            hidden_size=args.dim,
            num_attention_heads=args.n_heads,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": args.rope_theta,
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            },
        )
        hf_freqs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        ours = rope_frequencies(args.head_dim, args.rope_theta, s)
        assert torch.allclose(ours.float(), hf_freqs.float(), rtol=1e-6, atol=0), flavor
        unscaled = rope_frequencies(args.head_dim, args.rope_theta)
        assert (4096 * (unscaled - ours)).abs().max() > 3.0  # rad at position 4096: scaling matters
    assert LLAMA3_FLAVORS["8B"].rope_scaling is None and LLAMA3_FLAVORS["8B"].release == "3"


def _titanlite_from(folder):
    from titanlite.checkpoint.hf_io import load_hf_weights
    from titanlite.models.decoder import Transformer
    from titanlite.models.registry import hf_args

    model = Transformer(hf_args(folder))
    load_hf_weights(model, folder)
    return model


@pytest.mark.parametrize(
    "tied, scaling, kv_heads",
    [(False, None, 2), (True, LLAMA31_SCALING, 2), (False, LLAMA31_SCALING, 4), (True, None, 4)],
)
def test_import_gives_transformers_logits(tmp_path, tied, scaling, kv_heads):
    hf = hf_model(tmp_path, tied=tied, scaling=scaling, kv_heads=kv_heads)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    device = compute_device()
    ours, hf = _titanlite_from(tmp_path).to(device), hf.to(device)
    ours.init_buffers()  # the RoPE table is rebuilt in float64 on the device
    x = torch.randint(0, 300, (2, 300)).to(device)  # past original_max_position_embeddings = 64: scaling matters
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max() < 1e-5


def test_rope_scaling_beside_rope_parameters_as_transformers_applies_it(tmp_path):
    """A transformers-5 config.json (rope_parameters) with a rope_scaling block added by hand, as model cards tell
    users: transformers applies rope_scaling, and so does titanlite; when the two blocks disagree in a way
    transformers would resolve by dropping one (here rope_parameters' rope_theta), titanlite refuses, naming both."""
    from titanlite.config import ConfigError
    from titanlite.models.registry import hf_args

    hf_model(tmp_path)  # rope_parameters: default, theta 10000
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_theta", None)
    config["rope_scaling"] = dict(LLAMA31_SCALING)  # llama3 scaling with no rope_theta of its own
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    ours = _titanlite_from(tmp_path)
    assert ours.args.rope_scaling is not None and ours.args.rope_theta == 10000.0
    x = torch.randint(0, 300, (1, 300))  # past original_max_position_embeddings = 64
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max() < 1e-5

    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0}  # transformers: theta 10000
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="both rope_parameters and rope_scaling.*rope_theta 1000000.0 vs 10000.0"):
        hf_args(tmp_path)


def _titanlite_records(caplog):
    """titanlite's own log records: transformers' logger propagates to caplog in some test orders."""
    return [r for r in caplog.records if r.name.split(".")[0] == "titanlite"]


def test_a_tied_config_with_its_own_lm_head_loads_as_transformers_does(tmp_path, caplog):
    """tie_word_embeddings = true, but the weights hold an lm_head that differs from the embedding: transformers
    keeps that lm_head (untied) and warns; so does titanlite, naming the file. An equal lm_head stays tied."""
    from safetensors.torch import load_file, save_file

    hf_model(tmp_path, kv_heads=4)  # untied, lm_head and the embedding in different files
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["lm_head.weight"] != index["model.embed_tokens.weight"]
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        ours = _titanlite_from(tmp_path)
    x = torch.randint(0, 300, (2, 64))
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max() < 1e-5
    warnings = [r.getMessage() for r in _titanlite_records(caplog) if "tie_word_embeddings" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert (
        f"{tmp_path / 'config.json'} says tie_word_embeddings = true, but {index['lm_head.weight']} holds an "
        in (warnings[0])
    )
    assert "lm_head.weight that differs from model.embed_tokens.weight" in warnings[0]
    assert "using that lm_head.weight as the output projection, untied from the embedding" in warnings[0]
    assert not ours.args.tie_embeddings

    # the same lm_head as the embedding: tied, as transformers ties it, and nothing to warn about
    lm_file = tmp_path / index["lm_head.weight"]
    embedding = load_file(tmp_path / index["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    save_file(load_file(lm_file) | {"lm_head.weight": embedding.clone()}, lm_file, metadata={"format": "pt"})
    caplog.clear()
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        ours = _titanlite_from(tmp_path)
    assert ours.args.tie_embeddings and not [
        r for r in _titanlite_records(caplog) if "tie_word_embeddings" in r.getMessage()
    ]
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max() < 1e-5


def _import_sharded(folder, replicate):
    import torch.distributed as dist

    from titanlite.runtime.distributed import init_distributed

    init_distributed()
    t = make_trainer(
        tiny_argv(
            folder / "run",
            "--model.flavor",
            "hf",
            "--checkpoint.initial_load_path",
            str(folder),
            "--parallelism.data_parallel_replicate_degree",
            str(replicate),
            "--training.global_batch_size",
            "4",
            "--training.local_batch_size",
            "1",
        )
    )
    full = {k: v.full_tensor() for k, v in t.model.state_dict().items()}
    local_rows = t.model.layers[0].attention.wq.weight.to_local().shape[0]
    return full if dist.get_rank() == 0 else None, local_rows


@pytest.mark.slow
def test_import_sharded_fsdp_and_hsdp_equals_one_process(tmp_path):
    hf = hf_model(tmp_path, scaling=LLAMA31_SCALING)
    ref = _titanlite_from(tmp_path).state_dict()
    for world, replicate in ((2, 1), (4, 2)):
        res = run_distributed(_import_sharded, world, tmp_path, replicate)
        full, rows = res[0]
        assert rows == 64 // (world // replicate)  # really sharded
        assert full.keys() == ref.keys()
        for k in ref:
            assert torch.equal(full[k], ref[k]), (world, replicate, k)
    x = torch.randint(0, 300, (1, 100))
    ours = _titanlite_from(tmp_path)
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max() < 1e-5


def _train_and_export(tmp):
    t = make_trainer(
        tiny_argv(
            tmp,
            "--training.steps",
            "3",
            "--checkpoint.enable",
            "--checkpoint.last_save_in_hf",
            "--training.global_batch_size",
            "4",
            "--training.local_batch_size",
            "2",
            "--model.vocab_size",
            "300",
        )
    )
    t.train()
    from titanlite.generation import generate

    full = {k: v.full_tensor() for k, v in t.model.state_dict().items()}
    prompt = [256, *b"The function"]
    greedy = generate(t.model, prompt, 40, temperature=0.0)
    return full, greedy


@pytest.mark.slow
def test_train_export_and_load_with_transformers(tmp_path):
    full, greedy = run_distributed(_train_and_export, 2, tmp_path)[0]
    out = tmp_path / "checkpoint" / "hf-step-3"
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()
    assert not (out / "sharded").exists()
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    ours = _titanlite_from(out)
    for k, v in ours.state_dict().items():
        assert torch.equal(v, full[k]), k  # the export holds the trained weights exactly (fp32)
    x = torch.randint(0, 300, (2, 64))
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max() < 1e-5
    prompt = torch.tensor([[256, *b"The function"]])
    hf_greedy = hf.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert hf_greedy[0, prompt.shape[1] :].tolist() == greedy

    # the export command from the DCP checkpoint, fp32 and bf16, needs no config
    for dtype in ("float32", "bfloat16"):
        dest = tmp_path / f"export-{dtype}"
        r = run_module(
            "titanlite.checkpoint",
            "export",
            "--checkpoint",
            tmp_path / "checkpoint",
            "--output",
            dest,
            "--format",
            "hf",
            "--dtype",
            dtype,
            "--max-shard-size",
            "100000",
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert len(list(dest.glob("*.safetensors"))) > 1
        loaded = transformers.LlamaForCausalLM.from_pretrained(dest, dtype=getattr(torch, dtype)).eval()
        assert next(loaded.parameters()).dtype == getattr(torch, dtype)
        if dtype == "float32":
            with torch.no_grad():
                assert (loaded(x).logits - hf(x).logits).abs().max() < 1e-6
        assert json.loads((dest / "config.json").read_text())["torch_dtype"] == dtype
    # a step folder without the run files (saved before HF export existed) gets one clear message
    older = tmp_path / "older" / "step-3"
    shutil.copytree(tmp_path / "checkpoint" / "step-3", older)
    (older / "model_args.json").unlink()
    r = run_module(
        "titanlite.checkpoint", "export", "--checkpoint", older, "--output", tmp_path / "x", "--format", "hf"
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "has no readable model_args.json / job_config.toml" in r.stderr and not (tmp_path / "x").exists()


def _folder_state(folder):
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir())


def _check(args):
    r = run_module("titanlite.config", "--world-size", "1", *args, env=subprocess_env(TITANLITE_QUIET_CHECK="1"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-2000:])
    return r.stderr


@pytest.mark.slow  # a dozen launches of the trainer's checks (15 s): outside the fast inner loop
def test_bad_hf_folders_are_clear_config_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    hf_model(folder, shard="10MB")  # one model.safetensors
    base = ["--checkpoint.initial_load_path", str(folder), "--job.dump_folder", str(tmp_path / "out")]
    before = _folder_state(folder)
    # the flavor's shape against config.json: every mismatching field is named
    err = _check(base + ["--model.flavor", "debugmodel"])
    assert "config.json" in err and "dim 256 vs hidden_size 64" in err and "n_layers 6 vs num_hidden_layers 2" in err
    assert "vocab_size" in err
    err = _check(base + ["--model.flavor", "hf", "--model.tokenizer_path", str(tmp_path / "nope")])
    assert "model.tokenizer_path" in err
    weights = load_file(folder / "model.safetensors")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text())
    save_file(
        {k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k} | {"extra.weight": torch.zeros(2)},
        bad / "model.safetensors",
    )
    err = _check(["--checkpoint.initial_load_path", str(bad), "--model.flavor", "hf"])
    assert "missing tensors: model.layers.1.mlp.up_proj.weight" in err and "unexpected tensors: extra.weight" in err
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    err = _check(["--checkpoint.initial_load_path", str(bad), "--model.flavor", "hf"])
    assert "model.safetensors is not a readable safetensors file" in err and "truncated" in err
    (bad / "config.json").unlink()
    err = _check(["--checkpoint.initial_load_path", str(bad), "--model.flavor", "hf"])
    assert "hf" in err and "config.json" in err
    assert _folder_state(folder) == before  # nothing on disk touched


def test_llama3_tokenizer_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from titanlite.data.tokenizers import build_tokenizer

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
    )  # an instruct model
    t = build_tokenizer(str(tmp_path))
    ids = {s: tok.token_to_id(s) for s in specials}
    assert t.bos_id == ids["<|begin_of_text|>"] and t.eos_id == ids["<|end_of_text|>"]
    assert set(t.stop_ids) == {ids["<|end_of_text|>"], ids["<|eot_id|>"]}


@pytest.mark.slow
def test_generate_from_a_hf_folder_needs_no_other_flag(tmp_path):
    hf = hf_model(tmp_path, tied=True, scaling=LLAMA31_SCALING, vocab=258)
    r = run_module(
        "titanlite.generate",
        "--checkpoint",
        tmp_path,
        "--prompt",
        "The function",
        "--temperature",
        "0",
        "--max-new-tokens",
        "20",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    prompt = torch.tensor([[256, *b"The function"]])
    out = hf.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    from titanlite.data.tokenizers import ByteTokenizer

    assert "The function" + ByteTokenizer().decode(out[0, prompt.shape[1] :]) in r.stdout
    assert math.isfinite(len(r.stdout)) and os.path.isdir(tmp_path)
