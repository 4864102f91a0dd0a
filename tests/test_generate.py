"""Sampling from a DCP checkpoint with the weights kept sharded (FSDP 2 and 4, HSDP 2x2) equals an unsharded process;
KV-cache generation under FSDP equals the no-cache loop."""

import math
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, run_distributed, subprocess_env, tiny_argv

pytestmark = pytest.mark.slow  # multi-process (gloo) or torchrun tests

PROMPTS = ["The function"]
# (temperature, top_k, seed): greedy, and two sampled settings
SETTINGS = [(0.0, 0, 0), (0.8, 20, 1), (1.0, 0, 2)]
NEW_TOKENS = 16


def _train_argv(tmp):
    return tiny_argv(
        tmp,
        "--training.seq_len",
        "64",
        "--training.steps",
        "40",
        "--metrics.log_freq",
        "20",
        "--training.local_batch_size",
        "8",
    )


def _generate_all(model, tokenizer, prompts=PROMPTS, settings=SETTINGS, new_tokens=NEW_TOKENS):
    from titanlite.generation import generate

    return {
        (p, s): generate(
            model, [tokenizer.bos_id, *tokenizer.encode(p)], new_tokens, temperature=s[0], top_k=s[1], seed=s[2]
        )
        for p in prompts
        for s in settings
    }


def _sharded_samples(cfg, ckpt, mesh_shapes):
    """Tokens generated with the weights sharded over each (replicate, shard) mesh; every rank's result."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from titanlite.data.tokenizers import build_tokenizer
    from titanlite.generation import inference_model, load_weights
    from titanlite.parallel.dims import ParallelDims
    from titanlite.runtime.distributed import init_distributed

    init_distributed()
    tok = build_tokenizer("")
    out = {}
    for replicate, shard in mesh_shapes:
        dims = ParallelDims(dp_replicate=replicate, dp_shard=shard, world_size=dist.get_world_size())
        model = inference_model(cfg, tok.vocab_size, torch.device("cpu"), dims.build_meshes("cpu"))
        assert isinstance(model.layers[0], FSDPModule)
        local = model.layers[0].attention.wq.weight.to_local().shape[0]
        load_weights(model, ckpt)
        out[(replicate, shard)] = (local, _generate_all(model, tok))
    return out


def _train_save_and_sample(argv, ckpt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from titanlite.config import load
    from titanlite.trainer import Trainer

    t = Trainer(load(argv))
    losses = t.train()
    dcp.save({"model": get_model_state_dict(t.model)}, checkpoint_id=ckpt)
    return losses, _sharded_samples(t.cfg, ckpt, [(1, 2)])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained 40 steps at FSDP(2), saved as <tmp>/checkpoint/step-40, and its FSDP(2) samples."""
    tmp = tmp_path_factory.mktemp("gen")
    ckpt = tmp / "checkpoint" / "step-40"
    res = run_distributed(_train_save_and_sample, 2, _train_argv(tmp), str(ckpt))
    return tmp, ckpt, res


def _reference(argv, ckpt, **kw):
    """Unsharded: a plain Transformer in this process (no process group), the same DCP checkpoint."""
    import torch.distributed as dist

    from titanlite.config import load
    from titanlite.data.tokenizers import build_tokenizer

    assert not dist.is_initialized()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: more threads only contend with the other test processes
    try:
        return _reference_samples(load(argv), build_tokenizer(""), ckpt, **kw)
    finally:
        torch.set_num_threads(threads)


def _reference_samples(cfg, tok, ckpt, **kw):
    from titanlite.generation import inference_model, load_weights

    model = inference_model(cfg, tok.vocab_size, torch.device("cpu"))
    if ckpt is None:
        model.init_weights(cfg.training.seed)
    else:
        load_weights(model, ckpt)
    return _generate_all(model, tok, **kw)


