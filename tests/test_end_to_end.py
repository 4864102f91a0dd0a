"""run_train.sh: the launcher resolves configs, starts torchrun with gloo and logs the loss."""

import os
import re
from pathlib import Path

import pytest

from helpers import run_job

pytestmark = pytest.mark.slow  # multi-process (gloo) or torchrun tests

ROOT = Path(__file__).resolve().parent.parent


def _run(args, env_extra=None, timeout=300, cwd=ROOT):
    # Two gloo ranks on the CPU, also where a GPU is visible (two ranks cannot share one GPU under NCCL).
    env = {**os.environ, "NGPU": "2", "HF_HUB_OFFLINE": "1", "TITANLITE_DEVICE": "cpu", **(env_extra or {})}
    return run_job([str(ROOT / "run_train.sh"), *args], cwd=cwd, env=env, timeout=timeout)


def test_run_train_debug_config(tmp_path):
    r = _run(
        [
            "--config",
            "debug_model.toml",
            "--training.steps",
            "3",
            "--metrics.log_freq=1",
            "--training.seq_len",
            "64",
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    losses = [float(x) for x in re.findall(r"step:\s+\d+\s+loss:\s+([0-9.]+)", out)]
    assert len(losses) == 3, out[-3000:]
    assert "FSDP: shard_size=2" in out and "Sharded 8 modules + root" in out


def test_run_train_hsdp_override_and_config_file_env(tmp_path):
    cfg = tmp_path / "mine.toml"
    cfg.write_text((ROOT / "train_configs" / "debug_model.toml").read_text())
    r = _run(
        [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--training.steps=2",
            "--metrics.log_freq=1",
            "--model.flavor",
            "tiny",
            "--training.seq_len",
            "32",
            "--job.dump_folder",
            str(tmp_path),
        ],
        env_extra={"CONFIG_FILE": str(cfg)},
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "Replicate-only (DDP-like): replicate_size=2, shard_size=1" in out


def test_run_train_bad_config_fails_fast_without_traceback(tmp_path):
    r = _run(["--config", "llama8b_hsdp", "--parallelism.data_parallel_replicate_degree", "3"])
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "torchrun" not in r.stderr
    assert "data_parallel_replicate_degree = 3" in r.stderr and "world size 2" in r.stderr
    r = _run(["--config", "no_such_config"])
    assert r.returncode == 2 and "job.config_file = 'no_such_config'" in r.stderr


def test_paths_are_the_users_not_the_checkouts(tmp_path):
    """Run from a user's folder that has its own train_configs/debug_model.toml with a relative dump_folder."""
    user = tmp_path / "user"
    (user / "train_configs").mkdir(parents=True)
    shipped = (ROOT / "train_configs" / "debug_model.toml").read_text()
    assert 'dump_folder = "./outputs/debug"' in shipped
    mine = shipped.replace('description = "debug Llama on the embedded dataset"', 'description = "my own debug run"')
    assert "local_batch_size = 8\n" in mine
    mine = mine.replace("local_batch_size = 8\n", "local_batch_size = 4\n")
    (user / "train_configs" / "debug_model.toml").write_text(mine.replace("./outputs/debug", "./my_outputs"))
    quick = [
        "--training.steps",
        "2",
        "--model.flavor",
        "tiny",
        "--training.seq_len",
        "32",
        "--validation.enable",
        "false",
    ]
    r = _run(["--config", "train_configs/debug_model.toml", *quick], cwd=user)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "my own debug run" in out  # the user's file, not the shipped one of the same name
    assert list((user / "my_outputs" / "checkpoint").glob("step-2")), "a relative dump_folder is the user's"
    # CONFIG_FILE is relative to where the launcher runs too; a bare name still finds the shipped config
    dry = _run(["--dry-run"], env_extra={"CONFIG_FILE": "train_configs/debug_model.toml"}, cwd=user)
    assert "per rank 4 x 256 tokens" in dry.stdout, dry.stdout + dry.stderr  # the user's local batch
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    bare = _run(["--config", "debug_model", "--dry-run"], cwd=elsewhere)
    assert f"titanlite dry run: {ROOT / 'train_configs' / 'debug_model.toml'}" in bare.stdout, bare.stdout + bare.stderr
    assert "per rank 8 x 256 tokens" in bare.stdout
