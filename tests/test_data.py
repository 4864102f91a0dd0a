"""Tests for titanlite.data: tokenizers, the built-in corpus, document sources and the packed loader."""

import itertools
import json
import re
import sys

import pytest
import torch

from titanlite.data import builtin_corpus
from titanlite.data.builtin_corpus import builtin_corpus_path
from titanlite.data.packing import PackedDataLoader
from titanlite.data.sources import load_documents
from titanlite.data.tokenizers import ByteTokenizer, HFTokenizer, build_tokenizer
from titanlite.errors import ConfigError

from helpers import capture_logs

TINY_DOCS = [
    "The cat sat on the mat.",
    "A dog ran.",
    "Héllo wörld, naïve café!",
    "",
    "Short one",
    "The last document of the tiny dataset is a bit longer than the others.",
]


@pytest.fixture
def tiny_jsonl(tmp_path):
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TINY_DOCS)))
    return path


def full_windows(step):
    """Rebuild the seq_len + 1 token windows from a step's microbatches."""
    return torch.cat([torch.cat([mb.inputs, mb.labels[:, -1:]], dim=1) for mb in step.microbatches])


def global_steps(dataset, steps, seq_len, global_batch, local_batch, dp_degree, state=None, tokenizer=None):
    """Run one loader per DP rank and return, per step, the global batch in rank order."""
    tokenizer = tokenizer or ByteTokenizer()
    loaders = [
        PackedDataLoader(tokenizer, dataset, seq_len, global_batch, local_batch, r, dp_degree) for r in range(dp_degree)
    ]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    out = []
    for _ in range(steps):
        out.append(torch.cat([full_windows(loader.next_step()) for loader in loaders]))
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states), "state_dict must not depend on the rank"
    return out, states[0]


# ----------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    text = "Hello, wörld! 😀\n\ttabs"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.decode([0xFF, 65]) == "\ufffdA"


def test_build_tokenizer_errors(tmp_path):
    assert isinstance(build_tokenizer(""), ByteTokenizer)
    with pytest.raises(ValueError, match=r"model\.tokenizer_path.*nope.*tokenizer\.json"):
        build_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"model\.tokenizer_path.*without tokenizer\.json"):
        build_tokenizer(str(tmp_path))


def test_hf_tokenizer_needs_package(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match="pip install tokenizers"):
        build_tokenizer(str(tmp_path))


