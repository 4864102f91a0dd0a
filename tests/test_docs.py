"""The documentation stays true: README.md is a short front door that links every docs/ page, every relative
link (and #anchor) resolves, and the commands in ```bash blocks that can run on a CPU are valid as written.

A `./run_train.sh ...` line is checked the way run_train.sh checks it before starting torchrun:
`python -m titanlite.config --world-size NGPU*NNODES --job.config_file CONFIG [args]` (or, with --dry-run,
`python -m titanlite.dry_run ...`, which is what run_train.sh runs then), from an empty folder, so that
nothing a previous run left behind (checkpoints, a lock) makes a difference. A `python -m titanlite.X` line
must name a module whose `--help` exits 0; a `python benchmarks/x.py` line a script whose `--help` exits 0.
Both run in this process (runpy, exactly what `python -m` does), except the benchmarks, which get their
own process because they set up threads and multiprocessing when they start.
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_MAX_LINES = 250

# Commands in the docs that cannot be checked on a fresh CPU machine: a part of the line -> why.
SKIP = {
    "CONFIG_FILE=path/to/job.toml": "path/to/job.toml stands for the user's own file",
    "--config llama3_8b_finetune": "the config reads the HF folder /models/Llama-3.1-8B-Instruct, absent here",
    "RDZV_ENDPOINT=node0:29500 ./run_train.sh --config qwen3_8b_finetune": "reads /models/Qwen3-8B, absent here",
    "NGPU=8 ./run_train.sh --config qwen3_30b_a3b_finetune  ": "reads /models/Qwen3-30B-A3B, absent here",
    "NGPU=8 ./run_train.sh --config moonlight_16b_finetune  ": "reads /models/Moonlight-16B-A3B, absent here",
    "NGPU=8 ./run_train.sh --config gpt_oss_20b_finetune  ": "reads /models/gpt-oss-20b, absent here",
    "./run_train.sh --config qwen3_8b_lora   ": "its base is /models/Qwen3-8B, absent here (its dry run is checked)",
    "--checkpoint.initial_load_path /models/": "needs a downloaded HF model folder under /models/",
    "--checkpoint.initial_load_path model.pt": "model.pt is what the export command before it writes",
    "--checkpoint.load_step 400": "resumes from a step-400 checkpoint, which only an earlier run leaves",
    "./run_train.sh --config debug_dpo ": "starts from debug_sft's step 200, which the line before writes "
    "(tests/test_dpo.py trains DPO from a base it makes)",
    "--fault_tolerance.enable true --fault_tolerance.group_count 2": "needs the lighthouse the line before starts "
    "(tests/test_fault_tolerance.py runs such groups)",
    "RDZV_ENDPOINT=127.0.0.1:29533": "two nodes started together, one line each (tests/test_multi_node.py runs them)",
    "--checkpoint.folder s3://my-bucket/": "needs an S3 bucket and its credentials (tests/test_object_storage.py runs "
    "against moto's S3 server)",
    "s3://bucket/stores/corpus": "needs an S3 bucket and its credentials (tests/test_data_s3.py runs against moto's "
    "S3 server)",
}

# run_train.sh's CONFIG_FILE default, as the script sets it
LAUNCHER = (ROOT / "run_train.sh").read_text()
DEFAULT_CONFIG = re.search(r"^CONFIG_FILE=\$\{CONFIG_FILE:-([^}]+)\}", LAUNCHER, re.M).group(1)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# ---------------------------------------------------------------------------------------------------------
# Markdown: headings, links, bash blocks (outside fenced code only)


def _prose_lines(path: Path):
    """(line number, line) of the lines outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation (backticks, dots, colons, ...) dropped,
    spaces to hyphens; underscores and hyphens stay."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in _prose_lines(path):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _links(path: Path):
    """(line number, target) of every Markdown link outside code."""
    for number, line in _prose_lines(path):
        for m in LINK.finditer(re.sub(r"``?[^`]+``?", "", line)):
            yield number, m.group(1)


