"""How a run_train.sh job ends when something goes wrong: a worker's user error is one message and exit status 2
(no torchrun dump), so is a failed run (a non-finite loss), a frozen worker is reported by name within the hang
timeout by its launcher (a one-process job's too), and a temp folder that cannot be
written does not turn a finished run into a failed one (gloo, CPU)."""

import json
import time

import pytest

from titanlite.exit_status import ENV, read_outcome, record_end, record_failure

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
    from titanlite.hang_watch import HangWatch

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


def test_the_watch_judges_silence_and_hangs_on_its_own_clock(tmp_path, monkeypatch):
    """A fault-tolerant group leaves when a rank is silent longer than its limit; time the watcher itself did not
    run (a suspended job) does not count; a rank that ended is not silent; a phase longer than the timeout hangs."""
    import types

    from titanlite import hang_watch as hw

    clock = types.SimpleNamespace(t=1000.0)
    monkeypatch.setattr(hw, "time", types.SimpleNamespace(time=lambda: clock.t, monotonic=lambda: clock.t))
    folder = tmp_path / ".progress"
    folder.mkdir()

    def write(rank, **fields):
        record = {"attempt": hw._attempt(), "phase": f"step 3 of rank {rank}", "since": 990.0, "updated": clock.t}
        (folder / f"rank-{rank}.json").write_text(json.dumps(record | {"host": "h", "pid": 100 + rank} | fields))

    def tick(seconds, watch):
        clock.t += seconds
        write(0, since=clock.t)  # rank 0 moves on; rank 1's file stays as it was
        return watch.check()

    spec = {"folder": str(folder), "world": 3, "ranks": [0, 1], "timeout": 0, "leave_after": 2.0, "replica_id": 1}
    spec["refresh"] = 0.5
    write(0), write(1)
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
