"""The bad-input catalogue for training data, chat data and templates, and folders that cannot be written: each case
ends with exit status 2, a message naming the file, line, key or value, no traceback, and nothing on disk changed
(tests/bad_inputs.py).

Cases that need an environment variable (a read-only TITANLITE_CACHE or HF_DATASETS_CACHE) name it in ENV; the
test sets it for them.
"""

import json
import os

import pytest

from bad_inputs import Case, check, read_only
from helpers import tiny_argv

DUMP = "{tmp}/run"
A = "{tmp}/a.jsonl"
CHAT = ("--data.format", "chat", "--training.seq_len", "64")
GOOD = [{"text": f"document {i} of the tiny dataset"} for i in range(8)]
CONVERSATIONS = [
    {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
    for i in range(8)
]


def train(*extra):
    """One step of the tiny run, dumping and keeping token stores under the case's folder, plus extra."""
    return tuple(tiny_argv(DUMP, "--training.steps", "1", "--data.store_folder", "{tmp}/stores", *extra))


def prepare(*extra):
    """`python -m titanlite.data prepare` with one worker (in this process), plus extra."""
    return ("prepare", "--workers", "1", *extra)


def files(named: dict):
    """A setup writing each file (a path in the case's folder): str or bytes as is, a list of records as JSONL."""

    def setup(tmp):
        for name, content in named.items():
            path = tmp / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, list):
                content = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in content)
            path.write_bytes(content if isinstance(content, bytes) else content.encode())

    return setup


def then(*setups):
    """Several setups in order."""
    return lambda tmp: [s(tmp) for s in setups]


def read_only_folder(name):
    """A setup making the case's folder `name` read-only."""
    return lambda tmp: read_only(tmp / name)


def _symlink(tmp):
    os.symlink(tmp / "a.jsonl", tmp / "link.jsonl")


GOOD_A = files({"a.jsonl": GOOD})
GOOD_CHAT = files({"c.jsonl": CONVERSATIONS})
NOT_UTF8_JSONL = files({"a.jsonl": b'{"text": "fine"}\n{"text": "also fine"}\n{"text": "caf\xe9"}\n'})
WEIGHT = "valid: a finite number > 0"
CACHE = "{tmp}/cache"

