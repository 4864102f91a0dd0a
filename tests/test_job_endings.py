"""How a run_train.sh job ends when something goes wrong: a worker's user error is one message and exit status 2
(no torchrun dump), a frozen rank is reported by name within the hang timeout, and a temp folder that cannot be
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
def test_a_frozen_rank_is_reported_by_name_and_the_job_exits_non_zero(tmp_path):
    env = faults_env("stop:step:3:1", NGPU="2")
    r, text, seconds = _run_train(
        _job(tmp_path, "--training.steps", "100000", "--training.hang_timeout_seconds", "5"), env
    )
    assert r.returncode == 1, text[-3000:]
    assert "the job is hung: rank 0 made no progress" in r.stderr, text[-3000:]
    assert (
        "stopped answering" in r.stderr and "rank 1 (" in r.stderr and "'step 3: checkpoint save, if due'" in r.stderr
    )
    assert "ended at once: rank(s) 1 on this host" in r.stderr, text[-3000:]
    assert "Traceback" not in text and "ChildFailedError" not in text
    assert seconds < 60  # the timeout and a few refreshes: not torchrun's 30 s grace for the frozen worker


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
    stale.write_text(json.dumps(record | {"updated": record["updated"] - 100, "since": record["since"] - 100}))
    report = ranks[0].report()
    assert "rank 0 made no progress" in report and "(training.hang_timeout_seconds = 60)" in report
    assert "stopped answering" in report and "rank 1 (" in report and "microbatch 2 of 2' for 100 s" in report
    assert "still running: rank 0 (" in report
    assert "no progress report from rank(s) 2" in report
