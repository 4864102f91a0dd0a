"""The bad-input catalogue's harness: run one titanlite command in this process the way a careless or hostile
user would, and check that it ended as a user error must (docs/errors.md lists the classes covered).

A case is a `Case` in a `CASES` list of a `tests/test_bad_inputs*.py` module. `check(case, tmp, capsys)`
prepares `tmp` with the case's setup, runs the command's `main(argv)` ("{tmp}" in an argument or an expected
text is the case's folder), and asserts:
- the exit status (2, a user error, unless the case says otherwise);
- every expected text is in the output (the key, file or value the message must name), and no absent text;
- no traceback, and the message is printed once (its first expected text appears once);
- nothing that was on disk changed: every file under tmp before the run is still there, same bytes, same mode.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

KINDS = {
    "config": "a key, value or type that is not valid; conflicting settings",
    "numeric": "numeric extremes: infinite, negative or absurdly large values",
    "data": "training data: missing, empty, not UTF-8, malformed or wrong-typed records, bad mixtures",
    "chat": "chat data and templates: templates that raise or are blocked, bad conversations",
    "hf": "HF model folders: config.json fields, index.json, shards, tokenizer files",
    "checkpoint": "checkpoint folders: another model's, incomplete, hostile, changed since saved",
    "export": "export targets: existing models, files where folders are expected",
    "filesystem": "folders that cannot be written: read-only dump, cache or store folders",
}

COMMANDS = {
    "train": "titanlite.cli.train",
    "config": "titanlite.cli.check_config",
    "dry_run": "titanlite.cli.dry_run",
    "data": "titanlite.cli.data",
    "generate": "titanlite.cli.generate",
    "export": "titanlite.cli.checkpoint",
}


@dataclass(frozen=True)
class Case:
    """One bad input: what the user ran, what must be named in the answer."""

    id: str
    kind: str  # a key of KINDS
    command: str  # a key of COMMANDS
    args: tuple[str, ...]
    expect: tuple[str, ...]  # texts the output must hold ("{tmp}" is the case's folder)
    setup: Callable[[Path], None] | None = None  # prepares the case's folder
    code: int = 2
    absent: tuple[str, ...] = ()  # texts the output must not hold (a secret, advice that would be wrong)


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every file under root: its content hash and mode."""
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            files[str(path.relative_to(root))] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mode)
    return files


def check(case: Case, tmp: Path, capsys) -> None:
    """Run the case in this process and assert that it ended as a user error should (see the module doc)."""
    assert case.kind in KINDS, case.kind
    if case.setup is not None:
        case.setup(tmp)
    before = snapshot(tmp)
    argv = [a.replace("{tmp}", str(tmp)) for a in case.args]
    capsys.readouterr()
    main = importlib.import_module(COMMANDS[case.command]).main
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    finally:
        _restore_permissions(tmp)
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == case.code, f"{case.id}: exit status {code}, expected {case.code}\n{text}"
    assert "Traceback" not in text, f"{case.id}: a traceback\n{text}"
    expected = [e.replace("{tmp}", str(tmp)) for e in case.expect]
    for e in expected:
        assert e in text, f"{case.id}: {e!r} is not in the output\n{text}"
    assert text.count(expected[0]) == 1, f"{case.id}: the message is printed more than once\n{text}"
    for e in case.absent:
        assert e not in text, f"{case.id}: {e!r} is in the output\n{text}"
    after = snapshot(tmp)
    changed = [p for p, v in before.items() if after.get(p) != v]
    assert not changed, f"{case.id}: files on disk changed: {changed}"


_IMMUTABLE: list[Path] = []


def read_only(folder: Path) -> None:
    """Make folder read-only, for root too (root ignores modes: it gets the immutable attribute); a case whose
    folder cannot be made read-only on this machine is skipped."""
    import pytest

    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o555)
    if os.geteuid() == 0 and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0:
        _IMMUTABLE.append(folder)
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return
    _restore_permissions(folder)
    pytest.skip(f"{folder} cannot be made read-only on this machine")


def _restore_permissions(tmp: Path) -> None:
    """Cases make folders read-only; give them back so that pytest can clean up."""
    while _IMMUTABLE:
        subprocess.run(["chattr", "-i", str(_IMMUTABLE.pop())], capture_output=True)
    for path in [tmp, *tmp.rglob("*")]:
        if path.is_dir() and not path.is_symlink():
            os.chmod(path, 0o755)
