"""Turning dataset records into the token documents a store holds: plain text ([BOS] text [EOS], no BOS for a
tokenizer without one); the skip counts that every encoder keeps of the records it cannot use."""

from __future__ import annotations

from collections import Counter

from titanlite.data.datasets_io import DatasetSpec, text_problem


class SkippedRecords:
    """Records skipped by reason: how many, and the index of the first."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.first: dict[str, int] = {}

    def add(self, reason: str, index: int) -> None:
        """Count one skipped record."""
        self.counts[reason] += 1
        self.first[reason] = min(index, self.first.get(reason, index))

    def __bool__(self) -> bool:
        return bool(self.counts)

    def report(self) -> dict[str, list[int]]:
        """{reason: [count, first record index]} (the form store manifests keep)."""
        return {reason: [n, self.first[reason]] for reason, n in self.counts.items()}


class TextEncoder:
    """Plain-text documents: [BOS] + tokens + [EOS] (no BOS for a tokenizer without one, as Qwen's), every token
    counting in the loss; records whose text field is null or not a string are skipped and counted."""

    has_mask = False

    def __init__(self, tokenizer, spec: DatasetSpec):
        self.tokenizer, self.spec = tokenizer, spec
        self.identity = f"text:{spec.text_field}"  # part of a store's cache key
        self.skipped = SkippedRecords()

    def __call__(self, records: dict, first_index: int = 0) -> list[tuple[list[int], None] | None]:
        """(tokens, no mask) for each record of a batch (a dict of columns), None for a skipped record."""
        texts = records[self.spec.text_field]
        keep = []
        for i, text in enumerate(texts):
            if (problem := text_problem(text, self.spec)) is None:
                keep.append(i)
            else:
                self.skipped.add(problem, first_index + i)
        tok = self.tokenizer
        bos = [] if tok.bos_id is None else [tok.bos_id]
        out: list = [None] * len(texts)
        for i, ids in zip(keep, tok.encode_batch([texts[i] for i in keep])):
            out[i] = ([*bos, *ids, tok.eos_id], None)
        return out

    def skip_report(self) -> dict[str, list[int]]:
        """{reason: [count, first record index]} of the records skipped so far."""
        return self.skipped.report()
