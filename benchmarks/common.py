"""Shared by the benchmark scripts: spawn ranks, build titanlite Trainers of a given shape, time, print tables.

The same code runs on CPU with gloo and on GPUs with NCCL (one GPU per rank): titanlite picks the
device, the benchmarks only synchronise it before reading the clock.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titanlite.runtime.distributed import exit_process, free_port, shutdown

BENCH_FLAVOR = "bench"
SCRATCH = "TITANLITE_BENCH_SCRATCH"  # a folder every rank of a spawned world shares (spawn sets it)
_jobs = itertools.count()


def add_common_args(p: argparse.ArgumentParser, *, layers: int, hidden: int, intermediate: int, seq_len: int) -> None:
    """Model shape and device arguments shared by the benchmarks."""
    p.add_argument("--layers", type=int, default=layers, help="transformer blocks")
    p.add_argument("--hidden", type=int, default=hidden, help="model dim")
    p.add_argument("--intermediate", type=int, default=intermediate, help="feed-forward hidden size")
    p.add_argument("--head-dim", type=int, default=64, help="attention head size (heads = hidden / head-dim)")
    p.add_argument("--seq-len", type=int, default=seq_len, help="tokens per sequence")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: one GPU per rank when there are enough, else CPU with gloo",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="parameter dtype in compute; auto: float32 on CPU, bfloat16 on GPU",
    )


def device_type(requested: str, world_size: int) -> str:
    """'cuda' or 'cpu' for a run of world_size ranks; NCCL needs one GPU per rank."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cuda" and gpus < world_size:
        raise SystemExit(f"--device cuda: world size {world_size} needs {world_size} GPUs, {gpus} visible")
    if requested == "auto":
        return "cuda" if gpus >= world_size else "cpu"
    return requested


def param_dtype(requested: str, device: str) -> str:
    """The training.mixed_precision_param value for --dtype."""
    if requested != "auto":
        return requested
    return "bfloat16" if device == "cuda" else "float32"


def _worker(rank: int, world_size: int, port: int, device: str, fn, args, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TITANLITE_DEVICE=device,
        HF_HUB_OFFLINE="1",
    )
    os.environ[SCRATCH] = out_dir
    if device == "cpu":  # share the cores; more threads than cores only adds contention
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    finished = False
    try:
        result = fn(*args)
        finished = True
    finally:
        shutdown(wait_for_peers=finished)  # after a clean run, the ranks leave together
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    exit_process(0)  # no interpreter teardown racing gloo's threads (see titanlite.runtime.distributed.exit_process)


def spawn(fn, world_size: int, device: str, *args) -> list:
    """fn(*args) on world_size fresh processes (env as torchrun sets it); each rank's return value."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world_size, free_port(), device, fn, args, out_dir), nprocs=world_size, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


@contextlib.contextmanager
def job_folder():
    """A dump folder for one job of this spawned world: the same path on every rank, as a job's ranks share one
    (titanlite stops ranks whose configurations differ); removed with the world's scratch folder."""
    path = os.path.join(os.environ[SCRATCH], f"job{next(_jobs)}")
    os.makedirs(path, exist_ok=True)
    yield path


def register_shape(layers: int, hidden: int, intermediate: int, head_dim: int, seq_len: int) -> str:
    """Add a llama3 flavor with exactly this shape (FFN hidden size = intermediate); returns its name."""
    from titanlite.models.args import ModelArgs
    from titanlite.models.llama3 import LLAMA3_FLAVORS

    if hidden % head_dim:
        raise SystemExit(f"--hidden {hidden} must be a multiple of --head-dim {head_dim}")
    # ffn_hidden_dim rounds int(multiplier * 8 * dim / 3) up to a multiple of multiple_of; with
    # multiple_of = intermediate and this multiplier the result is intermediate itself.
    args = ModelArgs(
        dim=hidden,
        n_layers=layers,
        n_heads=hidden // head_dim,
        multiple_of=intermediate,
        ffn_dim_multiplier=intermediate / int(8 * hidden / 3),
        max_seq_len=seq_len,
    )
    assert args.ffn_hidden_dim == intermediate, (args.ffn_hidden_dim, intermediate)
    LLAMA3_FLAVORS[BENCH_FLAVOR] = args
    return BENCH_FLAVOR


