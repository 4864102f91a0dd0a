"""Tensor parallelism composed with FSDP/HSDP: the same weights, losses and resume at every (replicate, shard, tp).

World sizes 1, 2 and 4 with gloo on CPU: TP(2) alone, FSDP(2) x TP(2), replicate(2) x TP(2), with accumulation,
block-causal attention and a Qwen3 flavor (qk-norm on each rank's heads)."""

import types

import pytest
import torch

from helpers import assert_same_hf_weights, ckpt_argv, make_trainer, run_distributed, tiny_argv

TP2 = ("--parallelism.tensor_parallel_degree", "2")


def _parallelism(shard=-1, replicate=1, tp=1, sp=True, lp=True):
    return types.SimpleNamespace(
        data_parallel_shard_degree=shard,
        data_parallel_replicate_degree=replicate,
        tensor_parallel_degree=tp,
        enable_sequence_parallel=sp,
        enable_loss_parallel=lp,
    )


def test_dims_mesh_names_and_ranks():
    from titanlite.parallel.dims import ParallelDims

    d = ParallelDims.from_config(_parallelism(replicate=2, tp=2), 8)
    assert (d.dp_replicate, d.dp_shard, d.tp, d.dp_degree) == (2, 2, 2, 4)
    assert d.mesh_dim_names == ("dp_replicate", "dp_shard", "tp") and d.mesh_shape == (2, 2, 2)
    assert [d.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # tp innermost: neighbours share data
    assert d.describe() == "HSDP: replicate_size=2, shard_size=2"
    assert d.describe_tp(True, True) == "TP: tensor_parallel_size=2 (sequence parallel, loss parallel)"
    assert d.describe_tp(False, False) == "TP: tensor_parallel_size=2"
    assert ParallelDims.from_config(_parallelism(), 4).describe_tp(True, True) is None
    one = ParallelDims.from_config(_parallelism(tp=4), 4)
    assert (one.dp_shard, one.mesh_dim_names, one.mesh_shape) == (1, ("dp_shard", "tp"), (1, 4))


def test_tp_validation_names_the_values(tmp_path):
    from titanlite.config import ConfigError, load
    from titanlite.parallel.dims import ParallelDims
    from titanlite.plan import validate_for_world

    with pytest.raises(ConfigError, match="tensor_parallel_degree = 2 does not divide the world size 3; valid: 1, 3"):
        ParallelDims.from_config(_parallelism(tp=2), 3)
    with pytest.raises(ConfigError, match="replicate_degree = 3 x data_parallel_shard_degree = 1 x tensor_paral"):
        ParallelDims.from_config(_parallelism(shard=1, replicate=3, tp=2), 4)

    def check(*extra, world=4):
        validate_for_world(load(tiny_argv(tmp_path, *extra)), world, device_type=None)

    with pytest.raises(ConfigError, match="= 4 does not divide the model's 2 KV heads .*not replicated"):
        check("--parallelism.tensor_parallel_degree", "4")  # tiny: 4 heads, 2 KV heads
    with pytest.raises(ConfigError, match="does not divide the vocabulary of 258 rows .*valid: 1, 2, 3, 6, 43$"):
        check("--parallelism.tensor_parallel_degree", "4", "--model.flavor", "debugmodel")
    check("--parallelism.tensor_parallel_degree", "4", "--model.flavor", "debugmodel", "--model.vocab_size", "260")
    with pytest.raises(ConfigError, match="training.seq_len = 30 is not a multiple of 4.*enable_sequence_parallel"):
        check("--parallelism.tensor_parallel_degree", "4", "--model.flavor", "debugmodel", "--model.vocab_size", "260",
              "--training.seq_len", "30")  # fmt: skip


def _train_tp(tmp, runs):
    """Per run (name, argv): the losses and the step-0 full weights."""
    out = {}
    for name, argv in runs:
        t = make_trainer(
            tiny_argv(f"{tmp}/{name}", "--training.global_batch_size", "8", "--training.steps", "6", *argv)
        )
        init = {k: v.full_tensor().detach().clone() for k, v in t.model.state_dict().items()}
        out[name] = (t.train(), init)
    return out


def _variants(extra=(), layouts=True):
    """The configurations of one variant by world size; layouts=False leaves out those that only vary the data
    parallelism or the loss's chunks around TP (the causal variant runs them: they do not depend on the attention or
    the family)."""
    replicate = ("--parallelism.data_parallel_replicate_degree", "2")
    delay = ("--parallelism.hsdp_delay_all_reduce",)
    no_sp_lp = ("--parallelism.enable_sequence_parallel", "false", "--parallelism.enable_loss_parallel", "false")
    runs = {
        1: [("single", ["--training.local_batch_size", "8", *extra])],
        2: [
            ("tp2", ["--training.local_batch_size", "8", *TP2, *extra]),  # the loss in chunks over the vocab split
            ("tp2_whole_loss", ["--training.local_batch_size", "8", *TP2, "--training.loss_chunk_tokens", "0", *extra]),
            (
                "tp2_chunks_of_37",
                ["--training.local_batch_size", "8", *TP2, "--training.loss_chunk_tokens", "37", *extra],
            ),
        ],
        4: [
            ("fsdp2_tp2", ["--training.local_batch_size", "4", *TP2, *extra]),
            ("replicate2_tp2", ["--training.local_batch_size", "4", *TP2, *replicate, *extra]),
            ("fsdp2_tp2_accum2", ["--training.local_batch_size", "2", *TP2, *extra]),
            ("replicate2_tp2_accum2_delay", ["--training.local_batch_size", "2", *TP2, *replicate, *delay, *extra]),
            ("fsdp2_tp2_no_sp_no_lp", ["--training.local_batch_size", "4", *TP2, *no_sp_lp, *extra]),
        ],
    }
    if not layouts:
        kept = {"single", "tp2", "tp2_whole_loss", "fsdp2_tp2", "fsdp2_tp2_no_sp_no_lp"}
        runs = {world: [r for r in rs if r[0] in kept] for world, rs in runs.items()}
    return runs


def _assert_same(results, ref_name="single"):
    ref_losses, ref_init = results[ref_name]
    assert sorted(ref_losses) == list(range(1, 7)) and ref_losses[6] < ref_losses[1]
    for name, (losses, init) in results.items():
        for k, v in ref_init.items():
            assert torch.equal(init[k], v), (name, k)  # bit-identical weights at step 0
        for step, loss in ref_losses.items():
            assert abs(losses[step] - loss) <= 1e-5 * abs(loss), (name, step, losses[step], loss)


VARIANTS = {
    "causal": (),
    "block_causal": ("--model.attention", "block_causal"),
    "qwen3_tied": ("--model.name", "qwen3", "--model.tie_embeddings"),
}


@pytest.mark.slow
def test_same_weights_and_losses_at_every_tp_topology(tmp_path):
    """Causal (every layout), block-causal and tied Qwen3 (TP with and without sequence and loss parallelism, the
    loss whole and in chunks), each against its own one-process run; one spawned world per size runs every
    variant's configurations."""
    by_world: dict[int, list] = {}
    for variant, extra in VARIANTS.items():
        for world, runs in _variants(extra, layouts=variant == "causal").items():
            by_world.setdefault(world, []).extend((f"{variant}/{name}", argv) for name, argv in runs)
    results = {}
    for world, runs in by_world.items():
        results.update(run_distributed(_train_tp, world, str(tmp_path / str(world)), runs)[0])
    for variant in VARIANTS:
        _assert_same({k.split("/", 1)[1]: v for k, v in results.items() if k.startswith(f"{variant}/")})


def _resume_tp(tmp, local, extra, save):
    base = ckpt_argv(tmp, "--training.local_batch_size", str(local), *extra)
    if save:
        t = make_trainer(base + ["--checkpoint.folder", "a", "--checkpoint.interval", "3"])
        losses = t.train()
        resumed = make_trainer(base + ["--checkpoint.folder", "a", "--checkpoint.load_step", "3"]).train()
        return {"losses": losses, "resumed": resumed}
    return {"resumed": make_trainer(base + ["--checkpoint.folder", "a", "--checkpoint.load_step", "3"]).train()}


@pytest.mark.slow
def test_resume_exact_under_fsdp_tp_and_on_other_topologies(tmp_path):
    saved = run_distributed(_resume_tp, 4, str(tmp_path), 2, TP2, True)[0]  # FSDP(2) x TP(2), accumulation 2
    ref = saved["losses"]
    assert saved["resumed"] == {s: ref[s] for s in (4, 5, 6)}  # exact on the same topology
    for world, local, extra in ((1, 4, ()), (2, 4, TP2), (4, 1, ())):  # one process, TP(2), FSDP(4)
        resumed = run_distributed(_resume_tp, world, str(tmp_path), local, extra, False)[0]["resumed"]
        assert sorted(resumed) == [4, 5, 6]
        for s in (4, 5, 6):
            assert abs(resumed[s] - ref[s]) <= 1e-5 * ref[s], (world, extra, s)


def _hf_under_tp(folder, out):
    """Import a HF folder under FSDP(2) x TP(2) (the full weights), export it back as a HF folder, and greedy-generate
    with the weights kept split (tp 2, no sequence or loss parallelism) from the imported folder."""
    import torch.distributed as dist

    from titanlite.checkpoint.hf_io import save_hf_sharded
    from titanlite.config import load
    from titanlite.data.tokenizers import ByteTokenizer
    from titanlite.generation import generate, inference_model, load_weights
    from titanlite.parallel.dims import ParallelDims
    from titanlite.runtime.distributed import init_distributed

    init_distributed()
    argv = tiny_argv(
        f"{out}/run", "--model.name", "qwen2", "--model.flavor", "hf", "--checkpoint.initial_load_path", folder, *TP2
    )
    t = make_trainer(argv + ["--training.local_batch_size", "4", "--training.global_batch_size", "8"])
    full = {k: v.full_tensor() for k, v in t.model.state_dict().items()}
    save_hf_sharded(t.model, f"{out}/export", torch.float32, ByteTokenizer())
    cfg = load(argv)
    dims = ParallelDims.from_config(cfg.parallelism, dist.get_world_size())
    model = inference_model(cfg, 258, torch.device("cpu"), dims.build_meshes("cpu"))
    load_weights(model, folder)
    tokens = generate(model, [1, 2, 3, 4, 5], 32)
    return full if dist.get_rank() == 0 else None, tokens, model.layers[0].attention.n_kv_heads


@pytest.mark.slow
def test_hf_import_export_and_generation_under_tp(tmp_path):
    """A Qwen2 folder (q/k/v biases, permuted with their rows) under FSDP(2) x TP(2): bit-identical import, an export
    equal to the one-process export, and KV-cache generation equal to one process."""
    transformers = pytest.importorskip("transformers")
    from test_model_families import _titanlite_from, hf_family_model

    from titanlite.checkpoint.hf_io import save_hf_sharded
    from titanlite.data.tokenizers import ByteTokenizer
    from titanlite.generation import generate

    hf_family_model(tmp_path / "hf", "qwen2", tied=True)
    ref = _titanlite_from(tmp_path / "hf")
    save_hf_sharded(ref, tmp_path / "export1", torch.float32, ByteTokenizer())
    ref_tokens = generate(ref, [1, 2, 3, 4, 5], 32)
    res = run_distributed(_hf_under_tp, 4, str(tmp_path / "hf"), str(tmp_path))
    full = res[0][0]
    for k, v in ref.state_dict().items():
        assert torch.equal(full[k], v), k
    assert_same_hf_weights(tmp_path / "export1", tmp_path / "export")
    back = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "export").eval()
    x = torch.randint(0, 300, (1, 50))
    with torch.no_grad():
        assert (back(x).logits - ref(x)).abs().max() < 1e-5
    for _, tokens, local_kv_heads in res:
        assert tokens == ref_tokens and local_kv_heads == 1  # 2 KV heads over tp 2


