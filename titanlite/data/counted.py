"""What the loss counts once training.seq_len has cut long conversations: the start-up warning with the share
of counted tokens lost, a refusal when nothing is left, and the error for a batch that counts no token."""

from __future__ import annotations

import logging

import numpy as np

from titanlite.data.sequences import PackedLayout
from titanlite.errors import ConfigError

logger = logging.getLogger("titanlite")


def _lost(layout: PackedLayout) -> tuple[int, int]:
    """(counted labels before the cut, after it) of a packed layout."""
    return int(layout.store.counted_labels().sum()), layout.counted_labels()


def check_counted_after_cut(layout: PackedLayout, spec, training) -> None:
    """Warn about the conversations training.seq_len cuts, with the share of loss-counted tokens lost; a
    ConfigError when the cut leaves no token the loss counts (every step would train on nothing)."""
    if not layout.truncated:
        return
    before, after = _lost(layout)
    where = f"{spec.key} = {spec.name!r}"
    lengths = layout.store.document_lengths()
    if after == 0:
        raise ConfigError(
            f"training.seq_len = {training.seq_len} cuts {layout.truncated:,} of the {len(lengths):,} conversations "
            f"of {where} before any token the loss counts (training.loss_on = {training.loss_on!r}): all "
            f"{before:,} counted tokens are lost and every step would train on nothing; raise training.seq_len "
            f"(the conversations have {int(np.median(lengths)):,} tokens at the median, {int(lengths.max()):,} at "
            f"most)"
        )
    logger.warning(
        f"{layout.truncated:,} conversations of {where} are longer than training.seq_len + 1 = "
        f"{training.seq_len + 1} tokens: each is cut to that length, which loses {before - after:,} of the "
        f"{before:,} tokens the loss counts ({(before - after) / max(before, 1):.1%})"
    )


def no_counted_tokens(loader, what: str, training) -> ConfigError:
    """The error for `what` (a step's or validation's batches) holding no token the loss counts, with what
    training.seq_len cut from each source of the loader."""
    cuts = []
    for name, layout in zip(loader.names, getattr(loader, "layouts", [])):
        if isinstance(layout, PackedLayout) and layout.truncated:
            before, after = _lost(layout)
            cuts.append(
                f"training.seq_len = {training.seq_len} cut {layout.truncated:,} of the "
                f"{layout.store.num_documents:,} conversations of {name!r}, losing {before - after:,} of their "
                f"{before:,} counted tokens ({(before - after) / max(before, 1):.1%})"
            )
    return ConfigError(
        f"{what} holds no token the loss counts (training.loss_on = {training.loss_on!r})"
        + (f": {'; '.join(cuts)}" if cuts else "")
        + "; there is nothing to train on: raise training.seq_len, or check the data"
    )
