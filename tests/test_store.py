"""Token stores: the same sequences as the streaming path, any topology, resume, mixtures, formats, bad stores."""

import json
import os
import pathlib

import numpy as np
import pytest
import torch

from titanlite.config import load
from titanlite.data.build import build_loader, check_data, stores_folder, training_specs
from titanlite.data.encoders import TextEncoder
from titanlite.data.loader import Prefetcher
from titanlite.data.packing import PackedDataLoader
from titanlite.data.store import TokenStore
from titanlite.data.store_build import store_key, store_path
from titanlite.data.tokenizers import ByteTokenizer
from titanlite.errors import ConfigError

from helpers import capture_logs, run_distributed, run_module, subprocess_env

DOCS = [f"document {i}: " + "words of text " * (i % 7 + 1) for i in range(60)]


@pytest.fixture
def docs_jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    return path


def _cfg(tmp_path, dataset, *extra, seq_len=24, global_batch=8, local_batch=2):
    return load(
        [
            "--training.dataset",
            str(dataset),
            "--training.seq_len",
            str(seq_len),
            "--training.global_batch_size",
            str(global_batch),
            "--training.local_batch_size",
            str(local_batch),
            "--data.store_folder",
            str(tmp_path / "stores"),
            "--data.prefetch",
            "0",
            *extra,
        ]
    )


def _windows(step):
    return torch.cat([torch.cat([mb.inputs, mb.labels[:, -1:]], dim=1) for mb in step.microbatches])


def _global(cfg, steps, dp_degree, state=None):
    """Per step, the global batch assembled from every dp rank's loader (each reading only its share)."""
    loaders = [build_loader(cfg, ByteTokenizer(), "training", dp_rank=r, dp_degree=dp_degree) for r in range(dp_degree)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    out = [torch.cat([_windows(loader.next_step()) for loader in loaders]) for _ in range(steps)]
    return out, loaders[0].state_dict()


@pytest.mark.parametrize("dataset", ["builtin", "docs"])
def test_store_gives_the_streaming_sequences_when_unshuffled(tmp_path, docs_jsonl, dataset):
    name = "builtin" if dataset == "builtin" else docs_jsonl
    cfg = _cfg(tmp_path, name, "--data.shuffle", "false")
    store_steps, _ = _global(cfg, 45, 2)
    stream = [PackedDataLoader(ByteTokenizer(), str(name), 24, 8, 2, r, 2) for r in range(2)]
    for k, step in enumerate(store_steps):
        ref = torch.cat([_windows(s.next_step()) for s in stream])
        assert torch.equal(step, ref), k
    if dataset == "docs":  # 45 steps x 8 x 25 tokens: more than two epochs of the small dataset
        assert 45 * 8 * 25 > 2 * sum(len(d) + 2 for d in DOCS)


def test_positions_restart_at_each_document(tmp_path, docs_jsonl):
    cfg = _cfg(tmp_path, docs_jsonl, "--data.shuffle", "false", local_batch=8)
    mb = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1).next_step().microbatches[0]
    bos = ByteTokenizer.bos_id
    for inputs, positions in zip(mb.inputs, mb.positions):
        assert positions[0] == 0
        starts = (positions == 0).nonzero().flatten().tolist()
        assert starts == [0] + [i for i in range(1, len(inputs)) if inputs[i] == bos]
        for i in range(1, len(inputs)):
            assert positions[i] == 0 or positions[i] == positions[i - 1] + 1


@pytest.mark.parametrize("mixture", [False, True])
def test_order_is_topology_invariant_and_resume_continues_exactly(tmp_path, docs_jsonl, mixture):
    dataset = f"builtin:0.75,{docs_jsonl}:0.25" if mixture else str(docs_jsonl)
    cfg = _cfg(tmp_path, dataset)  # shuffled (the default)
    ref, ref_state = _global(cfg, 10, 1)
    for local_batch, dp in [(4, 1), (2, 2), (1, 4), (2, 4), (1, 8)]:
        got, state = _global(_cfg(tmp_path, dataset, local_batch=local_batch), 10, dp)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), (local_batch, dp)
        assert state == ref_state == {"sequence_index": 80}
    # stop after 3 steps at dp 2, resume at dp 4 with another local batch: nothing repeated or skipped
    _, state = _global(_cfg(tmp_path, dataset, local_batch=4), 3, 2)
    resumed, _ = _global(_cfg(tmp_path, dataset, local_batch=1), 7, 4, state=state)
    assert torch.equal(torch.cat(ref[3:]), torch.cat(resumed))
    # and with another global batch size the sequence stream still continues
    resumed, _ = _global(_cfg(tmp_path, dataset, global_batch=4, local_batch=1), 2, 2, state=state)
    assert torch.equal(torch.cat(resumed), torch.cat(ref)[24:32])
    # another seed, another order; the same documents
    other, _ = _global(_cfg(tmp_path, dataset, "--training.seed", "7"), 10, 1)
    assert not torch.equal(torch.cat(other), torch.cat(ref))


