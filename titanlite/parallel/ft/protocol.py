"""What the training loop asks of the replica groups around each step, and the answer when there are none.

The loop (trainer.Trainer.train) runs while `unfinished(state, steps)`; before each step it calls
`before_step(state)`, after it `after_step(state, committed)`, and does what they answer (Next). Inside a step it
asks for the global token count (`known_tokens`, `global_tokens`), averages the gradients over the groups
(`average_gradients`, `participants`) and asks whether the step holds (`commit`); a logged loss is summed over the
groups (`sum`) and labelled (`label`). Three policies answer: NoReplicaGroups here (no [fault_tolerance]),
groups.ReplicaGroups (sync: a quorum before each step) and diloco.DilocoGroups (a sync at each round's end). A policy
that replaces the weights (a heal, an outer step) says so through the run state's weights-replaced event.
"""

from __future__ import annotations

import enum

from titanlite.run_state import RunState


class Next(enum.Enum):
    """What the loop does next."""

    GO_ON = "go on"  # the step stands: log it, validate, save when due, then the next step
    RETRY = "retry"  # the step did not hold: the state is back where it was before it; take it again
    REPLACED = "replaced"  # the step was replaced by a live peer's state (a heal at a sync): on from there
    STOP = "stop"  # a stop signal came while the groups waited, or a heal reached the job's end: saved, stop


class NoReplicaGroups:
    """The policy without [fault_tolerance]: one group, always live, every step committed; each call leaves its
    value as it is."""

    participants = 1  # the groups the gradients are averaged over

    def unfinished(self, state: RunState, steps: int) -> bool:
        """Whether a step (or a sync of the groups) is still to come."""
        return state.step < steps

    def before_step(self, state: RunState) -> Next:
        """Before each step (fault tolerance: the quorum, where a restarted group heals)."""
        return Next.GO_ON

    def after_step(self, state: RunState, committed: bool) -> Next:
        """After each step, whether it was committed (fault tolerance: a failed step is rewound; DiLoCo syncs)."""
        return Next.GO_ON

    def known_tokens(self, tokens: int) -> int | None:
        """The step's global token count as the loader counted it (a fault-tolerant group must sum the live ones')."""
        return tokens

    def global_tokens(self, tokens):
        """The step's global token count from this group's."""
        return tokens

    def average_gradients(self, params) -> None:
        """Average the gradients over the groups."""

    def commit(self) -> bool:
        """Whether every group got through this step."""
        return True

    def sum(self, value):
        """`value` summed over the groups."""
        return value

    def label(self) -> None:
        """'live/planned' groups for the step line, or None."""
        return None

    def close(self) -> None:
        """Leave the job."""
