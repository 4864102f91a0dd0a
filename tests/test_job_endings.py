"""How a run_train.sh job ends when something goes wrong: a worker's user error is one message and exit status 2
(no torchrun dump), so is a failed run (a non-finite loss), a frozen worker is reported by name within the hang
timeout by its launcher (a one-process job's too), and a temp folder that cannot be
written does not turn a finished run into a failed one (gloo, CPU)."""

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from titanlite.runtime.exit_status import ENV, read_outcome, record_end, record_failure

from helpers import faults_env, run_job, subprocess_env, tiny_argv


def test_a_status_that_cannot_be_written_is_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(ENV, str(tmp_path / "gone" / "status"))  # a temp folder that cannot be written
    record_end("finished", 10)
    assert record_failure("config_error", "bad record", 1) is False  # the worker then prints it itself
    assert "could not record how this run ended" in caplog.text
    assert not (tmp_path / "gone").exists()


def test_failures_are_read_back_lowest_rank_and_user_errors_first(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "status"))
    assert record_failure("hung", "rank 3 is frozen", 0)
    assert record_failure("config_error", "bad record", 2)
    assert record_failure("config_error", "bad record", 1)
    outcome = read_outcome(str(tmp_path / "status"))
    assert outcome.first_failure() == {"status": "config_error", "rank": 1, "message": "bad record"} | {
        "time": outcome.failures[1]["time"]
    }


def _run_train(args, env, timeout=240):
    t0 = time.time()
    r = run_job(["./run_train.sh", *map(str, args)], env=env, timeout=timeout)
    return r, r.stdout + r.stderr, time.time() - t0


def _job(tmp_path, *extra):
    return tiny_argv(
        tmp_path / "job", "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "100", *extra
    )


@pytest.mark.slow
def test_a_workers_user_error_is_one_message_and_exit_2(tmp_path):
    env = faults_env("config_error:step:3:1", NGPU="2", LOG_RANK="0,1")
    r, text, _ = _run_train(_job(tmp_path), env)
    assert r.returncode == 2, text[-3000:]
    assert text.count("fault injection: a malformed record at step 3 on rank 1") == 1, text[-3000:]
    assert "config error (rank 1): fault injection" in r.stderr
    for noise in ("ChildFailedError", "Traceback", "closing signal", "exitcode"):
        assert noise not in text, text[-3000:]


@pytest.mark.slow
def test_a_frozen_one_process_job_is_ended_by_its_launcher(tmp_path):
    """The only worker freezes (SIGSTOP): the watch runs in the launcher, not in the frozen process, so the job
    ends with the report (it never ended before)."""
    env = faults_env("stop:step:3:0", NGPU="1", TITANLITE_STEP_PAUSE="1")  # a pace: the last phase is on file
    r, text, seconds = _run_train(
        _job(tmp_path, "--training.steps", "100000", "--training.hang_timeout_seconds", "5"), env, timeout=90
    )
    assert r.returncode == 1, text[-3000:]
    assert "the job is hung: rank 0 made no progress" in r.stderr, text[-3000:]
    assert (
        "stopped answering" in r.stderr and "rank 0 (" in r.stderr and "'step 3: checkpoint save, if due'" in r.stderr
    )
    assert "ended at once: rank(s) 0 on this host" in r.stderr, text[-3000:]
    assert "Traceback" not in text and "ChildFailedError" not in text
    assert seconds < 60  # start-up, the timeout and a refresh
    print(f"the frozen one-process job ended {seconds:.1f} s after its launch (hang_timeout_seconds 5)")


@pytest.mark.slow
def test_an_unwritable_temp_folder_does_not_fail_a_finished_run(tmp_path):
    env = subprocess_env(NGPU="2", TMPDIR=str(tmp_path / "gone"))  # nothing can be created in it
    r, text, _ = _run_train(_job(tmp_path, "--training.steps", "2"), env)
    assert r.returncode == 0, text[-3000:]
    assert (tmp_path / "job" / "checkpoint" / "step-2").is_dir()