def test_shuffle_visits_every_document_once_per_epoch(tmp_path, docs_jsonl):
    cfg = _cfg(tmp_path, docs_jsonl, seq_len=15, local_batch=8)
    store = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1).layouts[0].store
    epoch = torch.tensor(store.tokens(0, store.num_tokens)).sort().values
    loader = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1)
    n = store.num_tokens // 16 // 8 * 8  # whole batches inside the first epoch
    first = torch.cat([_windows(loader.next_step()) for _ in range(n // 8)]).flatten()
    counts = torch.bincount(first, minlength=258)
    assert (counts <= torch.bincount(epoch, minlength=258)).all()  # no document twice within the epoch
    unshuffled = _windows(
        build_loader(
            _cfg(tmp_path, docs_jsonl, "--data.shuffle", "false", seq_len=15, local_batch=8),
            ByteTokenizer(),
            "training",
            dp_rank=0,
            dp_degree=1,
        ).next_step()
    )
    assert not torch.equal(first[: unshuffled.numel()], unshuffled.flatten())


def test_mixture_follows_the_weights_and_reports_sources(tmp_path, docs_jsonl):
    cfg = _cfg(tmp_path, f"builtin:3,{docs_jsonl}:1", global_batch=40, local_batch=40)
    loader = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1)
    assert loader.names == ["builtin", str(docs_jsonl)]
    counts = np.sum([loader.next_step().sequences_by_source for _ in range(25)], axis=0)
    assert counts.tolist() == [750, 250]
    with pytest.raises(ConfigError, match=r"weight of 'builtin' is -1; valid: a finite number > 0"):
        check_data(_cfg(tmp_path, "builtin:-1"), ByteTokenizer())
    with pytest.raises(ConfigError, match="needs token stores"):
        check_data(_cfg(tmp_path, f"builtin,{docs_jsonl}", "--data.store", "none"), ByteTokenizer())


def test_prefetcher_hands_out_the_same_steps_and_state(tmp_path, docs_jsonl):
    cfg = _cfg(tmp_path, docs_jsonl)
    plain = build_loader(cfg, ByteTokenizer(), "training", dp_rank=1, dp_degree=2)
    ahead = Prefetcher(build_loader(cfg, ByteTokenizer(), "training", dp_rank=1, dp_degree=2), depth=3)
    for _ in range(5):
        a, b = plain.next_step(), ahead.next_step()
        assert torch.equal(_windows(a), _windows(b)) and a.global_valid_tokens == b.global_valid_tokens
        assert ahead.state_dict() == plain.state_dict()  # the last step handed out, not the ones prepared
    state = ahead.state_dict()
    ahead.load_state_dict({"sequence_index": 0})
    first = ahead.next_step()
    ahead.load_state_dict(state)
    assert torch.equal(_windows(ahead.next_step()), _windows(plain.next_step()))
    ahead.close()
    assert torch.equal(
        _windows(first), _windows(build_loader(cfg, ByteTokenizer(), "training", dp_rank=1, dp_degree=2).next_step())
    )


def _store_of(cfg, tokenizer=None):
    tokenizer = tokenizer or ByteTokenizer()
    ((spec, _),) = training_specs(cfg)
    return store_path(
        stores_folder(cfg), spec, store_key(spec, tokenizer.identity, TextEncoder(tokenizer, spec).identity)
    )


def test_corrupt_foreign_and_stale_stores(tmp_path, docs_jsonl):
    cfg = _cfg(tmp_path, docs_jsonl)
    build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1)
    path = _store_of(cfg)
    assert TokenStore(path).num_documents == len(DOCS)
    tokens = path / "tokens-00000.bin"
    tokens.write_bytes(tokens.read_bytes()[:-10])  # truncated
    with pytest.raises(ConfigError, match=rf"token store {path} is corrupt: tokens-00000.bin has .* bytes.*delete"):
        check_data(cfg, ByteTokenizer())
    (path / "offsets.npy").write_bytes(b"\x93NUMPY" + b"x" * 200)
    with pytest.raises(ConfigError, match="offsets.npy does not match its checksum"):
        TokenStore(path)
    (path / "store.json").write_text('{"format": "something-else"}')
    with pytest.raises(ConfigError, match=rf"{path} is not a titanlite token store"):
        TokenStore(path)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    with pytest.raises(ConfigError, match="not a titanlite token store .no store.json"):
        TokenStore(foreign)
    # a changed dataset gets a new store: the old one is never read for it
    first_key = path.name
    docs_jsonl.write_text(docs_jsonl.read_text() + json.dumps({"text": "one more document"}) + "\n")
    assert _store_of(cfg).name != first_key
    loader = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1)
    assert loader.layouts[0].store.num_documents == len(DOCS) + 1


