"""Packaging and layout: the wheel ships the configs and trains from an empty folder; the layout in
docs/architecture.md lists every module; imports run one way."""

import os
import re
import subprocess
import sys
import sysconfig
import venv

import pytest

from helpers import ROOT, subprocess_env


@pytest.mark.slow
def test_wheel_installs_and_trains_the_debug_config_from_an_empty_folder(tmp_path):
    wheels = tmp_path / "wheels"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = wheels.glob("titanlite-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # torch and the other dependencies come from this interpreter's site-packages through a .pth line,
    # which (unlike a site directory) runs none of that folder's .pth files: not the editable titanlite.
    (site,) = (env_dir / "lib").glob("python*/site-packages")
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_TARGET", "PIP_PREFIX")}
    r = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert list(site.glob("titanlite/train.py")), f"the wheel did not land in {site}: {r.stdout[-2000:]}"
    empty = tmp_path / "empty"
    empty.mkdir()
    env = subprocess_env()
    env.pop("PYTHONPATH")
    r = subprocess.run(
        [
            str(python),
            "-m",
            "titanlite.train",
            "--job.config_file",
            "debug_model",
            "--training.steps",
            "2",
            "--metrics.log_freq",
            "1",
            "--training.seq_len",
            "32",
            "--validation.enable",
            "false",
            "--checkpoint.enable",
            "false",
        ],
        cwd=empty,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert re.search(r"step:\s+2\s+loss:", out), out[-3000:]
    where = subprocess.run(
        [
            str(python),
            "-c",
            "import titanlite, titanlite.config as c; print(titanlite.__file__, "
            "c.CONFIG_DIR, c.loader.shipped_configs())",
        ],
        cwd=empty,
        env=env,
        capture_output=True,
        text=True,
    )
    assert str(env_dir) in where.stdout and "debug_model.toml" in where.stdout, where.stdout + where.stderr


def test_docs_layout_lists_every_module():
    page = (ROOT / "docs" / "architecture.md").read_text()
    layout = page[page.index("## Layout") :]
    for path in sorted((ROOT / "titanlite").rglob("*.py")):
        if path.name != "__init__.py":
            assert path.relative_to(ROOT).as_posix() in layout, path


# Imports run one way: a module imports modules of its own layer or lower ones, never an entry point.
LAYERS = [
    ("errors",),
    (
        "config",
        "models.registry",
        "models.args",
        "models.family",
        "models.hf_config",
        "models.hf_rope",
        "models.config_fields",
        "models.sliding_window",
        "models.llama3",
        "models.qwen3",
        "models.qwen2",
        "models.mistral",
        "models.qwen3_moe",
        "models.mixtral",
        "models.deepseek_v3",
        "models.glm4_moe",
        "models.gpt_oss",
        "models.hf_routing",
    ),
    ("*",),  # components: models, data, checkpoint, parallel, metrics, ...
    ("plan", "generation_plan"),  # the checks of a training run, and the plan of a generation run
    ("trainer",),
    ("cli",),
    ("train", "generate", "dry_run", "config.__main__", "checkpoint.__main__", "data.__main__"),  # shims
]


def _layer(module: str) -> int:
    name = module.removeprefix("titanlite.")
    best = None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or name.startswith(prefix + ".") or prefix == "*":
                if prefix != "*" and (best is None or len(prefix) > best[1]):
                    best = (i, len(prefix))
    return best[0] if best else 2


def test_imports_run_one_way():
    import ast

    problems = []
    for path in (ROOT / "titanlite").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("titanlite"):
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                target = max(
                    (
                        t
                        for t in targets
                        if (ROOT / (t.replace(".", "/") + ".py")).exists() or (ROOT / t.replace(".", "/")).is_dir()
                    ),
                    key=len,
                    default=node.module,
                )
                if _layer(target) > _layer(module):
                    problems.append(f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})")
    assert not problems, "\n".join(problems)


# Bands inside the components: what each package must never import (its __main__ shim excepted).
BANDS = {
    "models": ("parallel", "checkpoint", "data", "runtime", "sizing", "observe", "model_builder", "generation"),
    "parallel": ("checkpoint", "data", "runtime", "sizing", "observe", "model_builder", "generation"),
    "checkpoint": ("model_builder", "parallel", "sizing", "observe", "generation"),
    "data": ("models", "parallel", "checkpoint", "model_builder", "sizing", "observe"),
    "runtime": ("models", "parallel", "checkpoint", "data", "model_builder", "sizing", "observe", "config"),
    "observe": ("parallel", "checkpoint", "data", "model_builder", "runtime"),
    "sizing": ("checkpoint", "data", "runtime", "observe", "generation"),
}


def _imports_by_module() -> dict[str, set[str]]:
    import ast

    found = {}
    for path in (ROOT / "titanlite").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("titanlite"):
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names if a.name.startswith("titanlite")}
        found[module] = names
    return found


