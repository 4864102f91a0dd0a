"""End to end under torchrun: SIGKILL of a worker with elastic restarts, SIGTERM preemption (gloo, CPU)."""

import os
import re
import signal
import subprocess
import time

import pytest
import torch

from helpers import (
    faults_env,
    load_everything,
    make_trainer,
    run_distributed,
    run_job,
    start_job,
    stop_job,
    subprocess_env,
    tiny_argv,
    torchrun_cmd,
)

pytestmark = pytest.mark.slow  # multi-process (gloo) or torchrun tests


def _argv(tmp, *extra):
    return tiny_argv(
        tmp,
        "--training.steps",
        "6",
        "--training.global_batch_size",
        "8",
        "--training.local_batch_size",
        "4",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "0",
        *extra,
    )  # keep all: the test lists every save


def _torchrun(args, **popen_kw):
    """torchrun of these arguments, started as a job (stop_job it when done)."""
    return start_job(
        torchrun_cmd(*args),
        env=subprocess_env(),
        stdout=popen_kw.pop("stdout", subprocess.PIPE),
        stderr=subprocess.STDOUT,
        text=True,
        **popen_kw,
    )


def _logged_losses(out):
    return {int(s): float(v) for s, v in re.findall(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)", out)}


def _train_uninterrupted(argv):
    return make_trainer(argv).train()


def test_elastic_restart_after_sigkill_resumes_and_matches(tmp_path):
    # run_train.sh reads train_configs/debug_model.toml first; so does the reference
    ref_losses = run_distributed(
        _train_uninterrupted, 2, ["--job.config_file", "debug_model", *_argv(tmp_path / "ref")]
    )[0]
    # Fault injection (tests/faults/sitecustomize.py): restart 0: rank 1 is killed when the save of step 4
    # begins (step-2 is the newest complete one); restart 1: rank 1 is killed at the end of step 5 (after
    # step-4 was saved); restart 2 finishes.
    env = faults_env("kill:save:4:1,kill:step:5:1", NGPU="2", MAX_RESTARTS="2", LOG_RANK="0,1")
    p = run_job(["./run_train.sh", *_argv(tmp_path / "run")], env=env, timeout=600, merge_output=True)
    out = p.stdout
    assert p.returncode == 0, out[-4000:]
    assert out.count("fault injection: killing rank 1") == 2, out[-4000:]
    resumed = re.findall(r"Resuming from \S+/step-(\d+) \(step", out)
    assert resumed == ["2", "2", "4", "4"], resumed  # each line once per rank
    assert "Removing incomplete checkpoint" in out and ".tmp-step-4" in out
    folder = tmp_path / "run" / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4", "step-6"]
    # the same final loss (as logged) and bit-identical final weights and optimizer state
    assert _logged_losses(out)[6] == round(ref_losses[6], 4)
    ref = load_everything(tmp_path / "ref" / "checkpoint" / "step-6")
    got = load_everything(folder / "step-6")
    for part in ("model", "optimizer"):
        flat_ref, flat_got = _flatten(ref[part]), _flatten(got[part])
        assert flat_ref.keys() == flat_got.keys()
        for k in flat_ref:
            assert torch.equal(flat_ref[k], flat_got[k]), (part, k)
    assert (
        got["dataloader"] == ref["dataloader"]
        and got["train_state"]["tokens_seen"] == ref["train_state"]["tokens_seen"]
    )


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def _worker_pids(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def test_sigterm_to_one_worker_saves_every_rank_and_exits_zero(tmp_path):
    log = tmp_path / "log.txt"
    args = _argv(tmp_path, "--training.steps", "100000", "--checkpoint.interval", "100000")
    with open(log, "w") as f:
        p = _torchrun(args, stdout=f)
        try:
            deadline = time.time() + 300
            while not re.search(r"step:\s+3\s", log.read_text()):
                assert p.poll() is None and time.time() < deadline, log.read_text()[-4000:]
                time.sleep(0.2)
            workers = _worker_pids(p.pid)
            assert len(workers) == 2
            os.kill(workers[-1], signal.SIGTERM)  # as a scheduler would; only one rank gets it here
            rc = p.wait(timeout=300)
        finally:
            stop_job(p)
    out = log.read_text()
    assert rc == 0, out[-4000:]
    assert "Received SIGTERM" in out
    saved = re.findall(r"Stopped: checkpoint of step (\d+) saved", out)
    assert len(saved) == 2 and len(set(saved)) == 1, out[-4000:]  # both ranks stopped after the same step
    step = int(saved[0])
    folder = tmp_path / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == [f"step-{step}"]
    assert load_everything(folder / f"step-{step}")["train_state"]["step"] == step
    # the next launch resumes from there
    p = run_job(torchrun_cmd(*args, "--training.steps", str(step + 1)), env=subprocess_env(), timeout=600,
                merge_output=True)  # fmt: skip
    out = p.stdout
    assert p.returncode == 0, out[-4000:]
    assert f"/step-{step} (step {step})" in out and sorted(_logged_losses(out)) == [step + 1]