def test_sharded_generation_equals_unsharded(trained):
    tmp, ckpt, res = trained
    argv = _train_argv(tmp)
    ref = _reference(argv, ckpt)
    from titanlite.config import load

    world4 = run_distributed(_sharded_samples, 4, load(argv), str(ckpt), [(1, 4), (2, 2)])
    runs = {
        "fsdp2": [r[1][(1, 2)] for r in res],
        "fsdp4": [r[(1, 4)] for r in world4],
        "hsdp2x2": [r[(2, 2)] for r in world4],
    }
    for name, per_rank in runs.items():
        shard = {"fsdp2": 2, "fsdp4": 4, "hsdp2x2": 2}[name]
        for local, samples in per_rank:
            assert local == math.ceil(64 / shard)  # wq rows: really sharded
            assert samples == ref, name  # every rank, every prompt and setting: the same tokens
    assert len({tuple(v) for v in ref.values()}) > 1  # the settings do differ


def _bigram_nll(texts):
    """Mean negative log-likelihood per byte of `texts` under an add-one bigram model of the training corpus."""
    from titanlite.data.builtin_corpus import builtin_corpus_path

    data = torch.frombuffer(bytearray(builtin_corpus_path("train").read_bytes()[:1_000_000]), dtype=torch.uint8)
    data = data.long()
    counts = torch.bincount(data[:-1] * 256 + data[1:], minlength=256 * 256).view(256, 256).double() + 1
    logp = (counts / counts.sum(1, keepdim=True)).log()
    nll, n = 0.0, 0
    for text in texts:
        b = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        nll -= logp[b[:-1], b[1:]].sum().item()
        n += len(b) - 1
    return nll / n


@torch.no_grad()
def _no_cache_greedy(model, prompt, new_tokens):
    """Greedy tokens recomputing the whole sequence each step; a block-causal model sees one document
    (positions 0, 1, ...) through its block-causal mask."""
    tokens = torch.tensor([prompt])
    for _ in range(new_tokens):
        positions = torch.arange(tokens.shape[1])[None] if model.args.attention == "block_causal" else None
        nxt = model(tokens, positions)[0, -1].argmax()
        tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
    return tokens[0, len(prompt) :].tolist()


def _cache_and_no_cache(cfg, block_cfg, ckpt, mesh=None):
    """Per model (trained causal, untrained block-causal): greedy with the cache, the no-cache loop, and sampled
    with and without the cache."""
    from titanlite.data.tokenizers import build_tokenizer
    from titanlite.generation import generate, inference_model, load_weights

    tok = build_tokenizer("")
    prompt = [tok.bos_id, *tok.encode(PROMPTS[0])]
    out = {}
    for name, c, path in (("trained", cfg, ckpt), ("block_causal", block_cfg, None)):
        model = inference_model(c, tok.vocab_size, torch.device("cpu"), mesh)
        if path:
            load_weights(model, path)
        else:
            model.init_weights(c.training.seed)
        sampled = dict(temperature=0.8, top_k=20, seed=1)
        out[name] = (
            generate(model, prompt, 24),
            _no_cache_greedy(model, prompt, 24),
            generate(model, prompt, 24, **sampled),
            generate(model, prompt, 24, kv_cache=False, **sampled),
        )
    return out


def _sharded_cache_and_no_cache(cfg, block_cfg, ckpt):
    import torch.distributed as dist

    from titanlite.parallel.dims import ParallelDims
    from titanlite.runtime.distributed import init_distributed

    init_distributed()
    dims = ParallelDims(dp_replicate=1, dp_shard=2, world_size=dist.get_world_size())
    return _cache_and_no_cache(cfg, block_cfg, ckpt, dims.build_meshes("cpu"))


