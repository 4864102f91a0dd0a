"""The dry run: sizes the 8B and 70B jobs on a fake process group and catches the run's config errors."""

import dataclasses
import os
import re
import subprocess
from pathlib import Path

import pytest

from titanlite.cli import dry_run
from titanlite.sizing.memory import BackwardPeak, backward_peak, forward_end_buffer_bytes

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024**3


def _launcher(args, ngpu="8", nnodes="2"):
    env = {**os.environ, "NGPU": ngpu, "NNODES": nnodes, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(["./run_train.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _table(out: str) -> dict[str, float]:
    """GiB per row name of the memory table."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^  (\w[\w ]*?)\s{2,}.*?([0-9.]+)$", out, re.M)}


@pytest.mark.slow
def test_launcher_dry_run_8b_hsdp_on_16_gpus():
    r = _launcher(["--config", "llama8b_hsdp", "--dry-run", "--dry-run-gpu-mem-gib", "80"])
    out = r.stdout
    assert r.returncode == 0, r.stdout + r.stderr
    assert "torchrun" not in r.stderr and "world: 16 ranks = NNODES 2 x NGPU 8" in out
    assert "HSDP: replicate_size=2, shard_size=8" in out and "Sharded 34 modules + root" in out
    assert "Activation checkpointing: selective op on 32 of 32 blocks" in out
    rows = _table(out)
    params_gib = 8_030_261_248 * 4 / 8 / GIB  # fp32 master weights over a shard group of 8
    assert abs(rows["parameters"] - params_gib) < 0.01 and rows["gradients"] == rows["parameters"]
    assert abs(rows["optimizer"] - 2 * params_gib) < 0.01
    assert rows["total on GPU"] < 72 and "fits: yes" in out


def _main(capsys, world, *argv):
    code = dry_run.main(["--world-size", str(world), *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_dry_run_8b_configs_fit_and_need_ac(capsys):
    code, out, _ = _main(capsys, 16, "--job.config_file", "llama8b_fsdp")
    assert code == 0 and "FSDP: shard_size=16" in out and "fits: yes" in out
    fsdp = _table(out)
    assert abs(fsdp["parameters"] - 8_030_261_248 * 4 / 16 / GIB) < 0.01
    # without activation checkpointing 8B at seq_len 8192 does not fit an 80 GB GPU with 2 sequences per rank
    no_ac = ("--activation_checkpoint.mode", "none", "--training.local_batch_size", "2")
    code, out, _ = _main(capsys, 16, "--job.config_file", "llama8b_hsdp", *no_ac, "--training.global_batch_size", "32")
    assert code == 1 and "fits: no" in out
    none = _table(out)
    full_ac = ("--activation_checkpoint.mode", "full", "--training.local_batch_size", "2")
    code, out, _ = _main(
        capsys, 16, "--job.config_file", "llama8b_hsdp", *full_ac, "--training.global_batch_size", "32"
    )
    full = _table(out)
    assert code == 0 and full["activations"] < none["activations"] / 3
    assert full["parameters"] == none["parameters"]  # AC does not change the sharding


def test_dry_run_70b(capsys):
    code, out, _ = _main(capsys, 16, "--job.config_file", "llama70b_fsdp")
    assert code == 1 and "fits: no" in out and "70.55B parameters" in out
    code, out, _ = _main(capsys, 64, "--job.config_file", "llama70b_fsdp")
    assert code == 0 and "FSDP: shard_size=64" in out and "fits: yes" in out
    assert "Activation checkpointing: full on 80 of 80 blocks" in out
    # a bigger GPU budget changes only the verdict
    code, out, _ = _main(capsys, 16, "--job.config_file", "llama70b_fsdp", "--dry-run-gpu-mem-gib=141")
    assert code == 0 and "GPU memory    141.00 GiB" in out


def _pipeline_rows(out) -> dict[int, list[float]]:
    """Pipeline rank -> (params, grads, optim, gathered, activations, in flight, total) GiB from the pp table."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("  rank "):
            words = line.replace("(", " ").replace(")", " ").split()
            rows[int(words[1])] = [float(w) for w in words[4:]]
    return rows


def test_dry_run_405b_3d_per_pipeline_rank(capsys):
    code, out, _ = _main(capsys, 512, "--job.config_file", "llama405b_3d")
    assert code == 0 and "PP: pipeline_parallel_size=8; FSDP: shard_size=8" in out and "fits: yes" in out
    assert "126 blocks in 8 stages of 15, 16, 16, 16, 16, 16, 16, 15 (by parameters)" in out
    assert "bubble 17.9% in theory" in out
    rows = _pipeline_rows(out)
    assert sorted(rows) == list(range(8))
    assert [rows[r][5] for r in range(8)] == [8, 7, 6, 5, 4, 3, 2, 1]  # 1F1B: the first stage holds the most
    # every rank's fp32 parameter shards together are the model (x tp x dp), within the norms tp replicates
    assert abs(sum(r[0] for r in rows.values()) * 64 * GIB / 4 / 405.85e9 - 1) < 0.01
    code, out, _ = _main(capsys, 512, "--job.config_file", "llama405b_3d",
                         "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B")  # fmt: skip
    inter = _pipeline_rows(out)
    assert "16 stages of 7, 8," in out and "bubble 9.9% in theory" in out and inter[0][5] == 11.5
    assert inter[0][4] > rows[0][4]  # interleaving holds more activations in flight (in stage chunks)


def test_dry_run_catches_the_runs_config_errors(capsys):
    r = _launcher(["--config", "llama8b_hsdp", "--dry-run", "--parallelism.data_parallel_replicate_degree", "3"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "data_parallel_replicate_degree = 3 does not divide the world size 16" in r.stderr
    for argv, needle in [
        (["--training.global_batch_size", "24"], "training.global_batch_size = 24 is not a multiple"),
        (["--activation_checkpoint.selective_ac_option", "33"], "checkpoints no block of the 32"),
        (["--parallelism.fsdp_reshard_after_forward", "3"], "must divide the shard degree 8"),
        (["--model.tokenizer_path", "/no/such/tokenizer.json"], "model.tokenizer_path = '/no/such"),
        (["--training.dataset", "/no/such/data.jsonl"], "training.dataset = '/no/such/data.jsonl'"),
        (["--model.vocab_size", "100"], "model.vocab_size = 100"),
        (["--dry-run-gpu-mem-gib", "lots"], "--dry-run-gpu-mem-gib = 'lots'"),
    ]:
        code, _, err = _main(capsys, 16, "--job.config_file", "llama8b_hsdp", *argv)
        assert code == 2 and needle in err, (argv, err)


@pytest.mark.parametrize(
    "policy, sharded, in_forward, expected",
    [  # units 10, 5, 8 in forward order, the output in the last; compute 2 bytes, reduce 4. Backward peaks at
        # the 5-unit: its parameters and gradient (2 x 10) beside the 8-unit's reduce-scatter input (32), with
        # the 10-unit prefetched (20)
        ("default", True, False, (8 * 2, 52 + 20)),  # the loss after forward: the output unit only
        ("default", True, True, (8 * 2 * 3, 52 + 20)),  # the loss in forward: its gradient, the all-gather output
        ("default", False, True, (8 * 2 * 2, 52 + 20)),  # one rank: no all-gather output is kept
        ("never", True, False, (8 * 2 + (10 + 5) * 2, 10 * (2 + 4) + (10 + 5) * 2)),  # nothing to prefetch
        ("2", True, False, (8 * 2 + 23, 52 + 20 + 23)),  # every unit keeps half its shard
    ],
)
def test_fsdp_buffer_bytes(policy, sharded, in_forward, expected):
    forward_end = forward_end_buffer_bytes([10, 5, 8], 8, 2, policy, sharded=sharded, loss_in_forward=in_forward)
    assert (forward_end, _backward_buffers([10, 5, 8], 8, policy)) == expected


def _backward_buffers(units, output_unit, policy):
    """FSDP's largest buffers over backward: the walk with no activations and no gradients (compute 2, reduce 4)."""
    return backward_peak(units, [None] * len(units), [], [], 0, 0, output_unit, 2, 4, policy).buffers


def test_backward_walk_unit_by_unit():
    # units: embedding 10, blocks 6 and 4, output 8; each block keeps 100 bytes of activations, the second is
    # checkpointed (rebuilds 50); the final norm keeps 7; 46 bytes of gradients (2 per unit parameter); a = 2, r = 4
    walk = lambda policy: backward_peak([10, 6, 4, 8], [None, 0, 1, None], [100, 100], [0, 50], 7, 56, 8, 2, 4,
                                        policy)  # fmt: skip
    # the candidates, unit by unit from the last: output 8 (buffers max(48, 32) + 4 * 2; both blocks and the norm),
    # block 1 (max(24, 16 + 32) + 12; blocks 0, 1, its rebuild, the norm; 16 of gradients),
    # block 0 (max(36, 24 + 16) + 20; block 0 and the norm; 24 of gradients), embedding (max(60, 40 + 24); 36)
    assert walk("default") == BackwardPeak(buffers=48 + 12, activations=200 + 50 + 7, grads=16)
    never = walk("never")  # everything stays gathered, nothing to prefetch: (10 + 6 + 4) * 2 kept
    assert never == BackwardPeak(buffers=48 + 40, activations=257, grads=16)


def test_reduce_scatter_counts_the_unit_gathered_before_it():
    # the 12-unit's gradient and reduce-scatter input (72) with the 8-unit gathered before it (16) beat the
    # 5-unit's 30 with the 12-unit gathered (24), and the 8-unit's 48 with nothing
    assert _backward_buffers([8, 12, 5], 5, "default") == 12 * 6 + 8 * 2


# Peaks measured on one H200 (torch 2.11, bf16, seq 8192, local batch 2, selective 'op' AC, the loss of the whole
# microbatch at once, as titanlite computed it then; docs/performance.md):
# (flavor, blocks, compile) -> torch.cuda.max_memory_allocated in GiB.
MEASURED_H200_PEAKS = {
    ("1B", 16, False): 51.13,
    ("1B", 16, True): 34.47,
    ("8B", 15, False): 96.55,
    ("8B", 15, True): 79.02,
    # 2026-11-26: the loss in chunks of 1024 tokens, compile off
    ("1B", 16, False, "--training.loss_chunk_tokens", "1024"): 29.92,
}


def _estimate(monkeypatch, flavor, blocks, compiled, *extra):
    from titanlite.config import load
    from titanlite.models.llama3 import LLAMA3_FLAVORS
    from titanlite.plan import validate_for_world
    from titanlite.sizing.report import estimate

    monkeypatch.setitem(LLAMA3_FLAVORS, "cut", dataclasses.replace(LLAMA3_FLAVORS[flavor], n_layers=blocks))
    argv = ["--model.flavor", "cut", "--training.seq_len", "8192", "--training.local_batch_size", "2"]
    argv += ["--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "selective"]
    argv += ["--activation_checkpoint.selective_ac_option", "op", *(["--compile.enable"] if compiled else []), *extra]
    if "--training.loss_chunk_tokens" not in extra:
        argv += ["--training.loss_chunk_tokens", "0"]
    cfg = load(argv + (["--training.global_batch_size", "2"] if "--training.global_batch_size" not in extra else []))
    return estimate(cfg, validate_for_world(cfg, 1, device_type=None), 1)


@pytest.mark.parametrize("shape", list(MEASURED_H200_PEAKS))
def test_estimate_is_within_ten_percent_of_the_measured_gpu_peak(monkeypatch, shape):
    est = _estimate(monkeypatch, *shape)
    assert abs(est.gpu_total / GIB / MEASURED_H200_PEAKS[shape] - 1) < 0.10, (shape, est.gpu_total / GIB)


def test_estimate_is_within_ten_percent_of_the_measured_moe_peak(monkeypatch):
    """Qwen3-30B-A3B cut to 11 of its 48 blocks on one H200 (2026-11-26): bf16, seq 8192, local batch 1, selective
    'op' AC: torch.cuda.max_memory_allocated 117.11 GiB."""
    from titanlite.config import load
    from titanlite.models.qwen3_moe import QWEN3_MOE_FLAVORS
    from titanlite.plan import validate_for_world
    from titanlite.sizing.report import estimate

    monkeypatch.setitem(QWEN3_MOE_FLAVORS, "cut", dataclasses.replace(QWEN3_MOE_FLAVORS["30B-A3B"], n_layers=11))
    cfg = load(["--model.name", "qwen3_moe", "--model.flavor", "cut", "--training.seq_len", "8192",
                "--training.local_batch_size", "1", "--training.global_batch_size", "1",
                "--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "selective",
                "--activation_checkpoint.selective_ac_option", "op"])  # fmt: skip
    est = estimate(cfg, validate_for_world(cfg, 1, device_type=None), 1)
    assert abs(est.gpu_total / GIB / 117.11 - 1) < 0.10, est.gpu_total / GIB


def test_estimate_rules_for_gradients_and_the_compiled_loss(monkeypatch):
    eager, compiled = _estimate(monkeypatch, "1B", 2, False), _estimate(monkeypatch, "1B", 2, True)
    tokens, vocab = 2 * 8192, 128256  # Llama 3.2 1B
    assert eager.activations["loss or recompute"] == tokens * vocab * 12  # logits, fp32 copy, fp32 log_softmax
    assert compiled.activations["loss or recompute"] == tokens * vocab * 2  # the bf16 logits only
    chunked = _estimate(monkeypatch, "1B", 2, False, "--training.loss_chunk_tokens", "1024", "--model.vocab_size",
                        "1024000")  # fmt: skip
    assert chunked.activations["loss or recompute"] == 1024 * 1024000 * 10  # one chunk: logits, fp32 copy, softmax
    # one microbatch: backward frees activations as it makes gradients, so the peak is the larger moment
    act, forward_end, walk = eager.activations, eager.forward_end_buffers, eager.backward
    assert eager.moments() == {
        "end of forward": forward_end + act["total"],
        "backward": walk.total,
        "optimizer step": eager.grads,
    }
    assert eager.gpu_total == eager.params + eager.optimizer + max(eager.moments().values())
    # accumulation: the gradients of earlier microbatches stay beside the next one's activations
    accum = _estimate(monkeypatch, "1B", 2, False, "--training.global_batch_size", "4")
    assert accum.grads_with_activations and accum.held_grads == accum.grads
    assert accum.moments() == {
        "end of forward": forward_end + act["total"] + accum.grads,
        "backward": walk.total - walk.grads + accum.grads,
        "optimizer step": accum.grads,
    }


def test_last_microbatch_only_holds_every_units_unsharded_gradient():
    from titanlite.config import load
    from titanlite.plan import validate_for_world
    from titanlite.sizing.report import estimate

    def sized(sync):
        cfg = load(["--job.config_file", "llama8b_fsdp", "--training.global_batch_size", "16",
                    "--parallelism.gradient_sync", sync])  # fmt: skip
        return estimate(cfg, validate_for_world(cfg, 8, device_type=None), 8)

    every, last_only = sized("every_microbatch"), sized("last_microbatch_only")
    assert every.held_grads == every.grads  # this rank's fp32 shards
    # every unit's whole gradient in the reduce dtype (fp32): the whole model's, the final norm being in the output's
    assert last_only.held_grads == last_only.total_params * 4
    assert last_only.gpu_total - every.gpu_total == last_only.held_grads - every.held_grads > 25 * GIB


def test_dry_run_sizes_qwen3_8b_and_32b(capsys):
    """The Qwen3 fine-tuning config on 2 x 8 GPUs without its HF folder: 8B fits with selective AC; 32B does not,
    but does with full AC over FSDP(16)."""
    no_files = (
        "--job.config_file",
        "qwen3_8b_finetune",
        "--model.tokenizer_path",
        "",
        "--checkpoint.initial_load_path",
        "",
    )
    code, out, _ = _main(capsys, 16, *no_files)
    assert code == 0 and "model: qwen3 8B, 8.19B parameters, 36 blocks" in out and "fits: yes" in out
    assert "HSDP: replicate_size=2, shard_size=8" in out
    assert abs(_table(out)["parameters"] - 8_190_735_360 * 4 / 8 / GIB) < 0.01
    code, out, _ = _main(capsys, 16, *no_files, "--model.flavor", "32B")
    assert code == 1 and "model: qwen3 32B, 32.76B parameters, 64 blocks" in out and "fits: no" in out
    full = ("--activation_checkpoint.mode", "full", "--parallelism.data_parallel_replicate_degree", "1")
    code, out, _ = _main(capsys, 16, *no_files, "--model.flavor", "32B", *full)
    assert code == 0 and "fits: yes" in out


def test_dry_run_sizes_qwen3_moe_with_expert_parallelism(capsys):
    """Qwen3-30B-A3B fine-tuning on 8 GPUs (FSDP 8 x EP 8, full AC) fits; its state is 1/8 of the model's; EP keeps
    each rank from gathering every expert; 235B-A22B fits on 64 GPUs."""
    no_files = ("--job.config_file", "qwen3_30b_a3b_finetune", "--model.tokenizer_path", "",
                "--checkpoint.initial_load_path", "")  # fmt: skip
    code, out, _ = _main(capsys, 8, *no_files)
    assert code == 0 and "model: qwen3_moe 30B-A3B, 30.53B parameters, 48 blocks" in out and "fits: yes" in out
    assert "EP: expert_parallel_size=8, experts FSDP-sharded over 1 rank(s)" in out
    assert "MoE: 128 experts, top-8, EP=8 (16 experts per rank)" in out and "3.35B active parameters" in out
    table = _table(out)
    assert abs(table["parameters"] - 30_532_122_624 * 4 / 8 / GIB) < 0.01
    code, fsdp_only, _ = _main(capsys, 8, *no_files, "--parallelism.expert_parallel_degree", "1")
    assert _table(fsdp_only)["FSDP buffers"] > 2 * table["FSDP buffers"]  # each block's 128 experts gathered
    code, out, _ = _main(capsys, 8, *no_files, "--activation_checkpoint.mode", "selective",
                         "--activation_checkpoint.selective_ac_option", "op")  # fmt: skip
    assert code == 1 and "fits: no" in out
    code, out, _ = _main(capsys, 64, "--model.name", "qwen3_moe", "--model.flavor", "235B-A22B",
                         "--parallelism.expert_parallel_degree", "32", "--training.seq_len", "4096",
                         "--training.local_batch_size", "1", "--activation_checkpoint.mode", "full")  # fmt: skip
    assert code == 0 and "fits: yes" in out and "235.09B parameters" in out


def test_dry_run_sizes_an_moe_with_pipeline_and_expert_parallelism(capsys):
    """Qwen3-30B-A3B on 16 GPUs as PP 2 x FSDP 8 x EP 8: each pipeline rank holds its stage's 24 blocks, experts
    split over ep inside its stage group, so its parameters are the model's over all 16 ranks; it fits."""
    code, out, _ = _main(capsys, 16, "--job.config_file", "qwen3_30b_a3b_finetune", "--model.tokenizer_path", "",
                         "--checkpoint.initial_load_path", "", "--parallelism.pipeline_parallel_degree", "2",
                         "--parallelism.expert_parallel_degree", "8", "--activation_checkpoint.mode", "full",
                         "--training.local_batch_size", "2", "--training.global_batch_size", "32")  # fmt: skip
    assert code == 0 and "fits: yes" in out, out
    assert "EP: expert_parallel_size=8, experts FSDP-sharded over 1 rank(s)" in out
    assert "48 blocks in 2 stages of 24, 24" in out
    rows = re.findall(r"rank (\d)\s+stages \d+\s+([\d.]+)", out)
    assert [r for r, _ in rows] == ["0", "1"], out
    assert all(abs(float(params) - 30_532_122_624 * 4 / 16 / GIB) < 0.05 for _, params in rows), rows


def test_dry_run_70b_and_405b_with_tensor_parallelism(capsys, monkeypatch):
    """70B on 2 x 8 GPUs as FSDP 2 x TP 8 fits (FSDP alone needs 32 GPUs); per-rank state is the total over
    shard x tp plus the norms, which tp replicates; 405B fits on 16 x 8 GPUs, not on 8 x 8; tp beyond a node warns."""
    code, out, _ = _main(capsys, 16, "--job.config_file", "llama70b_fsdp_tp")
    assert code == 0 and "fits: yes" in out
    assert "FSDP: shard_size=2" in out and "TP: tensor_parallel_size=8 (sequence parallel, loss parallel)" in out
    assert "mesh ('dp_shard', 'tp') (2, 8)" in out
    total, norms = 70_553_706_496, (2 * 80 + 1) * 8192
    rows = _table(out)
    assert abs(rows["parameters"] - ((total - norms) / 16 + norms / 2) * 4 / GIB) < 0.01
    assert rows["gradients"] == rows["parameters"] and abs(rows["optimizer"] - 2 * rows["parameters"]) < 0.01
    code, out, _ = _main(capsys, 16, "--job.config_file", "llama70b_fsdp", "--training.global_batch_size", "16")
    assert code == 1 and "fits: no" in out
    for world, fits in ((64, False), (128, True)):
        code, out, _ = _main(capsys, world, "--job.config_file", "llama70b_fsdp_tp", "--model.flavor", "405B")
        assert ("fits: yes" in out) == fits and code == (0 if fits else 1), world
    monkeypatch.setenv("NGPU", "4")
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("titanlite").addHandler(handler)
    try:
        _main(capsys, 16, "--job.config_file", "llama70b_fsdp_tp")
    finally:
        logging.getLogger("titanlite").removeHandler(handler)
    assert any("larger than the 4 processes per node" in r.getMessage() for r in records)


def test_torchtitan_8b_shape_fits_80gb(capsys):
    """TorchTitan's 8B shape on 8 GPUs (local batch 2, seq 8192, selective 'op'): the loss of the whole microbatch
    at once does not fit 80 GB; the loss in chunks (the default) does, and TorchTitan's AC policy (every second
    matmul recomputed) leaves more room still."""
    shape = ("--job.config_file", "llama8b_fsdp", "--training.local_batch_size", "2")
    shape += ("--training.global_batch_size", "16")
    code, out, _ = _main(capsys, 8, *shape, "--training.loss_chunk_tokens", "0")
    assert code == 1 and "fits: no" in out
    whole_loss = _table(out)
    code, out, _ = _main(capsys, 8, *shape)
    assert code == 0 and "fits: yes" in out
    chunked = _table(out)
    assert whole_loss["activations"] - chunked["activations"] > 19  # GiB: 23.5 of loss, now one chunk's
    code, out, _ = _main(capsys, 8, *shape, "--activation_checkpoint.selective_op_policy", "every_second_matmul")
    assert code == 0 and "selective op, half the matmuls on 32 of 32 blocks" in out
    assert _table(out)["activations"] < 0.7 * chunked["activations"]


def test_dry_run_names_the_largest_local_batch_that_fits(capsys):
    code, out, _ = _main(capsys, 16, "--job.config_file", "llama8b_hsdp")
    assert code == 0 and "largest local batch that fits: 2 (training.local_batch_size; now 1)" in out
    # and the line agrees with the verdict at that batch and the next
    over = ("--training.local_batch_size", "3", "--training.global_batch_size", "48")
    code, out, _ = _main(capsys, 16, "--job.config_file", "llama8b_hsdp", *over)
    assert (
        code == 1 and "fits: no" in out and "largest local batch that fits: 2 (training.local_batch_size; now 3)" in out
    )
    code, out, _ = _main(capsys, 8, "--job.config_file", "llama70b_fsdp")
    assert code == 1 and "largest local batch that fits: none, not even 1 sequence" in out