@pytest.fixture
def hf_tokenizer_dir(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TINY_DOCS * 5, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


@pytest.mark.parametrize(
    "name, text, needle",
    [
        ("tokenizer_config.json", "{not json", "cannot be read as JSON"),
        ("generation_config.json", "[2]", "holds a list, not a JSON object"),
    ],
)
def test_broken_json_beside_a_tokenizer_is_named(hf_tokenizer_dir, name, text, needle):
    (hf_tokenizer_dir / name).write_text(text)
    with pytest.raises(ConfigError, match=needle) as e:
        build_tokenizer(str(hf_tokenizer_dir / "tokenizer.json"))
    assert str(hf_tokenizer_dir / name) in str(e.value)


@pytest.mark.parametrize("kind", ["eos", "bos"])
def test_a_named_special_token_the_vocabulary_lacks_is_refused(hf_tokenizer_dir, kind):
    """tokenizer_config.json naming a BOS or EOS the vocabulary lacks: refused, not another token in its place."""
    (hf_tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({f"{kind}_token": "<|end|>"}))
    with pytest.raises(ConfigError, match=f"names {kind}_token = '<\\|end\\|>', which the vocabulary") as e:
        build_tokenizer(str(hf_tokenizer_dir))
    assert ("('<s>')" if kind == "bos" else "('</s>')") in str(e.value)  # the vocabulary's own


def test_hf_tokenizer_round_trip(hf_tokenizer_dir):
    tok = build_tokenizer(str(hf_tokenizer_dir))
    assert isinstance(tok, HFTokenizer)
    assert isinstance(build_tokenizer(str(hf_tokenizer_dir / "tokenizer.json")), HFTokenizer)
    assert (tok.bos_id, tok.eos_id) == (0, 1) and tok.vocab_size > 258
    text = "The cat sat on a naïve café mat. 😀"
    ids = tok.encode(text)
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == text


def test_hf_tokenizer_in_loader(hf_tokenizer_dir, tiny_jsonl):
    tok = build_tokenizer(str(hf_tokenizer_dir))
    loader = PackedDataLoader(tok, str(tiny_jsonl), 8, 4, 2, 0, 1)
    stream = torch.cat([full_windows(loader.next_step()) for _ in range(4)]).flatten().tolist()
    expected = [t for doc in TINY_DOCS for t in [tok.bos_id, *tok.encode(doc), tok.eos_id]]
    assert stream == list(itertools.islice(itertools.cycle(expected), len(stream)))


# ----------------------------------------------------------------------------- built-in corpus


def test_builtin_corpus_is_big_natural_text():
    train, val = builtin_corpus_path("train"), builtin_corpus_path("validation")
    assert train.stat().st_size >= 1_000_000 and val.stat().st_size > 10_000
    train_docs, val_docs = list(load_documents("builtin")), list(load_documents("builtin", "validation"))
    text = "".join(train_docs)
    letters_and_spaces = len(re.sub(r"[^A-Za-z ]", "", text))
    assert letters_and_spaces / len(text) > 0.8
    assert " the " in text and " function " in text
    assert len(val_docs) > 20 and not set(train_docs) & set(val_docs)
    with pytest.raises(ValueError, match=r"training\.dataset = 'builtin'.*validation"):
        load_documents("builtin", "test")


def test_builtin_corpus_regenerates_identical_bytes(tmp_path):
    regenerated = builtin_corpus.write_corpus(tmp_path)
    for split in ("train", "validation"):
        assert regenerated[split].read_bytes() == builtin_corpus_path(split).read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# ----------------------------------------------------------------------------- document sources


def test_local_jsonl_txt_parquet_and_dir(tmp_path, tiny_jsonl):
    assert list(load_documents(str(tiny_jsonl))) == TINY_DOCS
    assert list(load_documents(str(tiny_jsonl), skip=2)) == TINY_DOCS[2:]

    txt = tmp_path / "lines.txt"
    txt.write_text("first line\nsecond line\nthird line\n")
    assert list(load_documents(str(txt))) == ["first line", "second line", "third line"]

    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    folder = tmp_path / "shards"
    folder.mkdir()
    pq.write_table(pa.table({"content": TINY_DOCS[3:], "n": [3, 4, 5]}), folder / "b.parquet")
    pq.write_table(pa.table({"content": TINY_DOCS[:3], "n": [0, 1, 2]}), folder / "a.parquet")
    assert list(load_documents(str(folder / "a.parquet"), text_field="content")) == TINY_DOCS[:3]
    # A directory is read file by file in sorted name order.
    assert list(load_documents(str(folder), text_field="content")) == TINY_DOCS


def test_missing_text_field_lists_fields(tiny_jsonl):
    with pytest.raises(ValueError, match=r"training\.dataset_text_field = 'body'.*\['id', 'text'\]"):
        next(load_documents(str(tiny_jsonl), text_field="body"))
    with pytest.raises(ValueError, match=r"training\.dataset_text_field"):
        PackedDataLoader(ByteTokenizer(), str(tiny_jsonl), 8, 2, 1, 0, 1, text_field="body")


def test_bad_datasets_name_config_key(tmp_path):
    with pytest.raises(ValueError, match=r"training\.dataset = .*no such file"):
        load_documents(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"training\.dataset = .*no data files"):
        load_documents(str(tmp_path))
    (tmp_path / "a.txt").write_text("x\n")
    (tmp_path / "b.jsonl").write_text('{"text": "y"}\n')
    with pytest.raises(ValueError, match=r"training\.dataset = .*mixes file formats"):
        load_documents(str(tmp_path))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match=r"training\.dataset = .*line 1 of .*bad\.jsonl is not a JSON record"):
        list(load_documents(str(tmp_path / "bad.jsonl")))
    # Offline (conftest's offline_hub), a hub name fails at once instead of retrying for a while.
    with pytest.raises(ValueError, match=r"training\.dataset = 'no-such-owner/no-such-dataset'.*Hugging Face Hub"):
        load_documents("no-such-owner/no-such-dataset")


