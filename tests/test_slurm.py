"""slurm/train.sbatch on a real SLURM: a two-node cluster on this machine (tests/slurm_cluster.py: slurmctld, two
slurmd daemons, munge; installed with apt-get where missing) that the tests start and stop. `sbatch -N2` trains as
one node of the same world size, bit for bit, with one copy of each step line; `scancel --signal=TERM` saves a
committed step that a second sbatch resumes exactly; the time-limit signal stops, saves and requeues the job, which
resumes by itself; a node's task killed with SIGKILL ends the job with one line and no process left. The launcher's
reading of SLURM's variables is checked without a cluster (fast)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from titanlite.errors import ConfigError
from titanlite.runtime.distributed import free_port
from titanlite.runtime.slurm import launch_settings

from helpers import run_job, subprocess_env

REPO = Path(__file__).resolve().parent.parent
STEP = re.compile(r"step: +(\d+) +loss: +([\d.]+)")
TINY = [
    "--model.flavor", "tiny", "--training.seq_len", "32", "--training.global_batch_size", "8",
    "--training.local_batch_size", "4", "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1",
    "--validation.enable", "false", "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_type", "constant",
    "--checkpoint.enable", "--checkpoint.interval", "100000",
]  # fmt: skip
STEPS = 6


def _losses(text: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in STEP.findall(text)}


# ------------------------------------------------------------------ the launcher's reading of SLURM's variables


def _step(nodes=2, tasks=None, node=0, **extra) -> dict:
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes),
           "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_NUM_TASKS": str(tasks or nodes),
           "SLURM_NODEID": str(node), "SLURM_JOB_NODELIST": "gpu[07-08]"}  # fmt: skip
    return {**env, **extra}


def test_the_launcher_reads_the_job_from_slurm_and_refuses_a_step_that_cannot_train_as_one_job():
    hosts = {"gpu[07-08]": "gpu07"}.__getitem__
    first = launch_settings(_step(), hosts)
    assert first == {"NNODES": "2", "TITANLITE_NODE_ID": "0", "RDZV_ENDPOINT": "gpu07:24242",
                     "RDZV_ID": "slurm-4242.0", "TITANLITE_FIRST_NODE_LOGS": "1"}  # fmt: skip
    other = launch_settings(_step(node=1, SLURM_GPUS_ON_NODE="8"), hosts)
    assert other["LOGLEVEL"] == "ERROR" and other["NGPU"] == "8" and other["RDZV_ENDPOINT"] == "gpu07:24242"
    some = launch_settings(_step(SLURM_STEP_NODELIST="gpu08"), {"gpu08": "gpu08"}.__getitem__)  # srun -w gpu08
    assert some["RDZV_ENDPOINT"] == "gpu08:24242"
    assert launch_settings(_step(RDZV_PORT="29500"), hosts)["RDZV_ENDPOINT"] == "gpu07:29500"
    single = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"}  # sbatch -N1, no srun: fine
    assert launch_settings(single, hosts) == {"NNODES": "1", "TITANLITE_NODE_ID": "0"}
    for env, message in (
        ({k: v for k, v in _step().items() if k != "SLURM_STEP_ID"}, r"outside srun \(no SLURM_STEP_ID\)"),
        (_step(tasks=16), r"runs 16 tasks on 2 node\(s\) .* --ntasks-per-node=1"),
        (_step(NNODES="4"), r"NNODES=4, but SLURM job 4242 runs this step on 2 node\(s\)"),
    ):
        with pytest.raises(ConfigError, match=message):
            launch_settings(env, hosts)


# ------------------------------------------------------------------ a real cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from slurm_cluster import Cluster, unavailable

    if why := unavailable():
        pytest.skip(why)
    running = Cluster(tmp_path_factory.mktemp("slurm")).start()
    yield running
    running.stop()


def _submit(cluster, out: Path, dump: Path, *args: str) -> int:
    env = subprocess_env(NGPU="1", TITANLITE_EXIT_BARRIER_TIMEOUT="5", RDZV_JOIN_TIMEOUT="60")
    env.pop("SLURM_CONF", None)
    return cluster.sbatch("--output", str(out), "-N2", "slurm/train.sbatch", *TINY, "--job.dump_folder", str(dump),
                          *args, cwd=REPO, env={**env, "SLURM_CONF": cluster.env["SLURM_CONF"]})  # fmt: skip


def _wait_for(path: Path, pattern: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and re.search(pattern, path.read_text())):
        assert time.monotonic() < deadline, path.read_text()[-3000:] if path.exists() else f"no {path}"
        time.sleep(0.3)


def _one_node(dump: Path, steps: int) -> dict[int, float]:
    """The reference: one node of world size 2, run by run_train.sh."""
    cmd = ["./run_train.sh", *TINY, "--job.dump_folder", str(dump), "--training.steps", str(steps)]
    done = run_job(cmd, env=subprocess_env(NGPU="2", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}"), timeout=240,
                   merge_output=True)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    return _losses(done.stdout)


@pytest.mark.slow
def test_sbatch_two_nodes_train_as_one_node_and_a_stopped_job_resumes_exactly(cluster, tmp_path):
    out = tmp_path / "two.out"
    job = _submit(cluster, out, tmp_path / "two", "--training.steps", str(STEPS))
    assert cluster.wait_done(job) == "COMPLETED", out.read_text()[-3000:]
    text = out.read_text()
    for s in range(1, STEPS + 1):
        assert len(re.findall(rf"step: +{s} +loss", text)) == 1, text[-3000:]  # one copy: the first node's rank 0
    assert f"(2 nodes x 1 process, slurm-{job})" in text and text.count("World size 2") == 1, text[-3000:]

    # scancel --signal=TERM: every rank of both nodes finishes its step and saves; a second sbatch resumes there.
    # (The reference is run last, as long as the stopped job went: the lr is constant, so its length does not count.)
    dump, stopped = tmp_path / "stopped", tmp_path / "stopped.out"
    job = _submit(cluster, stopped, dump, "--training.steps", "100000")
    _wait_for(stopped, r"step: +3 ")
    cluster.run(["scancel", "--signal=TERM", str(job)])
    assert cluster.wait_done(job) == "COMPLETED", stopped.read_text()[-3000:]
    saved = sorted(dump.glob("checkpoint/step-*"))
    assert len(saved) == 1 and {p.name for p in saved[0].glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    at = int(saved[0].name.split("-")[1])
    ref = _one_node(tmp_path / "one", max(STEPS, at + 2))
    assert at >= 3 and _losses(text) == {s: ref[s] for s in range(1, STEPS + 1)}  # bit for bit
    resumed = tmp_path / "resumed.out"
    job = _submit(cluster, resumed, dump, "--training.steps", str(at + 2))
    assert cluster.wait_done(job) == "COMPLETED", resumed.read_text()[-3000:]
    assert _losses(resumed.read_text()) == {at + 1: ref[at + 1], at + 2: ref[at + 2]}


@pytest.mark.slow
def test_the_time_limit_signal_saves_and_requeues_and_a_killed_node_ends_the_job_with_one_line(cluster, tmp_path):
    # What SLURM sends before the time limit (--signal=B:USR1@180): the batch script stops the run (every rank
    # saves), requeues the job, and the requeued job resumes from that checkpoint and finishes.
    # (It failed about one run in six, for two reasons now gone: torchrun's agent broke its shutdown at a second
    # stop signal, and the test started the requeued job at once, before SLURM's revocation of the old job
    # credential had expired: "Job credential revoked". The test cluster now has cred_expire=15 (also how long a
    # launch credential is valid) and schedules every 2 s, so the requeued job starts about 17 s later by itself,
    # as a real cluster's does after 121 s.)
    dump, out = tmp_path / "limit", tmp_path / "limit.out"
    job, ended = _time_limit_stop(cluster, dump, out)
    assert ended is None, f"the job ended ({ended}) without a requeue:\n{out.read_text()[-3000:]}"
    _wait_for(out, r"Resum", timeout=180)
    cluster.run(["scancel", "--signal=TERM", str(job)])  # (it would train 100000 steps)
    cluster.wait_done(job)
    text = out.read_text()
    assert "the time limit is near: stopping to save, then requeueing" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    first, again = text.split("restart 1: run_train.sh")
    saved = int(re.search(r"Resuming from \S+/step-(\d+) \(step \1\)", again).group(1))
    assert saved == max(_losses(first)) and min(_losses(again)) == saved + 1, text[-3000:]  # where it stopped

    # SIGKILL to the second node's task: the first node stops with one line, the job fails, nothing is left.
    dump, out = tmp_path / "killed", tmp_path / "killed.out"
    job = _submit(cluster, out, dump, "--training.steps", "100000")
    _wait_for(out, r"step: +2 ")
    second = _task_of_node(dump, "1")
    os.kill(second, signal.SIGKILL)
    assert cluster.wait_done(job) in ("FAILED", "CANCELLED"), out.read_text()[-3000:]
    text = out.read_text()
    lost = [line for line in text.splitlines() if line.startswith("error")]
    # (on one machine either node's agent may host the rendezvous: the killed one did, or the survivor names it)
    assert len(lost) == 1, text[-3000:]
    assert re.search(
        r"lost contact with (the ranks at 127.0.0.1|the job's rendezvous at RDZV_ENDPOINT=node1:)", lost[0]
    )
    deadline = time.monotonic() + 30
    while _left(dump) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not _left(dump), _left(dump)


def _time_limit_stop(cluster, dump: Path, out: Path) -> tuple[int, str | None]:
    """Submit a long job, send its batch script the time-limit signal, and wait until the requeued job starts again:
    (job id, None), or (job id, its last state) when it left the queue without being requeued."""
    job = _submit(cluster, out, dump, "--training.steps", "100000")
    _wait_for(out, r"step: +3 ")
    cluster.run(["scancel", "--batch", "--signal=USR1", str(job)])
    deadline = time.monotonic() + 240
    while "restart 1: run_train.sh" not in out.read_text():
        state = cluster.state(job)
        if state in ("", "COMPLETED", "FAILED", "CANCELLED") and "restart 1: run_train.sh" not in out.read_text():
            return job, state or "forgotten by the controller"
        if time.monotonic() > deadline:  # what the job and its processes were doing, to tell a hang from a race
            job_info = cluster.run(["scontrol", "show", "job", str(job)], check=False).stdout
            pytest.fail(f"{out.read_text()[-3000:]}\n{job_info}\nprocesses: {_left(dump)}")
        time.sleep(1)
    return job, None


def _task_of_node(dump: Path, node: str) -> int:
    """The pid of run_train.sh on SLURM node `node` of the job that trains into `dump`."""
    for line in subprocess.run(["pgrep", "-af", "run_train.sh"], capture_output=True, text=True).stdout.splitlines():
        pid = int(line.split()[0])
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(dump) in line and f"SLURM_NODEID={node}".encode() in environ:
            return pid
    raise AssertionError(f"no run_train.sh of node {node} for {dump}")


def _left(dump: Path) -> list[str]:
    out = subprocess.run(["pgrep", "-af", str(dump)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]
