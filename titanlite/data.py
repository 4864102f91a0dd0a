"""Tokenizers, document sources and the packed, resumable, DP-sharded data loader."""

from __future__ import annotations

import itertools
import json
import os
import pathlib
from collections.abc import Callable, Iterable, Iterator

import torch

from titanlite.builtin_corpus import SPLITS as BUILTIN_SPLITS
from titanlite.config import ConfigError
from titanlite.builtin_corpus import builtin_corpus_path

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "build_tokenizer",
    "builtin_corpus_path",
    "load_documents",
    "PackedDataLoader",
]


# ----------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 byte tokenizer: ids 0-255 are bytes, 256 is BOS and 257 is EOS. Needs no files."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as ids, without BOS/EOS."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Return the text of ``ids``, skipping BOS/EOS; invalid UTF-8 becomes U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` package.

    BOS/EOS are taken from a ``tokenizer_config.json`` next to the file if it names
    them, else from the first well-known special token the vocabulary has; a
    tokenizer with a single ``<|endoftext|>``-style token uses it for both.
    """

    BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "<|endoftext|>")
    EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>")

    def __init__(self, path: str | os.PathLike):
        try:
            import tokenizers
        except ImportError as e:
            raise ImportError(
                f"model.tokenizer_path = {str(path)!r} is a Hugging Face tokenizer, which needs the "
                "`tokenizers` package: pip install tokenizers (or set model.tokenizer_path = '' "
                "for the built-in byte tokenizer)"
            ) from e
        self.path = pathlib.Path(path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:
            raise ConfigError(
                f"model.tokenizer_path = {str(path)!r} is not a valid tokenizer.json: {e}"
            ) from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        named = self._config_special_tokens()
        self.bos_id = self._find_special("bos", named.get("bos_token"), self.BOS_CANDIDATES)
        self.eos_id = self._find_special("eos", named.get("eos_token"), self.EOS_CANDIDATES)

    def _config_special_tokens(self) -> dict[str, str]:
        config = self.path.parent / "tokenizer_config.json"
        if not config.is_file():
            return {}
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        out = {}
        for key in ("bos_token", "eos_token"):
            token = data.get(key)
            if isinstance(token, dict):  # AddedToken serialised as {"content": ...}
                token = token.get("content")
            if isinstance(token, str):
                out[key] = token
        return out

    def _find_special(self, kind: str, configured: str | None, candidates: tuple[str, ...]) -> int:
        for token in ((configured,) if configured else ()) + candidates:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        raise ConfigError(
            f"model.tokenizer_path = {str(self.path)!r}: found no {kind.upper()} token; "
            f"expected one of {list(candidates)} in the vocabulary, or {kind}_token in a "
            "tokenizer_config.json next to it"
        )

    def encode(self, text: str) -> list[int]:
        """Return the token ids of ``text``, without BOS/EOS."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Return the text of ``ids``, skipping special tokens."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        specials = (self.bos_id, self.eos_id)
        return self._tok.decode([i for i in ids if i not in specials], skip_special_tokens=True)


def build_tokenizer(path: str) -> ByteTokenizer | HFTokenizer:
    """Return the tokenizer for ``model.tokenizer_path``.

    ``""`` gives the built-in ByteTokenizer; a tokenizer.json file, or a directory
    holding one, gives an HFTokenizer.
    """
    if not path:
        return ByteTokenizer()
    valid = "'' (built-in byte tokenizer), a tokenizer.json file, or a directory containing tokenizer.json"
    file = pathlib.Path(path).expanduser()
    if file.is_dir():
        if not (file / "tokenizer.json").is_file():
            raise ConfigError(
                f"model.tokenizer_path = {path!r} is a directory without tokenizer.json; valid: {valid}"
            )
        file = file / "tokenizer.json"
    elif not file.is_file():
        raise ConfigError(f"model.tokenizer_path = {path!r} does not exist; valid: {valid}")
    return HFTokenizer(file)