def _build_in_job(cfg_argv):
    from titanlite.runtime.distributed import init_distributed

    init_distributed()
    cfg = load(cfg_argv)
    loader = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1)
    return str(loader.layouts[0].store.path)


def _stream(path):
    store = TokenStore(path)
    return store.tokens(0, store.num_tokens), np.asarray(store.offsets), len(store.info.part_tokens)


@pytest.mark.slow
def test_a_store_built_by_two_ranks_equals_one_built_by_one(tmp_path, docs_jsonl):
    argv = ["--training.dataset", str(docs_jsonl), "--training.global_batch_size", "8", "--data.store_folder"]
    two = run_distributed(_build_in_job, 2, argv + [str(tmp_path / "two")])
    assert two[0] == two[1]
    one = run_distributed(_build_in_job, 1, argv + [str(tmp_path / "one")])[0]
    (t2, o2, parts2), (t1, o1, parts1) = _stream(two[0]), _stream(one)
    assert (parts2, parts1) == (2, 1) and np.array_equal(t2, t1) and np.array_equal(o2, o1)
    # the CLI with 2 workers writes the same stream again; a second call finds it
    out = tmp_path / "cli"
    cmd = ["titanlite.data", "prepare", "--dataset", docs_jsonl, "--output", out, "--workers", "2"]
    r = run_module(*cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tokens/s" in r.stderr and "wrote token store" in r.stdout
    t3, o3, parts3 = _stream(out)
    assert parts3 == 2 and np.array_equal(t3, t1) and np.array_equal(o3, o1)
    r = run_module(*cmd)
    assert r.returncode == 0 and "already exists" in r.stdout
    # training.dataset may name the prepared store; another tokenizer is refused
    cfg = load(["--training.dataset", str(out), "--data.prefetch", "0", "--training.global_batch_size", "8"])
    store = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1).layouts[0].store
    assert np.array_equal(store.tokens(0, 50), t1[:50])

    class OtherTokenizer(ByteTokenizer):
        identity = "some-other-tokenizer"

    with pytest.raises(ConfigError, match="is a token store built with another tokenizer"):
        check_data(cfg, OtherTokenizer())
    bad = run_module("titanlite.data", "prepare", "--dataset", tmp_path / "missing")
    assert bad.returncode == 2 and "no such file" in bad.stderr and "Traceback" not in bad.stderr


