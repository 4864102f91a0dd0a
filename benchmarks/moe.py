"""Mixture of Experts on the CPU: the grouped GEMM against a per-expert loop, EP(2) against FSDP(2), and load balance.

    python benchmarks/moe.py                    # every part; about 13 minutes on 2 CPU cores
    python benchmarks/moe.py --parts gemm       # one part: gemm, ep or balance

gemm: forward and backward of one layer's experts (titanlite's GroupedExperts: torch._grouped_mm over the tokens
sorted by expert) against a Python loop of per-expert matmuls over the same tokens, timed interleaved (A B A B);
the table gives the median time of each and the median of the back-to-back ratios.

ep: a Qwen3-MoE-shaped Trainer (through titanlite's config, mesh, parallel/ and Trainer.train_step) at FSDP(2) and
at FSDP(2) x EP(2) on the same global batch, interleaved; with the bytes the token exchange moves per step (top_k
copies of every token's hidden state to and from the experts' ranks, forward and backward, counted from the
routing, the share that stays on its own rank excluded) against the bytes FSDP's all-gathers of the experts move
without EP.

balance: the busiest expert's load over the mean (per layer, the worst layer, averaged over logged steps) over
--balance-steps steps of the qwen3_moe debug model on the embedded text, with the aux-free routing bias and the
auxiliary loss, each at two strengths, and without balancing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titanlite.models.moe import GroupedExperts

import common


def per_expert_loop(experts: GroupedExperts, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The experts one at a time: a matmul per expert over its tokens (what a per-expert nn.Linear MoE does)."""
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        x = tokens[start : start + n]
        outs.append((F.silu(x @ experts.w1[e]) * (x @ experts.w3[e])) @ experts.w2[e])
        start += n
    return torch.cat(outs)


def gemm(opts) -> list[str]:
    torch.manual_seed(0)
    experts = GroupedExperts(opts.experts, opts.hidden, opts.expert_hidden)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.02)
    routed = opts.tokens * opts.top_k
    counts = torch.bincount(torch.randint(0, opts.experts, (routed,)), minlength=opts.experts)
    tokens = torch.randn(routed, opts.hidden, requires_grad=True)
    grad = torch.randn(routed, opts.hidden)

    def step(fn):
        t0 = time.perf_counter()
        fn(experts, tokens, counts).backward(grad)
        return time.perf_counter() - t0

    grouped = lambda e, x, c: e(x, c)  # noqa: E731
    for fn in (grouped, per_expert_loop):  # warm up
        step(fn)
    times = {"grouped": [], "loop": []}
    for rep in range(opts.reps):
        for name in ("grouped", "loop") if rep % 2 == 0 else ("loop", "grouped"):
            times[name].append(step(grouped if name == "grouped" else per_expert_loop))
    ratio = common.median_ratio(times["loop"], times["grouped"])
    rows = [
        [name, f"{statistics.median(t) * 1e3:.1f}", f"{min(t) * 1e3:.1f}-{max(t) * 1e3:.1f}"]
        for name, t in times.items()
    ]
    return [
        f"\ngemm: {opts.experts} experts, {opts.tokens} tokens x top-{opts.top_k}, dim {opts.hidden}, expert hidden "
        f"{opts.expert_hidden}, fp32, forward + backward, {opts.reps} reps",
        common.format_table(["experts as", "ms", "(min-max)"], rows),
        f"per-expert loop / grouped GEMM: {ratio:.2f} median of the per-repetition ratios",
    ]


def _ep_world(opts) -> dict | None:
    from titanlite.config import load
    from titanlite.trainer import Trainer

    rank = int(os.environ["RANK"])
    with common.job_folder() as dump:
        trainers = {}
        for name, ep in (("FSDP(2)", "1"), ("FSDP(2) x EP(2)", "2")):
            argv = [
                "--model.name", "qwen3_moe", "--model.flavor", "debugmodel", "--training.seq_len", str(opts.seq_len),
                "--training.local_batch_size", str(opts.batch), "--training.global_batch_size", str(2 * opts.batch),
                "--training.mixed_precision_param", "float32", "--parallelism.expert_parallel_degree", ep,
                "--metrics.log_freq", "1000000", "--job.dump_folder", f"{dump}/{ep}", "--training.steps", "1000000",
            ]  # fmt: skip
            trainers[name] = Trainer(load(argv))
        t = next(iter(trainers.values()))
        device, args = t.device, t.model_args
        batch = common.random_microbatches([2 * opts.batch], opts.seq_len, args.vocab_size, seed=0)
        mine = [tuple(x[rank * opts.batch : (rank + 1) * opts.batch] for x in batch[0])]
        for tr in trainers.values():
            tr.train_step(mine)
        times = {name: [] for name in trainers}
        for rep in range(opts.reps):
            order = list(trainers) if rep % 2 == 0 else list(reversed(trainers))
            for name in order:
                times[name].append(common.time_steps(lambda tr=trainers[name]: tr.train_step(mine), 1, device))
        # the exchange's bytes: routed slots that leave their rank (half the experts live on the other rank)
        tokens = opts.batch * opts.seq_len * args.top_k * args.n_layers
        exchange = torch.tensor(tokens * 0.5 * args.dim * 4 * 2 * 2, dtype=torch.float64)  # out and back, fwd + bwd
        dist.all_reduce(exchange)
        # FSDP without EP gathers every block's experts in forward and again in backward (and reduce-scatters)
        experts = 3 * args.n_experts * args.dim * args.moe_hidden_dim * args.n_layers
        fsdp_bytes = experts * 4 * (2 + 1) // 2  # this rank's half received twice, the gradient's half sent once
        if rank:
            return None
        return dict(times=times, exchange=exchange.item() / 2, fsdp=fsdp_bytes, args=args)


