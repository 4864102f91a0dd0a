"""Metrics: FLOPs by hand, peak table, step line, TensorBoard read back, no host sync on unlogged steps,
profiler traces, start-up summary and validation inside a sharded run (gloo, CPU)."""

import functools
import json
import logging
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from helpers import run_distributed, tiny_argv, wandb_history

# ----------------------------------------------------------------------------- FLOPs and peak table


def test_flops_per_token_8b_by_hand():
    from titanlite.models.llama3 import LLAMA3_FLAVORS
    from titanlite.sizing.flops import flops_per_token, param_counts

    args = LLAMA3_FLAVORS["8B"].with_overrides(vocab_size=128256)
    assert args.ffn_hidden_dim == 14336
    # By hand: dim 4096, 32 layers, 32 heads of 128, 8 KV heads (kv dim 1024), FFN 14336, vocab 128256.
    attention = 4096 * 4096 * 2 + 4096 * 1024 * 2  # wq, wo; wk, wv
    ffn = 3 * 4096 * 14336
    per_layer = attention + ffn + 2 * 4096  # 218,112,000
    assert per_layer == 218_112_000
    embedding = 128256 * 4096  # 525,336,576
    non_embedding = 32 * per_layer + 4096 + 128256 * 4096  # + final norm + output projection
    assert non_embedding == 7_504_924_672
    counts = param_counts(args)
    assert counts == {
        "total": 8_030_261_248,
        "embedding": embedding,
        "non_embedding": non_embedding,
        "active": 8_030_261_248,  # a dense model computes every token with all of them
        "active_non_embedding": non_embedding,
    }
    # 6 x 7,504,924,672 + 12 x 32 layers x 32 heads x 128 x 8192 tokens
    assert flops_per_token(args, 8192) == 45_029_548_032 + 12_884_901_888 == 57_914_449_920
    assert flops_per_token(args, 2048) == 45_029_548_032 + 3_221_225_472


@pytest.mark.parametrize("flavor", ["tiny", "debugmodel", "1B", "8B"])
def test_param_counts_match_the_model(flavor):
    from titanlite.models.decoder import Transformer
    from titanlite.models.llama3 import LLAMA3_FLAVORS
    from titanlite.sizing.flops import param_counts

    args = LLAMA3_FLAVORS[flavor]
    args = args.with_overrides(vocab_size=args.vocab_size or 258)
    with torch.device("meta"):
        model = Transformer(args)
    counts = param_counts(args)
    assert counts["total"] == sum(p.numel() for p in model.parameters())  # a tied weight once (1B is tied)
    assert counts["embedding"] == model.tok_embeddings.weight.numel()


def test_peak_flops_table():
    from titanlite.sizing.flops import peak_flops

    cases = {
        "NVIDIA H100 80GB HBM3": 989e12,
        "NVIDIA H100 PCIe": 756e12,
        "NVIDIA H100 NVL": 835e12,
        "NVIDIA H200": 989e12,
        "NVIDIA GH200 480GB": 989e12,
        "NVIDIA A100-SXM4-80GB": 312e12,
        "NVIDIA A100 80GB PCIe": 312e12,
        "NVIDIA B200": 2.25e15,
        "NVIDIA L40S": 362e12,
        "NVIDIA L4": 121e12,
        "NVIDIA A10G": 70e12,
        "AMD Instinct MI300X": 1307e12,
    }
    for name, value in cases.items():
        assert peak_flops(name) == value, name
    assert peak_flops(None) is None and peak_flops("Some CPU") is None
    assert peak_flops(None, override=5e12) == 5e12 and peak_flops("NVIDIA H100", override=1e15) == 1e15


def test_step_line_format():
    from titanlite.observe.metrics import StepMetrics, format_step_line

    m = StepMetrics(
        step=7,
        loss=2.5,
        grad_norm=0.75,
        lr=1e-3,
        tokens_per_sec=12345.6,
        tflops=400.5,
        mfu=40.4955,
        memory={"max_allocated": 12.3456, "max_reserved": 14.0},
        elapsed=3725.0,
        eta=59.6,
    )
    line = format_step_line(m)
    assert line == (
        "step:     7  loss:   2.5000  grad_norm:  0.7500  lr: 1.000e-03  tps: 12,346  tflops: 400  "
        "mfu: 40.50%  mem: 12.35/14.00GiB  elapsed: 1:02:05  eta: 0:01:00"
    )
    cpu = StepMetrics(
        step=1,
        loss=5.0,
        grad_norm=1.0,
        lr=1e-4,
        tokens_per_sec=100.0,
        tflops=1e-4,
        mfu=None,
        memory={"rss": 0.5},
        elapsed=1.0,
        eta=None,
    )
    assert "mfu: n/a  rss: 0.50GiB  elapsed: 0:00:01  eta: n/a" in format_step_line(cpu)
    assert set(cpu.scalars()) == {"loss", "grad_norm", "lr", "tokens_per_sec", "tflops", "memory/rss_gib"}