def test_empty_dataset(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"training\.dataset = .*no documents"):
        PackedDataLoader(ByteTokenizer(), str(tmp_path / "empty.jsonl"), 8, 2, 1, 0, 1)
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"training\.dataset = .*no documents"):
        load_documents(str(tmp_path / "empty.parquet"))


def test_records_without_text_are_skipped_counted_and_resume_counts_documents(tmp_path):
    records = [{"text": None}, {"text": TINY_DOCS[0]}, {"text": 3}, {"text": TINY_DOCS[1]}, {"id": 4}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    logs = capture_logs()
    assert list(load_documents(str(path))) == TINY_DOCS[:2]
    text = "\n".join(logs)
    assert "Skipped 3 records of training.dataset" in text
    assert "2 record(s) with a null 'text' field (first: record 0)" in text  # the record without the field too
    assert "1 record(s) with a 'text' field holding int, not text (first: record 2)" in text
    # document k is the k-th kept record: skipping and resuming count documents, not records
    assert list(load_documents(str(path), skip=1)) == TINY_DOCS[1:2]
    ref, _ = global_steps(str(path), 6, 8, 2, 2, 1)
    _, state = global_steps(str(path), 2, 8, 2, 2, 1)
    resumed, _ = global_steps(str(path), 4, 8, 2, 1, 2, state=state)
    assert all(torch.equal(a, b) for a, b in zip(ref[2:], resumed))
    path.write_text(json.dumps({"text": None}) + "\n" + json.dumps({"text": {"nested": 1}}) + "\n")
    with pytest.raises(ValueError, match=r"has no documents \(every record was skipped: .*holding dict, not text"):
        PackedDataLoader(ByteTokenizer(), str(path), 8, 2, 1, 0, 1)


def test_lines_that_are_not_utf8_or_not_records_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"line 3 of {bad} is not valid UTF-8 \(byte b'\\xe9' at column 14\)"):
        list(load_documents(str(bad)))
    txt = tmp_path / "bad.txt"
    txt.write_bytes(b"one\ntwo \x80\n")
    with pytest.raises(ValueError, match=rf"line 2 of {txt} is not valid UTF-8"):
        list(load_documents(str(txt)))
    bad.write_text('{"text": "ok"}\n["a", "list"]\n')
    with pytest.raises(ValueError, match=rf"line 2 of {bad} is a JSON list, not a record"):
        list(load_documents(str(bad)))


# ----------------------------------------------------------------------------- packing


def test_packing_shapes_shift_and_specials(tiny_jsonl):
    tok = ByteTokenizer()
    loader = PackedDataLoader(tok, str(tiny_jsonl), 16, 8, 2, 1, 2)
    steps = [loader.next_step() for _ in range(3)]
    for step in steps:
        assert len(step.microbatches) == 2
        for x, y, _ in step.microbatches:
            assert x.shape == y.shape == (2, 16) and x.dtype == y.dtype == torch.int64
            assert torch.equal(x[:, 1:], y[:, :-1])
    tokens = torch.cat([full_windows(mbs) for mbs in steps])
    assert (tokens == tok.bos_id).any() and (tokens == tok.eos_id).any()

    # Rank 1 of 2 holds the second half of each global batch of the endless document stream.
    expected = [t for doc in TINY_DOCS for t in [tok.bos_id, *tok.encode(doc), tok.eos_id]]
    stream = list(itertools.islice(itertools.cycle(expected), 3 * 8 * 17))
    ref = torch.tensor(stream).view(3, 8, 17)[:, 4:]
    assert torch.equal(tokens.view(3, 4, 17), ref)