# ----------------------------------------------------------------------------- documents

_BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".text": "text", ".parquet": "parquet"}
_VALID_DATASETS = (
    "valid: 'builtin', an existing .json/.jsonl/.txt/.text/.parquet file or a directory of such files, "
    "or a Hugging Face Hub dataset name such as 'owner/name'"
)


def load_documents(
    dataset: str, split: str = "train", text_field: str = "text", config_name: str = "", skip: int = 0
) -> Iterator[str]:
    """Return the texts of ``training.dataset``'s documents in a fixed order, from document ``skip`` on.

    ``dataset`` is ``"builtin"`` (the embedded corpus; split ``train`` or ``validation``),
    a local file or directory of .json/.jsonl/.txt/.text/.parquet files (``split`` is
    ignored; a .txt line is one document), or a Hugging Face Hub dataset name read
    with ``config_name`` and ``split``. Everything is streamed, never materialised.
    Bad names raise ValueError at once; a missing text field when it is reached.
    """
    return _DocumentSource(dataset, split, text_field, config_name).documents(skip)


class _DocumentSource:
    """An opened dataset that can be read from any document index, any number of times.

    Opening a `datasets` dataset is slow (it may even make a network request), so
    the loader opens it once and re-reads it for every epoch and resume.
    """

    def __init__(self, dataset: str, split: str, text_field: str, config_name: str):
        self.dataset, self.text_field = dataset, text_field
        if dataset == "builtin":
            if split not in BUILTIN_SPLITS:
                raise ConfigError(
                    f"training.dataset = 'builtin' has splits {list(BUILTIN_SPLITS)}, not {split!r}"
                )
            self._path = builtin_corpus_path(split)
        else:
            self._records = _open_streaming(dataset, split, config_name)

    def documents(self, skip: int = 0) -> Iterator[str]:
        """Return the document texts from index ``skip`` on."""
        if self.dataset == "builtin":
            records = _read_jsonl(self._path, skip)
        else:
            records = self._records.skip(skip) if skip else self._records
        return _texts(records, self.dataset, self.text_field)


def _read_jsonl(path: pathlib.Path, skip: int) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in itertools.islice(f, skip, None):
            yield json.loads(line)


def _open_streaming(dataset: str, split: str, config_name: str):
    import datasets

    path = pathlib.Path(dataset).expanduser()
    if path.exists():
        builder, files = _local_data_files(path, dataset)
        if all(os.path.getsize(f) == 0 for f in files):
            raise ConfigError(f"training.dataset = {dataset!r} has no documents (its files are empty)")
        try:
            return datasets.load_dataset(builder, data_files=files, split="train", streaming=True)
        except Exception as e:  # e.g. malformed JSON
            raise ConfigError(
                f"training.dataset = {dataset!r}: cannot read it as {builder}: {type(e).__name__}: {e}"
            ) from e
    if _looks_like_path(dataset):
        raise ConfigError(f"training.dataset = {dataset!r}: no such file or directory; {_VALID_DATASETS}")
    try:
        return datasets.load_dataset(dataset, config_name or None, split=split, streaming=True)
    except Exception as e:  # the hub raises many kinds: not found, offline, bad split/config...
        raise ConfigError(
            f"training.dataset = {dataset!r} is not a local path and could not be loaded from the "
            f"Hugging Face Hub (training.dataset_config = {config_name!r}, training.dataset_split = "
            f"{split!r}): {type(e).__name__}: {e}; {_VALID_DATASETS}"
        ) from e


def _looks_like_path(name: str) -> bool:
    """True for names that cannot be a hub id ('name' or 'owner/name')."""
    return (
        name.startswith(("/", ".", "~"))
        or name.count("/") > 1
        or "\\" in name
        or pathlib.PurePath(name).suffix in _BUILDERS
    )


