"""Two or more runs' settings compared key by key: each setting as canonical text by 'section.key', a digest of them
all, and the keys that differ named with their values. The ranks of one job (check_same_config) and the replica
groups of a fault-tolerant job (titanlite/parallel/ft/checks.py) compare through it. No torch here."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from titanlite.errors import ConfigError

MAX_KEYS = 6  # a message names this many differing keys, then counts the rest
# Keys that may differ between the nodes of one job: where each node's config file lies (its values are compared), and
# what only rank 0 shows. Paths that the ranks read or write (data, checkpoints, the dump folder) must be the same.
NODE_LOCAL = ("job.config_file", "job.description", "job.print_config")


def canonical(flat: dict) -> dict[str, str]:
    """Each value as canonical JSON (sorted keys; anything JSON lacks as its str), by key."""
    return {k: json.dumps(v, sort_keys=True, default=str) for k, v in flat.items()}


def flat_settings(cfg, sections=None, skip=()) -> dict[str, str]:
    """The settings of these sections of a JobConfig (every section by default) by 'section.key', as canonical JSON,
    without the keys in skip."""
    d = cfg.to_dict()
    flat = {f"{s}.{k}": v for s in (sections or d) for k, v in d[s].items()}
    return canonical({k: v for k, v in flat.items() if k not in skip})


def digest(settings: dict[str, str]) -> str:
    """A hash of all these settings (the same settings give the same digest on any machine)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def describe_difference(settings: dict[str, str], keys: list[str], peer: dict[str, str] | None = None) -> str:
    """'training.seq_len (here 2048)' or, with the peer's settings, 'training.seq_len (here 2048, there 1024)'."""
    if not keys:
        return "a setting this group does not have (another titanlite version?)"
    parts = []
    for k in keys[:MAX_KEYS]:
        there = "" if peer is None else f", there {peer.get(k, 'absent')}"
        parts.append(f"{k} (here {settings[k]}{there})")
    more = f" and {len(keys) - MAX_KEYS} more" if len(keys) > MAX_KEYS else ""
    return ("one of " if peer is None and len(keys) > 1 else "") + ", ".join(parts) + more


def _shown(text: str | None) -> str:
    """A canonical JSON value as a user writes it in a message ('tiny', 0.001, true); 'absent' for None."""
    if text is None:
        return "absent"
    value = json.loads(text)
    return repr(value) if isinstance(value, str) else text


def _ranks(ranks: list[int]) -> str:
    """'rank 3', 'ranks 0-7' or 'ranks 0, 2, 5-6'."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def describe_by_rank(settings_by_rank: list[dict[str, str]]) -> str:
    """The keys whose values differ between the ranks, each with its values and the ranks that hold them:
    "optimizer.lr (0.001 on rank 0, 0.002 on rank 1)"; '' when every rank holds the same settings."""
    keys = sorted({k for s in settings_by_rank for k in s})
    parts = []
    for key in keys:
        by_value: dict[str | None, list[int]] = {}
        for rank, settings in enumerate(settings_by_rank):
            by_value.setdefault(settings.get(key), []).append(rank)
        if len(by_value) > 1:
            parts.append(f"{key} ({', '.join(f'{_shown(v)} on {_ranks(r)}' for v, r in by_value.items())})")
    more = f" and {len(parts) - MAX_KEYS} more" if len(parts) > MAX_KEYS else ""
    return ", ".join(parts[:MAX_KEYS]) + more


def given_settings(cfg) -> dict[str, str]:
    """The settings a rank was started with, as check_same_config compares them: taken before the checks that resolve
    machine-local details (an object-storage input's cache copy on this machine)."""
    return flat_settings(cfg, skip=NODE_LOCAL)


def check_same_config(mine: dict[str, str], gather: Callable[[object], list]) -> None:
    """ConfigError on every rank, naming each key whose value differs between the ranks with the ranks that hold each
    value, when the settings they were started with (given_settings) differ; gather(obj): every rank's obj, in rank
    order (a collective that every rank calls, e.g. runtime.distributed.gather_objects). A digest is compared
    first."""
    if len(set(gather(digest(mine)))) == 1:
        return
    raise ConfigError(
        f"the ranks of this job were started with different configurations: {describe_by_rank(gather(mine))}; start "
        "every node with the same config file and overrides (run_train.sh's CONFIG_FILE or --config, and its "
        "--section.key arguments)"
    )