def test_the_hang_report_names_the_silent_rank_and_every_phase(tmp_path):
    from titanlite.runtime.hang_watch import HangWatch

    ranks = [HangWatch(str(tmp_path), r, 3, timeout_s=60) for r in range(2)]
    for r, watch in enumerate(ranks):
        watch.start()
        watch.phase(f"step 7: forward/backward, microbatch {r + 1} of 2")
        watch._publish()
        watch.stop()
    stale = tmp_path / ".progress" / "rank-1.json"
    record = json.loads(stale.read_text())
    del record["ended"]  # as a rank that froze left it
    stale.write_text(json.dumps(record | {"updated": record["updated"] - 100, "since": record["since"] - 100}))
    report = ranks[0].report()
    assert "rank 0 made no progress" in report and "(training.hang_timeout_seconds = 60)" in report
    assert "stopped answering" in report and "rank 1 (" in report and "microbatch 2 of 2' for 100 s" in report
    assert "still running: rank 0 (" in report
    assert "no progress report from rank(s) 2" in report


def test_a_non_finite_loss_is_told_once_by_the_launcher(tmp_path, monkeypatch, capsys):
    """The worker records why it failed: the launcher prints it (one line, exit 1), not torchrun's failure table."""
    from titanlite.cli.launch import _failed
    from titanlite.cli.train import main

    monkeypatch.setenv(ENV, str(tmp_path / "status"))
    argv = tiny_argv(tmp_path, "--optimizer.lr", "1e12", "--training.max_norm", "0", "--lr_scheduler.warmup_steps", "0")
    assert main([*argv, "--training.steps", "2"]) == 1
    failure = read_outcome(str(tmp_path / "status")).first_failure()
    assert failure["status"] == "failed" and "became non-finite at step" in failure["message"], failure
    capsys.readouterr()
    assert _failed("<torchrun's failure table>") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the loss or gradient norm became non-finite at step") and "table" not in err, err


def _fake_watch(tmp_path, monkeypatch, pids=None):
    """A clock the test moves, progress files of ranks 0 and 1 (rank r's pid: pids[r], else 100 + r), and
    tick(seconds, *watchers, fresh): the ranks in fresh move on (a new phase), the others' files stay as they were,
    and each watcher checks."""
    import types

    from titanlite.runtime import hang_watch as hw

    clock = types.SimpleNamespace(t=1000.0)
    monkeypatch.setattr(hw, "time", types.SimpleNamespace(time=lambda: clock.t, monotonic=lambda: clock.t))
    folder = tmp_path / ".progress"
    folder.mkdir(exist_ok=True)

    def write(rank, **fields):
        record = {"attempt": hw._attempt(), "phase": f"step 3 of rank {rank}", "since": 990.0, "updated": clock.t}
        fields = {"host": "h", "pid": (pids or {}).get(rank, 100 + rank)} | fields
        (folder / f"rank-{rank}.json").write_text(json.dumps(record | fields))

    def tick(seconds, *watches, fresh=(0,)):
        clock.t += seconds
        for rank in fresh:
            write(rank, since=clock.t)
        return [watch.check() for watch in watches] if len(watches) > 1 else watches[0].check()

    spec = {"folder": str(folder), "world": 3, "ranks": [0, 1], "timeout": 0, "leave_after": 2.0, "replica_id": 1}
    write(0), write(1)
    return clock, write, tick, spec | {"refresh": 0.5}