def _tp_activation_peak(ac_name, chunk):
    """Rank 0's MemTracker activation peak (Activation + Temp bytes) of one forward and backward of the tiny model
    (vocabulary 4096) split over tp = 2 with sequence and loss parallelism, and the dry run's estimate."""
    import types

    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh

    from titanlite.loss import loss_parallel_context, microbatch_loss
    from titanlite.models.decoder import Transformer
    from titanlite.models.decoder_tp import parallelize_decoder
    from titanlite.models.llama3 import LLAMA3_FLAVORS
    from titanlite.parallel.ac import apply_ac
    from titanlite.runtime.distributed import init_distributed
    from titanlite.sizing.memory import activation_bytes

    init_distributed()
    args = LLAMA3_FLAVORS["tiny"].with_overrides(vocab_size=4096, n_layers=4)
    with torch.device("meta"):
        model = Transformer(args)
    parallelize_decoder(
        model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sequence_parallel=True, loss_parallel=True
    )
    ac = types.SimpleNamespace(
        mode="full" if ac_name == "full" else "none", selective_ac_option="2", selective_op_policy="all_matmuls"
    )
    wrapped = apply_ac(model, ac)
    model.to_empty(device="cpu")
    model.init_weights(0)
    model.loss_chunk_tokens = chunk
    g = torch.Generator().manual_seed(0)
    batch, seq = 4, 64
    tokens, labels = (torch.randint(0, 4096, (batch, seq), generator=g) for _ in range(2))
    tracker = MemTracker()
    tracker.track_external(model, tokens)
    with tracker, loss_parallel_context(chunk == 0):
        loss, _ = microbatch_loss(model, (tokens, labels), torch.device("cpu"))
        loss.backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    measured = sum(v for k, v in peak.items() if k != "Total" and k.value in ("Activation", "Temp"))
    if chunk:  # the output weight's gradient (this rank's rows), made inside forward; FSDP's buffer in a run
        measured -= 4096 // 2 * args.dim * 4
    est = activation_bytes(args, batch * seq, 4, wrapped, False, loss_chunk_tokens=chunk, tp=2)["total"]
    return measured, est


