"""Per-rank data cost per step: the streaming path against the token store, at dp 1, 8, 64 and 512; the store
read from object storage (moto's S3 server) against the same store on disk; the store build.

    python benchmarks/data_loader.py [--seq-len 8192] [--local-batch 1] [--dps 1 8 64 512] [--vocab 25000]
                                     [--rounds 7] [--steps 20] [--skip-build]

A BPE tokenizer.json (--vocab tokens) is trained on the built-in corpus. Each data-parallel degree is
simulated in one process (dp_rank and dp_degree set by hand, no process group) with the same local
batch, so the global batch grows with the degree as in a real job. The streaming path tokenizes the
whole global batch on every rank; the store path reads only this rank's sequences.

A store step costs tens of microseconds, which one timed step cannot measure on a shared machine: each store
figure is the time of --steps consecutive steps, taken once per round for every degree in turn (interleaved:
dp1, dp8, ..., dp1, dp8, ...), and reported as the median over --rounds rounds; the dp ratio is the median of the
rounds' ratios, with their spread. The remote store (a moto server on this machine: no network latency, the HTTP
and S3 request path only) and the local store alternate the same way. Then the store is built from 10 copies of
the corpus with `python -m titanlite.data prepare` at 1 and 2 workers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from titanlite.config import load  # noqa: E402
from titanlite.data.build import build_loader  # noqa: E402
from titanlite.data.builtin_corpus import builtin_corpus_path  # noqa: E402
from titanlite.data.packing import PackedDataLoader  # noqa: E402
from titanlite.data.tokenizers import build_tokenizer  # noqa: E402


def train_tokenizer(folder: Path, vocab: int) -> Path:
    """A byte-level BPE tokenizer.json with `vocab` tokens, trained on the built-in corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [json.loads(line)["text"] for line in builtin_corpus_path("train").read_text().splitlines()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def time_steps(loader, reps: int) -> float:
    loader.next_step()  # first step: opening, caches
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        loader.next_step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved(loaders: dict, rounds: int, steps: int) -> dict[object, list[float]]:
    """Seconds per step of each loader, one sample of `steps` consecutive steps per round, loaders in turn."""
    for loader in loaders.values():
        loader.next_step()  # opening, caches
    samples = {name: [] for name in loaders}
    for _ in range(rounds):
        for name, loader in loaders.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                loader.next_step()
            samples[name].append((time.perf_counter() - t0) / steps)
    return samples


def ratio(samples: dict, a, b) -> tuple[float, float, float]:
    """Median, min and max over rounds of samples[b] / samples[a]."""
    ratios = [tb / ta for ta, tb in zip(samples[a], samples[b])]
    return statistics.median(ratios), min(ratios), max(ratios)


def _argv(tok_dir: Path, opts, dp: int, stores: Path, dataset: str = "builtin") -> list[str]:
    return [
        "--model.tokenizer_path", str(tok_dir), "--training.seq_len", str(opts.seq_len),
        "--training.local_batch_size", str(opts.local_batch), "--training.global_batch_size",
        str(opts.local_batch * dp), "--data.store_folder", str(stores), "--data.prefetch", "0",
        "--training.dataset", dataset,
    ]  # fmt: skip


def remote_vs_local(tok_dir: Path, tokenizer, opts, tmp: Path) -> None:
    """A store of --remote-copies copies of the corpus read from moto's S3 server against the same store on disk,
    interleaved, at dp 1, with an 8 MiB cache of 64 KiB chunks: shuffled short documents, most reads a GET."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    from titanlite.runtime.distributed import free_port

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    corpus = tmp / "remote-corpus.jsonl"
    corpus.write_text(builtin_corpus_path("train").read_text() * opts.remote_copies)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")  # fmt: skip
    try:
        boto3.client("s3").create_bucket(Bucket="bench")
        stores = tmp / "remote-stores"
        cfg = load(_argv(tok_dir, opts, 1, stores, str(corpus)))
        local = build_loader(cfg, tokenizer, "training", dp_rank=0, dp_degree=1)
        store = next(stores.rglob("store.json")).parent
        url = "s3://bench/store"
        from titanlite.storage import location, upload

        upload(store, location(url), last=("store.json",))
        small = ["--data.remote_cache_mib", "8"]  # under half the store: shuffled reads mostly miss
        cfg = load([*_argv(tok_dir, opts, 1, stores, url), *small])
        loaders = {"local": local, "moto S3": build_loader(cfg, tokenizer, "training", dp_rank=0, dp_degree=1)}
        samples = interleaved(loaders, opts.rounds, opts.steps)
        size = sum(f.stat().st_size for f in store.iterdir())
        print(f"\nstore on disk vs in object storage (moto's S3 server on this machine), {size / 2**20:.1f} MiB store, "
              f"dp 1, an 8 MiB cache of 64 KiB chunks, {opts.rounds} rounds of {opts.steps} steps:")  # fmt: skip
        seqs = opts.local_batch
        for name, times in samples.items():
            t = statistics.median(times)
            print(f"{name:>8}: {t * 1e3:.3f} ms/step, {seqs / t:,.0f} sequences/s per rank, "
                  f"{seqs * opts.seq_len / t:,.0f} tokens/s per rank")  # fmt: skip
        med, lo, hi = ratio(samples, "local", "moto S3")
        fetched = loaders["moto S3"].layouts[0].store.cache
        mib = fetched.fetched_bytes / 2**20
        print(f"moto/local time per step: x{med:.2f} (rounds {lo:.2f}-{hi:.2f}); fetched {mib:.1f} MiB in "
              f"{fetched.requests} ranged reads")  # fmt: skip
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--local-batch", type=int, default=1)
    p.add_argument("--dps", type=int, nargs="+", default=[1, 8, 64, 512])
    p.add_argument("--vocab", type=int, default=25000)
    p.add_argument("--reps", type=int, default=3, help="steps timed one by one for the streaming path (slow)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the store timings")
    p.add_argument("--steps", type=int, default=20, help="consecutive steps per store timing sample")
    p.add_argument("--skip-build", action="store_true", help="skip the store build benchmark")
    p.add_argument("--remote-copies", type=int, default=20, help="copies of the corpus in the object-storage store")
    p.add_argument("--stream-max-dp", type=int, default=512, help="skip the streaming path above this dp degree")
    p.add_argument("--build-copies", type=int, default=10, help="copies of the corpus for the build benchmark")
    opts = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok_dir = train_tokenizer(tmp, opts.vocab)
        tokenizer = build_tokenizer(str(tok_dir))
        print(
            f"tokenizer: byte-level BPE, {tokenizer.vocab_size:,} tokens; seq {opts.seq_len}, local batch "
            f"{opts.local_batch}; per-rank time per step, median of {opts.reps}"
        )
        print(f"{'dp':>5} {'global batch':>12} {'stream s/step':>14} {'store s/step':>13} {'store tokens/s/rank':>20}")
        loaders = {}
        for dp in opts.dps:  # the last rank: its sequences are the furthest into each step
            cfg = load(_argv(tok_dir, opts, dp, tmp / "stores"))
            loaders[dp] = build_loader(cfg, tokenizer, "training", dp_rank=dp - 1, dp_degree=dp)
        samples = interleaved(loaders, opts.rounds, opts.steps)
        store_times = {dp: statistics.median(t) for dp, t in samples.items()}
        for dp in opts.dps:
            g, rank = opts.local_batch * dp, dp - 1
            stream_s = "skipped"
            if dp <= opts.stream_max_dp:
                stream = PackedDataLoader(tokenizer, "builtin", opts.seq_len, g, opts.local_batch, rank, dp)
                stream_s = f"{time_steps(stream, opts.reps):.4f}"
            local_tokens = opts.local_batch * opts.seq_len
            print(
                f"{dp:>5} {g:>12} {stream_s:>14} {store_times[dp]:>13.5f} {local_tokens / store_times[dp]:>20,.0f}",
                flush=True,
            )
        lo, hi = min(opts.dps), max(opts.dps)
        med, low, high = ratio(samples, lo, hi)
        print(f"per-rank cost ratio dp{hi}/dp{lo}: {med:.2f} (median of {opts.rounds} interleaved rounds of "
              f"{opts.steps} steps; rounds {low:.2f}-{high:.2f})")  # fmt: skip
        print(
            f"store read rate per rank: {min(opts.local_batch * opts.seq_len / t for t in store_times.values()):,.0f} "
            f"tokens/s at worst (an 8B H100 rank consumes ~5,800)"
        )

        remote_vs_local(tok_dir, tokenizer, opts, tmp)
        if opts.skip_build:
            return
        corpus = tmp / "corpus.jsonl"
        text = builtin_corpus_path("train").read_text()
        corpus.write_text(text * opts.build_copies)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_CACHE": str(tmp / "hf")}
        print(f"\nstore build: {opts.build_copies} copies of the corpus with the BPE tokenizer")
        for workers in (1, 2):
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "titanlite.data",
                    "prepare",
                    "--dataset",
                    str(corpus),
                    "--tokenizer",
                    str(tok_dir),
                    "--output",
                    str(tmp / f"built{workers}"),
                    "--workers",
                    str(workers),
                ],
                env=env,
                capture_output=True,
                text=True,
            )
            m = re.search(r"([\d,]+) tokens in ([\d.]+) s \(([\d,]+) tokens/s, ([\d,]+) per worker", r.stdout)
            if r.returncode or not m:
                raise SystemExit(r.stdout + r.stderr)
            print(
                f"workers {workers}: {m.group(1)} tokens in {m.group(2)} s, {m.group(3)} tokens/s, "
                f"{m.group(4)} per worker",
                flush=True,
            )


if __name__ == "__main__":
    main()
