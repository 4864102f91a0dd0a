"""Opening a checkpoint never runs code: a hostile `.metadata` pickle, or a hostile bytes item inside a
valid-looking step folder whose manifest matches, is refused by every reader (the launcher's pre-check,
resume, initial_load_path, generate, export) and nothing it holds runs."""

import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from helpers import run_module, tiny_argv

pytestmark = pytest.mark.slow  # titanlite subprocesses


class _RunsCode:
    """Unpickling this runs `touch marker` (what an attacker's payload would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _seal(folder):
    from titanlite.checkpoint.integrity import seal, write_rank_manifest
    from titanlite.checkpoint.manager import RUN_FILES

    (folder / "manifest.json").unlink(missing_ok=True)
    write_rank_manifest(folder, 0)
    seal(folder, 1, [".metadata", *RUN_FILES])


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A real checkpoint, and two copies with a payload: in .metadata, and as a saved bytes item."""
    root = tmp_path_factory.mktemp("hostile")
    job = ["--training.global_batch_size", "8", "--training.local_batch_size", "8", "--checkpoint.enable"]
    r = run_module("titanlite.train", *tiny_argv(root / "job", "--training.steps", "2", *job))
    assert r.returncode == 0, r.stderr[-3000:]
    good = root / "job" / "checkpoint" / "step-2"
    marker = root / "payload-ran"

    in_metadata = root / "meta" / "checkpoint" / "step-2"
    shutil.copytree(good, in_metadata)
    (in_metadata / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    _seal(in_metadata)

    # The same state re-saved with one plain value replaced by the payload; manifest rebuilt to match.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(good, root / "full.pt")  # our own, trusted checkpoint
    state = torch.load(root / "full.pt", weights_only=False)
    state["train_state"]["tokens_seen"] = _RunsCode(marker)
    in_item = root / "item" / "checkpoint" / "step-2"
    dcp.save(state, checkpoint_id=str(in_item), no_dist=True)  # pickling runs nothing; unpickling would
    for name in ("job_config.toml", "model_args.json"):
        shutil.copy(good / name, in_item / name)
    _seal(in_item)
    return dict(good=good, in_metadata=in_metadata, in_item=in_item, marker=marker, job=job, root=root)


def _refused(r, hostile, needle="refused without running it"):
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert needle in out and "Traceback" not in out, out[-3000:]
    assert not hostile["marker"].exists(), "the payload ran"


def test_a_good_checkpoint_still_resumes_and_exports(hostile, tmp_path):
    dump = hostile["good"].parent.parent
    r = run_module("titanlite.train", *tiny_argv(dump, "--training.steps", "3", *hostile["job"]))
    assert r.returncode == 0 and "Resuming from" in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    r = run_module("titanlite.checkpoint", "export", "--checkpoint", hostile["good"], "--output", tmp_path / "m.pt")
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("where", ["in_metadata", "in_item"])
def test_resume_refuses_a_payload(hostile, where):
    dump = hostile[where].parent.parent
    r = run_module("titanlite.train", *tiny_argv(dump, "--training.steps", "3", *hostile["job"]))
    _refused(r, hostile)
    assert str(hostile[where]) in r.stdout + r.stderr  # names the folder or file


def test_the_launchers_pre_check_refuses_a_metadata_payload(hostile):
    dump = hostile["in_metadata"].parent.parent
    r = run_module("titanlite.config", "--world-size", "1", *tiny_argv(dump, *hostile["job"]))
    _refused(r, hostile)
    assert str(hostile["in_metadata"] / ".metadata") in r.stderr


@pytest.mark.parametrize("where", ["in_metadata", "in_item"])
def test_export_generate_and_initial_load_refuse_or_read_only_the_weights(hostile, where, tmp_path):
    folder = hostile[where]
    export = run_module("titanlite.checkpoint", "export", "--checkpoint", folder, "--output", tmp_path / "m.pt")
    generate = run_module(
        "titanlite.generate", "--checkpoint", folder, "--model.flavor", "tiny", "--prompt", "a", "--max-new-tokens", "2"
    )
    initial = run_module(
        "titanlite.train",
        *tiny_argv(tmp_path / "fresh", "--training.steps", "1", "--checkpoint.initial_load_path", folder),
    )
    if where == "in_metadata":
        for r in (export, generate, initial):
            _refused(r, hostile)
        assert not (tmp_path / "m.pt").exists()
    else:  # they read the model's tensors only, never the poisoned bytes item: they work, and nothing ran
        for r in (export, generate, initial):
            assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        assert not hostile["marker"].exists()