def test_dataset_formats_users_already_have(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["alpha beta", "gamma"], "id": [0, 1]})
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "validation": ds.select([1])}).save_to_disk(str(tmp_path / "dd"))
    hub = tmp_path / "hub" / "data"
    hub.mkdir(parents=True)
    ds.to_parquet(str(hub / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_dict({"text": ["held out"], "id": [9]}).to_parquet(str(hub / "validation-00000.parquet"))
    (tmp_path / "hub" / "dataset_info.json").write_text('{"description": "metadata, not data"}')
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "a.txt").write_text("first file\nstill the first file\n")
    (tmp_path / "files" / "b.txt").write_text("second file\n")

    def documents(name, *extra, which="training"):
        cfg = _cfg(tmp_path, name, "--data.shuffle", "false", "--validation.enable", *extra)
        loader = build_loader(cfg, ByteTokenizer(), which, dp_rank=0, dp_degree=1)
        store = loader.layouts[0].store
        return [
            ByteTokenizer().decode(store.tokens(int(a), int(b)).tolist())
            for a, b in zip(store.offsets[:-1], store.offsets[1:])
        ]

    assert documents(tmp_path / "saved", "--validation.dataset", str(tmp_path / "saved")) == ["alpha beta", "gamma"]
    assert documents(tmp_path / "dd") == ["alpha beta", "gamma"]
    assert documents(tmp_path / "dd", which="validation") == ["gamma"]
    assert documents(tmp_path / "hub") == ["alpha beta", "gamma"]  # not the validation file, not the metadata
    assert documents(tmp_path / "hub", which="validation") == ["held out"]
    assert documents(tmp_path / "files", "--validation.dataset", str(tmp_path / "files")) == [
        "first file",
        "still the first file",
        "second file",
    ]
    assert documents(
        tmp_path / "files", "--data.text_unit", "file", "--validation.dataset", str(tmp_path / "files")
    ) == ["first file\nstill the first file\n", "second file\n"]
    with pytest.raises(ConfigError, match="'text' is not a field .* fields: \\['content'\\]"):
        datasets.Dataset.from_dict({"content": ["x"]}).save_to_disk(str(tmp_path / "other"))
        documents(tmp_path / "other", "--validation.dataset", str(tmp_path / "other"))


def test_stores_are_reused_not_rebuilt(tmp_path, docs_jsonl):
    cfg = _cfg(tmp_path, docs_jsonl)
    build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1)
    path = _store_of(cfg)
    mtime = (path / "store.json").stat().st_mtime_ns
    build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1)
    assert (path / "store.json").stat().st_mtime_ns == mtime
    assert len([p for p in (tmp_path / "stores").iterdir() if not p.name.startswith(".")]) == 1
    assert os.listdir(tmp_path / "stores") == [path.name]  # no leftover build folder


def test_the_builtin_datasets_need_no_datasets_package(tmp_path, monkeypatch):
    """The default job (built-in corpus, token store) and builtin_chat run where `datasets` is not installed."""
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    for name in ("builtin", "builtin_chat"):
        chat = ["--data.format", "chat"] if name == "builtin_chat" else []
        cfg = _cfg(tmp_path, name, *chat, seq_len=256)  # conversations whole enough to hold a reply
        step = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1).next_step()
        assert step.global_tokens > 0, name


def test_global_counts_are_exact_and_per_rank_work_follows_the_local_batch(tmp_path, docs_jsonl, monkeypatch):
    """Counted labels, real tokens and sequences per source of the global batch, without visiting it."""
    from titanlite.data.sequences import Blend

    located = []
    real_locate = Blend.locate
    monkeypatch.setattr(Blend, "locate", lambda self, k: located.append(k) or real_locate(self, k))
    for dataset, extra in (("builtin_chat", ["--data.format", "chat"]), (f"builtin:3,{docs_jsonl}:1", [])):
        cfg = _cfg(tmp_path, dataset, *extra, "--data.prefetch", "0", global_batch=64, local_batch=1, seq_len=256)
        loader = build_loader(cfg, ByteTokenizer(), "training", dp_rank=5, dp_degree=64)
        # windows 0..N of the first source and their epoch boundaries: brute force over the global batch
        for first in (0, 64 * 7, loader.layouts[0].num_windows * 3 - 20):
            located.clear()
            step = loader.step_at(first)
            assert len(located) == 1, "a rank locates only its own sequences"
            everything = [real_locate(loader.blend, k) for k in range(first, first + 64)]
            assert step.global_valid_tokens == sum(loader.layouts[s].counted(j) for s, j in everything)
            assert step.global_tokens == sum(loader.layouts[s].real_tokens(j) for s, j in everything)
            per_source = [sum(1 for s, _ in everything if s == i) for i in range(len(loader.layouts))]
            assert step.sequences_by_source == per_source


# ----------------------------------------------------------------------------- careless inputs (issue 19)


@pytest.mark.parametrize("weight", ["nan", "inf", "-inf", "-1", "0", "x", ""])
def test_mixture_weights_must_be_finite_positive_numbers(tmp_path, docs_jsonl, weight):
    value = f"builtin:1,{docs_jsonl}:{weight}"
    with pytest.raises(ConfigError) as e:
        check_data(_cfg(tmp_path, value), ByteTokenizer())
    message = str(e.value)
    assert message.startswith(f"training.dataset = {value!r}: the weight of '{docs_jsonl}' is ")
    assert weight in message and "valid: a finite number > 0" in message