def test_batch_divisibility_error_and_the_plan_resolves_the_batch_once():
    from titanlite.config import load
    from titanlite.plan import batch_plan, validate_for_world

    cfg = load(["--training.global_batch_size", "6", "--training.local_batch_size", "2"])
    with pytest.raises(ValueError, match=r"training\.global_batch_size = 6 .*training\.local_batch_size = 2 .*= 4"):
        batch_plan(cfg, 2)
    assert batch_plan(load(["--training.global_batch_size", "16", "--training.local_batch_size", "2"]), 2) == (16, 4)
    auto = load(["--training.global_batch_size", "-1", "--training.local_batch_size", "2"])
    plan = validate_for_world(auto, 4, device_type=None)
    assert (plan.global_batch_size, plan.grad_accum) == (8, 1)
    assert auto.training.global_batch_size == -1  # the plan returns the value; the config stays as written


@pytest.mark.parametrize("dataset", ["builtin", "tiny"])
def test_global_order_independent_of_dp_and_local_batch(dataset, tiny_jsonl):
    name = str(tiny_jsonl) if dataset == "tiny" else "builtin"
    ref, ref_state = global_steps(name, 4, 32, 8, 8, 1)
    for local_batch, dp_degree in [(4, 1), (1, 1), (4, 2), (2, 2), (1, 4), (2, 4)]:
        got, state = global_steps(name, 4, 32, 8, local_batch, dp_degree)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), (local_batch, dp_degree)
        assert state == ref_state


@pytest.mark.parametrize("dataset", ["builtin", "tiny"])
def test_resume_with_resharding(dataset, tiny_jsonl):
    name = str(tiny_jsonl) if dataset == "tiny" else "builtin"
    seq_len, total = 24, 10
    ref, _ = global_steps(name, total, seq_len, 8, 8, 1)
    ref_sequences = torch.cat(ref)

    for split_at in (1, 3, 7):
        _, state = global_steps(name, split_at, seq_len, 8, 2, 2)
        assert state["sequence_index"] == split_at * 8
        assert all(type(v) is int for v in state.values())
        # Resume with another DP degree and local batch: nothing repeated, nothing skipped.
        resumed, _ = global_steps(name, total - split_at, seq_len, 8, 1, 4, state=state)
        assert all(torch.equal(a, b) for a, b in zip(ref[split_at:], resumed))
        # Resume with another global batch size: the sequence stream still continues.
        resumed, _ = global_steps(name, 2, seq_len, 4, 2, 1, state=state)
        assert torch.equal(torch.cat(resumed), ref_sequences[split_at * 8 : split_at * 8 + 8])

    if dataset == "tiny":  # the tiny dataset must have wrapped around several epochs
        _, state = global_steps(name, total, seq_len, 8, 8, 1)
        assert state["epoch"] >= 3


def test_load_state_dict_rejects_bad_state(tiny_jsonl):
    loader = PackedDataLoader(ByteTokenizer(), str(tiny_jsonl), 8, 2, 1, 0, 1)
    with pytest.raises(ValueError, match="missing"):
        loader.load_state_dict({"sequence_index": 0})
    with pytest.raises(ValueError, match="fewer documents"):
        loader.load_state_dict({"sequence_index": 0, "epoch": 0, "doc_index": 99, "token_offset": 0})
    with pytest.raises(ValueError, match="did the dataset or tokenizer change"):
        loader.load_state_dict({"sequence_index": 0, "epoch": 0, "doc_index": 1, "token_offset": 500})
