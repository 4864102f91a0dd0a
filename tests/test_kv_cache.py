"""KV-cache generation: a cached forward equals the full one, greedy tokens equal the no-cache loop (causal
and block-causal models, fp32), the stop at max_seq_len, the cache's layout, the log line, the CLI switch."""

import logging

import pytest
import torch

from titanlite.generation import GenerationTiming, generate, generate_timed
from titanlite.models.decoder import Transformer
from titanlite.models.kv_cache import KVCache
from titanlite.models.llama3 import LLAMA3_FLAVORS

from helpers import compute_device, tiny_argv


def _model(attention="causal", max_seq_len=2048, seed=0, **kw):
    args = LLAMA3_FLAVORS["tiny"].with_overrides(vocab_size=258, attention=attention, max_seq_len=max_seq_len, **kw)
    with torch.device(compute_device()):
        model = Transformer(args)
    model.init_weights(seed)
    return model.eval()


@torch.no_grad()
def reference_greedy(model, prompt, new_tokens):
    """Today's generation without a cache: the whole (cropped) sequence each step; a block-causal model sees
    it as one document (positions 0, 1, ...), through its block-causal mask."""
    tokens, max_len = list(prompt), model.args.max_seq_len
    for _ in range(new_tokens):
        window = torch.tensor([tokens[-max_len:]], device=compute_device())
        positions = torch.arange(window.shape[1], device=window.device)[None]
        logits = model(window, positions) if model.args.attention == "block_causal" else model(window)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("attention", ["causal", "block_causal"])
def test_cached_forward_equals_the_full_forward(attention):
    """Prefill, single-token decode and a multi-token chunk at a non-empty offset (explicit mask), batch 2, GQA."""
    model = _model(attention)
    tokens = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(0)).to(compute_device())
    cache = KVCache.for_model(model, 24, batch=2)
    with torch.no_grad():
        full = model(tokens)
        chunks = [(0, 9), (9, 10), (10, 17), (17, 18)] + [(i, i + 1) for i in range(18, 24)]
        parts = [model(tokens[:, a:b], cache=cache) for a, b in chunks]
    assert cache.offset == 24
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["causal", "block_causal"])
def test_greedy_tokens_equal_the_no_cache_loop(attention):
    model = _model(attention, seed=1)
    for seed in range(3):
        prompt = torch.randint(0, 258, (5 + 3 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        cached = generate(model, prompt, 32)
        assert cached == reference_greedy(model, prompt, 32)
        assert cached == generate(model, prompt, 32, kv_cache=False)
    # sampled: the same draws from the same generator
    kw = dict(temperature=0.9, top_k=20, seed=3)
    assert generate(model, prompt, 32, **kw) == generate(model, prompt, 32, kv_cache=False, **kw)


def test_stops_at_max_seq_len_with_one_line(caplog):
    model = _model(max_seq_len=16)
    prompt = list(range(1, 11))
    ref = reference_greedy(model, prompt, 20)  # goes on with a cropped window
    with caplog.at_level(logging.INFO, logger="titanlite"):
        new = generate(model, prompt, 20)
    assert new == ref[:7]  # positions 10..15 fed, the 7th token needs no forward
    assert "Stopped after 7 new tokens: the sequence reached 16 positions, the model's limit" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titanlite"):
        assert generate(model, prompt, 7) == ref[:7]  # exactly fits: no message
        assert "Stopped" not in caplog.text
        long_prompt = list(range(1, 21))
        assert generate(model, long_prompt, 3) == reference_greedy(model, long_prompt, 1)
    assert "The prompt's 20 tokens exceed max_seq_len = 16: keeping its last 16" in caplog.text


def test_cache_layout_dtype_and_heads():
    model = _model()
    cache = KVCache.for_model(model, 12)
    assert cache.max_len == 12 and cache.offset == 0 and cache.nbytes == 0  # allocated at the first write
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]], device=compute_device()), cache=cache)
    args = model.args
    for layer in cache.layers:
        assert layer.k.shape == layer.v.shape == (1, args.kv_heads, 12, args.head_dim)
        assert layer.k.dtype == torch.float32 and layer.k.device.type == compute_device().type
    assert cache.offset == 3 and cache.nbytes == 2 * args.n_layers * args.kv_heads * 12 * args.head_dim * 4
    bf16 = _model()
    for part in (bf16.tok_embeddings, bf16.layers, bf16.norm, bf16.output):  # not the complex RoPE table
        part.to(torch.bfloat16)
    cache = KVCache.for_model(bf16, 8)
    with torch.no_grad():
        bf16(torch.tensor([[1, 2]], device=compute_device()), cache=cache)
    assert cache.layers[0].k.dtype == torch.bfloat16  # the dtype the model computes in
    # the head count is each attention module's (a tensor-parallel plan leaves a rank fewer heads)
    model.layers[1].attention.n_kv_heads = 1
    assert [layer.kv_heads for layer in KVCache.for_model(model, 4).layers] == [args.kv_heads, 1]
    fixed = KVCache([(2, 16)], 4, batch=3, dtype=torch.float16)
    assert fixed.layers[0].k.shape == (3, 2, 4, 16) and fixed.layers[0].k.dtype == torch.float16


