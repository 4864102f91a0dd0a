"""The global order of training sequences over token stores: which tokens global sequence k holds.

Every function here is a pure function of the sequence index, so any rank can read any sequence
without reading the ones before it, whatever the data-parallel degree or batch size.

- `WindowLayout` (pre-training): each epoch's documents, shuffled with (seed, epoch) when asked,
  concatenated and cut into consecutive windows of seq_len + 1 tokens; windows run on into the next
  epoch. Unshuffled, this is exactly the stream `packing.PackedDataLoader` builds.
- `PackedLayout` (chat / SFT): whole documents packed greedily into windows of seq_len + 1 tokens (a
  longer one is truncated), the rest padded; the packing is fixed once and the windows are shuffled
  per epoch, so every epoch has the same number of sequences.
- `Blend` (mixtures): global sequence k -> (source, sequence of that source), in proportion to the
  weights, with a closed form so that resuming needs only k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from titanlite.data.store import TokenStore


@dataclass
class Window:
    """One sequence of seq_len + 1 tokens: ids, position in its document (0 at each document start and at
    the window start), and whether each token counts in the loss as a label."""

    tokens: np.ndarray
    positions: np.ndarray
    mask: np.ndarray
    filled: int = -1  # tokens before the padding (-1: no padding)


def _positions(starts: list[int], total: int) -> np.ndarray:
    """Positions that restart at 0 at each segment start (starts sorted, starting with 0)."""
    flags = np.zeros(total, dtype=bool)
    flags[starts] = True
    return positions_from_starts(flags)


def positions_from_starts(starts: np.ndarray) -> np.ndarray:
    """Position of each token in its document: 0 where `starts` is True and at index 0, then counting up."""
    pos = np.arange(len(starts), dtype=np.int64)
    seg = np.where(starts, pos, 0)
    return pos - np.maximum.accumulate(seg)


PACK_STREAM = 2**31 - 1


def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


class WindowLayout:
    """Pre-training windows over a store (see the module doc)."""

    def __init__(self, store: TokenStore, seq_len: int, shuffle_seed: int | None = None):
        self.store, self.window, self.seed = store, seq_len + 1, shuffle_seed
        self.lengths = store.document_lengths()
        self.epoch_tokens = store.num_tokens
        self.num_windows = store.num_tokens // self.window  # whole windows in one epoch
        self._cache: dict[int, tuple[np.ndarray | None, np.ndarray]] = {}

    def _order(self, epoch: int) -> tuple[np.ndarray | None, np.ndarray]:
        """(document order or None for dataset order, token offset of each document in that order)."""
        if self.seed is None:
            return None, self.store.offsets
        if epoch not in self._cache:
            perm = _permutation(len(self.lengths), self.seed, epoch)
            starts = np.concatenate([[0], np.cumsum(self.lengths[perm])])
            self._cache = {e: v for e, v in self._cache.items() if e >= epoch - 1}  # keep two epochs
            self._cache[epoch] = (perm, starts)
        return self._cache[epoch]

    def read(self, index: int) -> Window:
        """Global window `index` of this store."""
        ranges, starts = self._pieces(index)
        self.store.prefetch(ranges)  # (a store in object storage fetches them together)
        pieces = [self.store.tokens(begin, end) for begin, end in ranges]
        return Window(np.concatenate(pieces), _positions(starts, self.window), np.ones(self.window, dtype=np.uint8))

    def _pieces(self, index: int) -> tuple[list[tuple[int, int]], list[int]]:
        """The token ranges of window `index` in order, and where in it each document starts."""
        pos = index * self.window
        need = self.window
        ranges, starts, filled = [], [0], 0
        while need:
            epoch, offset = divmod(pos, self.epoch_tokens)
            perm, doc_starts = self._order(epoch)
            i = int(np.searchsorted(doc_starts, offset, side="right")) - 1
            doc = int(perm[i]) if perm is not None else i
            in_doc = offset - int(doc_starts[i])
            take = min(int(self.lengths[doc]) - in_doc, need)
            begin = int(self.store.offsets[doc]) + in_doc
            ranges.append((begin, begin + take))
            if in_doc == 0 and filled:
                starts.append(filled)
            filled += take
            pos += take
            need -= take
        return ranges, starts

    def counted(self, index: int) -> int:
        """Labels of window `index` that count in the loss: every one."""
        return self.window - 1

    def real_tokens(self, index: int) -> int:
        """Inputs of window `index` that are not padding: all of them."""
        return self.window - 1

    def counted_in(self, first: int, stop: int) -> int:
        """Counted labels of windows first..stop-1 (known in closed form)."""
        return (stop - first) * (self.window - 1)

    def real_tokens_in(self, first: int, stop: int) -> int:
        """Non-padding inputs of windows first..stop-1."""
        return (stop - first) * (self.window - 1)


class PackedLayout:
    """Whole documents packed into padded windows (see the module doc); `pad_id` fills the rest."""

    def __init__(
        self, store: TokenStore, seq_len: int, pad_id: int, shuffle_seed: int | None = None, pack_seed: int = 0
    ):
        self.store, self.window, self.pad_id, self.seed = store, seq_len + 1, pad_id, shuffle_seed
        lengths = store.document_lengths()
        self.truncated = int((lengths > self.window).sum())
        # The packing order: its own random stream (not any epoch's), fixed for the whole run.
        order = (
            _permutation(len(lengths), pack_seed, PACK_STREAM) if shuffle_seed is not None else np.arange(len(lengths))
        )
        self.order, self.bounds = order, self._pack(np.minimum(lengths[order], self.window))
        self._counted = self._count_labels(lengths)
        cum = np.concatenate([[0], np.cumsum(np.minimum(lengths[order], self.window))])
        self._filled = cum[self.bounds[1:]] - cum[self.bounds[:-1]]
        self.num_windows = len(self.bounds) - 1
        self._perm: tuple[int, np.ndarray] | None = None
        self._sums: tuple[int, np.ndarray, np.ndarray] | None = None  # one epoch's prefix sums (counted, real)

    def _pack(self, lengths: np.ndarray) -> np.ndarray:
        """Greedy: documents in order go into the current window while they fit; bounds into self.order."""
        bounds, used = [0], 0
        for i, n in enumerate(lengths.tolist()):
            if used + n > self.window:
                bounds.append(i)
                used = 0
            used += n
        bounds.append(len(lengths))
        return np.asarray(bounds, dtype=np.int64)

    def _count_labels(self, lengths: np.ndarray) -> np.ndarray:
        """Counted labels per window: each document's mask without its first token, after truncation."""
        per_doc = self.store.counted_labels().copy()
        truncated = np.flatnonzero(lengths > self.window).tolist()
        self.store.prefetch([(int(self.store.offsets[d]), int(self.store.offsets[d]) + self.window) for d in truncated])
        for doc in truncated:  # truncated: count what is kept
            start = int(self.store.offsets[doc])
            per_doc[doc] = int(self.store.mask(start + 1, start + self.window).sum())
        in_order = per_doc[self.order]
        cum = np.concatenate([[0], np.cumsum(in_order)])
        return cum[self.bounds[1:]] - cum[self.bounds[:-1]]

    def counted_labels(self) -> int:
        """Labels that count in the loss over all windows, after truncation."""
        return int(self._counted.sum())

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """The windows in epoch `epoch`'s order (shuffled per epoch with the seed); the last epoch's is kept."""
        if self._perm is None or self._perm[0] != epoch:
            order = (
                np.arange(self.num_windows) if self.seed is None else _permutation(self.num_windows, self.seed, epoch)
            )
            self._perm = (epoch, order)
        return self._perm[1]

    def _window_of(self, index: int) -> int:
        epoch, i = divmod(index, self.num_windows)
        return i if self.seed is None else int(self._epoch_order(epoch)[i])

    def read(self, index: int) -> Window:
        """Global window `index`: its documents back to back, then padding (which never counts)."""
        w = self._window_of(index)
        tokens, masks, starts, filled = [], [], [], 0
        docs = self.order[self.bounds[w] : self.bounds[w + 1]].tolist()
        offsets = self.store.offsets
        self.store.prefetch([(int(offsets[d]), min(int(offsets[d + 1]), int(offsets[d]) + self.window)) for d in docs])
        for doc in docs:
            begin = int(self.store.offsets[doc])
            n = min(int(self.store.offsets[doc + 1]) - begin, self.window)
            mask = self.store.mask(begin, begin + n).copy()
            mask[0] = 0  # a document's first token is never a label: it would be predicted from another document
            tokens.append(self.store.tokens(begin, begin + n))
            masks.append(mask)
            starts.append(filled)
            filled += n
        if filled < self.window:
            tokens.append(np.full(self.window - filled, self.pad_id, dtype=np.int64))
            masks.append(np.zeros(self.window - filled, dtype=np.uint8))
            starts.append(filled)
        return Window(np.concatenate(tokens), _positions(starts, self.window), np.concatenate(masks), filled)

    def counted(self, index: int) -> int:
        """Labels of window `index` that count in the loss."""
        return int(self._counted[self._window_of(index)])

    def real_tokens(self, index: int) -> int:
        """Inputs of window `index` that are not padding."""
        return min(int(self._filled[self._window_of(index)]), self.window - 1)

    def counted_in(self, first: int, stop: int) -> int:
        """Counted labels of windows first..stop-1: O(1) from the epoch's prefix sums."""
        return self._sum_in(first, stop, 0)

    def real_tokens_in(self, first: int, stop: int) -> int:
        """Non-padding inputs of windows first..stop-1."""
        return self._sum_in(first, stop, 1)

    def _sum_in(self, first: int, stop: int, which: int) -> int:
        total = 0
        while first < stop:
            epoch, i = divmod(first, self.num_windows)
            end = min(stop - epoch * self.num_windows, self.num_windows)
            sums = self._epoch_sums(epoch)[which]
            total += int(sums[end] - sums[i])
            first = epoch * self.num_windows + end
        return total

    def _epoch_sums(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Prefix sums of counted labels and real tokens over the windows in epoch `epoch`'s order."""
        if self._sums is None or self._sums[0] != epoch:
            order = self._epoch_order(epoch)
            counted = np.concatenate([[0], np.cumsum(self._counted[order])])
            real = np.concatenate([[0], np.cumsum(np.minimum(self._filled[order], self.window - 1))])
            self._sums = (epoch, counted, real)
        return self._sums[1], self._sums[2]


BLEND_PERIOD = 10_000


def blend_quota(weights: list[float], period: int = BLEND_PERIOD) -> np.ndarray:
    """How many of every `period` global sequences each source gets: its rounded share (largest remainders)."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    quota = np.floor(w * period).astype(np.int64)
    for s in np.argsort(-(w * period - quota), kind="stable")[: period - quota.sum()]:
        quota[s] += 1
    return quota


class Blend:
    """Global sequence k -> (source, that source's sequence j), in proportion to the weights.

    Within each period of `period` sequences the sources get round(weight x period) slots (largest
    remainders first), spread by always picking the source furthest behind its share; the period
    repeats, so the position of k is found in O(1).
    """

    def __init__(self, weights: list[float], period: int = BLEND_PERIOD):
        self.period = period if len(weights) > 1 else 1
        quota = blend_quota(weights, self.period)
        assign, counts = np.zeros(self.period, dtype=np.int64), np.zeros(len(quota), dtype=np.int64)
        prefix = np.zeros((self.period + 1, len(quota)), dtype=np.int64)
        target = quota / self.period
        for i in range(self.period):
            open_ = counts < quota
            s = int(np.argmax(np.where(open_, target * (i + 1) - counts, -np.inf)))
            assign[i] = s
            counts[s] += 1
            prefix[i + 1] = counts
        self.assign, self.prefix, self.quota = assign, prefix, quota
        self.weights = (quota / self.period).tolist()

    def locate(self, k: int) -> tuple[int, int]:
        """(source, index of the sequence within that source) of global sequence k."""
        q, r = divmod(k, self.period)
        s = int(self.assign[r])
        return s, q * int(self.quota[s]) + int(self.prefix[r, s])

    def ranges(self, first: int, stop: int) -> list[tuple[int, int]]:
        """Per source, the (first, stop) of its own sequence indices among global sequences first..stop-1:
        they are consecutive in each source, so this is O(sources) whatever the batch."""
        return [(int(a), int(b)) for a, b in zip(self._before(first), self._before(stop))]

    def _before(self, k: int) -> np.ndarray:
        """How many of the global sequences 0..k-1 each source has."""
        q, r = divmod(k, self.period)
        return q * self.quota + self.prefix[r]
