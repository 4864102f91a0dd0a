"""What data.format decides: how records become documents (the encoder), how the first record is checked before
launch, and how a store's documents become training sequences (the layout)."""

from __future__ import annotations

import logging

from titanlite.config import JobConfig
from titanlite.data.chat import ChatEncoder, TemplateRejected
from titanlite.data.counted import check_counted_after_cut
from titanlite.data.datasets_io import DatasetSpec
from titanlite.data.encoders import TextEncoder
from titanlite.data.pairs import PairLayout
from titanlite.data.preference import PreferenceEncoder
from titanlite.data.sequences import PackedLayout, WindowLayout
from titanlite.data.sources import DocumentSource
from titanlite.errors import ConfigError

logger = logging.getLogger("titanlite")

WHY_DROPPED = {  # by data.pair_truncation: what makes a pair too long
    "response": "each prompt fills the sequence",
    "prompt": "each response alone is longer",
    "drop": "each pair is longer",
}


def make_encoder(cfg: JobConfig, tokenizer, spec: DatasetSpec):
    """How records become documents: plain text, chat conversations with a loss mask, or preference pairs
    (data.format)."""
    if cfg.data.format == "chat":
        return ChatEncoder(tokenizer, spec, cfg.data, cfg.training.loss_on)
    if cfg.data.format == "preference":
        return PreferenceEncoder(tokenizer, spec, cfg.data)
    return TextEncoder(tokenizer, spec)


def check_first_record(cfg: JobConfig, spec: DatasetSpec, encoder) -> None:
    """Open the dataset and check its first record (its text field, or that it is a conversation or a pair)."""
    if cfg.data.format == "text":
        next(DocumentSource(spec).documents(), None)
        return
    record = next(iter(DocumentSource(spec).records()), None)
    if record is None:
        raise ConfigError(f"{spec.key} = {spec.name!r} has no records")
    d = cfg.data
    if cfg.data.format == "preference":
        parsed, what = encoder.pair(record), "preference pair"
        fields = f"data.prompt_field / data.chosen_field / data.rejected_field (now {d.prompt_field!r}, "
        fields += f"{d.chosen_field!r}, {d.rejected_field!r})"
    else:
        parsed, what = encoder.conversation(record), "conversation"
        fields = "data.messages_field or data.prompt_field / data.response_field"
    if isinstance(parsed, str):
        raise ConfigError(
            f"{spec.key} = {spec.name!r}, data.format = {d.format!r}: its first record is not a {what} ({parsed}); "
            f"fields: {sorted(record)}; set {fields}"
        )
    try:  # renders with the template: a template that cannot fails here
        encoder.encode(*parsed, index=0) if d.format == "preference" else encoder.encode(parsed, 0)
    except TemplateRejected:
        pass  # a conversation the template refuses is skipped and counted by the build, as other bad records


def make_layout(cfg: JobConfig, tokenizer, spec: DatasetSpec, store, seed: int | None):
    """The store's documents as training sequences: windows of text, packed conversations or preference pairs."""
    t = cfg.training
    if cfg.data.format == "chat":
        layout = PackedLayout(store, t.seq_len, pad_id=tokenizer.eos_id, shuffle_seed=seed, pack_seed=t.seed)
        check_counted_after_cut(layout, spec, t)
        logger.info(
            f"Packed {store.num_documents:,} conversations of {spec.name!r} into "
            f"{layout.num_windows:,} sequences of {t.seq_len + 1} tokens"
        )
        return layout
    if cfg.data.format == "preference":
        rule = cfg.data.pair_truncation
        layout = PairLayout(store, t.seq_len, tokenizer.eos_id, rule, seed)
        if layout.num_windows == 0:
            raise ConfigError(
                f"{spec.key} = {spec.name!r}: none of its {layout.num_pairs:,} preference pairs fits training.seq_len "
                f"= {t.seq_len} with data.pair_truncation = {cfg.data.pair_truncation!r} ({WHY_DROPPED[rule]}); "
                "valid: a larger training.seq_len, or another data.pair_truncation ('response' cuts responses, "
                "'prompt' cuts prompts)"
            )
        (logger.warning if layout.dropped else logger.info)(layout.describe(spec.name))
        return layout
    return WindowLayout(store, t.seq_len, seed)
