"""The errors titanlite reports to users; this module imports nothing of titanlite."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user mistake in the configuration or its inputs: the message names the key, the value and what is valid.

    Entry points print it as one line (`config error: ...`) and exit with status 2.
    """


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (the message says where, why, and which checkpoint is intact)."""


class DataReadError(RuntimeError):
    """Training data could not be read after retries (an object store that stays down): the message names the URL."""


class ReplicaGroupsError(RuntimeError):
    """A fault-tolerant group cannot go on (its lighthouse is gone, too few groups are live): the message says what
    happened and which checkpoint it saved."""