def test_cache_misuse_is_refused():
    model = _model(max_seq_len=16)
    with pytest.raises(ValueError, match="longer than the model's max_seq_len = 16"):
        KVCache.for_model(model, 17)
    cache = KVCache.for_model(model, 4)
    tokens = torch.tensor([[1, 2, 3]], device=compute_device())
    with torch.no_grad():
        model(tokens, cache=cache)
        with pytest.raises(ValueError, match="KV cache full: 3 of 4 positions filled, 3 more do not fit"):
            model(tokens, cache=cache)
        with pytest.raises(ValueError, match="takes no positions"):
            model(tokens[:, :1], torch.zeros(1, 1, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="batch 1, 2 kv heads"):
            model(torch.ones(2, 1, dtype=torch.long, device=compute_device()), cache=cache)


def test_timing_line():
    line = GenerationTiming(12, 64, 0.02, 0.43, True).describe()
    assert line == "Generated 64 tokens in 0.43 s (prefill 12 tokens 0.02 s, decode 153.7 tokens/s, KV cache)"
    assert "decode -, no KV cache" in GenerationTiming(3, 1, 0.01, 0.01, False).describe()
    new, timing = generate_timed(_model(), [1, 2, 3], 5)
    assert (timing.prompt_tokens, timing.new_tokens, timing.kv_cache) == (3, 5, True) and len(new) == 5
    assert 0 < timing.prefill_s <= timing.total_s


def test_cli_no_kv_cache_switch_gives_the_same_greedy_text(tmp_path, caplog, monkeypatch):
    from titanlite.cli.generate import run

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = [*tiny_argv(tmp_path), "--checkpoint", "none", "--prompt", "The function", "--temperature", "0"]
    argv += ["--max-new-tokens", "24"]
    with caplog.at_level(logging.INFO, logger="titanlite"):
        cached = run(argv)
        assert "Generated 24 tokens in" in caplog.text and "tokens/s, KV cache)" in caplog.text
        assert run([*argv, "--no-kv-cache"]) == cached
    assert "tokens/s, no KV cache)" in caplog.text


@pytest.mark.slow
def test_cache_path_under_compiled_blocks():
    """Inference never compiles blocks, but a compiled model decodes from the cache too (a graph for the
    prefill, one for the decode steps)."""
    model, compiled = _model(seed=2), _model(seed=2)
    for block in compiled.layers:
        block.compile(backend="aot_eager", fullgraph=True)
    prompt = [1, 5, 9, 200, 17]
    assert generate(compiled, prompt, 24) == reference_greedy(model, prompt, 24)


def test_a_tiny_temperature_samples_as_its_limit_greedy():
    """--temperature 1e-300 ended in a raw traceback (logits / T overflowed to inf - inf); it is the greedy limit."""
    from titanlite.generation import sample_next

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(258, generator=g) * 5
    for t in (1e-300, 1e-30, 5e-324):
        assert sample_next(logits, t, 0, g).item() == logits.argmax().item()
        assert sample_next(logits.bfloat16(), t, 5, g).item() == logits.bfloat16().argmax().item()
    model = _model()
    assert generate(model, [1, 2, 3], 8, temperature=1e-300) == generate(model, [1, 2, 3], 8, temperature=0.0)


def test_a_tp_change_on_resume_is_listed():
    from titanlite.checkpoint.resume import describe_changes
    from titanlite.config import load

    saved, now = load([]), load(["--parallelism.tensor_parallel_degree", "2"])
    lines = describe_changes(saved, now, 10, 80, None, 1e-3)
    assert lines == ["parallelism.tensor_parallel_degree: 1 -> 2: the model and optimizer are resharded"]


@pytest.mark.parametrize("kv_cache", [True, False])
def test_generation_projects_only_the_last_position(kv_cache):
    """A long prompt never makes its whole (prompt x vocab) logits: generation projects the last position alone, and
    its logits are the full forward's last row."""
    model = _model()
    prompt = torch.randint(0, 258, (1, 40), generator=torch.Generator().manual_seed(3), device=compute_device())
    with torch.no_grad():
        assert torch.allclose(model(prompt, last_only=True), model(prompt)[:, -1:], atol=1e-6)
    rows = []
    model.output.register_forward_hook(lambda m, inputs, out: rows.append(out.shape[1]))
    generate(model, prompt[0].tolist(), 3, kv_cache=kv_cache)
    assert rows == [1, 1, 1]
