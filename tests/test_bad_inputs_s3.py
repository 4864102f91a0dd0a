"""The bad-input catalogue, object storage: an endpoint that is down, wrong credentials, a missing bucket, a prefix
another job holds, a dump folder given as a URL, an export over objects that are not a model, a step folder without
its commit marker. Each ends as one message naming the key and the URL, exit status 2, no traceback, and no
credential printed (the harness: bad_inputs.py)."""

from __future__ import annotations

import json
import uuid

import pytest

from bad_inputs import Case, check
from helpers import ckpt_argv, s3_server

pytestmark = pytest.mark.slow  # a server process


def _train(*extra):
    return tuple(ckpt_argv("{tmp}/run", "--training.steps", "2", *extra))


def _url(name: str) -> str:
    return f"s3://titanlite-test/{uuid.uuid4().hex[:6]}-{name}"


def test_endpoint_down_missing_bucket_dump_url(tmp_path, capsys, s3, monkeypatch):
    s3.use(monkeypatch)
    down = _url("down")
    s3.down.touch()
    try:
        check(Case("s3-endpoint-down", "filesystem", "train", _train("--checkpoint.folder", down),
                   (f"checkpoint.folder = {down!r}", "the object store cannot be reached", "AWS_ENDPOINT_URL")),
              tmp_path / "a", capsys)  # fmt: skip
    finally:
        s3.up()
    check(Case("s3-no-bucket", "filesystem", "train", _train("--checkpoint.folder", "s3://no-such-bucket/x"),
               ("checkpoint.folder = 's3://no-such-bucket/x'", "bucket 'no-such-bucket' does not exist")),
          tmp_path / "b", capsys)  # fmt: skip
    check(Case("s3-dump-folder", "config", "train", _train("--job.dump_folder", "s3://titanlite-test/d"),
               ("job.dump_folder = 's3://titanlite-test/d'", "checkpoint.folder = 's3://bucket/prefix'")),
          tmp_path / "c", capsys)  # fmt: skip
    missing = _url("missing")
    check(Case("s3-initial-load-path-missing", "checkpoint", "train", _train("--checkpoint.initial_load_path", missing),
               (f"checkpoint.initial_load_path = {missing!r} does not exist",)), tmp_path / "d", capsys)  # fmt: skip
    check(Case("s3-store-folder", "config", "train", _train("--data.store_folder", "s3://titanlite-test/stores"),
               ("data.store_folder = 's3://titanlite-test/stores'", "python -m titanlite.data prepare",
                "--output s3://titanlite-test/stores/<name>")), tmp_path / "e", capsys)  # fmt: skip
    missing = _url("missing.jsonl")
    check(Case("s3-dataset-missing", "config", "train", _train("--training.dataset", missing),
               (f"training.dataset = {missing!r} does not exist",)), tmp_path / "f", capsys)  # fmt: skip


def test_prefix_of_another_job_uncommitted_step_export_over_other_objects(tmp_path, capsys, s3, monkeypatch):
    from titanlite.storage import location

    s3.use(monkeypatch)
    busy = location(_url("busy"))
    holder = {"host": "node-3", "pid": 77, "run_id": "other", "started": "2026-11-27 09:00:00"}
    (busy / ".titanlite.lock").write_text(json.dumps(holder))
    check(Case("s3-prefix-in-use", "filesystem", "train", _train("--checkpoint.folder", str(busy)),
               (f"checkpoint.folder = {str(busy)!r} is in use by another titanlite job (host node-3, pid 77",)),
          tmp_path / "a", capsys)  # fmt: skip

    cut = location(_url("cut"))
    (cut / "step-2" / ".metadata").write_text("not committed")
    check(Case("s3-step-not-committed", "checkpoint", "train",
               _train("--checkpoint.folder", str(cut), "--checkpoint.load_step", "2"),
               ("checkpoint.load_step = 2", "it has no commit marker (.committed)")),
          tmp_path / "b", capsys)  # fmt: skip

    notes = location(_url("notes"))
    (notes / "README.txt").write_text("keep me")
    (tmp_path / "c").mkdir()
    check(Case("s3-export-over-other-objects", "export", "export",
               ("export", "--checkpoint", "{tmp}/nothing", "--output", str(notes), "--format", "hf", "--overwrite"),
               (f"--output {notes} holds README.txt and no model",)), tmp_path / "c", capsys)  # fmt: skip
    assert (notes / "README.txt").read_text() == "keep me"
    check(Case("s3-export-over-a-bucket", "export", "export",
               ("export", "--checkpoint", str(cut), "--output", "s3://titanlite-test", "--format", "hf", "--overwrite"),
               ("--output s3://titanlite-test is a whole bucket",)), tmp_path / "c", capsys)  # fmt: skip
    check(Case("s3-export-over-its-checkpoint", "export", "export",
               ("export", "--checkpoint", f"{cut}/step-2", "--output", str(cut), "--format", "hf", "--overwrite"),
               (f"--output {cut} is or holds the checkpoint being exported",)), tmp_path / "c", capsys)  # fmt: skip
    assert (cut / "step-2" / ".metadata").read_text() == "not committed"


def test_wrong_credentials_name_the_bucket_and_print_no_secret(tmp_path, capsys, monkeypatch):
    pytest.importorskip("moto")
    with s3_server(tmp_path / "down", check_keys=True) as env:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-do-not-print")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY0000")
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        check(Case("s3-wrong-credentials", "filesystem", "train", _train("--checkpoint.folder", "s3://titanlite-test/k"),
                   ("checkpoint.folder = 's3://titanlite-test/k'", "access to bucket 'titanlite-test' was denied",
                    "AWS_ACCESS_KEY_ID"), absent=("wrong-secret-do-not-print",)), tmp_path / "run", capsys)  # fmt: skip