def ep(opts) -> list[str]:
    res = common.spawn(_ep_world, 2, "cpu", opts)[0]
    args, times = res["args"], res["times"]
    base = times["FSDP(2)"]
    rows = [
        [name, f"{statistics.median(t) * 1e3:.0f}", f"{min(t) * 1e3:.0f}-{max(t) * 1e3:.0f}",
         f"x{common.median_ratio(t, base):.2f}"]
        for name, t in times.items()
    ]  # fmt: skip
    return [
        f"\nep: qwen3_moe debugmodel ({args.n_layers} blocks, {args.n_experts} experts, top-{args.top_k}, dim "
        f"{args.dim}, expert hidden {args.moe_hidden_dim}), world 2, global batch {2 * opts.batch} x "
        f"{opts.seq_len}, fp32, {opts.reps} reps",
        common.format_table(["mode", "step ms", "(min-max)", "vs FSDP(2)"], rows),
        f"per rank per step: the token exchange moves {res['exchange'] / 2**20:.1f} MiB (EP); FSDP's experts "
        f"all-gathers and reduce-scatter move {res['fsdp'] / 2**20:.1f} MiB without EP",
    ]


def _balance(opts, mode: str, extra: tuple[str, ...]) -> tuple[float, float]:
    from titanlite.config import load
    from titanlite.trainer import Trainer

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(common.free_port())
    with tempfile.TemporaryDirectory() as dump:  # one process
        argv = [
            "--model.name", "qwen3_moe", "--model.flavor", "debugmodel", "--training.seq_len", "256",
            "--training.local_batch_size", "8", "--training.steps", str(opts.balance_steps),
            "--training.mixed_precision_param", "float32", "--moe.load_balance", mode, "--metrics.log_freq",
            "1000000", "--job.dump_folder", dump, *extra,
        ]  # fmt: skip
        t = Trainer(load(argv))
        shares = []
        for _ in range(opts.balance_steps):
            data = t.dataloader.next_step()
            out = t.train_step(data.microbatches, data.global_valid_tokens)
            shares.append(t.balance.report(out.moe)["busiest_over_mean"])
        t.dataloader.close()
        dist.destroy_process_group()
    last = shares[-opts.balance_steps // 4 :]
    return statistics.mean(shares), statistics.mean(last)


BALANCE_RUNS = (  # (load_balance, its setting)
    ("aux_free", ("--moe.bias_update_rate", "0.001")),
    ("aux_free", ("--moe.bias_update_rate", "0.01")),
    ("aux_loss", ("--moe.aux_loss_coef", "0.001")),
    ("aux_loss", ("--moe.aux_loss_coef", "0.01")),
    ("none", ()),
)


def balance(opts) -> list[str]:
    rows = []
    for mode, extra in BALANCE_RUNS[: opts.balance_runs]:
        whole, last = _balance(opts, mode, extra)
        rows.append([mode, " ".join(extra).replace("--moe.", "") or "-", f"{whole:.2f}", f"{last:.2f}"])
    return [
        f"\nbalance: qwen3_moe debugmodel (6 blocks, 8 experts, top-2), lr 8e-4, {opts.balance_steps} steps of 8 x 256 "
        f"tokens; the busiest expert's load over the mean in the worst layer, averaged over the steps (1.00 = even, "
        f"4.00 = every token's first choice on one expert)",
        common.format_table(["load_balance", "setting", "all steps", f"last {opts.balance_steps // 4}"], rows),
    ]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=["gemm", "ep", "balance"], choices=["gemm", "ep", "balance"])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096, help="gemm: tokens routed")
    p.add_argument("--hidden", type=int, default=512, help="gemm: model dim")
    p.add_argument("--expert-hidden", type=int, default=512, help="gemm: an expert's hidden size")
    p.add_argument("--seq-len", type=int, default=256, help="ep: tokens per sequence")
    p.add_argument("--batch", type=int, default=4, help="ep: sequences per rank")
    p.add_argument("--reps", type=int, default=6, help="timed repetitions of each mode (interleaved)")
    p.add_argument("--balance-steps", type=int, default=200)
    p.add_argument("--balance-runs", type=int, default=len(BALANCE_RUNS), help="balance: the first N settings")
    opts = p.parse_args(argv)
    print(common.machine_line("cpu"))
    torch.set_num_threads(os.cpu_count() or 1)
    for part in opts.parts:
        print("\n".join({"gemm": gemm, "ep": ep, "balance": balance}[part](opts)), flush=True)


if __name__ == "__main__":
    main()
