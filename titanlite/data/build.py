"""From a config to data loaders: which datasets (and weights), their token stores (opened, or built by the
job's ranks), the layouts, and the per-rank loader with background prefetching.

`check_data` runs before any process group (titanlite.plan); `build_loader` runs on every rank once
the process group exists, because a missing store is built by all ranks together.
"""

from __future__ import annotations

import logging
import math
import os
import pathlib
import shutil
import time
from datetime import timedelta

import torch.distributed as dist

from titanlite.config import JobConfig
from titanlite.data.builtin_corpus import cache_setting, check_writable
from titanlite.data.datasets_io import BUILTIN, DatasetSpec, has_split, is_local, open_table
from titanlite.data.formats import check_first_record, make_encoder, make_layout
from titanlite.data.loader import Prefetcher, StoreDataLoader
from titanlite.data.packing import PackedDataLoader
from titanlite.data.remote_store import RemoteTokenStore
from titanlite.data.sequences import BLEND_PERIOD, blend_quota
from titanlite.data.store import MANIFEST, TokenStore, token_dtype
from titanlite.data.store_build import (
    Progress,
    build_part,
    build_tag,
    cache_root,
    describe_skips,
    finalize,
    merge_skips,
    new_build_dir,
    share,
    store_key,
    store_path,
)
from titanlite.errors import ConfigError
from titanlite.storage import describe_failure, is_file, is_url, location

logger = logging.getLogger("titanlite")

BUILD_TIMEOUT = timedelta(hours=72)  # a collective build may take long; the default collective timeout would not do


VALID_WEIGHT = "valid: a finite number > 0 after the last ':' (e.g. 'a.jsonl:0.7,b.jsonl:0.3')"


def parse_mixture(value: str, key: str) -> list[tuple[str, float]]:
    """'a:0.7,b:0.3' (or one name) -> [(name, weight)]; ConfigError naming the key for a bad entry."""
    out = []
    for item in (v.strip() for v in value.split(",")):
        if not item:
            continue
        name, sep, weight = item.rpartition(":")
        if sep and "://" in item:  # s3://bucket/run:2/store: a colon of the URL unless a number follows it
            try:
                float(weight)
            except ValueError:
                name, sep, weight = item, "", ""
        try:
            w = float(weight) if sep else 1.0
        except ValueError:
            if not pathlib.Path(item).expanduser().exists():
                raise ConfigError(
                    f"{key} = {value!r}: the weight of {name!r} is {weight!r}, not a number; {VALID_WEIGHT} "
                    f"(a name that holds ':' must be an existing file or folder)"
                ) from None
            name, w = item, 1.0  # a colon that is part of an existing file's name
        if not sep:
            name = item
        if not math.isfinite(w) or w <= 0:
            raise ConfigError(f"{key} = {value!r}: the weight of {name!r} is {weight}; {VALID_WEIGHT}")
        out.append((name, w))
    if not out:
        raise ConfigError(f"{key} = {value!r} names no dataset")
    return out


def _identity(spec: DatasetSpec) -> tuple:
    """What makes two entries of a mixture the same dataset: the resolved path of a local one (or the name of an
    embedded or Hub one), its split, text field, Hub config and text unit."""
    path = pathlib.Path(spec.name).expanduser()
    where = os.path.realpath(path) if spec.name not in BUILTIN and path.exists() else spec.name
    return (where, spec.split, spec.text_field, spec.config_name, spec.text_unit)


def check_distinct(specs: list[tuple[DatasetSpec, float]], value: str, key: str) -> None:
    """ConfigError naming the dataset when a mixture names one dataset twice."""
    seen: dict[tuple, str] = {}
    for spec, _ in specs:
        identity = _identity(spec)
        if identity in seen:
            same = f" ({seen[identity]!r} and {spec.name!r} are the same file)" if seen[identity] != spec.name else ""
            raise ConfigError(
                f"{key} = {value!r} names the dataset {spec.name!r} twice{same}; valid: each dataset once in a "
                f"mixture, with its weight (weights need not add up to 1)"
            )
        seen[identity] = spec.name