DATA = [
    Case(
        "file-missing",
        "data",
        "train",
        train("--training.dataset", "{tmp}/missing.jsonl"),
        ("no such file", "{tmp}/missing.jsonl"),
    ),
    Case(
        "file-empty",
        "data",
        "train",
        train("--training.dataset", A),
        ("has no documents (its files are empty)", A),
        setup=files({"a.jsonl": ""}),
    ),
    Case(
        "jsonl-blank-lines",
        "data",
        "train",
        train("--training.dataset", A),
        ("has no documents", A),
        setup=files({"a.jsonl": "\n\n\n"}),
    ),
    Case(
        "folder-without-data-files",
        "data",
        "train",
        train("--training.dataset", "{tmp}/data"),
        ("is a folder with no data files", "{tmp}/data"),
        setup=files({"data/README.md": "not data"}),
    ),
    Case(
        "folder-mixing-formats",
        "data",
        "train",
        train("--training.dataset", "{tmp}/data"),
        ("mixes file formats", "{tmp}/data"),
        setup=files({"data/a.txt": "x\n", "data/b.jsonl": [{"text": "y"}]}),
    ),
    Case(
        "jsonl-line-not-json",
        "data",
        "train",
        train("--training.dataset", A),
        (f"line 3 of {A} is not a JSON record",),
        setup=files({"a.jsonl": [*GOOD[:2], "{not json"]}),
    ),
    Case(
        "jsonl-line-a-list",
        "data",
        "train",
        train("--training.dataset", A),
        (f"line 2 of {A} is a JSON list, not a record",),
        setup=files({"a.jsonl": [GOOD[0], "[1, 2]"]}),
    ),
    Case(
        "jsonl-line-a-number",
        "data",
        "train",
        train("--training.dataset", A),
        (f"line 2 of {A} is a JSON int, not a record",),
        setup=files({"a.jsonl": [GOOD[0], "42"]}),
    ),
    Case(
        "json-truncated",
        "data",
        "train",
        train("--training.dataset", "{tmp}/a.json"),
        ("{tmp}/a.json cannot be read as json",),
        setup=files({"a.json": '[{"text": "a"},'}),
    ),
    Case(
        "parquet-corrupt",
        "data",
        "train",
        train("--training.dataset", "{tmp}/a.parquet"),
        ("{tmp}/a.parquet cannot be read as parquet",),
        setup=files({"a.parquet": b"PAR1 not a parquet file"}),
    ),
    Case(
        "text-field-missing",
        "data",
        "train",
        train("--training.dataset", A),
        ("training.dataset_text_field = 'text' is not a field", "['body']"),
        setup=files({"a.jsonl": [{"body": "x"}]}),
    ),
    Case(
        "text-field-misnamed",
        "data",
        "train",
        train("--training.dataset", A, "--training.dataset_text_field", "content"),
        ("training.dataset_text_field = 'content' is not a field", "['text']"),
        setup=GOOD_A,
    ),
    Case(
        "text-all-null",
        "data",
        "train",
        train("--training.dataset", A),
        ("has no documents (every record was skipped", "3 record(s) with a null 'text' field"),
        setup=files({"a.jsonl": [{"text": None}] * 3}),
    ),
    Case(
        "text-all-numbers",
        "data",
        "train",
        train("--training.dataset", A),
        ("every record was skipped", "'text' field holding int, not text"),
        setup=files({"a.jsonl": [{"text": 1}, {"text": 2}]}),
    ),
    Case(
        "text-all-lists",
        "data",
        "train",
        train("--training.dataset", A),
        ("every record was skipped", "'text' field holding list, not text"),
        setup=files({"a.jsonl": [{"text": ["a", "b"]}, {"text": ["c"]}]}),
    ),
    Case(
        "text-null-or-missing",
        "data",
        "train",
        train("--training.dataset", A),
        ("every record was skipped", "2 record(s) with a null 'text' field (first: record 0)"),
        setup=files({"a.jsonl": [{"text": None, "id": 1}, {"id": 2}]}),
    ),
    Case(
        "jsonl-not-utf8",
        "data",
        "train",
        train("--training.dataset", A),
        (f"line 3 of {A} is not valid UTF-8",),
        setup=NOT_UTF8_JSONL,
    ),
    Case(
        "txt-not-utf8",
        "data",
        "train",
        train("--training.dataset", "{tmp}/a.txt"),
        ("line 2 of {tmp}/a.txt is not valid UTF-8",),
        setup=files({"a.txt": b"first line\nsecond \xff line\n"}),
    ),
    Case(
        "json-not-utf8",
        "data",
        "train",
        train("--training.dataset", "{tmp}/a.json"),
        ("line 2 of {tmp}/a.json is not valid UTF-8",),
        setup=files({"a.json": b'[{"text": "a"},\n {"text": "\xc3("}]\n'}),
    ),
    Case(
        "jsonl-lone-surrogate",
        "data",
        "train",
        train("--training.dataset", A),
        (f"line 2 of {A} holds '\\ud800'",),
        setup=files({"a.jsonl": [GOOD[0], '{"text": "\\ud800 half a pair"}']}),
    ),
    Case(
        "mixture-same-file-twice",
        "data",
        "train",
        train("--training.dataset", f"{A}:1,{A}:2"),
        (f"names the dataset '{A}' twice", "training.dataset"),
        setup=GOOD_A,
    ),
    Case(
        "mixture-same-file-two-spellings",
        "data",
        "train",
        train("--training.dataset", f"{A},{{tmp}}/./a.jsonl"),
        ("are the same file", "training.dataset"),
        setup=GOOD_A,
    ),
    Case(
        "mixture-file-and-its-symlink",
        "data",
        "train",
        train("--training.dataset", f"{A}:0.5,{{tmp}}/link.jsonl:0.5"),
        ("names the dataset '{tmp}/link.jsonl' twice", "are the same file"),
        setup=then(GOOD_A, _symlink),
    ),
    Case(
        "mixture-builtin-twice", "data", "train", train("--training.dataset", "builtin,builtin:2"), ("'builtin' twice",)
    ),
    Case(
        "validation-mixture-twice",
        "data",
        "train",
        train("--training.dataset", A, "--validation.enable", "--validation.dataset", f"{A},{A}"),
        ("validation.dataset = ", "twice"),
        setup=GOOD_A,
    ),
    Case("mixture-names-nothing", "data", "train", train("--training.dataset", " , "), ("names no dataset",)),
    Case("weight-nan", "data", "train", train("--training.dataset", f"{A}:nan"), ("is nan; " + WEIGHT,), setup=GOOD_A),
    Case(
        "weight-infinite",
        "data",
        "train",
        train("--training.dataset", f"builtin:1,{A}:inf"),
        (f"the weight of '{A}' is inf",),
        setup=GOOD_A,
    ),
    Case("weight-negative", "data", "train", train("--training.dataset", "builtin:-1"), ("is -1; " + WEIGHT,)),
    Case("weight-zero", "data", "train", train("--training.dataset", "builtin:0"), ("is 0; " + WEIGHT,)),
    Case(
        "weight-not-a-number",
        "data",
        "train",
        train("--training.dataset", f"{A}:x"),
        (f"the weight of '{A}' is 'x', not a number",),
        setup=GOOD_A,
    ),
    Case(
        "weight-too-small-to-be-used",
        "data",
        "train",
        train("--training.dataset", f"builtin:1,{A}:1e-6"),
        (f"the weight of '{A}' is 1e-06, too small",),
        setup=GOOD_A,
    ),
    Case("weight-empty", "data", "train", train("--training.dataset", "builtin:"), ("is '', not a number",)),
    Case(
        "prepare-missing",
        "data",
        "data",
        prepare("--dataset", "{tmp}/nope.jsonl"),
        ("no such file", "{tmp}/nope.jsonl"),
    ),
    Case(
        "prepare-not-utf8",
        "data",
        "data",
        prepare("--dataset", A, "--output", "{tmp}/out"),
        (f"line 3 of {A} is not valid UTF-8",),
        setup=NOT_UTF8_JSONL,
    ),
    Case(
        "prepare-every-record-null",
        "data",
        "data",
        prepare("--dataset", A, "--output", "{tmp}/out"),
        ("no document was left", "null 'text' field"),
        setup=files({"a.jsonl": [{"text": None}] * 2}),
    ),
    Case(
        "prepare-output-not-a-store",
        "data",
        "data",
        prepare("--dataset", A, "--output", "{tmp}/out"),
        ("--output {tmp}/out exists and is not a token store",),
        setup=then(GOOD_A, files({"out/notes.txt": "mine"})),
    ),
    Case("prepare-no-workers", "data", "data", prepare("--dataset", A, "--workers", "0"), ("--workers 0",)),
]