def _bash_lines(path: Path):
    """(line number, command) of each command in the page's ```bash blocks; continuation lines joined."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```bash":
            i += 1
            continue
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            start, command = i + 1, lines[i].strip()
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command[:-1].rstrip() + " " + lines[i].strip()
            if command and not command.startswith("#"):
                yield start, command
            i += 1
        i += 1


def _split_comment(command: str) -> tuple[str, str]:
    """The command and its trailing `# comment` (a # that starts a word outside quotes)."""
    quote = None
    for i, ch in enumerate(command):
        if quote:
            if ch == quote:
                quote = None
            elif ch == "\\" and quote == '"':
                continue
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or command[i - 1].isspace()):
            return command[:i].rstrip(), command[i + 1 :].strip()
    return command, ""


ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _commands():
    """Every checkable command in the docs: (id, kind, env, tokens, skip reason or None)."""
    found = []
    for page in PAGES:
        variables: dict[str, str] = {}  # NAME="..." lines of the page's blocks, for $NAME in later lines
        for number, raw in _bash_lines(page):
            command, _comment = _split_comment(raw)
            for name, value in variables.items():
                command = re.sub(rf"\$\{{{name}\}}|\${name}\b", value, command)
            tokens = shlex.split(command)
            env = {}
            while tokens and ASSIGNMENT.match(tokens[0]):
                name, value = tokens.pop(0).split("=", 1)
                env[name] = value
            if not tokens:  # a variable for the lines that follow
                variables.update(env)
                continue
            if tokens[0] == "./run_train.sh":
                kind = "launcher"
            elif tokens[:2] == ["python", "-m"] and tokens[2].startswith("titanlite."):
                kind, tokens = "module", tokens[2:]
            elif tokens[0] == "torchrun" and "-m" in tokens and tokens[tokens.index("-m") + 1].startswith("titanlite."):
                kind, tokens = "module", tokens[tokens.index("-m") + 1 :]
            elif tokens[0] == "python" and len(tokens) > 1 and tokens[1].startswith("benchmarks/"):
                kind, tokens = "script", tokens[1:]
            else:
                continue  # pip, huggingface-cli, tensorboard: not titanlite's to check
            skip = next((why for part, why in SKIP.items() if part in raw), None)
            found.append((f"{_rel(page)}:{number}", kind, env, tokens, skip, raw))
    return found


COMMANDS = _commands()


# ---------------------------------------------------------------------------------------------------------
# (a) README is a front door; links resolve


def test_readme_is_short_and_links_every_docs_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"
    linked = {target.split("#")[0] for _, target in _links(README)}
    missing = [_rel(page) for page in DOCS if _rel(page) not in linked]
    assert not missing, f"README.md's Documentation list does not link {missing}"