def check_shares(specs: list[tuple[DatasetSpec, float]], value: str, key: str) -> None:
    """ConfigError naming the dataset whose weight is too small for it ever to be trained on."""
    if len(specs) < 2:
        return
    for (spec, w), slots in zip(specs, blend_quota([w for _, w in specs])):
        if slots == 0:
            raise ConfigError(
                f"{key} = {value!r}: the weight of {spec.name!r} is {w:g}, too small for any of every "
                f"{BLEND_PERIOD:,} sequences to come from it; {VALID_WEIGHT}, more than 1/{2 * BLEND_PERIOD:,} of "
                f"the sum of the weights"
            )


def training_specs(cfg: JobConfig) -> list[tuple[DatasetSpec, float]]:
    """The training datasets and their weights."""
    t = cfg.training
    specs = [
        (DatasetSpec(name, t.dataset_split, _text_field(cfg), t.dataset_config, cfg.data.text_unit), w)
        for name, w in parse_mixture(t.dataset, "training.dataset")
    ]
    check_distinct(specs, t.dataset, "training.dataset")
    check_shares(specs, t.dataset, "training.dataset")
    return specs


def _text_field(cfg: JobConfig) -> str | None:
    """The text field of plain-text records; chat records have none (their fields are data.*_field)."""
    return cfg.training.dataset_text_field if cfg.data.format == "text" else None


def validation_specs(cfg: JobConfig) -> list[tuple[DatasetSpec, float]]:
    """The held-out datasets: validation.dataset, or the held-out split of each training dataset."""
    v, t = cfg.validation, cfg.training
    if v.dataset:
        specs = [
            (
                DatasetSpec(
                    name,
                    v.dataset_split,
                    _text_field(cfg),
                    t.dataset_config,
                    cfg.data.text_unit,
                    key="validation.dataset",
                ),
                w,
            )
            for name, w in parse_mixture(v.dataset, "validation.dataset")
        ]
        check_distinct(specs, v.dataset, "validation.dataset")
        check_shares(specs, v.dataset, "validation.dataset")
        return specs
    out = []
    for spec, w in training_specs(cfg):
        held_out = DatasetSpec(
            spec.name, v.dataset_split, spec.text_field, spec.config_name, spec.text_unit, key="validation.dataset"
        )
        if spec.name not in BUILTIN and v.dataset_split == spec.split:
            raise ConfigError(
                f"validation.dataset_split = {v.dataset_split!r} is the training split of "
                f"training.dataset = {spec.name!r}; valid: a held-out split name (e.g. 'validation')"
            )
        if is_local(spec) and not has_split(held_out, v.dataset_split):
            raise ConfigError(
                f"validation.dataset = '' would validate on training.dataset = {spec.name!r}, which has no "
                f"{v.dataset_split!r} split (no file named like validation-*, valid.*, dev/...); valid: set "
                f"validation.dataset to a held-out file or folder"
            )
        out.append((held_out, w))
    return out


def prepared_store(spec: DatasetSpec):
    """The folder (a URL's UPath in object storage) when the dataset names a token store made by
    `python -m titanlite.data prepare`; ConfigError naming the dataset key when a URL cannot be reached."""
    if is_url(spec.name):
        path = location(spec.name, spec.key)
        try:
            return path if is_file(path / MANIFEST) else None
        except Exception as e:  # botocore and fsspec raise their own types for an unreachable store
            raise ConfigError(describe_failure(path, spec.key, e)) from None
    path = pathlib.Path(spec.name).expanduser()
    return path if (path / MANIFEST).is_file() else None


def stores_folder(cfg: JobConfig) -> pathlib.Path:
    """Where token stores are kept (data.store_folder, else the cache)."""
    return pathlib.Path(cfg.data.store_folder).expanduser() if cfg.data.store_folder else cache_root() / "token_stores"


def stores_setting(cfg: JobConfig) -> str:
    """What chose the stores folder, for messages: data.store_folder, or the cache (TITANLITE_CACHE)."""
    if cfg.data.store_folder:
        return f"data.store_folder = {cfg.data.store_folder!r}"
    return cache_setting("where token stores go unless data.store_folder names another folder")


def _check_prepared(path, spec: DatasetSpec, encoder, remote: tuple[int, int]) -> TokenStore:
    hint = f"rebuild it with `python -m titanlite.data prepare ... --output {path}`"
    store = RemoteTokenStore(spec.name, *remote, hint) if is_url(spec.name) else TokenStore(path, hint)
    src = store.info.source
    if src.get("tokenizer") != encoder.tokenizer.identity or src.get("encoding") != encoder.identity:
        raise ConfigError(
            f"{spec.key} = {spec.name!r} is a token store built with another tokenizer or format "
            f"(tokenizer {src.get('tokenizer_path') or 'built-in bytes'!r}, format {src.get('encoding')!r}) than "
            f"this job's (model.tokenizer_path = {getattr(encoder.tokenizer, 'path', '') or ''!r}); rebuild it "
            f"with this job's tokenizer or point at the raw dataset"
        )
    return store