def test_the_watch_judges_silence_and_hangs_on_its_own_clock(tmp_path, monkeypatch):
    """A fault-tolerant group leaves when a rank is silent longer than its limit; time the watcher itself did not
    run (a suspended job) does not count; a rank that ended is not silent; a phase longer than the timeout hangs."""
    from titanlite.runtime import hang_watch as hw

    clock, write, tick, spec = _fake_watch(tmp_path, monkeypatch)
    monkeypatch.setattr(hw, "process_stopped", lambda pid: pid == 101)  # rank 1 is stopped (SIGSTOP)
    watch = hw.Watcher(spec, lambda r: True, end_all=True)
    assert [tick(0.5, watch) for _ in range(3)] == [None] * 3
    assert tick(100, watch) is None  # the watcher was stopped 100 s: only its period counts
    assert tick(0.5, watch) is None
    report, rank, pids = tick(0.5, watch)  # 2.5 s of silence seen
    assert rank == 1 and sorted(pids) == [100, 101], (rank, pids)
    assert "no progress report from rank(s) 2" in report  # another node's rank: read for the report only
    assert (
        report.startswith("rank 1 stopped answering 2 s ago in 'step 3 of rank 1'")
        and "replica_id = 1) leaves" in report
    )

    write(1, ended=True)  # on its way out after training: no longer watched
    watch = hw.Watcher(spec, lambda r: True, end_all=True)
    assert [tick(1, watch) for _ in range(5)] == [None] * 5
    write(1, since=clock.t - 17)
    hung = hw.Watcher(spec | {"leave_after": 0, "timeout": 30}, lambda r: True, end_all=False)
    assert tick(1, hung) is None  # rank 1 has been in this phase for 18 s
    assert [tick(0.5, hung) for _ in range(24)] == [None] * 24  # 30 s: not more than the timeout yet
    report, rank, pids = tick(0.5, hung)
    assert report.startswith("the job is hung: rank 1 made no progress for 30 s in 'step 3 of rank 1'"), report  # 30.5
    assert pids == [101] and "ended at once: rank(s) 1 on this host" in report  # only the silent one


