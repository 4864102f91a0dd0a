"""The [fault_tolerance] section: replica groups that fail, heal and rejoin (torchft; docs/fault_tolerance.md). No
torch here."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config.fields import POSITIVE, fraction, non_negative, one_of, positive, setting

# A cross-group collective, a commit or a quorum takes milliseconds at best: a shorter timeout cannot work (every one
# fails and is retried, each with a C++ stack dump), and a longer one than a week overflows torchft's timers.
MIN_TIMEOUT, MAX_TIMEOUT = 1.0, 7 * 24 * 3600.0
TIMEOUT_VALID = f"a number of seconds from {MIN_TIMEOUT:g} to {MAX_TIMEOUT:g} (a week)"
MODES = ("sync", "diloco")


def usable_timeout(v) -> bool:
    return MIN_TIMEOUT <= v <= MAX_TIMEOUT


@dataclass
class FaultTolerance:
    enable: bool = setting(
        False,
        "this job is one replica group of a fault-tolerant job: FSDP (with EP, CP or PP, if set) inside it, the "
        "gradient averaged across the live groups through torchft's manager; a group that dies is dropped, a restarted "
        "one heals from a peer",
    )
    replica_id: int = setting(
        0,
        "this group's id, 0 .. group_count - 1: which part of each global batch it reads",
        non_negative,
        "an integer >= 0",
    )
    group_count: int = setting(
        1,
        "replica groups the job is planned for: each global batch is split over group_count x the group's "
        "data-parallel ranks (a group that is down has its part skipped)",
        positive,
        POSITIVE,
    )
    lighthouse: str = setting(
        "",
        "the torchft lighthouse's address (http://host:port, or host:port); '' = the TORCHFT_LIGHTHOUSE environment "
        "variable",
    )
    min_replicas: int = setting(
        1,
        "live groups a step needs; with fewer, the step waits for more (for quorum_timeout_seconds; then the group "
        "saves what was committed and stops)",
        positive,
        POSITIVE,
    )
    timeout_seconds: float = setting(
        10.0,
        "a collective across groups or a commit that takes longer drops the groups that did not answer",
        usable_timeout,
        TIMEOUT_VALID,
    )
    quorum_timeout_seconds: float = setting(
        60.0,
        "how long a step waits for min_replicas live groups (and torchft for a quorum), and for a lighthouse that "
        "stopped answering to answer again, before the group saves what was committed and stops",
        usable_timeout,
        TIMEOUT_VALID,
    )
    mode: str = setting(
        "sync",
        "sync: the groups average every step's gradient (HSDP across groups); diloco: each group takes sync_every "
        "steps on its own, then the groups average how far they moved and an outer Nesterov step applies it "
        "(docs/fault_tolerance.md)",
        one_of(*MODES),
        " or ".join(MODES),
    )
    sync_every: int = setting(
        100,
        "diloco: the inner steps each group takes between two outer steps (and at the job's last step)",
        positive,
        "an integer >= 1",
    )
    outer_lr: float = setting(
        0.7,
        "diloco: the outer optimizer's learning rate (1 with outer_momentum 0 averages the groups' weights)",
        positive,
        POSITIVE,
    )
    outer_momentum: float = setting(
        0.9,
        "diloco: the outer optimizer's Nesterov momentum (0: plain SGD)",
        fraction,
        "a number from 0 to below 1",
    )
