"""run_train.sh and torchrun on a shared cluster: bad launcher input, one job per dump folder, workers that
outlive their launcher, and stop signals that save and exit 0 (gloo, CPU)."""

import contextlib
import json
import os
import re
import signal
import subprocess
import time

import pytest

from helpers import run_job, sigint_ignored, start_job, stop_job, subprocess_env, tiny_argv, torchrun_cmd


def _launch(args, **env):
    return run_job(["./run_train.sh", *args], env=subprocess_env(**env), timeout=300)


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"NGPU": "0"}, "NGPU=0 is not valid"),
        ({"NNODES": "0"}, "NNODES=0 is not valid"),
        ({"NGPU": "abc"}, "NGPU=abc is not valid"),
        ({"NGPU": "1.5"}, "NGPU=1.5 is not valid"),
        ({"NGPU": "-1"}, "NGPU=-1 is not valid"),
        ({"MAX_RESTARTS": "abc"}, "MAX_RESTARTS=abc is not valid"),
        ({"RDZV_JOIN_TIMEOUT": "0"}, "RDZV_JOIN_TIMEOUT=0 is not valid: seconds to wait for every node"),
        ({"NGPU": "2", "LOG_RANK": "5"}, "LOG_RANK=5 names no local rank: with NGPU=2 the local ranks are 0 to 1"),
    ],
)
def test_bad_launcher_input_is_one_line_and_exit_2(env, needle):
    r = _launch(["--training.steps", "1"], **{"NGPU": "2", **env})
    assert r.returncode == 2 and needle in r.stderr, (r.returncode, r.stderr[-1000:])
    assert "Traceback" not in r.stderr and "unbound variable" not in r.stderr and "torchrun" not in r.stderr


def _wait_for(log, pattern, proc, seconds=240):
    deadline = time.time() + seconds
    while not re.search(pattern, log.read_text()):
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _wait_until_gone(pids, seconds):
    """Seconds waited until no process of pids is alive (giving up after `seconds`)."""
    t0 = time.time()
    while any(_alive(p) for p in pids) and time.time() - t0 < seconds:
        time.sleep(0.2)
    return time.time() - t0


def _endless_job_argv(tmp_path, *extra):
    """A 2-rank job that trains until it is stopped, checkpointing only when asked to stop."""
    return tiny_argv(
        tmp_path / "job",
        "--training.steps",
        "100000",
        "--training.local_batch_size",
        "4",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "100000",
        *extra,
    )


