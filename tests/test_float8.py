"""[float8] on a GPU: torchao's float8 linears train like bf16, resume exactly and leave checkpoints without float8.

These run where TITANLITE_TEST_DEVICE=cuda on a GPU of compute capability 8.9+ with torchao installed (the GPU check,
benchmarks/gpu_check.py); elsewhere they skip, and tests/test_bad_inputs.py checks that such a machine refuses
[float8] with one message.
"""

from __future__ import annotations

import importlib.util
import math
import shutil

import pytest
import torch

from titanlite.parallel.float8 import MIN_CAPABILITY

from helpers import TEST_DEVICE, make_trainer, tiny_argv

pytestmark = pytest.mark.skipif(
    not (
        TEST_DEVICE == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability() >= MIN_CAPABILITY
        and importlib.util.find_spec("torchao") is not None
    ),
    reason="float8 training needs TITANLITE_TEST_DEVICE=cuda on a GPU of compute capability 8.9+ with torchao",
)


def _argv(tmp, *extra):
    """30 bf16 steps of the debug model (dim 256: every block linear is float8-eligible) at seq 256."""
    return tiny_argv(
        tmp,
        "--model.flavor",
        "debugmodel",
        "--training.seq_len",
        "256",
        "--training.steps",
        "30",
        "--training.mixed_precision_param",
        "bfloat16",
        "--training.deterministic",
        "true",
        *extra,
    )


def _mean_last(losses: dict, n: int = 10) -> float:
    return sum(losses[k] for k in sorted(losses)[-n:]) / n


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_trains_like_bf16(tmp_path, recipe):
    bf16 = make_trainer(_argv(tmp_path / "bf16")).train()
    trainer = make_trainer(_argv(tmp_path / recipe, "--float8.enable", "true", "--float8.recipe", recipe))
    converted = [n for n, m in trainer.model.named_modules() if type(m).__name__ == "Float8Linear"]
    assert len(converted) == 7 * trainer.model_args.n_layers  # q, k, v, o, w1, w2, w3 of every block
    assert "Float8" not in type(trainer.model.output).__name__  # the output projection stays as it is
    float8 = trainer.train()
    assert all(math.isfinite(v) for v in float8.values())
    # float8 rounds each matmul input to 3 mantissa bits (e4m3) under a per-tensor or per-row scale: the curve
    # moves the way a different data order would; the smoothed loss stays within 3% of bf16's.
    assert abs(_mean_last(float8) - _mean_last(bf16)) / _mean_last(bf16) < 0.03, (float8, bf16)


def test_float8_with_compile_trains(tmp_path):
    argv = _argv(tmp_path / "compiled", "--float8.enable", "true", "--compile.enable", "true", "--training.steps", "10")
    losses = make_trainer(argv).train()
    assert all(math.isfinite(v) for v in losses.values()) and losses[10] < losses[1]


def test_float8_resume_is_exact_and_checkpoints_hold_no_float8(tmp_path):
    f8 = ("--float8.enable", "true", "--checkpoint.enable", "--checkpoint.interval", "3", "--training.steps", "6")
    straight = make_trainer(_argv(tmp_path / "straight", *f8)).train()
    shutil.copytree(tmp_path / "straight/checkpoint/step-3", tmp_path / "resumed/checkpoint/step-3")
    resumed = make_trainer(_argv(tmp_path / "resumed", *f8))
    assert resumed.step == 3
    assert resumed.train() == {k: straight[k] for k in (4, 5, 6)}
    # the same checkpoint resumes without float8: its weights are plain tensors under the usual names
    plain = make_trainer(_argv(tmp_path / "resumed", "--checkpoint.enable", "--training.steps", "8"))
    assert plain.step == 6 and all(math.isfinite(v) for v in plain.train().values())
