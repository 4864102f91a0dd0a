"""Per-rank data cost per step: the streaming path against the token store, at dp 1, 8, 64 and 512.

    python benchmarks/data_loader.py [--seq-len 8192] [--local-batch 1] [--dps 1 8 64 512] [--vocab 25000]

A BPE tokenizer.json (--vocab tokens) is trained on the built-in corpus. Each data-parallel degree is
simulated in one process (dp_rank and dp_degree set by hand, no process group) with the same local
batch, so the global batch grows with the degree as in a real job. The streaming path tokenizes the
whole global batch on every rank; the store path reads only this rank's sequences. Then the store is
built from 10 copies of the corpus with `python -m titanlite.data prepare` at 1 and 2 workers.
Times are medians over --reps steps (the first step of each loader excluded).
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--local-batch", type=int, default=1)
    p.add_argument("--dps", type=int, nargs="+", default=[1, 8, 64, 512])
    p.add_argument("--vocab", type=int, default=25000)
    p.add_argument("--reps", type=int, default=3)
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
        store_times = {}
        for dp in opts.dps:
            g = opts.local_batch * dp
            argv = [
                "--model.tokenizer_path",
                str(tok_dir),
                "--training.seq_len",
                str(opts.seq_len),
                "--training.local_batch_size",
                str(opts.local_batch),
                "--training.global_batch_size",
                str(g),
                "--data.store_folder",
                str(tmp / "stores"),
                "--data.prefetch",
                "0",
            ]
            cfg = load(argv)
            rank = dp - 1  # the last rank: its sequences are the furthest into each step
            store = build_loader(cfg, tokenizer, "training", dp_rank=rank, dp_degree=dp)
            store_times[dp] = time_steps(store, opts.reps)
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
        print(f"per-rank cost ratio dp{hi}/dp{lo}: {store_times[hi] / store_times[lo]:.2f}")
        print(
            f"store read rate per rank: {min(opts.local_batch * opts.seq_len / t for t in store_times.values()):,.0f} "
            f"tokens/s at worst (an 8B H100 rank consumes ~5,800)"
        )

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