@pytest.mark.slow
def test_one_job_per_dump_folder_and_no_orphans(tmp_path):
    argv = _endless_job_argv(tmp_path)
    log = tmp_path / "a.log"
    with open(log, "w") as out:
        first = start_job(torchrun_cmd(*argv), env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for(log, r"step:\s+3\s", first)
        # a second job on the same dump folder is refused before it starts, naming the first
        second = _launch([*argv, "--training.steps", "2"], NGPU="2")
        assert second.returncode == 2 and "is in use by another titanlite job" in second.stderr, second.stderr
        assert "pid" in second.stderr and "Traceback" not in second.stderr
        workers = _children(first.pid)
        assert len(workers) == 2
        os.kill(first.pid, signal.SIGKILL)  # the launcher dies; its workers must not train on
        first.wait()
        waited = _wait_until_gone(workers, 30)
        assert not any(_alive(w) for w in workers), "workers outlived their launcher"
        assert waited < 10
    finally:
        stop_job(first)
    # the kernel ends them with their launcher (PR_SET_PDEATHSIG): no checkpoint, and no time for a last line
    assert not list((tmp_path / "job" / "checkpoint").glob("step-*"))  # no checkpoint written on the way out
    # the lock of the dead job is stale: the next job takes it over and runs
    third = _launch([*argv, "--training.steps", "2"], NGPU="2", LOG_RANK="0")
    assert third.returncode == 0, third.stderr[-3000:]
    assert "Taking over the lock of a titanlite job that is gone" in third.stdout + third.stderr
    assert not (tmp_path / "job" / ".titanlite.lock").exists()  # released at the end


def _run_until_step(tmp_path, name, step, extra=()):
    """run_train.sh on an endless job, started and waited for until it logs `step` (stopped if that fails);
    stop_job it when done."""
    argv = _endless_job_argv(tmp_path, *extra)
    log = tmp_path / f"{name}.log"
    with open(log, "w") as out:
        proc = start_job(
            ["./run_train.sh", *argv],
            env=subprocess_env(NGPU="2", LOG_RANK="0,1"),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for(log, rf"step:\s+{step}\s", proc)
    except BaseException:
        stop_job(proc)
        raise
    return proc, log


def _stopped_cleanly(proc, log) -> str:
    """The log of a job that was asked to stop: exit status 0, each rank saved the same step, one line each and
    no traceback (torchrun's SignalException included)."""
    try:
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        stop_job(proc)
    text = log.read_text()
    saved = re.findall(r"Stopped: checkpoint of step (\d+) saved", text)
    assert len(saved) == 2 and len(set(saved)) == 1, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text and "SignalException" not in text, text[-3000:]
    return saved[0]


@pytest.mark.slow
def test_ctrl_c_sigterm_to_torchrun_and_a_second_ctrl_c(tmp_path):
    # Ctrl-C (SIGINT to the launcher): every worker saves at the end of its step; the launcher exits 0
    proc, log = _run_until_step(tmp_path, "int", 3)
    if sigint_ignored(proc.pid):
        stop_job(proc)
        pytest.skip("SIGINT cannot be delivered to run_train.sh here: it started with SIGINT ignored")
    proc.send_signal(signal.SIGINT)
    resumed_from = int(_stopped_cleanly(proc, log))
    # SIGTERM to every process of the job, as SLURM sends a scheduler's stop, and to torchrun again while it shuts its
    # workers down (run_train.sh passes it on too): the workers save, and the launcher and run_train.sh exit 0. (The
    # second one once broke torchrun's shutdown: it said nothing was saved, and the job hung.)
    proc, log = _run_until_step(tmp_path, "term", resumed_from + 2)
    torchrun = _children(proc.pid)[0]
    for pid in [proc.pid, *_descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(torchrun, signal.SIGTERM)
    assert int(_stopped_cleanly(proc, log)) > resumed_from and f"(step {resumed_from})" in log.read_text()
    # a stop before anything can be saved (start-up, or here a run without checkpoints): one line and 128 + the
    # signal, no traceback
    with open(tmp_path / "early.log", "w") as out:
        proc = start_job(
            ["./run_train.sh", *_endless_job_argv(tmp_path / "early", "--checkpoint.enable", "false")],
            env=subprocess_env(NGPU="2", LOG_RANK="0,1"),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for(tmp_path / "early.log", r"World size 2|Token store|tokenizing", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, (tmp_path / "early.log").read_text()[-3000:]
    finally:
        stop_job(proc)
    text = (tmp_path / "early.log").read_text()
    assert text.count("titanlite: stopped by SIGTERM; the workers saved no checkpoint") == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    # a second Ctrl-C stops everything at once (the debug model: a step and a save take long enough to be caught)
    argv = [
        "--job.dump_folder",
        str(tmp_path / "debug"),
        "--training.steps",
        "100000",
        "--validation.enable",
        "false",
        "--checkpoint.interval",
        "100000",
    ]
    log = tmp_path / "twice.log"
    with open(log, "w") as out:
        proc = start_job(["./run_train.sh", *argv], env=subprocess_env(NGPU="2"), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for(log, r"step:\s+10\s", proc)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        t0 = time.time()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130 and time.time() - t0 < 10, log.read_text()[-3000:]
        assert "second Ctrl-C: stopping every process now" in log.read_text()
        assert not [pid for pid in _children(proc.pid) if _alive(pid)]
    finally:
        stop_job(proc)


def test_more_processes_than_gpus_is_a_clear_error(monkeypatch):
    """Two ranks on one GPU would fail deep inside NCCL ("Duplicate GPU detected"); say what to set instead."""
    import torch

    from titanlite.errors import ConfigError
    from titanlite.runtime.distributed import init_distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for key, value in {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TITANLITE_DEVICE", raising=False)
    with pytest.raises(
        ConfigError, match=r"NGPU=2 processes on this node, but 1 GPU\(s\) are visible.*TITANLITE_DEVICE=cpu"
    ):
        init_distributed()


def _descendants(pid):
    out = []
    for child in _children(pid):
        out += [child, *_descendants(child)]
    return out


@pytest.mark.slow
def test_kill_9_of_run_train_sh_stops_the_whole_job(tmp_path):
    proc, log = _run_until_step(
        tmp_path, "killed", 5, extra=("--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0")
    )
    job = []
    try:
        job = _descendants(proc.pid)  # torchrun (in a session of its own) and its 2 workers
        assert len(job) >= 3, job
        saved = {p.name for p in (tmp_path / "job" / "checkpoint").glob("step-*")}
        # a frozen worker runs no watchdog: only the kernel can end it (rank 1's own pid, from its progress file)
        worker = json.loads((tmp_path / "job" / ".progress" / "rank-1.json").read_text())["pid"]
        assert worker in job and "titanlite" in open(f"/proc/{worker}/cmdline").read(), job
        os.kill(worker, signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        waited = _wait_until_gone(job, 20)
        assert not any(_alive(p) for p in job), "processes of the job outlived run_train.sh"
        assert waited < 10
    finally:
        for p in job:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        stop_job(proc)
    assert saved and saved <= {p.name for p in (tmp_path / "job" / "checkpoint").glob("step-*")}


def test_a_process_that_has_exited_is_not_alive_even_before_it_is_reaped():
    """An orphaned worker stays a zombie until init reaps it; its lock must already count as free."""
    from titanlite.runtime.run_control import pid_alive

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.time() + 10
        while time.time() < deadline and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        assert not pid_alive(pid)  # exited, not yet reaped
        assert pid_alive(os.getpid())
    finally:
        os.waitpid(pid, 0)
