"""Streaming without a token store: every rank tokenizes the whole global batch and keeps its slice.

The same global stream as the token store's unshuffled `WindowLayout`, for small jobs and for Hub
datasets too large to download (`data.store = "none"`); its cost per rank grows with the dp degree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from titanlite.data.datasets_io import DatasetSpec
from titanlite.data.loader import Step, to_microbatches
from titanlite.data.sequences import Window, positions_from_starts
from titanlite.data.sources import DocumentSource
from titanlite.data.tokenizers import ByteTokenizer, HFTokenizer
from titanlite.errors import ConfigError


class _TokenStream:
    """The endless token stream [BOS] doc0 [EOS] [BOS] doc1 [EOS] ..., epoch after epoch (no BOS for a tokenizer
    without one).

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
                "training.dataset has no documents"
                if doc_index == 0
                else f"cannot resume at document {doc_index}: the dataset has fewer documents (did it change?)"
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
        bos = [] if tok.bos_id is None else [tok.bos_id]  # a model without a BOS (Qwen): text then EOS
        return torch.tensor([*bos, *tok.encode(text), tok.eos_id], dtype=torch.long)

    def take(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``n`` tokens, and True where a document starts."""
        pieces, starts = [], torch.zeros(n, dtype=torch.bool)
        filled = 0
        while filled < n:
            if self.token_offset == 0:
                starts[filled] = True
            piece = self._tokens[self.token_offset : self.token_offset + n - filled]
            pieces.append(piece)
            filled += len(piece)
            self.token_offset += len(piece)
            if self.token_offset == len(self._tokens):
                self._next_document()
        return torch.cat(pieces), starts

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

    Documents are tokenized as [BOS] + encode(text) + [EOS] (without the BOS for a
    tokenizer that has none), concatenated, and cut
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
        dataset: str | DatasetSpec,
        seq_len: int,
        global_batch_size: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        split: str = "train",
        text_field: str = "text",
        config_name: str = "",
    ):
        # The configured values were checked by titanlite.plan; these are the loader's own invariants.
        if not 0 <= dp_rank < dp_degree or global_batch_size % (local_batch_size * dp_degree):
            raise ValueError(
                f"dp_rank {dp_rank} of {dp_degree}, global batch {global_batch_size} and local batch "
                f"{local_batch_size} do not split into whole microbatches"
            )
        self.tokenizer = tokenizer
        self.names = [dataset if isinstance(dataset, str) else dataset.name]
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        if not isinstance(dataset, DatasetSpec):
            dataset = DatasetSpec(dataset, split, text_field, config_name)
        self._source = DocumentSource(dataset)
        self._sequence_index = 0
        self._stream = self._open_stream(0, 0, 0)

    def _open_stream(self, epoch: int, doc_index: int, token_offset: int) -> _TokenStream:
        return _TokenStream(self.tokenizer, self._source.documents, epoch, doc_index, token_offset)

    def next_step(self) -> Step:
        """This rank's microbatches of the next step."""
        window = self.seq_len + 1
        tokens, starts = self._stream.take(self.global_batch_size * window)
        tokens, starts = tokens.view(self.global_batch_size, window), starts.view(self.global_batch_size, window)
        self._sequence_index += self.global_batch_size
        per_rank = self.global_batch_size // self.dp_degree
        lo, hi = self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank
        windows = [
            Window(t.numpy(), positions_from_starts(s.numpy()), np.ones(window, dtype=np.uint8))
            for t, s in zip(tokens[lo:hi], starts[lo:hi])
        ]
        # Every label of a packed window is a real next token and nothing is padding: the global counts are
        # known without communication.
        global_tokens = self.global_batch_size * self.seq_len
        return Step(
            to_microbatches(windows, self.local_batch_size),
            global_valid_tokens=global_tokens,
            sequences_by_source=[self.global_batch_size],
            local_tokens=per_rank * self.seq_len,
            global_tokens=global_tokens,
        )

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