def lora_base(opts, vocab: int | None = None) -> str:
    """A consolidated file of random base weights of the benchmark shape (a LoRA run starts from a base), written
    once into the temp folder and reused."""
    from titanlite.config import load
    from titanlite.models.registry import model_args, model_class

    vocab = vocab or opts.vocab
    flavor = register_shape(opts.layers, opts.hidden, opts.intermediate, opts.head_dim, opts.seq_len)
    shape = f"{opts.layers}x{opts.hidden}x{opts.intermediate}x{opts.head_dim}-{vocab}"
    path = os.path.join(tempfile.gettempdir(), f"titanlite-lora-base-{shape}.pt")
    if not os.path.exists(path):
        cfg = load(["--model.flavor", flavor, "--model.vocab_size", str(vocab)])
        with torch.device("meta"):
            model = model_class(cfg.model.name)(model_args(cfg.model, vocab, opts.seq_len))
        gen = torch.Generator().manual_seed(0)
        state = {k: torch.randn(v.shape, generator=gen) * 0.02 for k, v in model.state_dict().items()}
        torch.save(state, f"{path}.{os.getpid()}.tmp")
        os.replace(f"{path}.{os.getpid()}.tmp", path)
    return path


def build_trainer(opts, dump_folder: str, **settings):
    """A titanlite Trainer for the benchmark shape, through titanlite's own config, mesh and parallel/
    (settings: those of trainer_config)."""
    from titanlite.trainer import Trainer

    return Trainer(trainer_config(opts, dump_folder, int(os.environ["WORLD_SIZE"]), **settings))


def trainer_config(
    opts,
    dump_folder: str,
    world: int,
    *,
    local_batch_size: int,
    accumulation: int,
    replicate: int,
    gradient_sync: str = "every_microbatch",
    dtype: str = "float32",
    extra: tuple[str, ...] = (),
):
    """The JobConfig of a benchmark Trainer of world ranks (extra: more overrides; with
    --parallelism.tensor_parallel_degree or pipeline_parallel_degree N the global batch counts world / N dp
    ranks)."""
    from titanlite.config import load

    for key in ("--parallelism.tensor_parallel_degree", "--parallelism.pipeline_parallel_degree"):
        if key in extra:
            world //= int(extra[extra.index(key) + 1])
    flavor = register_shape(opts.layers, opts.hidden, opts.intermediate, opts.head_dim, opts.seq_len)
    argv = [
        "--model.flavor",
        flavor,
        "--training.seq_len",
        str(opts.seq_len),
        "--training.local_batch_size",
        str(local_batch_size),
        "--training.global_batch_size",
        str(local_batch_size * accumulation * world),
        "--training.steps",
        "1000000",
        "--training.mixed_precision_param",
        dtype,
        "--parallelism.data_parallel_replicate_degree",
        str(replicate),
        "--parallelism.gradient_sync",
        gradient_sync,
        "--optimizer.lr",
        "1e-5",
        "--lr_scheduler.warmup_steps",
        "0",
        "--metrics.log_freq",
        "1000000",
        "--job.dump_folder",
        dump_folder,
        *extra,
    ]
    return load(argv)


def random_microbatches(sizes: list[int], seq_len: int, vocab_size: int, seed: int) -> list[tuple]:
    """Random (inputs, labels) microbatches of the given batch sizes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in sizes:
        tokens = torch.randint(0, vocab_size, (b, seq_len + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, steps: int, device: torch.device) -> float:
    """Seconds per call of step() over `steps` calls, the slowest rank's (all ranks call it together)."""
    dist.barrier()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # on the CPU: gloo serves it on GPU machines too
    return elapsed.item() / steps


def add_repetition_args(p, reps: int) -> None:
    """--reps, --steps and --warmup of a benchmark that times its modes interleaved."""
    p.add_argument("--reps", type=int, default=reps, help="repetitions of each mode (interleaved)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per repetition")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per mode first")


def time_modes(trainers: dict, batches: dict, opts, device: torch.device, after_warmup=None) -> dict[str, list[float]]:
    """Seconds per train_step of each mode (trainers and batches by mode), per repetition: opts.warmup untimed
    steps each (then after_warmup(), if given), then opts.reps repetitions of opts.steps steps, the modes in an
    order rotated every repetition."""
    modes = list(trainers)
    for m in modes:
        for _ in range(opts.warmup):
            trainers[m].train_step(batches[m])
    if after_warmup is not None:
        after_warmup()
    times = {m: [] for m in modes}
    for rep in range(opts.reps):
        for m in modes[rep % len(modes) :] + modes[: rep % len(modes)]:
            step = lambda t=trainers[m], mbs=batches[m]: t.train_step(mbs)  # noqa: E731
            times[m].append(time_steps(step, opts.steps, device))
    return times


def summary(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """The median of the per-repetition ratios numerator / denominator (each pair timed back to back)."""
    return statistics.median(n / d for n, d in zip(numerators, denominators))


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """A plain fixed-width table (first column left-aligned, the others right-aligned)."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]

    def line(r):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def machine_line(device: str) -> str:
    """Date, device, cores and load: what a reader needs to judge the numbers."""
    if device == "cuda":
        what = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, NCCL"
    else:
        what = f"CPU, {os.cpu_count()} cores, gloo, max(1, cores / world) threads per rank"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{time.strftime('%Y-%m-%d %H:%M')}  torch {torch.__version__}  {what}  load average {load}"
