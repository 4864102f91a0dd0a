"""The global order of preference pairs over a token store (documents 2i, 2i+1 = pair i's chosen and rejected), and
their microbatches: b pairs are 2b padded rows, the b chosen sequences first, then the b rejected ones.

A pair longer than the window (training.seq_len + 1 tokens) is cut by data.pair_truncation, decided once from the
stored lengths: `response` cuts both responses at their end (a prompt that leaves no room for one response token
drops the pair), `prompt` cuts the shared prompt at its start so the longer response fits (a response longer than
the window drops the pair), `drop` drops it. Cuts fall between tokens, so every kept label is the true next token.
The kept pairs are shuffled per epoch with the seed; global sequence k is one pair, whatever the topology.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from titanlite.data.sequences import Window, _permutation, _positions
from titanlite.data.store import TokenStore
from titanlite.loss import IGNORE_INDEX

TRUNCATION = ("response", "prompt", "drop")


class PairMicrobatch(NamedTuple):
    """2b rows (chosen of each pair, then rejected of each): token ids, labels (IGNORE_INDEX where they do not count),
    positions, int64 (2b, L); and each pair's (source, pair index) key, int64 (b, 2)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    pairs: torch.Tensor


class PairWindows(NamedTuple):
    """One pair: its chosen and rejected windows and its index in the store."""

    chosen: Window
    rejected: Window
    pair: int


class PairLayout:
    """Preference pairs of a store, cut to the window (see the module doc); `pad_id` fills each row's rest."""

    def __init__(self, store: TokenStore, seq_len: int, pad_id: int, truncation: str, shuffle_seed: int | None = None):
        if truncation not in TRUNCATION:
            raise ValueError(f"truncation must be one of {TRUNCATION}, not {truncation!r}")
        self.store, self.window, self.pad_id, self.seed = store, seq_len + 1, pad_id, shuffle_seed
        lengths, responses = store.document_lengths(), store.counted_labels()
        if len(lengths) % 2:
            raise ValueError(f"{store.path} holds {len(lengths)} documents, not (chosen, rejected) pairs")
        self.num_pairs = len(lengths) // 2
        chosen_len, rejected_len = lengths[0::2], lengths[1::2]
        prompt = chosen_len - responses[0::2]  # every response token counts, no prompt token does
        longest = np.maximum(responses[0::2], responses[1::2])
        fits = prompt + longest <= self.window
        if truncation == "response":
            keep, front = prompt < self.window, np.zeros_like(prompt)
        elif truncation == "prompt":
            keep, front = longest < self.window, np.maximum(prompt + longest - self.window, 0)
        else:
            keep, front = fits, np.zeros_like(prompt)
        self.kept = np.flatnonzero(keep)
        self.dropped, self.cut = int((~keep).sum()), int((~fits & keep).sum())
        self._front, self._prompt = front, prompt  # per pair: prompt tokens cut at its start, and before the cut
        self._len = np.minimum(np.stack([chosen_len, rejected_len]) - front, self.window)  # kept tokens per row
        real = self._len[:, self.kept].sum(axis=0) - 2  # inputs that are not padding, both rows
        self._real, self.num_windows = real, len(self.kept)
        self._perm: tuple[int, np.ndarray, np.ndarray] | None = None  # one epoch's order and prefix sums of real

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if self._perm is None or self._perm[0] != epoch:
            n = self.num_windows
            order = np.arange(n) if self.seed is None else _permutation(n, self.seed, epoch)
            self._perm = (epoch, order, np.concatenate([[0], np.cumsum(self._real[order])]))
        return self._perm[1], self._perm[2]

    def pair_of(self, index: int) -> int:
        """The store's pair index of global sequence `index`."""
        epoch, i = divmod(index, self.num_windows)
        return int(self.kept[self._epoch(epoch)[0][i]])

    def read(self, index: int) -> PairWindows:
        """Global sequence `index`: one pair's two windows."""
        return self.read_pair(self.pair_of(index))

    def read_pair(self, pair: int) -> PairWindows:
        """Pair `pair` of the store (one that is kept), cut to the window and padded."""
        offsets, front = self.store.offsets, int(self._front[pair])
        spans = []
        for side in (0, 1):
            doc = 2 * pair + side
            begin = int(offsets[doc]) + front
            spans.append((begin, begin + int(self._len[side, pair])))
        self.store.prefetch(spans)
        windows = []
        for begin, end in spans:
            n = end - begin
            tokens = np.full(self.window, self.pad_id, dtype=np.int64)
            mask = np.zeros(self.window, dtype=np.uint8)
            tokens[:n] = self.store.tokens(begin, end)
            mask[:n] = self.store.mask(begin, end)
            mask[0] = 0  # (a cut prompt's first kept token: never a label)
            starts = [0, n] if n < self.window else [0]
            windows.append(Window(tokens, _positions(starts, self.window), mask, n))
        return PairWindows(windows[0], windows[1], pair)

    def counted_tokens(self) -> np.ndarray:
        """(pairs, 2): the labels that count in each pair's chosen and rejected rows as read (kept pairs)."""
        return self._len.T - (self._prompt - self._front)[:, None]

    def counted(self, index: int) -> int:
        """What global sequence `index` counts for in the loss's normalization: one pair."""
        return 1

    def counted_in(self, first: int, stop: int) -> int:
        """Pairs among global sequences first..stop-1."""
        return stop - first

    def real_tokens(self, index: int) -> int:
        """Inputs of pair `index`'s two rows that are not padding."""
        epoch, i = divmod(index, self.num_windows)
        return int(self._real[self._epoch(epoch)[0][i]])

    def real_tokens_in(self, first: int, stop: int) -> int:
        """Non-padding inputs of the pairs first..stop-1."""
        total = 0
        while first < stop:
            epoch, i = divmod(first, self.num_windows)
            end = min(stop - epoch * self.num_windows, self.num_windows)
            sums = self._epoch(epoch)[1]
            total += int(sums[end] - sums[i])
            first = epoch * self.num_windows + end
        return total

    def describe(self, name: str) -> str:
        """One line: pairs kept, cut and dropped."""
        line = f"{self.num_windows:,} preference pairs of {name!r} in sequences of {self.window} tokens"
        if self.cut:
            line += f"; {self.cut:,} cut to fit"
        if self.dropped:
            line += f"; {self.dropped:,} dropped (too long for data.pair_truncation)"
        return line

    @staticmethod
    def microbatches(pairs: list[PairWindows], sources: list[int], local_batch_size: int, pin_memory=False) -> list:
        """Pairs (from the sources' layouts) -> PairMicrobatches of local_batch_size pairs."""
        out = []
        for i in range(0, len(pairs), local_batch_size):
            group = pairs[i : i + local_batch_size]
            rows = [p.chosen for p in group] + [p.rejected for p in group]
            tokens = torch.from_numpy(np.stack([w.tokens for w in rows]))
            mask = torch.from_numpy(np.stack([w.mask for w in rows])).bool()
            positions = torch.from_numpy(np.stack([w.positions for w in rows]))
            keys = torch.tensor([[s, p.pair] for s, p in zip(sources[i : i + local_batch_size], group)])
            mb = PairMicrobatch(
                tokens[:, :-1].contiguous(),
                tokens[:, 1:].masked_fill(~mask[:, 1:], IGNORE_INDEX).contiguous(),
                positions[:, :-1].contiguous(),
                keys,
            )
            out.append(PairMicrobatch(*(t.pin_memory() for t in mb)) if pin_memory else mb)
        return out