def _local_data_files(path: pathlib.Path, dataset: str) -> tuple[str, list[str]]:
    """Return the `datasets` builder name and the sorted data files of a local file or directory."""
    if path.is_file():
        files = [path]
    else:
        files = sorted(
            p for p in path.rglob("*")
            if p.is_file() and p.suffix in _BUILDERS
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise ConfigError(
                f"training.dataset = {dataset!r} is a directory with no data files; {_VALID_DATASETS}"
            )
    kinds = {_BUILDERS.get(p.suffix) for p in files}
    if None in kinds:
        raise ConfigError(f"training.dataset = {dataset!r} has an unsupported file type; {_VALID_DATASETS}")
    if len(kinds) > 1:
        raise ConfigError(f"training.dataset = {dataset!r} mixes file formats {sorted(kinds)}; use one format")
    return kinds.pop(), [str(p) for p in files]


def _texts(records: Iterable[dict], dataset: str, text_field: str) -> Iterator[str]:
    records = iter(records)
    while True:
        try:
            record = next(records, None)
        except Exception as e:  # malformed files only fail when they are read
            raise ConfigError(
                f"training.dataset = {dataset!r}: cannot read a record: {type(e).__name__}: {e}"
            ) from e
        if record is None:
            return
        if text_field not in record:
            raise ConfigError(
                f"training.dataset_text_field = {text_field!r} is not a field of the records of "
                f"training.dataset = {dataset!r}; fields: {sorted(record)}"
            )
        text = record[text_field]
        if text is None:
            text = ""
        elif not isinstance(text, str):
            raise ConfigError(
                f"training.dataset_text_field = {text_field!r} of training.dataset = {dataset!r} "
                f"holds {type(text).__name__}, not text"
            )
        yield text


# ----------------------------------------------------------------------------- packing


class _TokenStream:
    """The endless token stream [BOS] doc0 [EOS] [BOS] doc1 [EOS] ..., epoch after epoch.

    It knows the (epoch, doc_index, token_offset) of its next token, always inside
    a document (``token_offset`` < the document's length).
    """

    def __init__(
        self,
        tokenizer: ByteTokenizer | HFTokenizer,
        open_documents: Callable[[int], Iterator[str]],
        epoch: int = 0,
        doc_index: int = 0,
        token_offset: int = 0,
    ):
        self._tokenizer = tokenizer
        self._open_documents = open_documents
        self.epoch, self.doc_index = epoch, doc_index
        self._docs = open_documents(doc_index)
        text = next(self._docs, None)
        if text is None:
            raise ConfigError(
                "training.dataset has no documents" if doc_index == 0 else
                f"cannot resume at document {doc_index}: the dataset has fewer documents (did it change?)"
            )
        self._tokens = self._tokenize(text)
        if not 0 <= token_offset < len(self._tokens):
            raise ConfigError(
                f"cannot resume at token {token_offset} of document {doc_index}: it has "
                f"{len(self._tokens)} tokens (did the dataset or tokenizer change?)"
            )
        self.token_offset = token_offset

    def _tokenize(self, text: str) -> torch.Tensor:
        tok = self._tokenizer
        return torch.tensor([tok.bos_id, *tok.encode(text), tok.eos_id], dtype=torch.long)

    def take(self, n: int) -> torch.Tensor:
        """Return the next ``n`` tokens."""
        pieces = []
        while n > 0:
            piece = self._tokens[self.token_offset : self.token_offset + n]
            pieces.append(piece)
            n -= len(piece)
            self.token_offset += len(piece)
            if self.token_offset == len(self._tokens):
                self._next_document()
        return torch.cat(pieces)

    def _next_document(self) -> None:
        text = next(self._docs, None)
        if text is None:  # end of the epoch: start again from the first document
            self.epoch, self.doc_index = self.epoch + 1, 0
            self._docs = self._open_documents(0)
            text = next(self._docs, None)
            if text is None:
                raise ConfigError("training.dataset has no documents")
        else:
            self.doc_index += 1
        self._tokens = self._tokenize(text)
        self.token_offset = 0


class PackedDataLoader:
    """One global deterministic stream of packed sequences, each DP rank its slice.

    Documents are tokenized as [BOS] + encode(text) + [EOS], concatenated, and cut
    into consecutive windows of seq_len + 1 tokens (inputs = w[:-1], labels = w[1:]).
    When the documents run out, the stream starts again from the first document
    (next epoch), in the same order.

    Step k uses global sequences [k*G, (k+1)*G) where G = global_batch_size. With
    D = dp_degree and b = local_batch_size, the accumulation A = G // (b*D). DP rank
    r takes global sequences [k*G + r*b*A, k*G + (r+1)*b*A) and splits them into A
    microbatches of b, in order. Every rank reads the whole stream and keeps its
    slice, so the global order does not depend on D or b.
    """

    def __init__(
        self,
        tokenizer: ByteTokenizer | HFTokenizer,
        dataset: str,
        seq_len: int,
        global_batch_size: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        split: str = "train",
        text_field: str = "text",
        config_name: str = "",
    ):
        if seq_len < 1:
            raise ConfigError(f"training.seq_len must be >= 1, got {seq_len}")
        if local_batch_size < 1 or global_batch_size < 1:
            raise ConfigError(
                f"training.global_batch_size ({global_batch_size}) and training.local_batch_size "
                f"({local_batch_size}) must be >= 1"
            )
        if not 0 <= dp_rank < dp_degree:
            raise ConfigError(f"dp_rank {dp_rank} is not in [0, dp_degree={dp_degree})")
        if global_batch_size % (local_batch_size * dp_degree):
            raise ConfigError(
                f"training.global_batch_size ({global_batch_size}) must be divisible by "
                f"training.local_batch_size ({local_batch_size}) x data-parallel degree ({dp_degree}) "
                f"= {local_batch_size * dp_degree}"
            )
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.accumulation_steps = global_batch_size // (local_batch_size * dp_degree)
        self._source = _DocumentSource(dataset, split, text_field, config_name)
        self._sequence_index = 0
        self._stream = self._open_stream(0, 0, 0)

    def _open_stream(self, epoch: int, doc_index: int, token_offset: int) -> _TokenStream:
        return _TokenStream(self.tokenizer, self._source.documents, epoch, doc_index, token_offset)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Return this rank's A microbatches for the next step: (inputs, labels), int64 [b, seq_len] each."""
        window = self.seq_len + 1
        sequences = self._stream.take(self.global_batch_size * window).view(self.global_batch_size, window)
        self._sequence_index += self.global_batch_size
        per_rank = self.local_batch_size * self.accumulation_steps
        mine = sequences[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        return [(mb[:, :-1].contiguous(), mb[:, 1:].contiguous()) for mb in mine.split(self.local_batch_size)]

    @property
    def global_valid_tokens(self) -> int:
        """Labels that count in the loss over one whole global batch (every rank, every microbatch).

        Every label of a packed window is a real next token, so this is known without communication.
        """
        return self.global_batch_size * self.seq_len

    def state_dict(self) -> dict[str, int]:
        """Return the global stream position (the same on every rank), as plain ints.

        ``sequence_index`` is the next global sequence; it starts at token
        ``token_offset`` of document ``doc_index`` in epoch ``epoch``.
        """
        return {
            "sequence_index": self._sequence_index,
            "epoch": self._stream.epoch,
            "doc_index": self._stream.doc_index,
            "token_offset": self._stream.token_offset,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume exactly at a ``state_dict`` position, whatever dp_rank/dp_degree/batch sizes saved it."""
        keys = ("sequence_index", "epoch", "doc_index", "token_offset")
        missing = [k for k in keys if k not in state]
        if missing:
            raise ConfigError(f"data loader state is missing {missing}; got keys {sorted(state)}")
        values = {k: int(state[k]) for k in keys}
        self._stream = self._open_stream(values["epoch"], values["doc_index"], values["token_offset"])
        self._sequence_index = values["sequence_index"]