def template(source):
    """A setup writing the conversations and the chat template t.jinja."""
    return files({"c.jsonl": CONVERSATIONS, "t.jinja": source})


def chat(*extra):
    """The tiny run on the case's conversations (c.jsonl), plus extra."""
    return train("--training.dataset", "{tmp}/c.jsonl", *CHAT, *extra)


TEMPLATE = ("--data.chat_template", "{tmp}/t.jinja")
FROM_TEMPLATE = "the chat template from data.chat_template = '{tmp}/t.jinja'"

LONG_PROMPT = [
    {"messages": [{"role": "user", "content": "why " * 30}, {"role": "assistant", "content": "because"}]}
    for _ in range(4)
]
SHORT = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}

CHAT_CASES = [
    Case(
        "chat-seq-len-cuts-every-reply",
        "chat",
        "train",
        chat(),
        ("training.seq_len = 64 cuts 4 of the 4 conversations", "before any token the loss counts", "at most"),
        setup=files({"c.jsonl": LONG_PROMPT}),
    ),
    Case(
        "chat-a-step-counts-no-token",  # most replies cut: the first step's batch counts nothing
        "chat",
        "train",
        chat("--training.local_batch_size", "1", "--data.shuffle", "false"),
        ("step 1's global batch of 1 sequences holds no token the loss counts", "cut 4 of the 5 conversations"),
        setup=files({"c.jsonl": [*LONG_PROMPT, SHORT]}),
    ),
    Case(
        "chat-validation-counts-no-token",
        "chat",
        "train",
        chat(
            "--validation.enable",
            "--validation.dataset",
            "{tmp}/v.jsonl",
            "--validation.steps",
            "2",
            "--training.local_batch_size",
            "1",
            "--data.shuffle",
            "false",
        ),  # fmt: skip
        ("validation's 2 global batch(es) holds no token the loss counts", "cut 4 of the 5 conversations"),
        setup=files({"c.jsonl": CONVERSATIONS, "v.jsonl": [*LONG_PROMPT, SHORT]}),
    ),
    Case(
        "chat-first-record-not-a-conversation",
        "chat",
        "train",
        chat(),
        ("its first record is not a conversation", "fields: ['text']"),
        setup=files({"c.jsonl": [{"text": "plain text"}]}),
    ),
    Case(
        "chat-message-content-not-text",
        "chat",
        "train",
        chat(),
        ("its first record is not a conversation (a message without text content)",),
        setup=files(
            {"c.jsonl": [{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}]}]}
        ),
    ),
    Case(
        "chat-messages-not-a-list",
        "chat",
        "train",
        chat(),
        ("'messages' is not a list of {role, content} messages",),
        setup=files({"c.jsonl": [{"messages": "hello"}]}),
    ),
    Case(
        "chat-unknown-role",
        "chat",
        "train",
        chat(),
        ("unknown role 'tool'",),
        setup=files({"c.jsonl": [{"messages": [{"role": "tool", "content": "x"}]}]}),
    ),
    Case(
        "chat-not-utf8",
        "chat",
        "train",
        chat(),
        ("line 9 of {tmp}/c.jsonl is not valid UTF-8",),
        setup=files(
            {"c.jsonl": b"".join(json.dumps(c).encode() + b"\n" for c in CONVERSATIONS) + b'{"messages": "\xff"}\n'}
        ),
    ),
    Case(
        "chat-without-token-stores",
        "chat",
        "train",
        chat("--data.store", "none"),
        ("needs token stores", "data.store = 'auto'"),
        setup=GOOD_CHAT,
    ),
    Case(
        "template-raises",
        "chat",
        "train",
        chat(*TEMPLATE),
        (FROM_TEMPLATE + " fails on record 0", "TypeError"),
        setup=template("{{ messages[0]['content'] + 1 }}"),
    ),
    Case(
        "template-blocked-by-the-sandbox",
        "chat",
        "train",
        chat(*TEMPLATE),
        (FROM_TEMPLATE + " fails on record 0", "SecurityError", "unsafe"),
        setup=template("{{ messages.append(1) }}{{ messages }}"),
    ),
    Case(
        "template-reads-outside-the-sandbox",
        "chat",
        "train",
        chat(*TEMPLATE),
        (FROM_TEMPLATE + " fails on record 0", "SecurityError"),
        setup=template("{{ cycler.__init__.__globals__.os.system('true') }}"),
    ),
    Case(
        "template-nested-loops-generate",  # hung `generate --chat` forever
        "chat",
        "generate",
        ("--checkpoint", "none", "--chat", "--prompt", "hi", "--max-new-tokens", "1", *TEMPLATE),
        (FROM_TEMPLATE + " was stopped", "more than 1,000,000 template blocks", "loops in it that do not end"),
        setup=template("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"),
    ),
    Case(
        "template-nested-loops-training",
        "chat",
        "train",
        chat(*TEMPLATE),
        (FROM_TEMPLATE + " was stopped on record 0", "more than 1,000,000 template blocks"),
        setup=template("{% for a in range(99999) %}{% for m in range(99999) %}{{ '' }}{% endfor %}{% endfor %}"),
    ),
    Case(
        "template-recursive-macro",
        "chat",
        "train",
        chat(*TEMPLATE),
        (FROM_TEMPLATE + " fails on record 0",),
        setup=template("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"),
    ),
    Case(
        "template-huge-output",
        "chat",
        "train",
        chat(*TEMPLATE),
        (FROM_TEMPLATE + " was stopped on record 0", "repeats a sequence to more than"),
        setup=template("{{ 'x' * 1000000000 }}"),
    ),
    Case(
        "template-rejects-every-record",
        "chat",
        "train",
        chat(*TEMPLATE),
        ("no document was left", "8 record(s) with a conversation the chat template rejects (a system turn first)"),
        setup=template("{{ raise_exception('a system turn first') }}"),
    ),
    Case(
        "template-does-not-compile",
        "chat",
        "train",
        chat(*TEMPLATE),
        (FROM_TEMPLATE + " does not compile",),
        setup=template("{% for %}"),
    ),
    Case(
        "template-missing",
        "chat",
        "train",
        chat(*TEMPLATE),
        ("data.chat_template = '{tmp}/t.jinja': no such file",),
        setup=GOOD_CHAT,
    ),
    Case(
        "template-not-utf8",
        "chat",
        "train",
        chat(*TEMPLATE),
        ("data.chat_template = '{tmp}/t.jinja' cannot be read", "UnicodeDecodeError"),
        setup=template(b"\xff\xfe{{ messages }}"),
    ),
]