def _band_problems(imports: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, names in imports.items():
        parts = module.split(".")
        if len(parts) < 3 or parts[1] not in BANDS or parts[-1] == "__main__":
            continue
        for name in names:
            target = name.split(".")[1] if name.count(".") else ""
            if target in BANDS[parts[1]]:
                problems.append(f"{module} imports {name} ({parts[1]}/ must not import {target})")
    return sorted(problems)


def test_components_keep_their_bands():
    """models/ never reaches parallel/ or checkpoint/, checkpoint/ never builds a model, and so on (BANDS)."""
    problems = _band_problems(_imports_by_module())
    assert not problems, "\n".join(problems)
    assert _band_problems({"titanlite.models.decoder": {"titanlite.parallel.fsdp"}}) == [
        "titanlite.models.decoder imports titanlite.parallel.fsdp (models/ must not import parallel)"
    ]
    assert _band_problems({"titanlite.checkpoint.lora_export": {"titanlite.model_builder"}})


def test_the_run_state_imports_nothing_of_titanlite_and_fault_tolerance_stays_a_policy():
    """RunState is taken by the checkpoint manager, healing and the replica groups: it imports nothing of titanlite;
    parallel/ft/ is never imported by models/ or checkpoint/, and no module but trainer.py builds or reads a Trainer."""
    imports = _imports_by_module()
    assert not imports["titanlite.run_state"], imports["titanlite.run_state"]
    reaching = sorted(
        f"{m} imports {n}"
        for m, names in imports.items()
        if m.startswith(("titanlite.models", "titanlite.checkpoint"))
        for n in names
        if n.startswith("titanlite.parallel.ft")
    )
    assert not reaching, reaching
    trainer_users = sorted(m for m, names in imports.items() if "titanlite.trainer" in names)
    assert trainer_users == ["titanlite.cli.train"], trainer_users


def test_torch_range_is_the_one_compat_admits(monkeypatch):
    """pyproject.toml and titanlite/compat.py name the same torch versions; outside them the run warns."""
    import torch

    from titanlite import compat

    (low_major, low_minor), (high_major, high_minor) = compat.SUPPORTED
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={low_major}.{low_minor},<{high_major}.{high_minor}"' in pyproject
    assert compat.version_warning() is None  # the torch this suite runs on is admitted
    monkeypatch.setattr(torch, "__version__", "2.10.1+cu128")
    assert "torch 2.10.1+cu128 is outside the versions titanlite admits (>= 2.11, < 2.16)" in compat.version_warning()
    monkeypatch.setattr(torch, "__version__", "2.16.0")
    assert compat.version_warning() is not None
    monkeypatch.setattr(torch, "__version__", "2.15.2")
    assert compat.version_warning() is None


def test_no_module_outside_models_names_a_model_parameter():
    """Parameter names (and so a family's layout) live in titanlite/models/ only: every other module asks the
    model or its ModelArgs (shapes, counts, FLOPs, activation bytes, HF names)."""
    import ast
    import re

    from titanlite.models.args import ModelArgs

    every_switch = ModelArgs(vocab_size=8, qk_norm=True, qkv_bias=True, tie_embeddings=False)
    moe = every_switch.with_overrides(n_experts=4, top_k=2, moe_hidden_dim=8)
    names = set(every_switch.parameter_shapes()) | set(moe.parameter_shapes()) | {"layers.0.feed_forward.expert_bias"}
    generic = {"layers", "attention", "weight", "bias", "norm", "output", "experts", "router"}  # also plain words
    generic |= {str(i) for i in range(99)}
    parts = {p for n in names for p in n.split(".")} - generic
    assert {"wq", "w1", "q_norm", "tok_embeddings", "feed_forward", "expert_bias"} <= parts
    pattern = re.compile(r"\b(" + "|".join(sorted(parts)) + r")\b|\b(output|norm)\.weight\b")
    problems = []
    for path in (ROOT / "titanlite").rglob("*.py"):
        if "models" in path.relative_to(ROOT / "titanlite").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
            text = node.attr if isinstance(node, ast.Attribute) else text
            if text is not None and (m := pattern.search(text)):
                problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: {m.group(0)}")
    assert not problems, problems


def test_every_package_is_in_the_wheel():
    """pyproject.toml lists the packages by name: a new folder under titanlite/ (a model family) must be in it."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "titanlite").rglob("__init__.py")} | {
        "titanlite.train_configs"
    }
    assert listed == found, (sorted(found - listed), sorted(listed - found))


def test_each_parallelism_is_applied_in_its_own_module():
    """parallel/ holds one module per kind of parallelism: only parallel/fsdp.py calls fully_shard, only the
    family's plan (models/: the decoder's, the transformers backend's) and parallel/ apply tensor parallelism, and
    nothing outside parallel/ builds a mesh."""
    owners = {
        "fully_shard(": {"titanlite/parallel/fsdp.py"},
        "parallelize_module(": {"titanlite/models/decoder_tp.py", "titanlite/models/transformers_backend/tp.py"},
        "init_device_mesh(": {"titanlite/parallel/dims.py"},
    }
    for path in sorted((ROOT / "titanlite").rglob("*.py")):
        text, rel = path.read_text(), path.relative_to(ROOT).as_posix()
        for call, allowed in owners.items():
            assert call not in text or rel in allowed, (rel, call)
