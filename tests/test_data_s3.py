"""Training data in object storage, against moto's S3 server (the `s3` fixture): a token store built into
s3://... by `python -m titanlite.data prepare --output`, read there by every rank with ranged reads (each fetching a
small part of the store), with a local store's losses at 2 ranks, an exact resume on another topology, and an
outage that stops the job with one message naming the URL after its retries."""

from __future__ import annotations

import uuid

import pytest
import torch

from helpers import make_trainer, run_distributed, tiny_argv

pytestmark = pytest.mark.slow  # moto's server and spawned worlds


def _url(name: str) -> str:
    return f"s3://titanlite-test/data-{uuid.uuid4().hex[:8]}/{name}"


def _argv(dump, dataset, steps=4, *extra):
    return tiny_argv(dump, "--training.dataset", dataset, "--training.steps", str(steps), "--checkpoint.enable",
                     "--training.global_batch_size", "8", "--training.local_batch_size", "2",
                     "--checkpoint.interval", "2", "--data.remote_chunk_kib", "16", *extra)  # fmt: skip


def _layout_of(trainer):
    loader = trainer.dataloader
    return getattr(loader, "loader", loader).layouts[0]  # (the prefetcher's)


def _store_of(trainer):
    return _layout_of(trainer).store


def _train(tmp, dataset, run, *extra):
    """Losses of a 4-step run on this world, and (a store in object storage) what this rank fetched of it."""
    t = make_trainer(_argv(tmp / run, dataset, 4, *extra))
    losses = t.train()
    store = _store_of(t)
    cache = getattr(store, "cache", None)
    fetched = (cache.fetched_bytes, cache.requests) if cache is not None else None
    return {"losses": losses, "fetched": fetched, "store_bytes": store.num_tokens * store.dtype.itemsize}


def test_a_token_store_in_s3_trains_as_a_local_one_each_rank_fetching_its_ranges_and_resumes(tmp_path, s3, monkeypatch):
    from titanlite.cli.data import main as data_command

    s3.use(monkeypatch)
    url = _url("builtin-bytes")
    assert data_command(["prepare", "--dataset", "builtin", "--output", url]) == 0
    assert data_command(["prepare", "--dataset", "builtin", "--output", url]) == 0  # found, not built again
    local = run_distributed(_train, 2, tmp_path, "builtin", "local")
    remote = run_distributed(_train, 2, tmp_path, url, "remote")
    assert remote[0]["losses"] == local[0]["losses"]  # the same global order, bit for bit
    for rank in remote:
        fetched, requests = rank["fetched"]
        assert 0 < fetched < rank["store_bytes"] / 8, (fetched, rank["store_bytes"])  # its own ranges only
        assert requests <= fetched // (16 << 10) + 1
    resumed = run_distributed(_resume, 1, tmp_path, url)[0]
    assert resumed == {s: remote[0]["losses"][s] for s in (3, 4)}


def _resume(tmp, url):
    import shutil

    shutil.copytree(tmp / "remote" / "checkpoint", tmp / "resumed" / "checkpoint")
    return make_trainer(_argv(tmp / "resumed", url, 4, "--checkpoint.load_step", "2")).train()


def _counted(method, name, calls):
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return method(*args, **kwargs)

    return wrapper


def test_an_outage_while_reading_stops_after_the_retries_with_one_message_naming_the_url(tmp_path, s3, monkeypatch):
    from titanlite.cli.data import main as data_command
    from titanlite.data import remote_store
    from titanlite.errors import DataReadError

    s3.use(monkeypatch)
    url = _url("outage")
    assert data_command(["prepare", "--dataset", "builtin", "--output", url]) == 0
    monkeypatch.setattr(remote_store, "RETRY_DELAYS", (0.1, 0.2))
    t = make_trainer(_argv(tmp_path / "run", url, 50, "--data.prefetch", "0", "--checkpoint.enable", "false"))
    fs, calls = _store_of(t).path.fs, {"cat_ranges": 0, "cat_file": 0}
    for method in calls:  # a window's chunks come in one concurrent request, not one per document
        monkeypatch.setattr(fs, method, _counted(getattr(fs, method), method, calls))
    _layout_of(t).read(1000)
    assert calls == {"cat_ranges": 1, "cat_file": 0}, calls
    s3.down.touch()  # the endpoint goes down once the job runs
    try:  # (in this process: its process group is destroyed at the end, for the tests after it)
        with pytest.raises(DataReadError, match=r"reading s3://titanlite-test/data-\w+/outage/tokens-\d+.bin "
                           r"\(bytes \d+-\d+\) failed 3 times.*the job stops rather than skip data"):  # fmt: skip
            t.train()
    finally:
        s3.up()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _docs_losses(tmp, dataset, run):
    return make_trainer(_argv(tmp / run, dataset, 3)).train()


def test_documents_in_s3_are_tokenized_as_the_same_local_file_and_recorded_by_their_url(tmp_path, s3, monkeypatch):
    """A jsonl file in object storage as training.dataset: copied once to this machine and tokenized into a local
    token store, with the local file's losses; the run's job_config.toml names the URL."""
    import json

    import s3fs

    s3.use(monkeypatch)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i}: " + "lorem ipsum " * (i % 13 + 3)}) + "\n"
                            for i in range(400)))  # fmt: skip
    url = _url("docs.jsonl")
    s3fs.S3FileSystem().put_file(str(docs), url.removeprefix("s3://"))
    local = run_distributed(_docs_losses, 1, tmp_path, str(docs), "local")[0]
    remote = run_distributed(_docs_losses, 1, tmp_path, url, "remote")[0]
    assert remote == local
    saved = (tmp_path / "remote" / "checkpoint" / "step-3" / "job_config.toml").read_text()
    assert f'dataset = "{url}"' in saved, saved
