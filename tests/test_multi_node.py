"""Several nodes rehearsed on one machine: two torchrun agents started by run_train.sh exactly as on two nodes
(NNODES=2 NGPU=1, one RDZV_ENDPOINT, one dump folder as a shared filesystem gives): the same losses as one node of the
same world size, checkpoints that resume from two nodes on one and back, the locks, and the failures (a node killed,
a node stopped by SIGTERM, a node that never arrives, a second job on the folder)."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from titanlite.runtime.distributed import free_port

from helpers import job, make_trainer, run_distributed, run_job, stop_job, subprocess_env, tiny_argv

pytestmark = pytest.mark.slow  # torchrun agents

STEP = re.compile(r"step: +(\d+) +loss: +([\d.]+)")
TINY = [
    "--model.flavor", "tiny", "--training.seq_len", "32", "--training.global_batch_size", "8",
    "--training.local_batch_size", "4", "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1",
    "--validation.enable", "false", "--lr_scheduler.warmup_steps", "2", "--checkpoint.enable",
    "--checkpoint.interval", "2",
]  # fmt: skip


def _env(**extra) -> dict:
    return subprocess_env(TITANLITE_EXIT_BARRIER_TIMEOUT="5", **extra)


def _node(port: int, nnodes: int = 2, ngpu: int = 1, **extra) -> dict:
    extra.setdefault("RDZV_JOIN_TIMEOUT", "60")  # a node whose peer failed to start does not wait 10 minutes
    return _env(NNODES=str(nnodes), NGPU=str(ngpu), RDZV_ENDPOINT=f"127.0.0.1:{port}", **extra)


def _losses(text: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in STEP.findall(text)}


def _two_nodes(dump: Path, *args: str, timeout: float = 240, only_b=()) -> list[subprocess.CompletedProcess]:
    """run_train.sh on two 'nodes' (two agents, one rendezvous) until both end; only_b: node b's own overrides."""
    port = free_port()
    cmd = ["./run_train.sh", *TINY, "--job.dump_folder", str(dump), *args]
    log = dump.parent / f"{dump.name}-node0.log"  # a file, not a pipe nobody reads while node 1 runs
    with open(log, "w") as out, job(cmd, env=_node(port), stdout=out, stderr=subprocess.STDOUT) as a:
        b = run_job([*cmd, *only_b], env=_node(port), timeout=timeout, merge_output=True)
        a.wait(timeout=timeout)
    return [subprocess.CompletedProcess(a.args, a.returncode, log.read_text(), None), b]


