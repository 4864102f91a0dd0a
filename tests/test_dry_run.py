"""The dry run: sizes the 8B and 70B jobs on a fake process group and catches the run's config errors."""

import os
import re
import subprocess
from pathlib import Path

import pytest

from titanlite.cli import dry_run
from titanlite.memory_estimate import fsdp_buffer_bytes

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
    # without activation checkpointing 8B at seq_len 8192 does not fit an 80 GB GPU
    code, out, _ = _main(capsys, 16, "--job.config_file", "llama8b_hsdp", "--activation_checkpoint.mode", "none")
    assert code == 1 and "fits: no" in out
    none = _table(out)
    code, out, _ = _main(capsys, 16, "--job.config_file", "llama8b_hsdp", "--activation_checkpoint.mode", "full")
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
    "policy, expected",
    [
        ("default", (10 + 8) * 2 + 10 * (2 + 4)),
        ("never", (10 + 8 + 5) * 2 + 10 * (2 + 4)),
        ("2", (10 + 8) * 2 + (10 + 8 + 5) * 2 // 2 + 10 * (2 + 4)),
    ],
)
def test_fsdp_buffer_bytes(policy, expected):
    assert fsdp_buffer_bytes([10, 5, 8], 2, 4, policy) == expected