@pytest.mark.slow
def test_activation_estimate_under_tp_matches_memtracker():
    for ac_name, chunk in (("none", 0), ("none", 64), ("full", 64)):
        measured, est = run_distributed(_tp_activation_peak, 2, ac_name, chunk)[0]
        assert 0.9 < est / measured < 1.15, (ac_name, chunk, measured, est)


def _compiled_against_eager(tmp, runs):
    """Per run (name, argv): the losses of 3 steps and every parameter's full gradient after one more microbatch
    pass. Compiled runs go twice over one inductor cache (cold, then warm after a dynamo reset)."""
    import os

    from titanlite.loss import loss_parallel_context

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{tmp}/inductor_cache"
    out = {}
    for name, argv in runs:
        for cache in ("cold", "warm") if "--compile.enable" in argv else ("eager",):
            torch._dynamo.reset()
            t = make_trainer(tiny_argv(f"{tmp}/{name}_{cache}", "--training.steps", "3", *argv))
            losses = t.train()
            for mb in t.dataloader.next_step().microbatches:
                with loss_parallel_context(t.loss_parallel):
                    loss, _ = t.objective(t.model, mb, t.device)
                    loss.backward()
            grads = {n: p.grad.full_tensor() for n, p in t.model.named_parameters()}
            out[f"{name}_{cache}"] = (losses, grads)
    return out