FILESYSTEM = [
    Case(
        "store-folder-read-only",
        "filesystem",
        "train",
        train("--training.dataset", A),
        ("data.store_folder = '{tmp}/stores'", "cannot be written"),
        setup=then(GOOD_A, read_only_folder("stores")),
    ),
    Case(
        "store-folder-is-a-file",
        "filesystem",
        "train",
        train("--training.dataset", A, "--data.store_folder", "{tmp}/a.jsonl"),
        ("data.store_folder = '{tmp}/a.jsonl'", "is not a folder"),
        setup=GOOD_A,
    ),
    Case(
        "cache-read-only-for-token-stores",
        "filesystem",
        "train",
        tuple(tiny_argv(DUMP, "--training.steps", "1", "--training.dataset", A)),
        (f"TITANLITE_CACHE = '{CACHE}'", "token stores", "cannot be written"),
        setup=then(GOOD_A, read_only_folder("cache")),
    ),
    Case(
        "cache-read-only-for-the-builtin-corpus",
        "filesystem",
        "train",
        train("--training.dataset", "builtin"),
        (f"TITANLITE_CACHE = '{CACHE}'", "built-in datasets", "cannot be written"),
        setup=read_only_folder("cache"),
    ),
    Case(
        "cache-read-only-for-the-builtin-chat",
        "filesystem",
        "train",
        train("--training.dataset", "builtin_chat", *CHAT),
        (f"TITANLITE_CACHE = '{CACHE}'", "cannot be written"),
        setup=read_only_folder("cache"),
    ),
    Case(
        "datasets-cache-read-only",
        "filesystem",
        "train",
        train("--training.dataset", A),
        ("HF_DATASETS_CACHE = '{tmp}/hf'", "cannot be written"),
        setup=then(GOOD_A, read_only_folder("hf")),
    ),
    Case(
        "prepare-output-in-a-read-only-folder",
        "filesystem",
        "data",
        prepare("--dataset", A, "--output", "{tmp}/ro/out"),
        ("--output {tmp}/ro/out", "cannot be written"),
        setup=then(GOOD_A, read_only_folder("ro")),
    ),
    Case(
        "prepare-store-folder-read-only",
        "filesystem",
        "data",
        prepare("--dataset", A, "--store-folder", "{tmp}/stores"),
        ("--store-folder {tmp}/stores", "cannot be written"),
        setup=then(GOOD_A, read_only_folder("stores")),
    ),
    Case(
        "prepare-cache-read-only",
        "filesystem",
        "data",
        prepare("--dataset", A),
        (f"TITANLITE_CACHE = '{CACHE}'", "cannot be written"),
        setup=then(GOOD_A, read_only_folder("cache")),
    ),
]

ENV = {  # case id -> environment variables for its run ("{tmp}" is the case's folder)
    **{
        case: {"TITANLITE_CACHE": CACHE}
        for case in (
            "cache-read-only-for-token-stores",
            "cache-read-only-for-the-builtin-corpus",
            "cache-read-only-for-the-builtin-chat",
            "prepare-cache-read-only",
        )
    },
    "datasets-cache-read-only": {"HF_DATASETS_CACHE": "{tmp}/hf"},
}
CASES = DATA + CHAT_CASES + FILESYSTEM


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case, tmp_path, capsys, monkeypatch):
    for name, value in ENV.get(case.id, {}).items():
        monkeypatch.setenv(name, value.replace("{tmp}", str(tmp_path)))
        if name == "HF_DATASETS_CACHE":  # datasets reads it when imported
            import datasets

            monkeypatch.setattr(datasets.config, name, value.replace("{tmp}", str(tmp_path)))
    check(case, tmp_path, capsys)


def test_the_catalogue_covers_data_chat_and_folders():
    assert len({c.id for c in CASES}) == len(CASES) >= 25
    assert {c.kind for c in CASES} == {"data", "chat", "filesystem"}
    assert set(ENV) <= {c.id for c in CASES}