def check_data(cfg: JobConfig, tokenizer) -> None:
    """Every data check that needs no process group: names, splits, fields, existing stores (ConfigError)."""
    if is_url(cfg.data.store_folder):
        raise ConfigError(
            f"data.store_folder = {cfg.data.store_folder!r}: a job builds its token stores on a filesystem; build one "
            "into object storage with `python -m titanlite.data prepare --dataset <dataset> --output "
            f"{cfg.data.store_folder.rstrip('/')}/<name>` and set training.dataset to that URL (each rank then reads "
            "its own ranges there), or give a local or shared folder"
        )
    for which, specs in (
        ("training", training_specs(cfg)),
        ("validation", validation_specs(cfg) if cfg.validation.enable else []),
    ):
        if cfg.data.store == "none" and (len(specs) > 1 or cfg.data.format != "text"):
            data = "chat data" if cfg.data.format == "chat" else "preference pairs"
            what = (
                f"a mixture of {len(specs)} datasets"
                if len(specs) > 1
                else f"{data} (data.format = {cfg.data.format!r})"
            )
            raise ConfigError(f"{which}.dataset: {what} needs token stores; valid: data.store = 'auto'")
        for spec, _ in specs:
            encoder = make_encoder(cfg, tokenizer, spec)
            if (path := prepared_store(spec)) is not None:
                _check_prepared(path, spec, encoder, remote_sizes(cfg))
                continue
            if is_url(spec.name):  # documents in object storage: copied and read at launch (remote_inputs.py)
                continue
            if cfg.data.store == "auto":
                final = store_path(stores_folder(cfg), spec, store_key(spec, tokenizer.identity, encoder.identity))
                if (final / MANIFEST).is_file():
                    TokenStore(final)  # refuses a corrupt one with a message saying how to rebuild it
                    continue
                if final.parent.exists():  # one that does not exist yet may be another machine's (a dry run)
                    check_writable(final.parent, stores_setting(cfg))
            check_first_record(cfg, spec, encoder)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def remote_sizes(cfg: JobConfig) -> tuple[int, int]:
    """A token store in object storage's (cache bytes per rank, bytes per ranged read)."""
    return cfg.data.remote_cache_mib << 20, cfg.data.remote_chunk_kib << 10


def open_or_build_store(
    spec: DatasetSpec, encoder, folder: pathlib.Path, setting: str = "", remote: tuple[int, int] = (256 << 20, 64 << 10)
) -> TokenStore:
    """The store of `spec` in `folder`: opened when it exists, else built by every rank (each its share).

    setting: what chose the folder (for the message when it cannot be written); remote: a store in object
    storage's (cache bytes per rank, bytes per read): remote_sizes."""
    if (path := prepared_store(spec)) is not None:
        return _check_prepared(path, spec, encoder, remote)
    tok = encoder.tokenizer
    rank, world = _rank_world()
    box = [store_key(spec, tok.identity, encoder.identity), build_tag()]
    if world > 1:
        dist.broadcast_object_list(box, src=0)  # rank 0's view decides: one key, one build folder
    key, tag = box
    final = store_path(folder, spec, key)
    exists = [(final / MANIFEST).is_file()]
    if world > 1:
        dist.broadcast_object_list(exists, src=0)
    if exists[0]:
        store = TokenStore(final)
        if store.info.source.get("skipped") and rank == 0:
            logger.warning(
                f"Token store {final} was built without some records of {spec.name!r}: "
                f"{describe_skips(store.info.source['skipped'])}"
            )
        logger.info(
            f"Token store {final}: {store.num_documents:,} documents, {store.num_tokens:,} tokens "
            f"({spec.key} = {spec.name!r})"
        )
        return store
    group = dist.new_group(backend="gloo", timeout=BUILD_TIMEOUT) if world > 1 else None
    try:
        return _build(spec, encoder, final, key, tag, rank, world, group, setting)
    finally:
        if group is not None:
            dist.destroy_process_group(group)