def test_a_weight_too_small_to_ever_be_used_is_refused(tmp_path, docs_jsonl):
    with pytest.raises(ConfigError, match=rf"the weight of '{docs_jsonl}' is 1e-05, too small for any of every 10,000"):
        check_data(_cfg(tmp_path, f"builtin:1,{docs_jsonl}:0.00001"), ByteTokenizer())
    check_data(_cfg(tmp_path, f"builtin:1,{docs_jsonl}:0.0001"), ByteTokenizer())  # 1 sequence in 10,000


def test_the_same_dataset_twice_in_a_mixture_is_refused(tmp_path, docs_jsonl, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for value, named in [
        ("docs.jsonl:1,./docs.jsonl:2", "./docs.jsonl"),  # one file, two spellings
        (f"builtin:3,docs.jsonl:1,{docs_jsonl}:1", str(docs_jsonl)),
        ("builtin,builtin", "builtin"),
    ]:
        with pytest.raises(ConfigError, match=rf"training.dataset = '{value}' names the dataset '{named}' twice"):
            check_data(_cfg(tmp_path, value), ByteTokenizer())
    held_out = ["--validation.enable", "--validation.dataset", "docs.jsonl,builtin,docs.jsonl"]
    with pytest.raises(ConfigError, match=r"validation.dataset = .* names the dataset 'docs.jsonl' twice"):
        check_data(_cfg(tmp_path, "builtin", *held_out), ByteTokenizer())
    # another split or text field is another dataset: a held-out mixture may name a training dataset
    (tmp_path / "other.jsonl").write_text(json.dumps({"text": "x", "body": "y"}) + "\n")
    check_data(_cfg(tmp_path, "docs.jsonl:1,other.jsonl:1"), ByteTokenizer())


def test_records_without_text_are_skipped_and_counted(tmp_path):
    records = [{"text": "first"}, {"text": None}, {"text": 7}, {"text": "second"}, {"text": ["a"]}, {"text": None}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    logs = capture_logs()
    cfg = _cfg(tmp_path, path, "--data.shuffle", "false", seq_len=7, global_batch=2, local_batch=2)
    loader = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1)
    store = loader.layouts[0].store
    assert store.num_documents == 2
    assert ByteTokenizer().decode(store.tokens(0, store.num_tokens).tolist()) == "firstsecond"
    text = "\n".join(logs)
    assert "Skipped 4 records" in text
    assert "2 record(s) with a null 'text' field (first: record 1)" in text
    assert "1 record(s) with a 'text' field holding int, not text (first: record 2)" in text
    assert "1 record(s) with a 'text' field holding list, not text (first: record 4)" in text
    # the streaming path skips the same records: the same sequences
    stream = PackedDataLoader(ByteTokenizer(), str(path), 7, 2, 2, 0, 1)
    assert torch.equal(_windows(loader.next_step()), _windows(stream.next_step()))
    # a dataset with no text left is refused before the run, with the reasons
    path.write_text(json.dumps({"text": None}) + "\n" + json.dumps({"text": 1}) + "\n")
    with pytest.raises(ConfigError, match=r"has no documents \(every record was skipped: 1 record\(s\) with a null"):
        check_data(cfg, ByteTokenizer())


def test_the_cache_key_sees_edits_that_keep_the_size_and_the_modification_time(tmp_path, docs_jsonl):
    """cp -p, touch -r and rsync -t keep the mtime: the key must still change, and the store be rebuilt."""
    cfg = _cfg(tmp_path, docs_jsonl, "--data.shuffle", "false")
    first = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1).layouts[0].store
    before = os.stat(docs_jsonl)
    data = docs_jsonl.read_bytes()
    docs_jsonl.write_bytes(data.replace(b"document 1:", b"DOCUMENT 1:"))  # in place, same size
    os.utime(docs_jsonl, ns=(before.st_atime_ns, before.st_mtime_ns))  # what cp -p and touch -r do
    assert os.stat(docs_jsonl).st_size == before.st_size and os.stat(docs_jsonl).st_mtime_ns == before.st_mtime_ns
    second = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1).layouts[0].store
    assert second.path != first.path
    assert b"DOCUMENT 1:" in bytes(second.tokens(0, second.num_tokens).astype(np.uint8))
    # a copy with the old modification time over the file (a new inode): a new key again
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(data)
    os.utime(copy, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(copy, docs_jsonl)
    assert _store_of(cfg) not in (first.path, second.path)


def test_the_cache_key_reads_a_bounded_sample_of_each_file(tmp_path, monkeypatch):
    """Sampled blocks (start, middle, end) of each file: O(1) in the file's size, and a change in a block is seen."""
    from titanlite.data import datasets_io
    from titanlite.data.datasets_io import DatasetSpec, fingerprint

    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # 1 GiB, sparse
    read = []
    real_open = open

    class Counted:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def seek(self, *args):
            return self.f.seek(*args)

        def read(self, n=-1):
            data = self.f.read(n)
            read.append(len(data))
            return data

    monkeypatch.setattr(datasets_io, "open", lambda *a, **k: Counted(real_open(*a, **k)), raising=False)
    key = fingerprint(DatasetSpec(str(big)))
    assert sum(read) <= 3 * 64 * 1024
    monkeypatch.undo()
    st = os.stat(big)
    with open(big, "r+b") as f:
        f.seek((1 << 30) - 10)
        f.write(b"x")
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fingerprint(DatasetSpec(str(big))) != key


def test_a_finished_build_removes_killed_builds_and_keeps_live_ones(tmp_path, docs_jsonl):
    import signal
    import socket
    import subprocess
    import sys
    import time

    from titanlite.data.store_build import ORPHAN_AGE, remove_orphans

    cfg = _cfg(tmp_path, docs_jsonl)
    final = _store_of(cfg)
    # a build killed half-way: its folder made by new_build_dir, a part file half-written, then SIGKILL
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, pathlib, sys; from titanlite.data.store_build import build_tag, new_build_dir; "
            "b = new_build_dir(pathlib.Path(sys.argv[1]), build_tag()); "
            "(b / 'tokens-00000.bin').write_bytes(bytes(100)); print(b, flush=True); os.kill(os.getpid(), 9)",
            str(final),
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    orphan = pathlib.Path(killed.stdout.strip())
    assert orphan.is_dir() and orphan.parent == final.parent
    dead_pid = int(orphan.name.rsplit("-", 1)[1])
    host = socket.gethostname()

    def build_folder(tag, age=0.0):
        folder = final.parent / f".build-{final.name}-{tag}"
        folder.mkdir()
        (folder / "tokens-00000.bin").write_bytes(b"\0" * 10)
        for p in (folder / "tokens-00000.bin", folder):
            os.utime(p, (time.time() - age, time.time() - age))
        return folder

    live = build_folder(f"{host}-{os.getppid()}")  # a live process of this host: a concurrent build
    old_remote = build_folder(f"other-node-7-{dead_pid}", age=ORPHAN_AGE + 60)
    recent_remote = build_folder(f"other-node-7-{dead_pid}0", age=60)  # maybe a live build on another node
    other_store = final.parent / f".build-{final.name}x-{host}-{dead_pid}"
    other_store.mkdir()
    build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1)
    assert (final / "store.json").is_file()
    assert not orphan.exists() and not old_remote.exists()
    assert live.exists() and recent_remote.exists() and other_store.exists()
    mine = build_folder(f"{host}-{os.getpid()}")  # this very process, building
    assert remove_orphans(final) == [] and mine.exists()


def test_a_failed_build_leaves_no_build_folder(tmp_path):
    path = tmp_path / "null.jsonl"
    path.write_text(json.dumps({"text": None}) + "\n")
    with pytest.raises(ConfigError, match="no document was left to train on"):
        build_loader(_cfg(tmp_path, path), ByteTokenizer(), "training", dp_rank=0, dp_degree=1)
    assert list((tmp_path / "stores").iterdir()) == []


def test_a_store_folder_that_cannot_be_written_is_named_before_the_run(tmp_path, docs_jsonl):
    from bad_inputs import _restore_permissions, read_only

    read_only(tmp_path / "stores")
    try:
        with pytest.raises(ConfigError, match=rf"data.store_folder = '{tmp_path}/stores': .* cannot be written"):
            check_data(_cfg(tmp_path, docs_jsonl), ByteTokenizer())
    finally:
        _restore_permissions(tmp_path)
