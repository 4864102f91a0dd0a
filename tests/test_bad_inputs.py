"""The bad-input catalogue (config, numeric extremes, checkpoints, folders): each case ends with exit status 2,
a message naming the key, file or value, no traceback, and nothing on disk changed (tests/bad_inputs.py)."""

import pytest

from bad_inputs import Case, check
from helpers import tiny_argv

DUMP = "{tmp}/run"


def train(*extra):
    """The tiny run's arguments, dumping under the case's folder, plus extra."""
    return tuple(tiny_argv(DUMP, *extra))


CASES = [
    Case("lr-infinite", "numeric", "train", train("--optimizer.lr", "inf"), ("optimizer.lr", "inf")),
    Case("lr-nan", "numeric", "train", train("--optimizer.lr", "nan"), ("optimizer.lr", "nan")),
    Case("seed-negative", "numeric", "train", train("--training.seed", "-1"), ("training.seed", "-1")),
    Case("seq-len-huge", "numeric", "train", train("--training.seq_len", "1000000000000"), ("training.seq_len",)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case, tmp_path, capsys):
    check(case, tmp_path, capsys)