def _assert_compiled_equals_eager(results):
    for name, (losses, grads) in results.items():
        ref_losses, ref_grads = results[name.rsplit("_", 1)[0] + "_eager"]
        for step, loss in ref_losses.items():
            assert abs(losses[step] - loss) <= 1e-5 * abs(loss), (name, step, losses[step], loss)
        for k, g in ref_grads.items():
            assert g.abs().max() > 0, (name, k)  # every parameter gets a gradient (the embedding's was zero)
            assert (grads[k] - g).abs().max() <= 1e-5 * g.abs().max(), (name, k)


@pytest.mark.slow
def test_tp_with_compile_equals_eager_on_a_cold_and_a_warm_cache(tmp_path):
    """torch.compile (inductor) under FSDP(2) x TP(2), tied Qwen3: the same losses and every parameter's gradient as
    eager, with inductor's cache cold and warm (a warm cache once halved the loss). (TP(2) alone compiles the same
    tensor-parallel blocks; its own case cost half a minute of the suite.)"""
    compile_on = ("--compile.enable", "--compile.backend", "inductor")
    # tied Qwen3 (qk-norm, the embedding and output one weight) with the whole-microbatch loss-parallel path
    fsdp_tp = ("--training.global_batch_size", "4", "--training.local_batch_size", "2", *TP2, "--model.name", "qwen3",
               "--model.tie_embeddings", "--training.loss_chunk_tokens", "0")  # fmt: skip
    four = [("fsdp2_tp2_qwen3_tied", fsdp_tp), ("fsdp2_tp2_qwen3_tied", (*fsdp_tp, *compile_on))]
    _assert_compiled_equals_eager(run_distributed(_compiled_against_eager, 4, str(tmp_path / "four"), four)[0])