def test_eta_is_mean_step_time_without_the_first_step(monkeypatch):
    from titanlite.observe import metrics

    now = [100.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    timer = metrics.StepTimer(total_steps=10)
    assert timer.eta(3) is None
    now[0] = 130.0  # the first step run (3: resumed after step 2) is slow: 30 s
    timer.step_done(3)
    assert timer.eta(3) == 30.0 * 7
    for step in range(4, 7):  # then 2 s each
        now[0] += 2.0
        timer.step_done(step)
    assert timer.eta(6) == 2.0 * 4 and timer.elapsed() == 36.0


# ----------------------------------------------------------------------------- one sharded run


TITANLITE_DIR = Path(__file__).resolve().parent.parent / "titanlite"


@functools.cache
def _in_titanlite(filename: str) -> bool:
    return TITANLITE_DIR in Path(filename).resolve().parents


class HostSyncCounter:
    """Counts calls from titanlite's own code that make the host wait for the device on a GPU.

    On the CPU nothing really syncs, so this records the calls that would: reading a tensor's value
    (item, tolist, float(), bool(), format, ...), creating a device tensor from host data
    (torch.tensor(..., device=...)) and blocking copies (.to(..., non_blocking=False)).
    """

    READS = (
        "item",
        "tolist",
        "numpy",
        "cpu",
        "__float__",
        "__int__",
        "__bool__",
        "__index__",
        "__format__",
        "__repr__",
    )

    def __init__(self, trainer):
        self.trainer = trainer
        self.calls: list[tuple[int, str, str]] = []
        self._saved = []

    def _record(self, what):
        frame = sys._getframe(2)  # _record <- wrapper <- the caller
        if _in_titanlite(frame.f_code.co_filename):
            self.calls.append((self.trainer.step, what, f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"))

    def __enter__(self):
        def wrap(owner, name, should_count=lambda *a, **k: True):
            orig = getattr(owner, name)

            def wrapper(*args, **kwargs):
                if should_count(*args, **kwargs):
                    self._record(name)
                return orig(*args, **kwargs)

            self._saved.append((owner, name, orig))
            setattr(owner, name, wrapper)

        for name in self.READS:
            wrap(torch.Tensor, name)
        wrap(torch, "tensor", lambda *a, **k: k.get("device") is not None)
        wrap(torch.Tensor, "to", lambda *a, **k: _moves(a[1:], k) and not k.get("non_blocking", False))
        return self

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self._saved):
            setattr(owner, name, orig)


def _moves(args, kwargs) -> bool:
    """Whether a Tensor.to(...) call names a device (or a tensor, whose device it takes): a dtype cast alone never
    waits for the device."""
    return "device" in kwargs or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args)


def _capture_logs():
    lines = []

    class Handler(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("titanlite").addHandler(Handler())
    logging.getLogger("titanlite").setLevel(logging.INFO)
    return lines


def _observed_runs(argv_full, argv_quiet):
    """Run A: everything on, every step logged. Run B: sparse logging, syncs counted. Then checks on A's model."""
    import torch.distributed as dist

    from titanlite.config import load
    from titanlite.data.build import build_loader
    from titanlite.data.tokenizers import build_tokenizer
    from titanlite.models.decoder import Transformer
    from titanlite.sizing.memory import sharded_state_bytes
    from titanlite.trainer import Trainer
    from titanlite.validate import Validator

    lines = _capture_logs()
    a = Trainer(load(argv_full))
    a_losses = a.train()
    again = a.validator.evaluate(a.model, a.device), a.validator.evaluate(a.model, a.device)
    # The same weights evaluated unsharded in one process (dp degree 1, no all-reduce).
    full = {k: v.full_tensor() for k, v in a.model.state_dict().items()}
    plain = Transformer(a.model_args)
    plain.load_state_dict(full)
    loader = build_loader(
        a.cfg, build_tokenizer(""), "validation", dp_rank=0, dp_degree=1, global_batch_size=a.global_batch_size
    )
    single = Validator(a.cfg, loader).evaluate(plain, torch.device("cpu"))
    opt_bytes = sum(
        s.to_local().numel() * s.element_size()
        for st in a.optimizer.state.values()
        for k, s in st.items()
        if k in ("exp_avg", "exp_avg_sq")
    )
    estimate = sharded_state_bytes(a.model, 2)
    a_lines = list(lines)

    b = Trainer(load(argv_quiet))
    with HostSyncCounter(b) as counter:
        b_losses = b.train()
    return dict(
        rank=dist.get_rank(),
        lines=a_lines,
        tb_dir=a.metrics.tb_dir,
        a_losses=a_losses,
        a_val=a.val_losses,
        again=again,
        single=single,
        opt_bytes=opt_bytes,
        estimate=estimate,
        b_losses=b_losses,
        b_val=b.val_losses,
        syncs=counter.calls,
    )


def _printed_matches(printed: str, value: float) -> bool:
    """value equals the printed figure to the precision it was printed with (TensorBoard stores float32)."""
    s = printed.replace(",", "").rstrip("%").removesuffix("GiB")
    mantissa, _, exponent = s.partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    unit = 10.0 ** (-decimals) * 10.0 ** int(exponent or 0)
    return abs(float(s) - value) <= unit / 2 * (1 + 1e-6) + 1e-6 * abs(value)


STEP_TAGS = {
    "loss": "loss",
    "grad_norm": "grad_norm",
    "lr": "lr",
    "tps": "tokens_per_sec",
    "tflops": "tflops",
    "mfu": "mfu_pct",
    "rss": "memory/rss_gib",
}


@pytest.mark.slow
def test_sharded_run_metrics_tensorboard_validation_profiling(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    full = tiny_argv(
        tmp_path / "a",
        "--training.steps",
        "8",
        "--metrics.enable_tensorboard",
        "--metrics.peak_flops",
        "1e12",
        "--validation.enable",
        "--validation.freq",
        "3",
        "--validation.steps",
        "2",
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "3",
        "--profiling.enable_memory_snapshot",
    )
    quiet = tiny_argv(
        tmp_path / "b",
        "--training.steps",
        "8",
        "--metrics.log_freq",
        "4",
        "--validation.enable",
        "--validation.freq",
        "5",
        "--validation.steps",
        "1",
    )
    res = run_distributed(_observed_runs, 2, full, quiet)
    r0 = res[0]

    # Start-up summary and the step lines
    text = "\n".join(r0["lines"])
    assert "World size 2: data-parallel degree 2 (replicate 1 x shard 2)" in text
    assert re.search(r"Model llama3 tiny: 131,648 parameters \(115,136 non-embedding\), 65,824 on this rank", text)
    assert "Per-rank memory estimate: parameters 257.12 KiB + gradients 257.12 KiB + optimizer 514.25 KiB" in text
    assert "profiling.enable_memory_snapshot: skipped" in text
    step_lines = [ln for ln in r0["lines"] if ln.startswith("step:")]
    assert len(step_lines) == 8
    assert all(re.search(r"elapsed: \d+:\d\d:\d\d  eta: (\d+:\d\d:\d\d|n/a)$", ln) for ln in step_lines)

    # TensorBoard holds exactly what the lines printed
    acc = EventAccumulator(r0["tb_dir"])
    acc.Reload()
    tb = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    for ln in step_lines:
        fields = dict(re.findall(r"(\w+):\s+(\S+)", ln))
        step = int(fields.pop("step"))
        for key, tag in STEP_TAGS.items():
            assert _printed_matches(fields[key], tb[tag][step]), (step, key, fields[key], tb[tag][step])
        assert _printed_matches(fields["mfu"], tb["tflops"][step] / 1.0 * 100)  # peak 1 TFLOP/s
        assert abs(tb["loss"][step] - r0["a_losses"][step]) < 1e-6
    val_lines = [ln for ln in r0["lines"] if ln.startswith("validation at step")]
    assert [int(re.match(r"validation at step (\d+)", ln).group(1)) for ln in val_lines] == [3, 6, 8]
    for ln in val_lines:
        step, loss, ppl = re.match(r"validation at step (\d+): loss:\s+(\S+)\s+perplexity: (\S+)", ln).groups()
        assert _printed_matches(loss, tb["validation/loss"][int(step)])
        assert _printed_matches(ppl, tb["validation/perplexity"][int(step)])
        assert abs(math.exp(float(loss)) - float(ppl)) < 1e-3 * float(ppl)

    # Validation: the same data every time, topology-invariant, and training does not notice it
    first, second = r0["again"]
    assert first.loss == second.loss and first.tokens == second.tokens == 2 * 16 * 32
    assert abs(first.loss - r0["a_val"][8]) < 1e-12  # no training since the last validation
    assert abs(r0["single"].loss - first.loss) < 1e-5, (r0["single"].loss, first.loss)
    assert r0["a_val"][3] > r0["a_val"][8]  # it learns
    for step, loss in r0["b_losses"].items():  # run B validated at other steps and logged less
        assert abs(loss - r0["a_losses"][step]) < 1e-6, step
    assert sorted(r0["b_val"]) == [5, 8]

    # Per-rank memory estimate: the optimizer state really is what was estimated (tiny divides evenly by 2)
    for r in res:
        assert r["opt_bytes"] == r["estimate"].optimizer

    # Profiler traces every 3 steps, from every rank
    for step in (3, 6):
        for rank in (0, 1):
            trace = tmp_path / "a" / "profile_traces" / f"iteration_{step}" / f"rank{rank}_trace.json"
            assert "traceEvents" in json.loads(trace.read_text())
    assert not (tmp_path / "a" / "memory_snapshot").exists()  # CPU: skipped

    # No host sync on steps that neither log nor validate; the counter does see the logged ones
    for r in res:
        by_step = {}
        for step, what, where in r["syncs"]:
            by_step.setdefault(step, []).append(f"{what} at {where}")
        assert by_step.get(4) and by_step.get(5) and by_step.get(8), by_step
        quiet_steps = set(range(1, 9)) - {4, 8} - {5}
        assert not {s: by_step[s] for s in quiet_steps if s in by_step}, by_step


def _train(argv):
    from titanlite.config import load
    from titanlite.trainer import Trainer

    return Trainer(load(argv)).train()


@pytest.mark.slow
def test_wandb_offline_run_holds_the_loss_history_and_a_resumed_run_appends(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    job = tmp_path / "job"
    argv = tiny_argv(job, "--metrics.enable_wandb", "--metrics.wandb_run_name", "tiny", "--checkpoint.enable")
    first = run_distributed(_train, 1, argv + ["--training.steps", "3"])[0]
    second = run_distributed(_train, 1, argv + ["--training.steps", "6"])[0]  # resumes at step 3
    runs = sorted((job / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs
    (id_a, rows_a, config), (id_b, rows_b, _) = wandb_history(runs[0]), wandb_history(runs[1])
    assert id_a == id_b == (job / "wandb_run_id").read_text().strip()  # the same W&B run, continued
    for rows, losses in ((rows_a, first), (rows_b, second)):
        logged = {int(r["_step"]): float(r["loss"]) for r in rows if "loss" in r}
        assert logged.keys() == losses.keys() and all(abs(logged[k] - losses[k]) < 1e-6 for k in losses)
        assert all("tokens_per_sec" in r and "grad_norm" in r for r in rows if "loss" in r)  # TensorBoard's tags
    assert sorted(second) == [4, 5, 6]
    assert json.loads(config["training"])["local_batch_size"] == 8 and json.loads(config["metrics"])["enable_wandb"]


def test_wandb_without_the_package_is_a_config_error(tmp_path, monkeypatch):
    import sys

    from titanlite.config import ConfigError, load
    from titanlite.plan import validate_for_world

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"metrics.enable_wandb = true needs the wandb package.*titanlite\[wandb\]"):
        validate_for_world(load(tiny_argv(tmp_path, "--metrics.enable_wandb")), 1)


def test_wandb_that_fails_to_import_is_a_config_error_before_the_run(tmp_path, monkeypatch, capsys):
    """wandb installed but broken (its import raises): one message at the pre-check, not an ImportError once the
    model is built."""
    import sys

    from titanlite.cli.check_config import main

    broken = tmp_path / "site" / "wandb"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("import wandb_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    assert main(["--world-size", "1", *tiny_argv(tmp_path / "run", "--metrics.enable_wandb")]) == 2
    err = capsys.readouterr().err
    assert "the installed wandb package fails to import (ModuleNotFoundError" in err and "Traceback" not in err, err
