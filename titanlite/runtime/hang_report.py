"""The hang watch's words: the report of a hung job (who stopped answering, who was ended, who still runs and
where) and the lines of a fault-tolerant group that leaves the job (runtime.hang_watch judges; this says it)."""

from __future__ import annotations

import time
from pathlib import Path


def hung_line(rank: int, seconds: float, phase: str, timeout: float) -> str:
    """The first line of a hung job's report."""
    return (
        f"the job is hung: rank {rank} made no progress for {seconds:.0f} s in '{phase}' "
        f"(training.hang_timeout_seconds = {timeout:g})"
    )


def _rejoin(restarts: int) -> str:
    if restarts > 0:
        return f"torchrun restarts its workers ({restarts} restart(s) left of --max-restarts), which rejoin and heal"
    return "run its command again to rejoin (it heals from a live group)"


def leave_line(rank: int, seconds: float, phase: str, replica_id, restarts: int = 0) -> str:
    """Why a fault-tolerant group leaves the job: one of its ranks on this node is stopped."""
    return (
        f"rank {rank} stopped answering {seconds:.0f} s ago in '{phase}' (its process is stopped): this replica "
        f"group (fault_tolerance.replica_id = {replica_id}) leaves the job so that the live groups go on; "
        f"{_rejoin(restarts)}"
    )


def left_line(rank: int, host: str, replica_id, restarts: int = 0) -> str:
    """Why this node's workers end: another node's launcher took their group out of the job."""
    return (
        f"rank {rank} ({host}) stopped answering and its node's launcher took this replica group "
        f"(fault_tolerance.replica_id = {replica_id}) out of the job: this node's workers end too, so that the live "
        f"groups go on; {_rejoin(restarts)}"
    )


def describe(records: dict[int, dict | None], first: str, refresh: float, ended: list[int], folder: Path) -> str:
    """`first`, then which ranks stopped answering (a file older than 3 refreshes), which were ended, which still
    run and where, and which never reported."""
    now = time.time()
    silent, waiting, unknown = [], [], []
    for rank, r in records.items():
        if r is None:
            unknown.append(rank)
            continue
        where = f"rank {rank} ({r['host']}, pid {r['pid']}): '{r['phase']}' for {now - r['since']:.0f} s"
        if now - r["updated"] > 3 * refresh and not r.get("ended"):
            silent.append(f"{where}, silent for {now - r['updated']:.0f} s")
        else:
            waiting.append(where)
    lines = [first]
    if silent:
        lines.append("stopped answering (stopped, frozen or lost process): " + "; ".join(silent[:8]))
    if ended:
        lines.append(
            f"ended at once: rank(s) {_ranges(sorted(ended))} on this host (a frozen worker answers no SIGTERM: "
            f"torchrun would wait 30 s before killing it)"
        )
    if waiting:
        lines.append("still running: " + "; ".join(waiting[:8]) + (" ..." if len(waiting) > 8 else ""))
    if unknown:
        lines.append(
            f"no progress report from rank(s) {_ranges(unknown)} in {folder} (another node's dump folder, if it "
            f"is not shared)"
        )
    return "\n  ".join(lines)


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], ranks[0]
    for prev, r in zip(ranks, ranks[1:] + [None]):
        if r != prev + 1:
            out.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = r
    return ", ".join(out)
