"""What a checkpoint's data position counts in: the tokenizer and the documents of each training source.

A checkpoint saves how many sequences were consumed; that number means the same data only while the tokenizer
and every source's documents are the same. Each save records `data_identity.json` (the tokenizer's identity:
a hash of its files; per token-store source its documents, tokens and a checksum of every document's length in
tokens); a resume compares it with the run's own. A difference is a ConfigError naming what changed, unless
`checkpoint.allow_data_change` says to go on (then it is a warning). A source named differently in the config is
a deliberate change and is reported by resume.describe_changes instead. With `data.store = "none"` (streamed
documents) only the tokenizer is compared.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from titanlite.checkpoint.remote_inputs import url_of
from titanlite.errors import ConfigError

logger = logging.getLogger("titanlite")

FILE = "data_identity.json"


def current(tokenizer, loader) -> dict:
    """This run's tokenizer identity and, per token-store source of the loader, what its documents are."""
    sources = []
    for name, layout in zip(getattr(loader, "names", []), getattr(loader, "layouts", [])):
        info = layout.store.info
        sources.append(
            {
                "name": url_of(name),  # (documents copied from object storage: by their URL, on any machine)
                "documents": info.num_documents,
                "tokens": info.num_tokens,
                "lengths_sha256": info.offsets_sha256,
            }
        )
    return {"tokenizer": tokenizer.identity, "sources": sources}


def write(folder: Path, identity: dict) -> None:
    """Record the identity in a checkpoint folder being written."""
    (folder / FILE).write_text(json.dumps(identity, indent=2) + "\n")


def differences(saved: dict, now: dict) -> list[str]:
    """What changed between a checkpoint's data identity and this run's, one line each."""
    lines = []
    if saved.get("tokenizer") != now["tokenizer"]:
        lines.append(
            f"the tokenizer is not the one the checkpoint was trained with ({saved.get('tokenizer')} then, "
            f"{now['tokenizer']} now): the same token ids now stand for other text"
        )
    before = {s["name"]: s for s in saved.get("sources", [])}
    for source in now["sources"]:
        old = before.get(source["name"])
        if old is None or old == source:
            continue
        lines.append(
            f"training data {source['name']!r} changed since the checkpoint: {old['documents']:,} documents, "
            f"{old['tokens']:,} tokens then, {source['documents']:,} documents, {source['tokens']:,} tokens now"
            + (" (same counts, other document lengths)" if old["tokens"] == source["tokens"] else "")
            + "; the saved data position now points into other data"
        )
    return lines


def check_unchanged(folder: Path, now: dict, allow_change: bool) -> None:
    """ConfigError when the data or tokenizer changed since the checkpoint in folder (a warning when allowed);
    a checkpoint saved without data_identity.json is not checked."""
    try:
        saved = json.loads((folder / FILE).read_text())
    except (OSError, ValueError):
        return
    lines = differences(saved, now)
    if not lines:
        return
    if allow_change:
        logger.warning(
            f"Resuming from {folder} with other data (checkpoint.allow_data_change = true):\n  " + "\n  ".join(lines)
        )
        return
    raise ConfigError(
        f"cannot resume from {folder}: " + "; ".join(lines) + "; use the tokenizer and data of that run, or set "
        "checkpoint.allow_data_change = true to go on from its position in the new data"
    )