def test_the_leave_rule_takes_only_a_stopped_process_for_frozen(tmp_path, monkeypatch):
    """A rank whose progress file went stale while its process runs or waits (state S or D: a rename stalled on a
    shared file system during a big save) does not take its group out, however long; stopped (SIGSTOP, state T), the
    same rank does. The limit is at least 10 s, whatever quorum_timeout_seconds / 4 is."""
    from titanlite.runtime import hang_watch as hw

    rank1 = subprocess.Popen(["sleep", "120"])
    try:
        clock, write, tick, spec = _fake_watch(tmp_path, monkeypatch, pids={0: os.getpid(), 1: rank1.pid})
        watch = hw.Watcher(spec, lambda r: True, end_all=True)
        assert [tick(1, watch) for _ in range(30)] == [None] * 30  # silent for 30 s, but sleeping (state S)
        assert not hw.process_stopped(os.getpid()) and not hw.process_stopped(rank1.pid)
        os.kill(rank1.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not hw.process_stopped(rank1.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        report, rank, pids = tick(1, watch)
        assert rank == 1 and sorted(pids) == sorted([os.getpid(), rank1.pid]), (rank, pids)
        assert report.startswith("rank 1 stopped answering 30 s ago in 'step 3 of rank 1' (its process is stopped)")
    finally:
        rank1.kill()
        rank1.wait()
    quick = hw.HangWatch(str(tmp_path), 0, 1, timeout_s=1800)
    quick.leave_when_silent(6 / 4, 0)  # quorum_timeout_seconds = 6
    assert quick.leave_after == hw.LEAVE_FLOOR == 10 and quick.leave_after >= 3 * quick.refresh
    default = hw.HangWatch(str(tmp_path), 0, 1, timeout_s=1800)
    default.leave_when_silent(60 / 4, 0)
    assert default.leave_after == 15 and default.leave_after >= 3 * default.refresh


def test_a_group_leaving_on_one_node_takes_its_other_nodes_out(tmp_path, monkeypatch):
    """A group of 2 nodes sharing a dump folder (ranks 0-1 on node A, 2-3 on node B); rank 1 stops: node A's
    launcher ends its workers and marks the group's leave; node B's launcher, whose ranks still answer (blocked in the
    quorum, their rank 0 heartbeating), ends its workers too. A marker of an earlier run (same rdzv id) is stale."""
    from titanlite.runtime import hang_watch as hw

    clock, write, tick, spec = _fake_watch(tmp_path, monkeypatch)
    monkeypatch.setattr(hw, "process_stopped", lambda pid: pid == 101)
    write(2), write(3)
    spec = spec | {"world": 4}
    node_a = hw.Watcher(spec, lambda r: True, end_all=True)
    node_b = hw.Watcher(spec | {"ranks": [2, 3]}, lambda r: True, end_all=True)
    fresh = (0, 2, 3)
    assert [tick(0.5, node_a, node_b, fresh=fresh) for _ in range(5)] == [[None, None]] * 5
    (report_a, rank_a, pids_a), (report_b, rank_b, pids_b) = tick(0.5, node_a, node_b, fresh=fresh)
    assert rank_a == 1 and sorted(pids_a) == [100, 101] and "replica_id = 1) leaves the job" in report_a
    assert rank_b == 1 and sorted(pids_b) == [102, 103], pids_b
    assert report_b.startswith(
        "rank 1 (h) stopped answering and its node's launcher took this replica group (fault_tolerance.replica_id = 1)"
        " out of the job: this node's workers end too"
    ), report_b
    assert "ended at once: rank(s) 2-3 on this host" in report_b
    rerun = hw.Watcher(spec | {"ranks": [2, 3]}, lambda r: True, end_all=True)  # the group's command run again
    assert [tick(0.5, rerun, fresh=(0, 1, 2, 3)) for _ in range(3)] == [None] * 3


def test_workers_that_cannot_tell_their_launcher_watch_each_other(tmp_path, monkeypatch, caplog):
    """The spec file for the launcher's watch cannot be written (a full or read-only temp folder): the workers judge
    themselves (the launcher would watch nothing); when it can, the launcher judges."""
    from titanlite.runtime import hang_watch as hw

    monkeypatch.setenv(hw.LAUNCHER_ENV, "1")
    monkeypatch.setenv(ENV, str(tmp_path / "gone" / "status"))
    watch = hw.HangWatch(str(tmp_path), 0, 1, timeout_s=60).start()
    watch.stop()
    assert watch._judge is not None and "this node's workers watch each other" in caplog.text
    monkeypatch.setenv(ENV, str(tmp_path / "status"))
    watch = hw.HangWatch(str(tmp_path), 0, 1, timeout_s=60).start()
    watch.stop()
    assert watch._judge is None and json.loads(hw.spec_path(str(tmp_path / "status")).read_text())["timeout"] == 60


def test_a_worker_whose_launcher_died_during_its_imports_exits():
    """The launcher names itself (TITANLITE_LAUNCHER_PID): a worker whose launcher died before the worker armed its
    parent-death signal exits at once; one whose named launcher is its live parent, or another job's live process
    (a name inherited from elsewhere), goes on."""
    from titanlite.runtime import run_control

    gone = subprocess.Popen(["true"])
    gone.wait()

    def worker_status(launcher: int) -> int:
        pid = os.fork()
        if pid == 0:
            try:
                os.environ |= {"TORCHELASTIC_RUN_ID": "t", run_control.LAUNCHER_PID_ENV: str(launcher)}
                run_control.die_with_launcher()
            finally:
                os._exit(0)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    assert worker_status(gone.pid) == 1
    assert worker_status(os.getpid()) == 0
    assert worker_status(1) == 0


def test_the_launchers_watch_stops_in_bounded_time_and_a_restart_is_not_the_end(tmp_path, monkeypatch, caplog):
    """A read hung on NFS does not block the launcher's exit; with torchrun restarts left, a verdict is logged and
    says the workers restart (it is not the job's end: nothing recorded for the launcher to print)."""
    from titanlite.runtime import hang_watch as hw

    hung = threading.Event()
    monkeypatch.setattr(hw, "_read_json", lambda path: hung.wait(60) and None)
    monkeypatch.setattr(hw, "STOP_JOIN", 0.5)
    watch = hw.LauncherWatch(str(tmp_path / "status"), poll=0.01).start()
    time.sleep(0.1)
    began = time.monotonic()
    watch.stop()
    hung.set()
    assert time.monotonic() - began < 3
    monkeypatch.setenv(ENV, str(tmp_path / "status"))
    hw.announce("the job is hung: rank 0 ...", 0, restarts=2)
    assert not read_outcome(str(tmp_path / "status")).failures and "the job is hung: rank 0" in caplog.text
    hw.announce("the job is hung: rank 0 ...", 0, restarts=0)
    assert read_outcome(str(tmp_path / "status")).first_failure()["status"] == "hung"
    line = hw.leave_line(1, 12, "step 3", 1, restarts=2)
    assert "torchrun restarts its workers (2 restart(s) left" in line and "run its command again" not in line
    assert "run its command again to rejoin" in hw.leave_line(1, 12, "step 3", 1, restarts=0)