def test_kv_cache_generation_equals_no_cache_fsdp2(trained):
    """Greedy (fp32) from the KV cache equals the no-cache loop on a plain model and at FSDP(2), for the trained
    causal model and a block-causal one; sampled too."""
    from titanlite.config import load

    tmp, ckpt, _ = trained
    argv = _train_argv(tmp)
    cfg, block_cfg = load(argv), load([*argv, "--model.attention", "block_causal"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = _cache_and_no_cache(cfg, block_cfg, str(ckpt))
    finally:
        torch.set_num_threads(threads)
    for name, (cached, no_cache, sampled, sampled_no_cache) in plain.items():
        assert cached == no_cache and sampled == sampled_no_cache, name
    for per_rank in run_distributed(_sharded_cache_and_no_cache, 2, cfg, block_cfg, str(ckpt)):
        assert per_rank == plain


def test_trained_sample_is_closer_to_training_text(trained):
    """After a short run the samples look like the corpus: mostly letters and spaces, likely under its bigrams."""
    from titanlite.data.tokenizers import ByteTokenizer

    tmp, ckpt, res = trained
    argv = _train_argv(tmp)
    losses = res[0][0]
    assert losses[40] < losses[20] < 4.5
    tok = ByteTokenizer()
    texts = {}
    for name, c in (("untrained", None), ("trained", ckpt)):
        samples = _reference(
            argv,
            c,
            prompts=["The function", "Return the", "If the"],
            settings=[(0.8, 20, 1), (1.0, 0, 2)],
            new_tokens=64,
        )
        texts[name] = [tok.decode(ids) for ids in samples.values()]
    letters = {
        k: sum(ch.isascii() and (ch.isalpha() or ch == " ") for t in v for ch in t) / sum(map(len, v))
        for k, v in texts.items()
    }
    nll = {k: _bigram_nll(v) for k, v in texts.items()}
    print(letters, nll, texts["trained"])
    assert letters["trained"] > 0.75 and letters["trained"] > letters["untrained"] + 0.3, letters
    assert nll["trained"] < nll["untrained"] - 1.5, nll


def test_generate_cli_torchrun_matches_unsharded(trained):
    tmp, ckpt, _ = trained
    argv = _train_argv(tmp)
    ref = _reference(argv, ckpt)[(PROMPTS[0], SETTINGS[1])]
    from titanlite.data.tokenizers import ByteTokenizer

    env = subprocess_env()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--local-ranks-filter",
        "0",
        "-m",
        "titanlite.generate",
        "--config",
        "debug_model",
        *argv,
        "--checkpoint",
        str(tmp / "checkpoint"),  # the root: the newest step-N is used
        "--prompt",
        PROMPTS[0],
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--temperature",
        str(SETTINGS[1][0]),
        "--top-k",
        str(SETTINGS[1][1]),
        "--seed",
        str(SETTINGS[1][2]),
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert PROMPTS[0] + ByteTokenizer().decode(ref) in r.stdout, (r.stdout, ref)
    assert "FSDP: shard_size=2, weights gathered per block on demand" in r.stderr
    assert f"Generated {NEW_TOKENS} tokens in" in r.stderr and "tokens/s, KV cache)" in r.stderr
    assert "step-40" in r.stderr


def test_checkpoint_errors(tmp_path, trained):
    from titanlite.config import ConfigError, load
    from titanlite.generation import inference_model, load_weights, resolve_checkpoint

    _, ckpt, _ = trained
    assert resolve_checkpoint(str(ckpt.parent)) == ckpt
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="neither a DCP checkpoint"):
        resolve_checkpoint(str(tmp_path))
    model = inference_model(load(["--model.flavor", "debugmodel"]), 258, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"does not fit the model: 'tok_embeddings.weight' has shape \(258, 64\)"):
        load_weights(model, ckpt)


def test_a_user_error_on_several_processes_is_one_message_and_exit_2(tmp_path):
    """`generate --nproc 2` (titanlite's launcher) on an HF folder whose one KV head tp = 2 cannot split: the message
    once, with a hint that fits a folder (its config.json key, the valid degrees), exit 2, no traceback; under plain
    torchrun the message is printed once too (torchrun's own failure report and exit status follow it)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        bos_token_id=256,
        eos_token_id=257,
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(tmp_path / "hf")
    args = ["--checkpoint", str(tmp_path / "hf"), "--prompt", "hi", "--parallelism.tensor_parallel_degree", "2"]
    message = "does not divide the model's 1 KV heads (num_key_value_heads in " + str(tmp_path / "hf" / "config.json")
    r = subprocess.run(
        [sys.executable, "-m", "titanlite.generate", "--nproc", "2", *args],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 2 and out.count(message) == 1 and "valid: 1" in out, out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out and "or a flavor" not in out, out[-3000:]
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "titanlite.generate", *args],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (r.stdout + r.stderr).count(message) == 1, (r.stdout + r.stderr)[-3000:]