def _one_node(dump: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = ["./run_train.sh", *TINY, "--job.dump_folder", str(dump), *args]
    return run_job(cmd, env=_node(free_port(), nnodes=1, ngpu=2), timeout=240, merge_output=True)


def test_two_nodes_train_as_one_node_and_their_checkpoints_resume_on_either(tmp_path):
    one = _one_node(tmp_path / "one", "--training.steps", "6")
    assert one.returncode == 0, one.stdout[-3000:]
    two = _two_nodes(tmp_path / "two", "--training.steps", "6")
    for node in two:
        assert node.returncode == 0, node.stdout[-3000:]
        assert "World size 2 (2 nodes x 1 process): data-parallel degree 2" in node.stdout  # both agents ran a rank
    assert "World size 2: data-parallel degree 2" in one.stdout
    ref = _losses(one.stdout)
    assert sorted(ref) == [1, 2, 3, 4, 5, 6] and _losses(two[0].stdout) == ref  # the same world size, bit-identical
    step = tmp_path / "two" / "checkpoint" / "step-6"
    assert {p.name for p in step.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}  # each node wrote its shard

    # Two nodes' checkpoint resumed on one node, and one node's on two: the steps after it are the same losses.
    on_one = _one_node(tmp_path / "two", "--training.steps", "6", "--checkpoint.load_step", "4")
    on_two = _two_nodes(tmp_path / "one", "--training.steps", "6", "--checkpoint.load_step", "4")
    assert on_one.returncode == 0 and all(n.returncode == 0 for n in on_two), on_one.stdout[-2000:]
    assert _losses(on_one.stdout) == {5: ref[5], 6: ref[6]}
    assert _losses(on_two[0].stdout) == {5: ref[5], 6: ref[6]}

    # Nodes started with different settings: each ends at once with one line naming the keys, and exit status 2.
    apart = _two_nodes(tmp_path / "apart", "--training.steps", "6", only_b=("--optimizer.lr", "2e-3"))
    for node in apart:
        told = [line for line in node.stdout.splitlines() if "started with different configurations" in line]
        assert node.returncode == 2 and len(told) == 1, node.stdout[-3000:]
        assert told[0].startswith("config error") and "optimizer.lr (0.00" in told[0], told  # ranks: rendezvous'
        assert "0.003 on rank " in told[0] and "0.002 on rank " in told[0], told
        assert "Traceback" not in node.stdout and "step:" not in node.stdout, node.stdout[-3000:]


def _configured_apart(tmp: str, by_rank: list[list[str]]) -> str | None:
    """Build a Trainer with this rank's overrides; the ConfigError it raised (None when it built)."""
    import os

    from titanlite.errors import ConfigError

    try:
        make_trainer(tiny_argv(tmp, *by_rank[int(os.environ["RANK"])]))
    except ConfigError as e:
        return str(e)
    return None


def test_ranks_started_with_different_configurations_stop_before_any_collective(tmp_path):
    """Before FSDP's set-up (a different model.flavor crashed gloo there), every rank refuses with one line that
    names each differing key with its value on each rank; keys that only locate the config file may differ."""
    config = Path(__file__).parent.parent / "train_configs" / "debug_model.toml"
    elsewhere = tmp_path / "elsewhere.toml"
    elsewhere.write_text(config.read_text())
    apart = ["--optimizer.lr", "2e-3", "--training.seq_len", "64", "--model.flavor", "debugmodel"]
    told = run_distributed(_configured_apart, 2, str(tmp_path), [[], apart])
    assert told[0] == told[1] and told[0] is not None and "\n" not in told[0], told
    assert told[0].startswith("the ranks of this job were started with different configurations: "), told[0]
    for key in ("model.flavor ('tiny' on rank 0, 'debugmodel' on rank 1)", "optimizer.lr (0.003 on rank 0, 0.002 on "
                "rank 1)", "training.seq_len (32 on rank 0, 64 on rank 1)"):  # fmt: skip
        assert key in told[0], told[0]
    assert not (tmp_path / "checkpoint").exists()
    # The same settings from a config file at another path: the same job.
    by_rank = [["--job.config_file", str(config)], ["--job.config_file", str(elsewhere)]]
    assert run_distributed(_configured_apart, 2, str(tmp_path), by_rank) == [None, None]


def _wait_for(proc_out: Path, pattern: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while pattern not in proc_out.read_text():
        assert time.monotonic() < deadline, proc_out.read_text()[-3000:]
        time.sleep(0.2)


def _left(dump: Path) -> list[str]:
    """Processes of a job still alive (their command line names its dump folder)."""
    out = subprocess.run(["pgrep", "-af", str(dump)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def _listening(port: int) -> bool:
    """Whether a socket on this machine listens on port (read from /proc: a probe connection would reach the store)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    return True
    return False


@contextlib.contextmanager
def _once_listening(port: int, started_job, timeout: float = 60):
    """Enter started_job (a job(...)) once something listens on port (the first node's rendezvous)."""
    deadline = time.monotonic() + timeout
    while not _listening(port):
        assert time.monotonic() < deadline, f"nothing listens on port {port}"
        time.sleep(0.2)
    with started_job as proc:
        yield proc


def _none_left(dump: Path) -> None:
    deadline = time.monotonic() + 10
    while _left(dump) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _left(dump), _left(dump)


def test_a_node_that_is_killed_stopped_or_never_comes_and_a_second_job(tmp_path):
    dump = tmp_path / "run"
    cmd = ["./run_train.sh", *TINY, "--training.steps", "100000", "--checkpoint.interval", "100000",
           "--job.dump_folder", str(dump)]  # fmt: skip
    logs = [tmp_path / "a.log", tmp_path / "b.log"]

    files = contextlib.ExitStack()

    def start_both():
        """Node a, then node b once a hosts the rendezvous (a listens on RDZV_ENDPOINT)."""
        port = free_port()
        outs = [files.enter_context(open(log, "w")) for log in logs]
        a = job(cmd, env=_node(port), stdout=outs[0], stderr=subprocess.STDOUT)
        return a, _once_listening(port, job(cmd, env=_node(port), stdout=outs[1], stderr=subprocess.STDOUT))

    # SIGTERM to one node's launcher: every rank of both nodes saves the same step and both nodes exit 0.
    a_job, b_job = start_both()
    with a_job as a, b_job as b:
        _wait_for(logs[1], "step:     2 ")
        second = run_job(["./run_train.sh", *TINY, "--job.dump_folder", str(dump)], env=_node(free_port(), 1, 1),
                         timeout=120, merge_output=True)  # fmt: skip
        assert second.returncode == 2 and f"job.dump_folder = '{dump}' is in use by another titanlite job" in (
            second.stdout
        ), second.stdout[-2000:]
        b.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert b.wait(timeout=60) == 0 and a.wait(timeout=60) == 0, (logs[0].read_text() + logs[1].read_text())[-3000:]
        ended = time.monotonic() - t0
    saved = sorted(dump.glob("checkpoint/step-*"))
    assert len(saved) == 1 and {p.name for p in saved[0].glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    assert "saved no checkpoint" not in logs[1].read_text()  # its launcher read its own node's record
    assert "Traceback" not in logs[0].read_text() + logs[1].read_text()
    assert ended < 30, ended  # the exit barrier waits 5 s (TITANLITE_EXIT_BARRIER_TIMEOUT) for the stopped node

    # kill -9 of one node's run_train.sh (not the rendezvous' host): the other node's job ends within seconds, with
    # one message naming the lost ranks' address.
    a_job, b_job = start_both()
    with a_job as a, b_job as b:
        _wait_for(logs[1], f"Resuming from {saved[0]}")
        _wait_for(logs[1], f"step: {int(saved[0].name[5:]) + 2:5d} ")
        b.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        assert a.wait(timeout=60) == 1
        ended = time.monotonic() - t0
        stop_job(b)
    text = logs[0].read_text()
    assert ended < 20, ended
    files.close()
    lost = [line for line in text.splitlines() if line.startswith("error")]
    assert len(lost) == 1 and "lost contact with the ranks at 127.0.0.1" in lost[0], text[-3000:]
    assert "NNODES=2" in lost[0], lost
    assert "Traceback" not in text, text[-3000:]
    _none_left(dump)

    # kill -9 of the node that hosts the rendezvous: the survivor's one line names the rendezvous, with no C++ stack
    # trace before it (torchrun's store warns with one when its server is gone).
    files = contextlib.ExitStack()
    a_job, b_job = start_both()
    with a_job as a, b_job as b:
        _wait_for(logs[1], f"step: {int(saved[0].name[5:]) + 2:5d} ")
        a.send_signal(signal.SIGKILL)
        assert b.wait(timeout=60) == 1
        stop_job(a)
    files.close()
    text = logs[1].read_text()
    lost = [line for line in text.splitlines() if line.startswith("error")]
    assert len(lost) == 1, text[-3000:]
    assert lost[0].startswith("error: lost contact with the job's rendezvous at RDZV_ENDPOINT=127.0.0.1:"), lost
    assert "frame #" not in text and "Exception raised from" not in text and "Traceback" not in text, text[-3000:]
    _none_left(dump)

    # A node whose peer never arrives gives up after RDZV_JOIN_TIMEOUT with one message naming what to check.
    port = free_port()
    alone = run_job(cmd, env=_node(port, RDZV_JOIN_TIMEOUT="3"), timeout=120, merge_output=True)
    assert alone.returncode == 1, alone.stdout[-2000:]
    assert f"NNODES=2 nodes were to meet at RDZV_ENDPOINT=127.0.0.1:{port}" in alone.stdout, alone.stdout[-2000:]
    assert "Traceback" not in alone.stdout
