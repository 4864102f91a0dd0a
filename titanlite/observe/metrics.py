"""The step log line and TensorBoard scalars: loss, grad norm, lr, throughput, TFLOP/s, MFU, memory, ETA.

Nothing here touches device tensors on steps that are not logged: `step_done` is host bookkeeping
only, and `log` receives plain floats that the caller read (synced) on the logged step.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import time
from dataclasses import dataclass, field

import torch

from titanlite.observe.wandb_tracker import WandbRun
from titanlite.sizing.flops import peak_flops

logger = logging.getLogger("titanlite")

GiB = 1024**3


def job_label() -> str:
    """'slurm-<job id>' inside a SLURM job (a requeued job keeps its id), else '': for run names and the start line."""
    job = os.environ.get("SLURM_JOB_ID", "")
    return f"slurm-{job}" if job else ""


def setup_logging() -> None:
    """One format for every titanlite log line; the level INFO, or TITANLITE_LOG_LEVEL's (ERROR on a SLURM job's
    other nodes: runtime/slurm.py)."""
    level = os.environ.get("TITANLITE_LOG_LEVEL", "INFO").upper()
    if os.environ.get("TITANLITE_FIRST_NODE_LOGS") == "1" and os.environ.get("GROUP_RANK", "0") != "0":
        level = "ERROR"  # a SLURM job's other nodes (runtime/slurm.py): one copy of each line in the job's output
    logging.basicConfig(
        level=level if isinstance(logging.getLevelName(level), int) else logging.INFO,
        format="[titanlite] %(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


@dataclass
class StepMetrics:
    """What one logged step reports; every value is a plain number, already reduced over ranks where global."""

    step: int
    loss: float  # mean token loss over the global batch
    grad_norm: float  # global gradient norm before clipping
    lr: float
    tokens_per_sec: float  # per rank, since the previous logged step
    tflops: float = 0.0  # achieved model TFLOP/s per rank
    mfu: float | None = None  # percent of the device's peak; None when the peak is unknown
    memory: dict[str, float] = field(default_factory=dict)  # GiB: max_allocated/max_reserved (GPU) or rss (CPU)
    elapsed: float = 0.0  # seconds since training started
    eta: float | None = None  # seconds to the last step
    moe: dict[str, float] | None = None  # an MoE's load balance (moe_balance.LoadBalance.report)
    replicas: str | None = None  # fault tolerance: live / planned replica groups this step ("1/2")
    pairs: dict[str, float] | None = None  # [dpo]: rewards of chosen and rejected, margin, accuracy (global batch)

    def scalars(self) -> dict[str, float]:
        """The TensorBoard scalars of this step, by tag."""
        out = {
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "lr": self.lr,
            "tokens_per_sec": self.tokens_per_sec,
            "tflops": self.tflops,
        }
        if self.mfu is not None:
            out["mfu_pct"] = self.mfu
        out.update({f"memory/{k}_gib": v for k, v in self.memory.items()})
        if self.moe:
            out.update({f"moe/{k}": v for k, v in self.moe.items() if k != "busiest_layer"})
        if self.pairs:
            out.update({f"dpo/{k}": v for k, v in self.pairs.items()})
        return out


def format_pairs(pairs: dict[str, float] | None) -> str:
    """[dpo]'s part of a step or validation line: mean rewards of chosen and rejected, margin, reward accuracy."""
    if not pairs:
        return ""
    return (
        f"  rewards: {pairs['reward_chosen']:+.4f}/{pairs['reward_rejected']:+.4f}  margin: {pairs['margin']:+.4f}  "
        f"acc: {pairs['accuracy']:.3f}"
    )


def memory_stats(device: torch.device) -> dict[str, float]:
    """GiB in use: the CUDA caching allocator's peaks since the last call (then reset), or the process RSS."""
    if device.type == "cuda":
        stats = {
            "max_allocated": torch.cuda.max_memory_allocated(device) / GiB,
            "max_reserved": torch.cuda.max_memory_reserved(device) / GiB,
        }
        torch.cuda.reset_peak_memory_stats(device)
        return stats
    return {"rss": _rss_bytes() / GiB}


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: the peak RSS (KiB on Linux, bytes on macOS)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss if os.uname().sysname == "Darwin" else rss * 1024