def _build(spec, encoder, final, key, tag, rank, world, group, setting) -> TokenStore:
    build_dir = final.parent / f".build-{final.name}-{tag}"
    if rank == 0:
        new_build_dir(final, tag, setting)
        logger.info(f"No token store for {spec.key} = {spec.name!r} yet: building {final} with {world} rank(s)")
    try:
        _tokenize(spec, encoder, final, key, build_dir, rank, world, group)
    except BaseException:
        if rank == 0:  # a build that failed leaves nothing behind (a killed one: see store_build.remove_orphans)
            shutil.rmtree(build_dir, ignore_errors=True)
        raise
    if group is not None:
        dist.barrier(group=group)
    found = [(final / MANIFEST).is_file()]
    if group is not None:
        everyone = [None] * world
        dist.all_gather_object(everyone, found[0], group=group)
        found = [all(everyone)]
    if not found[0]:
        raise ConfigError(
            f"data.store_folder: the token store {final} built by rank 0 is not visible to every "
            f"rank: put data.store_folder on a filesystem every node shares, or build the store on "
            f"each node first with `python -m titanlite.data prepare`"
        )
    return TokenStore(final)


def _tokenize(spec, encoder, final, key, build_dir, rank, world, group) -> None:
    """Every rank tokenizes its share into build_dir; rank 0 then finalizes the store."""
    if group is not None:
        dist.barrier(group=group)
    t0 = time.perf_counter()
    table = open_table(spec)
    start, stop = share(len(table), rank, world)
    progress = Progress(stop - start, f"tokenizing (rank 0's share of {world})", enabled=rank == 0)
    stats = build_part(table, encoder, token_dtype(encoder.tokenizer.vocab_size), build_dir, rank, world, progress)
    progress.close()
    all_stats = [None] * world
    if group is not None:
        dist.all_gather_object(all_stats, stats, group=group)
    else:
        all_stats = [stats]
    if rank == 0:
        seconds = time.perf_counter() - t0
        finalize(build_dir, final, key, spec, encoder, all_stats, seconds)
        tokens = sum(s["tokens"] for s in all_stats)
        skipped = sum(s["skipped"] for s in all_stats)
        if skipped:
            logger.warning(
                f"Skipped {skipped:,} records of {spec.key} = {spec.name!r}: {describe_skips(merge_skips(all_stats))}"
            )
        logger.info(
            f"Built token store {final}: {sum(s['documents'] for s in all_stats):,} documents, "
            f"{tokens:,} tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9) / world:,.0f} tokens/s "
            f"per rank, {world} rank(s)){f'; skipped {skipped:,} records' if skipped else ''}"
        )


def build_loader(
    cfg: JobConfig,
    tokenizer,
    which: str,
    *,
    dp_rank: int,
    dp_degree: int,
    global_batch_size: int | None = None,
    pin_memory: bool = False,
):
    """The training ('training') or held-out ('validation') data loader of this rank.

    global_batch_size: the plan's (titanlite.plan resolves training.global_batch_size = -1); None takes
    training.global_batch_size as configured.
    """
    t = cfg.training
    global_batch_size = t.global_batch_size if global_batch_size is None else global_batch_size
    if global_batch_size < 1:
        raise ValueError(
            f"build_loader needs the resolved global batch size (plan.global_batch_size), not {global_batch_size}"
        )
    specs = training_specs(cfg) if which == "training" else validation_specs(cfg)
    shape = dict(
        seq_len=t.seq_len,
        global_batch_size=global_batch_size,
        local_batch_size=t.local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
    )
    if cfg.data.store == "none":
        loader = PackedDataLoader(tokenizer, specs[0][0], **shape)
    else:
        seed = t.seed if cfg.data.shuffle and which == "training" else None
        layouts = []
        for spec, _ in specs:
            encoder = make_encoder(cfg, tokenizer, spec)
            store = open_or_build_store(spec, encoder, stores_folder(cfg), stores_setting(cfg), remote_sizes(cfg))
            layout = make_layout(cfg, tokenizer, spec, store, seed)
            layouts.append(layout)
        loader = StoreDataLoader(
            layouts, [w for _, w in specs], names=[spec.name for spec, _ in specs], pin_memory=pin_memory, **shape
        )
    if which == "training" and cfg.data.prefetch > 0:
        return Prefetcher(loader, cfg.data.prefetch)
    return loader
