"""Turning dataset records into the token documents a store holds: plain text ([BOS] text [EOS])."""

from __future__ import annotations

from titanlite.data.datasets_io import DatasetSpec, record_text


class TextEncoder:
    """Plain-text documents: [BOS] + tokens + [EOS], every token counting in the loss."""

    has_mask = False

    def __init__(self, tokenizer, spec: DatasetSpec):
        self.tokenizer, self.spec = tokenizer, spec
        self.identity = f"text:{spec.text_field}"  # part of a store's cache key

    def texts(self, records: dict, first_index: int) -> list[str]:
        """The text field of a batch of records; ConfigError naming a record that holds other data."""
        return [record_text(t, self.spec, first_index + i) for i, t in enumerate(records[self.spec.text_field])]

    def __call__(self, records: dict, first_index: int = 0) -> list[tuple[list[int], None]]:
        """(tokens, no mask) for each record of a batch (a dict of columns)."""
        tok = self.tokenizer
        return [([tok.bos_id, *ids, tok.eos_id], None) for ids in tok.encode_batch(self.texts(records, first_index))]
