"""Per-rank data loading: each data-parallel rank reads only its own sequences of each step, in the background.

Step k of a run that started at global sequence s0 holds global sequences [s0 + k*G, s0 + (k+1)*G)
(G = global batch size); with local batch b, accumulation A and dp degree D, rank r takes
[.. + r*b*A, .. + (r+1)*b*A) and splits them into A microbatches of b. Reading global sequence k
costs the same whatever k is (see titanlite.data.sequences), so a rank's cost per step follows its
local tokens, never the dp degree, and the state is one global integer.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from titanlite.data.sequences import Blend
from titanlite.loss import IGNORE_INDEX


class Microbatch(NamedTuple):
    """Token ids, labels (IGNORE_INDEX where they do not count) and positions in the document; int64 (b, L)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor


@dataclass
class Step:
    """One optimizer step's data on this rank, and what the whole global batch holds."""

    microbatches: list[Microbatch]
    global_valid_tokens: int  # labels that count over the global batch (every rank, every microbatch); pairs: pairs
    sequences_by_source: list[int]  # global sequences of this step from each source
    local_tokens: int  # this rank's input tokens that are not padding
    global_tokens: int  # the same over the global batch


def to_microbatches(windows: list, local_batch_size: int, pin_memory: bool = False) -> list[Microbatch]:
    """Windows (tokens, positions, mask of seq_len + 1 each) -> microbatches of local_batch_size."""
    tokens = torch.from_numpy(np.stack([w.tokens for w in windows]))
    positions = torch.from_numpy(np.stack([w.positions for w in windows]))
    mask = torch.from_numpy(np.stack([w.mask for w in windows])).bool()
    inputs = tokens[:, :-1]
    labels = tokens[:, 1:].masked_fill(~mask[:, 1:], IGNORE_INDEX)
    out = []
    for i in range(0, len(windows), local_batch_size):
        mb = Microbatch(
            inputs[i : i + local_batch_size].contiguous(),
            labels[i : i + local_batch_size].contiguous(),
            positions[i : i + local_batch_size, :-1].contiguous(),
        )
        out.append(Microbatch(*(t.pin_memory() for t in mb)) if pin_memory else mb)
    return out


class StoreDataLoader:
    """Steps over one or more token-store layouts, mixed by weight; resumable from one global integer."""

    def __init__(
        self,
        layouts: list,
        weights: list[float],
        seq_len: int,
        global_batch_size: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        names: list[str] | None = None,
        pin_memory: bool = False,
    ):
        if not 0 <= dp_rank < dp_degree or global_batch_size % (local_batch_size * dp_degree):
            raise ValueError(
                f"dp_rank {dp_rank} of {dp_degree}, global batch {global_batch_size} and local batch "
                f"{local_batch_size} do not split into whole microbatches"
            )
        self.layouts, self.blend = layouts, Blend(weights)
        self.names = names or [f"source {i}" for i in range(len(layouts))]
        self.seq_len, self.global_batch_size, self.local_batch_size = seq_len, global_batch_size, local_batch_size
        self.dp_rank, self.dp_degree, self.pin_memory = dp_rank, dp_degree, pin_memory
        self.per_rank = global_batch_size // dp_degree
        self._next = 0  # the next global sequence

    def step_at(self, first: int) -> Step:
        """The step whose global batch starts at global sequence `first` (a pure function of `first`).

        A rank reads only its own sequences; the global batch's counts (sequences per source, counted
        labels, real tokens) come in closed form from each source's range, so the work per rank follows
        the local batch, never the dp degree.
        """
        mine_first = first + self.dp_rank * self.per_rank
        mine = [self.blend.locate(k) for k in range(mine_first, mine_first + self.per_rank)]
        windows = [self.layouts[s].read(j) for s, j in mine]
        counts, valid, real = [], 0, 0
        for layout, (j0, j1) in zip(self.layouts, self.blend.ranges(first, first + self.global_batch_size)):
            counts.append(j1 - j0)
            valid += layout.counted_in(j0, j1)
            real += layout.real_tokens_in(j0, j1)
        local = sum(self.layouts[s].real_tokens(j) for s, j in mine)
        pairs = getattr(self.layouts[0], "microbatches", None)  # preference pairs (data/pairs.py): 2 rows each
        if pairs is not None:
            batches = pairs(windows, [s for s, _ in mine], self.local_batch_size, self.pin_memory)
        else:
            batches = to_microbatches(windows, self.local_batch_size, self.pin_memory)
        return Step(batches, valid, counts, local, real)

    def tokens_per_epoch(self) -> int:
        """Tokens in one pass over every source (padding excluded)."""
        return sum(layout.store.num_tokens for layout in self.layouts)

    def sequences_per_epoch(self) -> int:
        """Whole windows in one pass over every source's documents."""
        return sum(layout.num_windows for layout in self.layouts)

    def next_step(self) -> Step:
        """This rank's microbatches of the next step."""
        step = self.step_at(self._next)
        self._next += self.global_batch_size
        return step

    def state_dict(self) -> dict[str, int]:
        """The next global sequence: the same on every rank, whatever the topology."""
        return {"sequence_index": self._next}

    def load_state_dict(self, state: dict) -> None:
        """Continue at a state_dict position, whatever topology or batch size saved it."""
        self._next = int(state["sequence_index"])


class Prefetcher:
    """Prepares the next steps of a loader in a background thread while the current step computes.

    It keeps the loader's interface (next_step, state_dict, load_state_dict); the state is that of the
    last step handed out, not of the ones prepared ahead. An error in the thread (a bad record) is
    raised by the next_step call that would have returned that step.
    """

    def __init__(self, loader, depth: int = 2):
        self.loader, self.depth = loader, max(1, depth)
        self._state = loader.state_dict()
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __getattr__(self, name):  # seq_len, global_batch_size, dp_degree, ... of the wrapped loader
        return getattr(self.loader, name)

    def _run(self, q: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                item = (self.loader.next_step(), self.loader.state_dict(), None)
            except BaseException as e:  # handed to the main thread
                item = (None, None, e)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    def next_step(self) -> Step:
        """The next step, usually already prepared."""
        if self._thread is None:
            self._queue, self._stop = queue.Queue(maxsize=self.depth), threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(self._queue, self._stop), daemon=True, name="titanlite-data"
            )
            self._thread.start()
        step, state, error = self._queue.get()
        if error is not None:
            self.close()
            raise error
        self._state = state
        return step

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.loader.load_state_dict(state)
        self._state = self.loader.state_dict()

    def close(self) -> None:
        """Stop the background thread; the loader goes back to the last step handed out."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.loader.load_state_dict(self._state)