def device_name(device: torch.device) -> str | None:
    """The accelerator's model name (as torch reports it), or None on the CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def format_duration(seconds: float | None) -> str:
    """h:mm:ss, or n/a."""
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def format_step_line(m: StepMetrics) -> str:
    """The compact step line; docs/metrics.md documents each figure."""
    mfu = "n/a" if m.mfu is None else f"{m.mfu:.2f}%"
    if "rss" in m.memory:
        mem = f"rss: {m.memory['rss']:.2f}GiB"
    else:
        mem = f"mem: {m.memory.get('max_allocated', 0.0):.2f}/{m.memory.get('max_reserved', 0.0):.2f}GiB"
    moe = ""
    if m.moe:
        moe = f"  moe: busiest {m.moe['busiest_over_mean']:.2f}x mean (layer {m.moe['busiest_layer']})"
        if "aux_loss" in m.moe:
            moe += f"  aux: {m.moe['aux_loss']:.4f}"
    if m.replicas:
        moe += f"  replicas: {m.replicas}"
    moe += format_pairs(m.pairs)
    return (
        f"step: {m.step:5d}  loss: {m.loss:8.4f}  grad_norm: {m.grad_norm:7.4f}  lr: {m.lr:.3e}  "
        f"tps: {m.tokens_per_sec:,.0f}  tflops: {m.tflops:.3g}  mfu: {mfu}  {mem}{moe}  "
        f"elapsed: {format_duration(m.elapsed)}  eta: {format_duration(m.eta)}"
    )


class Throughput:
    """Tokens per second per rank between two logged steps, minus time spent outside training."""

    def __init__(self):
        self.last_time = time.perf_counter()
        self.tokens = 0
        self.excluded = 0.0

    def add(self, tokens: int) -> None:
        """Tokens processed by this rank in one step."""
        self.tokens += tokens

    def exclude(self, seconds: float) -> None:
        """Do not count these seconds (validation, checkpointing) as training time."""
        self.excluded += seconds

    def rate(self) -> float:
        """Tokens per second since the previous call (or the start); restarts the interval."""
        now = time.perf_counter()
        rate = self.tokens / max(now - self.last_time - self.excluded, 1e-9)
        self.last_time, self.tokens, self.excluded = now, 0, 0.0
        return rate


class StepTimer:
    """Elapsed time since training started and the ETA from the mean step time, the first step excluded."""

    def __init__(self, total_steps: int):
        self.total_steps = total_steps
        self.t0 = time.perf_counter()
        self.first_step: int | None = None  # the first step this process ran (warm-up, compile); > 1 on resume
        self.t_first: float | None = None

    def step_done(self, step: int) -> None:
        """Host clock only; on a GPU it runs ahead of the device except on logged (synced) steps."""
        if self.first_step is None:
            self.first_step, self.t_first = step, time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since the clock started."""
        return time.perf_counter() - self.t0

    def eta(self, step: int) -> float | None:
        """Seconds to the last step after `step`; None before the first step finished."""
        now = time.perf_counter()
        if self.t_first is None:
            return None
        if step > self.first_step:
            mean = (now - self.t_first) / (step - self.first_step)
        else:
            mean = now - self.t0
        return mean * (self.total_steps - step)


