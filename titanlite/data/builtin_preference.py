"""The embedded preference dataset (`builtin_preference`): pairs made from the embedded instruction dataset.

Each conversation of `builtin_chat` gives one pair: the prompt is its messages before the first reply (a system
message sometimes, the user's question), chosen is that reply (the docstring's first paragraph), rejected a degraded
one: the reply's words shuffled, or its first words trailing off into a non-answer. Held-out conversations give the
held-out pairs (`validation`). Generated on first use into the titanlite cache as JSONL records
`{"prompt": [...], "chosen": "...", "rejected": "..."}`; for a given Python version the bytes are always the same.
"""

from __future__ import annotations

import json
import pathlib
import random

from titanlite.data.builtin_chat import SPLITS, VERSION, builtin_chat_path
from titanlite.data.builtin_corpus import cache_dir, cache_setting, check_writable, write_jsonl_atomic

_SEED = 8765
NON_ANSWER = "... I am not sure what else it does."


def builtin_preference_path(split: str = "train") -> pathlib.Path:
    """The JSONL file of the built-in preference pairs for `split`, generating it if needed."""
    if split not in SPLITS:
        raise ValueError(f"builtin_preference split must be one of {SPLITS}, got {split!r}")
    path = cache_dir() / f"builtin_preference-{VERSION}{'' if split == 'train' else '.val'}.jsonl"
    if not path.exists():
        source = builtin_chat_path(split)
        check_writable(cache_dir(), cache_setting("where titanlite generates the built-in datasets"))
        with open(source, encoding="utf-8") as f:
            conversations = [json.loads(line) for line in f if line.strip()]
        write_jsonl_atomic(path, preference_pairs(conversations))
    return path


def preference_pairs(conversations: list[dict]) -> list[dict]:
    """One (prompt, chosen, rejected) record per conversation: its first reply against a degraded one."""
    rng = random.Random(_SEED)
    out = []
    for i, conversation in enumerate(conversations):
        messages = conversation["messages"]
        first = next(j for j, m in enumerate(messages) if m["role"] == "assistant")
        reply = messages[first]["content"]
        words = reply.split()
        if i % 2 == 0 and len(set(words)) > 3:  # (words that all differ from each other: a shuffle changes them)
            shuffled = words[:]
            while shuffled == words:
                rng.shuffle(shuffled)
            rejected = " ".join(shuffled)
        else:
            rejected = " ".join(words[: max(1, len(words) // 4)]) + " " + NON_ANSWER
        out.append({"prompt": messages[:first], "chosen": reply, "rejected": rejected})
    return out
