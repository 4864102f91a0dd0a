"""`python -m titanlite.data prepare`: tokenize a dataset once into a token store, with several worker processes.

    python -m titanlite.data prepare --dataset DATASET [--tokenizer PATH] [--output DIR] [--workers N]
        [--split train] [--text-field text] [--dataset-config NAME] [--text-unit line|paragraph|file]

Without --output the store goes where a training job with the same dataset and tokenizer looks for it
(data.store_folder, default $TITANLITE_CACHE/token_stores), so the job finds it; with --output, point
training.dataset at DIR. Exit status 0 built (or already there), 2 bad input.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time

from titanlite.data.builtin_corpus import cache_setting, check_writable
from titanlite.data.datasets_io import TEXT_UNITS, DatasetSpec, open_table
from titanlite.data.encoders import TextEncoder
from titanlite.data.remote_store import RemoteTokenStore
from titanlite.data.store import MANIFEST, TokenStore, token_dtype
from titanlite.data.store_build import (
    Progress,
    build_part,
    build_tag,
    cache_root,
    describe_skips,
    finalize,
    new_build_dir,
    store_key,
    store_path,
)
from titanlite.data.tokenizers import build_tokenizer
from titanlite.errors import ConfigError
from titanlite.observe.metrics import setup_logging
from titanlite.storage import describe_failure, files_under, is_file, is_url, location, storage_problem, upload

STORE_FILE = re.compile(r"(tokens|mask)-\d{5}\.bin|offsets\.npy|counted\.npy")  # store.json: last, the commit
logger = logging.getLogger("titanlite")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m titanlite.data", description="Prepare token stores.")
    sub = p.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("prepare", help="tokenize a dataset once into a memory-mapped token store")
    pr.add_argument("--dataset", required=True, help="as training.dataset: builtin, a file or folder, a Hub name")
    pr.add_argument("--tokenizer", default="", help="as model.tokenizer_path ('' = the built-in byte tokenizer)")
    pr.add_argument("--output", default="", help="store folder (default: where a job finds it by its cache key)")
    pr.add_argument("--store-folder", default="", help="as data.store_folder, when --output is not given")
    pr.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1)), help="tokenizing processes")
    pr.add_argument("--split", default="train", help="as training.dataset_split")
    pr.add_argument("--text-field", default="text", help="as training.dataset_text_field")
    pr.add_argument("--dataset-config", default="", help="as training.dataset_config")
    pr.add_argument("--text-unit", default="line", choices=list(TEXT_UNITS), help="as data.text_unit")
    return p.parse_args(argv)


def _worker(args: argparse.Namespace, build_dir: str, worker: int, workers: int, progress_queue) -> dict:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker: the workers are the parallelism
    spec, tokenizer = _spec(args), build_tokenizer(args.tokenizer)
    report = lambda docs, tokens: progress_queue.put((docs, tokens))
    return build_part(
        open_table(spec),
        TextEncoder(tokenizer, spec),
        token_dtype(tokenizer.vocab_size),
        pathlib.Path(build_dir),
        worker,
        workers,
        on_batch=report,
    )


def _spec(args: argparse.Namespace) -> DatasetSpec:
    return DatasetSpec(args.dataset, args.split, args.text_field, args.dataset_config, args.text_unit, key="--dataset")


def prepare_remote(args: argparse.Namespace) -> TokenStore:
    """Build the store of --output s3://... (any fsspec URL) on this machine, then upload it with its manifest last
    (a store without store.json is unfinished); an existing one of the same dataset and tokenizer is kept."""
    url = args.output
    remote = location(url, "--output")
    if problem := storage_problem(remote, "--output"):
        raise ConfigError(problem)
    spec, tokenizer = _spec(args), build_tokenizer(args.tokenizer)
    key = store_key(spec, tokenizer.identity, TextEncoder(tokenizer, spec).identity)
    if is_file(remote / MANIFEST):
        store = RemoteTokenStore(url, 1 << 20, 64 << 10)
        if store.info.key != key:
            raise ConfigError(f"--output {url} holds a token store of another dataset or tokenizer; choose another")
        print(f"token store {url} already exists: {store.num_documents:,} documents, {store.num_tokens:,} tokens")
        return store
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="titanlite-store-", dir=cache_root()) as tmp:
        local = pathlib.Path(tmp) / "store"
        prepare(argparse.Namespace(**{**vars(args), "output": str(local)}))
        t0 = time.perf_counter()
        try:
            _clear_partial_upload(remote, url)
            upload(local, remote, last=(MANIFEST,))
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(describe_failure(remote, "--output", e)) from None
        size = sum(f.stat().st_size for f in local.iterdir())
        print(f"uploaded token store to {url}: {size / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f} s")
    return RemoteTokenStore(url, 1 << 20, 64 << 10)


def _clear_partial_upload(remote, url: str) -> None:
    """Remove what an earlier, interrupted upload left (a store's own files, no manifest); ConfigError when the
    prefix holds anything else: it is not a store's folder, and nothing there is touched."""
    found = files_under(remote)
    if other := [name for name in found if not STORE_FILE.fullmatch(name)]:
        raise ConfigError(
            f"--output {url} holds {len(other)} object(s) that are no token store's ({other[0]}, ...); give a prefix "
            "of its own (e.g. s3://bucket/stores/<name>)"
        )
    for name in found:
        (remote / name).unlink()


def prepare(args: argparse.Namespace) -> TokenStore:
    """Build (or find) the store; returns it opened."""
    if is_url(args.output):
        return prepare_remote(args)
    if args.workers < 1:
        raise ConfigError(f"--workers {args.workers} is not valid; expected a number >= 1")
    spec, tokenizer = _spec(args), build_tokenizer(args.tokenizer)
    encoder = TextEncoder(tokenizer, spec)
    key = store_key(spec, tokenizer.identity, encoder.identity)
    folder = pathlib.Path(args.store_folder).expanduser() if args.store_folder else cache_root() / "token_stores"
    final = pathlib.Path(args.output).expanduser() if args.output else store_path(folder, spec, key)
    if (final / MANIFEST).is_file():
        store = TokenStore(final)
        if store.info.key != key:
            raise ConfigError(
                f"--output {final} holds a token store of another dataset or tokenizer; choose "
                f"another folder or delete it"
            )
        print(f"token store {final} already exists: {store.num_documents:,} documents, {store.num_tokens:,} tokens")
        return store
    if final.exists() and any(final.iterdir()):
        raise ConfigError(f"--output {final} exists and is not a token store; choose an empty or new folder")
    if args.output:
        setting = f"--output {args.output}"
    elif args.store_folder:
        setting = f"--store-folder {args.store_folder}"
    else:
        setting = cache_setting("where token stores go unless --store-folder or --output names another folder")
    check_writable(final.parent, setting)
    table = open_table(spec)  # once here, so the workers find the Arrow cache built
    build_dir = new_build_dir(final, build_tag(), setting)
    try:
        return _build(args, spec, tokenizer, encoder, table, build_dir, final, key)
    except BaseException:
        shutil.rmtree(build_dir, ignore_errors=True)  # a failed build leaves nothing behind
        raise


def _build(args, spec, tokenizer, encoder, table, build_dir, final, key) -> TokenStore:
    t0 = time.perf_counter()
    workers = min(args.workers, len(table))
    progress = Progress(len(table), f"tokenizing with {workers} worker(s)", enabled=True)
    if workers == 1:  # in this process: no pool to start
        stats = [build_part(table, encoder, token_dtype(tokenizer.vocab_size), build_dir, 0, 1, progress)]
    else:
        ctx = mp.get_context("spawn")
        with ctx.Manager() as manager, ctx.Pool(workers) as pool:
            q = manager.Queue()
            results = [pool.apply_async(_worker, (args, str(build_dir), w, workers, q)) for w in range(workers)]
            while not all(r.ready() for r in results) or not q.empty():
                try:
                    progress.update(*q.get(timeout=0.2))
                except Exception:  # queue.Empty from the manager's proxy
                    pass
            stats = [r.get() for r in results]
    progress.close()
    seconds = time.perf_counter() - t0
    store = finalize(build_dir, final, key, spec, encoder, stats, seconds)
    tokens = sum(s["tokens"] for s in stats)
    if store.info.source["skipped"]:
        skipped = sum(s["skipped"] for s in stats)
        why = describe_skips(store.info.source["skipped"])
        logger.warning(f"Skipped {skipped:,} records of --dataset {spec.name!r}: {why}")
    print(
        f"wrote token store {final}: {store.num_documents:,} documents, {tokens:,} tokens in {seconds:.1f} s "
        f"({tokens / seconds:,.0f} tokens/s, {tokens / seconds / workers:,.0f} per worker, {workers} worker(s))"
    )
    return store


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    setup_logging()
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    try:
        prepare(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