def test_ci_runs_the_readmes_two_commands_in_a_fresh_virtual_environment():
    """CI is a newcomer: a new venv (pip resolves today's versions, not the machine's), then the README's two commands
    as written, the main job first."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    setup, tests = (next(b.strip() for b in blocks if b.strip().endswith(end)) for end in ("./run_train.sh", " tests"))
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    venv = next(i for i, line in enumerate(ci) if "-m venv .venv" in line and ". .venv/bin/activate" in line)
    assert "rm -rf .venv" in ci[venv]
    assert ci[venv + 1 :] == [setup, tests]


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_point_to_files_and_headings_that_exist(page):
    broken = []
    for number, target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{_rel(page)}:{number}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{_rel(page)}:{number}: {target} (no heading #{anchor} in {_rel(file)})")
    assert not broken, "\n".join(broken)


def test_the_docs_have_commands_to_check_and_every_skip_is_still_needed():
    kinds = {kind for _, kind, _, _, skip, _ in COMMANDS if not skip}
    assert kinds == {"launcher", "module", "script"}, kinds
    unused = [part for part in SKIP if not any(part in raw for *_, raw in COMMANDS)]
    assert not unused, f"SKIP entries that match no command in the docs any more: {unused}"


# ---------------------------------------------------------------------------------------------------------
# (b) the commands are valid as written


def _run_module(module: str, argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """`python -m module *argv` in this process: (exit status, output)."""
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", [module, *argv])
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out = capsys.readouterr()
    return code, out.out + out.err


def _launcher_argv(env: dict[str, str], args: list[str]) -> tuple[str, list[str], dict[str, str]]:
    """What run_train.sh runs before torchrun for these variables and arguments: (module, argv, env)."""
    config_file, rest, dry_run = env.get("CONFIG_FILE", DEFAULT_CONFIG), [], False
    i = 0
    while i < len(args):
        if args[i] == "--config":
            config_file, i = args[i + 1], i + 2
            continue
        if args[i].startswith("--config="):
            config_file = args[i].split("=", 1)[1]
        elif args[i] == "--dry-run":
            dry_run = True
        else:
            rest.append(args[i])
        i += 1
    if (ROOT / config_file).is_file():  # the docs' commands run in the checkout; the check runs elsewhere
        config_file = str(ROOT / config_file)
    if dry_run:  # `exec python -m titanlite.dry_run`, which reads NGPU and NNODES itself
        return "titanlite.dry_run", ["--job.config_file", config_file, *rest], env
    world = int(env.get("NGPU", "2")) * int(env.get("NNODES", "1"))
    argv = ["--world-size", str(world), "--job.config_file", config_file, *rest]
    return "titanlite.config", argv, {**env, "TITANLITE_QUIET_CHECK": "1"}


LAUNCHES = {}  # (variables, arguments) -> the first place the docs use them: each distinct launch is checked once
for _where, _kind, _env, _tokens, _skip, _raw in COMMANDS:
    if _kind == "launcher" and not _skip:
        LAUNCHES.setdefault((tuple(_env.items()), tuple(_tokens[1:])), _where)
HELPS = {}  # module or script (with its subcommand) -> the first place the docs use it
for _where, _kind, _env, _tokens, _skip, _raw in COMMANDS:
    if _kind in ("module", "script") and not _skip:
        _target = tuple(_tokens[:2]) if len(_tokens) > 1 and re.fullmatch(r"[a-z_]+", _tokens[1]) else (_tokens[0],)
        HELPS.setdefault((_kind, _target, tuple(sorted(_env.items()))), _where)


@pytest.mark.parametrize("env,args", list(LAUNCHES), ids=list(LAUNCHES.values()))
def test_launch_commands_pass_the_launchers_check(env, args, tmp_path, monkeypatch, capsys):
    where = LAUNCHES[(env, args)]
    module, argv, env = _launcher_argv(dict(env), list(args))
    for name in ("NGPU", "NNODES", "CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)  # a fresh machine: no outputs/ of an earlier run, no lock
    code, out = _run_module(module, argv, monkeypatch, capsys)
    assert code == 0, f"{where}: python -m {module} {shlex.join(argv)} exited {code}:\n{out[-3000:]}"


@pytest.mark.parametrize("kind,target,env", [k for k in HELPS], ids=[f"{HELPS[k]}:{' '.join(k[1])}" for k in HELPS])
def test_documented_modules_and_scripts_answer_help(kind, target, env, monkeypatch, capsys):
    if kind == "module":
        code, out = _run_module(target[0], [*target[1:], "--help"], monkeypatch, capsys)
    else:
        script = ROOT / target[0]
        assert script.is_file(), f"{target[0]} does not exist"
        r = subprocess.run(
            [sys.executable, str(script), *target[1:], "--help"],
            cwd=ROOT,
            env={**os.environ, **dict(env)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        code, out = r.returncode, r.stdout + r.stderr
    assert code == 0, f"{' '.join(target)} --help exited {code}:\n{out[-3000:]}"
    assert "usage" in out.lower(), out[-3000:]