class MetricsLogger:
    """Prints the step line (every rank; torchrun's LOG_RANK filter picks what is shown) and, when enabled,
    writes the same values to TensorBoard under <dump_folder>/<save_tb_folder>/<run> (rank 0 only)."""

    def __init__(
        self,
        metrics_cfg,
        dump_folder: str,
        rank: int,
        run_name: str | None = None,
        *,
        device: torch.device | None = None,
        flops_per_token: int = 0,
        total_steps: int = 0,
    ):
        self.rank = rank
        self.device = device or torch.device("cpu")
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops(device_name(self.device), getattr(metrics_cfg, "peak_flops", 0.0))
        self.total_steps = total_steps
        self.start()
        self.writer = None
        self.tb_dir = None
        self.wandb = None
        self.metrics_cfg, self.dump_folder = metrics_cfg, dump_folder
        if metrics_cfg.enable_tensorboard and rank == 0:
            from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard is slow to import, often unused

            run = run_name or "-".join(filter(None, (time.strftime("%Y%m%d-%H%M%S"), job_label())))
            self.tb_dir = os.path.join(dump_folder, metrics_cfg.save_tb_folder, run)
            self.writer = SummaryWriter(self.tb_dir)
            logger.info(f"TensorBoard: tensorboard --logdir {os.path.join(dump_folder, metrics_cfg.save_tb_folder)}")

    def start(self) -> None:
        """Start the clocks (elapsed, ETA, tokens/s): call when the training loop begins."""
        self.throughput = Throughput()
        self.timer = StepTimer(self.total_steps)

    def open_wandb(self, config: dict, resumed: bool) -> None:
        """Start (or, resumed, continue) the W&B run on rank 0 when metrics.enable_wandb is set."""
        if getattr(self.metrics_cfg, "enable_wandb", False) and self.rank == 0 and self.wandb is None:
            self.wandb = WandbRun(self.metrics_cfg, self.dump_folder, config, resumed)
            how = "continued" if resumed else "new"
            logger.info(f"W&B: run {self.wandb.run.id} ({how}), files under {self.dump_folder}/wandb")

    def step_done(self, step: int, local_tokens: int) -> None:
        """Count a finished step's tokens on this rank (host-side only, no device access)."""
        self.throughput.add(local_tokens)
        self.timer.step_done(step)

    def exclude_time(self, seconds: float) -> None:
        """Time spent on something other than training (validation): not in tokens/s."""
        self.throughput.exclude(seconds)

    def collect(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        moe: dict | None = None,
        replicas: str | None = None,
        pairs: dict | None = None,
    ) -> StepMetrics:
        """Everything the step line shows; call after the values were read from the device (synced)."""
        tps = self.throughput.rate()
        tflops = tps * self.flops_per_token / 1e12
        mfu = 100.0 * tflops * 1e12 / self.peak_flops if self.peak_flops else None
        return StepMetrics(
            step=step,
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            tokens_per_sec=tps,
            tflops=tflops,
            mfu=mfu,
            memory=memory_stats(self.device),
            elapsed=self.timer.elapsed(),
            eta=self.timer.eta(step),
            moe=moe,
            replicas=replicas,
            pairs=pairs,
        )

    def log(self, m: StepMetrics) -> str:
        """Print the step line and write the TensorBoard scalars; returns the line."""
        line = format_step_line(m)
        logger.info(line)
        if self.writer is not None:
            for tag, value in m.scalars().items():
                self.writer.add_scalar(tag, value, m.step)
        if self.wandb is not None:
            self.wandb.log(m.scalars(), m.step)
        return line

    def log_validation(
        self, step: int, loss: float, perplexity: float, tokens: int, seconds: float, pairs: dict | None = None
    ) -> str:
        """Print the validation line and write validation/loss and validation/perplexity ([dpo]: validation/loss and
        the pairs' rewards, margin and accuracy, over `tokens` pairs)."""
        if pairs:
            line = f"validation at step {step}: loss: {loss:8.4f}{format_pairs(pairs)}  "
            line += f"({tokens:,} pairs, {seconds:.1f}s)"
            scalars = {"validation/loss": loss, **{f"validation/dpo/{k}": v for k, v in pairs.items()}}
        else:
            line = (
                f"validation at step {step}: loss: {loss:8.4f}  perplexity: {perplexity:.3f}  "
                f"({tokens:,} tokens, {seconds:.1f}s)"
            )
            scalars = {"validation/loss": loss, "validation/perplexity": perplexity}
        logger.info(line)
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step)
        return line

    def close(self) -> None:
        """Flush and close TensorBoard and W&B."""
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None
