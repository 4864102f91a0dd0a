"""Fault-tolerant replica groups ([fault_tolerance], torchft; docs/fault_tolerance.md): what the groups must agree on
and the check before launch (checks), what the training loop asks of them around each step (protocol), the wait
for a quorum (quorum), the sync-mode groups (groups), healing a restarted group (heal) and DiLoCo (diloco).
"""

from __future__ import annotations

from titanlite.parallel.ft.checks import data_slice, problem
from titanlite.parallel.ft.diloco import DilocoGroups, OuterOptimizer
from titanlite.parallel.ft.groups import ReplicaGroups
from titanlite.parallel.ft.protocol import Next, NoReplicaGroups
from titanlite.run_state import RunState

__all__ = ["Next", "NoReplicaGroups", "data_slice", "outer_optimizer", "problem", "replica_groups"]


def replica_groups(cfg, state: RunState, env, **services):
    """The policy around the loop's steps: DilocoGroups in diloco mode, ReplicaGroups in sync mode, NoReplicaGroups
    when [fault_tolerance] is off. `services`: the keywords ReplicaGroups takes (checkpointer, hang, check_finite,
    global_batch_size, balance)."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return NoReplicaGroups()
    return (DilocoGroups if ft.mode == "diloco" else ReplicaGroups)(cfg, state, env, **services)


def outer_optimizer(cfg, model) -> OuterOptimizer | None:
    """DiLoCo's outer state for a fault-tolerant job in diloco mode, else None."""
    ft = cfg.fault_tolerance
    return OuterOptimizer(model, ft) if ft.enable and ft.mode == "diloco" else None
