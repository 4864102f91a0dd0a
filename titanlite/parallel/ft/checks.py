"""What fault-tolerant replica groups must agree on, and what their lighthouse says (docs/fault_tolerance.md).

- The lighthouse's address (`http://` added when it is left out, as torchft needs it), the check before launch that
  a torchft lighthouse answers there, and the groups of its last quorum (which told a restarted group that its
  peers left at the job's last step).
- The step vector: one fixed-size float64 vector summed over the live groups at every step, whatever the settings
  (a size that depended on a setting, e.g. group_count, would crash gloo instead of naming it). It carries the
  counted tokens, a count of the live groups, their replica ids, each group's fingerprint of its weights (in its
  replica id's slot; 0 when it did not compare at this step), whether each group took part in a committed step
  before (so that a joiner that differs is told, not the live groups) and each shared setting's hash in one of
  KEY_SLOTS slots, so that a difference names its key.

No torchft import here: the module is read by the pre-launch check too.
"""

from __future__ import annotations

import hashlib
import http.client
import importlib.metadata
import importlib.util
import json
import os
import re
import socket
import urllib.request
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from titanlite.config.compare import canonical, flat_settings
from titanlite.models.nf4 import local_nf4

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
LIGHTHOUSE_COMMAND = (
    "torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 --quorum_tick_ms 100 --bind [::]:29510"
)
# The settings every group must share: they decide the model, the data each rank reads and the update.
SHARED_SECTIONS = ("model", "training", "data", "optimizer", "lr_scheduler", "parallelism", "moe", "lora", "float8")
# [checkpoint] keys that change where a group starts from, compared without paths: the same base may sit at another
# (node-local, relative) path; the weights fingerprint compares what was loaded.
START_KEYS = ("exclude_from_loading",)
INITIAL_LOAD = "checkpoint.initial_load_path is set"
WORLD = "the world size (processes per group)"

ID_SLOTS = 256  # replica ids are counted in slot id % ID_SLOTS (exact up to 256 groups)
KEY_SLOTS = 256  # each shared setting's 32-bit hash is added into slot hash(key) % KEY_SLOTS
TOKENS, LIVE = 0, 1
IDS = 2  # ID_SLOTS counts of groups by replica id
PRINTS = IDS + ID_SLOTS  # each group's weights fingerprint + 1 (0: not compared at this step), by replica id
SENIOR = PRINTS + ID_SLOTS  # 1 for each group that took part in a committed step before this one, by replica id
KEYS = SENIOR + ID_SLOTS  # KEY_SLOTS sums of the shared settings' hashes
VECTOR = KEYS + KEY_SLOTS  # the same for every group and every configuration
MOD = 2**32  # hashes are 32-bit: a sum over up to 2**21 groups stays exact in float64


def _h32(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)


# ---------------------------------------------------------------- the lighthouse


def lighthouse_address(ft_cfg) -> str:
    """The lighthouse's address, fault_tolerance.lighthouse else $TORCHFT_LIGHTHOUSE ('' when neither), with
    `http://` added when it has no scheme (torchft needs one; `host:port` is what users often write)."""
    address = (ft_cfg.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")).strip()
    return address if not address or "://" in address else f"http://{address}"


# What reading a /status page raises when nothing, or something that does not speak HTTP (an SSH port), answers.
LIGHTHOUSE_ERRORS = (OSError, ValueError, http.client.HTTPException)


def lighthouse_status(address: str, timeout: float = 3.0) -> str:
    """The text of the lighthouse's /status page (raises one of LIGHTHOUSE_ERRORS when no web server answers)."""
    with urllib.request.urlopen(f"{address.rstrip('/')}/status", timeout=timeout) as r:
        return r.read(1 << 20).decode(errors="replace")


def is_lighthouse(text: str) -> bool:
    """Whether a /status page is a torchft lighthouse's."""
    return "quorum_id" in text and "Previous Quorum" in text


def lighthouse_problem(ft_cfg) -> str | None:
    """Why no torchft lighthouse can be used at the configured address, or None."""
    address = lighthouse_address(ft_cfg)
    key = "fault_tolerance.lighthouse" if ft_cfg.lighthouse else LIGHTHOUSE_ENV
    given = ft_cfg.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        return (
            f"fault_tolerance.lighthouse = '' and {LIGHTHOUSE_ENV} is not set: give the lighthouse's address "
            f"(http://host:port), after starting one: {LIGHTHOUSE_COMMAND}"
        )
    url = urlparse(address)
    if "@" in url.netloc:  # http://user:secret@host would be printed in every message that names the address
        return (
            f"{key}: an address with credentials in it is not accepted (they would appear in logs and saved configs), "
            "and a torchft lighthouse takes none; valid: http://host:port (or host:port)"
        )
    if url.scheme != "http" or not url.hostname:
        return f"{key} = {given!r}: valid: http://host:port (or host:port), the address of a torchft lighthouse"
    try:
        socket.create_connection((url.hostname, url.port or 80), timeout=3).close()
    except (OSError, ValueError) as e:
        return (
            f"{key} = {given!r}: no lighthouse answers there ({type(e).__name__}: {e}); start one first: "
            f"{LIGHTHOUSE_COMMAND}"
        )
    try:
        text = lighthouse_status(address)
    except LIGHTHOUSE_ERRORS as e:
        text = f"{type(e).__name__}: {e}"
    if not is_lighthouse(text):
        return (
            f"{key} = {given!r}: something answers there, but not a torchft lighthouse (its /status page: "
            f"{' '.join(text.split())[:120]!r}); give the address of one, started with: {LIGHTHOUSE_COMMAND}"
        )
    return None


def previous_quorum(text: str) -> list[tuple[str, int]]:
    """(replica id, step) of each group in the lighthouse's last quorum, read off its /status page."""
    _, _, previous = text.partition("Previous Quorum")
    return [(rid, int(step)) for rid, step in re.findall(r"<b>([^<]+)</b>\s*<br/>\s*Step:\s*(\d+)", previous)]


# ---------------------------------------------------------------- the shared settings


def shared_settings(cfg, world_size: int) -> dict[str, str]:
    """Every setting the groups must share, by its key ('section.key'), as canonical JSON."""
    d = cfg.to_dict()
    flat = {f"checkpoint.{k}": d["checkpoint"][k] for k in START_KEYS}
    flat[INITIAL_LOAD] = bool(cfg.checkpoint.initial_load_path)
    flat["metrics.log_freq"] = cfg.metrics.log_freq  # logged steps sum their loss across the groups
    flat["fault_tolerance.group_count"] = cfg.fault_tolerance.group_count
    flat["fault_tolerance.min_replicas"] = cfg.fault_tolerance.min_replicas
    flat["fault_tolerance.mode"] = cfg.fault_tolerance.mode
    if cfg.fault_tolerance.mode == "diloco":
        for key in ("sync_every", "outer_lr", "outer_momentum"):
            flat[f"fault_tolerance.{key}"] = getattr(cfg.fault_tolerance, key)
    flat[WORLD] = world_size
    return flat_settings(cfg, SHARED_SECTIONS) | canonical(flat)


def _slot(key: str) -> int:
    return _h32(key) % KEY_SLOTS


def settings_slots(settings: dict[str, str]) -> list[int]:
    """KEY_SLOTS 32-bit values: the sum of the hashes of the (key, value) pairs whose key falls in each slot."""
    slots = [0] * KEY_SLOTS
    for key, value in settings.items():
        slots[_slot(key)] = (slots[_slot(key)] + _h32(f"{key}={value}")) % MOD
    return slots


def differing_keys(settings: dict[str, str], differing_slots) -> list[str]:
    """The keys of `settings` whose slot differs between the groups (a slot holds a few keys: all are named)."""
    wanted = set(int(s) for s in differing_slots)
    return sorted(k for k in settings if _slot(k) in wanted)


# ---------------------------------------------------------------- the weights


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors whose bits stand for t: a QLoRA base weight's codes, scales and their factors and mean (its
    NF4 tensor has no integer view)."""
    nf4 = local_nf4(t)
    if nf4 is None:
        return [t]
    return [nf4.quantized_data, nf4.quantized_scalers, nf4.quantization_factor, nf4.scaler_mean.reshape(1)]


def weights_fingerprint(tensors) -> int:
    """A 32-bit fingerprint of these tensors' exact bits (their integer sums, in order; on the device, one host
    read), the same on every rank of the group: each rank hashes its shards and the group sums the hashes."""
    tensors = [b for t in tensors for b in _bits(t)]
    sums = [
        t.detach().contiguous().reshape(-1).view(_INT_OF_SIZE[t.element_size()]).sum(dtype=torch.int64)
        for t in tensors
        if t.numel()
    ]
    mine = _h32(json.dumps(torch.stack(sums).tolist() if sums else []))
    if dist.is_initialized() and dist.get_world_size() > 1:
        total = torch.tensor([float(mine)], dtype=torch.float64)  # a CPU tensor: the gloo half of a GPU group
        dist.all_reduce(total)
        return int(total.item()) % MOD
    return mine


def weights_verdict(prints, senior, mine: float) -> str | None:
    """Whether this group's weights fingerprint `mine` is wrong, given every group's (`prints`, 0 where a group did
    not compare at this step) and whether each took part in a committed step before (`senior`): the reference is
    the senior groups that compared (else all that compared), and its strict majority decides. 'differs' when this
    group's differ from that majority; 'no majority' when the reference splits evenly; None when fine."""
    compared = [(p, s > 0) for p, s in zip(prints, senior) if p]
    reference = [p for p, s in compared if s] or [p for p, _ in compared]
    if not mine or len(set(reference)) <= 1 and mine in reference:
        return None
    top = max(set(reference), key=reference.count)
    if 2 * reference.count(top) <= len(reference):
        return "no majority"
    return "differs" if mine != top else None


def any_rank(*flags: bool) -> list[bool]:
    """Each flag: whether it holds on some rank of this group (a collective, so that the ranks decide together)."""
    values = torch.tensor([int(f) for f in flags], dtype=torch.int32)  # CPU: the gloo half of a GPU group
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(v) for v in values.tolist()]


# One quorum request's bound: a stop signal is acted on between requests. Not shorter: a request asked again resets
# the lighthouse's join clock, so requests shorter than its join_timeout_ms get no quorum while a group that
# heartbeats has not joined (LIGHTHOUSE_COMMAND's is 10 s). At most half of quorum_timeout_seconds: a request under
# way when the lighthouse dies fails only at its bound, and one more must fit after a restart.
QUORUM_CALL_SECONDS = 15.0


def quorum_request_seconds(ft_cfg) -> float:
    """The bound of one quorum request (a stop signal waits at most that long)."""
    return max(1.0, min(QUORUM_CALL_SECONDS, ft_cfg.quorum_timeout_seconds / 2))


def longest_quorum_wait(ft_cfg) -> float:
    """About the longest a group may wait in one step for a quorum without being hung: quorum_timeout_seconds for a
    quorum (with one request's overrun), then as long again for min_replicas groups."""
    return 2 * ft_cfg.quorum_timeout_seconds + QUORUM_CALL_SECONDS


def _unsupported(cfg, dims) -> str | None:
    """What a replica group cannot hold: a replicate dimension of its own (CP, EP, PP and LoRA compose)."""
    if dims.dp_replicate > 1:
        return (
            f"parallelism.data_parallel_replicate_degree = {dims.dp_replicate} inside a fault-tolerant group: the "
            "replicate dimension is across groups (fault_tolerance.group_count); set it to 1"
        )
    return None


def problem(cfg, dims, args=None, device_type: str | None = None, inference: bool = False) -> str | None:
    """Why [fault_tolerance] cannot run this group, or None (also when it is off). device_type None: the dry run,
    where the lighthouse need not answer now."""
    ft = cfg.fault_tolerance
    check_lighthouse = device_type is not None
    if ft.mode != "sync" and not ft.enable and not inference:
        return (
            f"fault_tolerance.mode = {ft.mode!r} synchronises replica groups, but fault_tolerance.enable = false; set "
            "fault_tolerance.enable = true (one job per group, docs/fault_tolerance.md) or leave mode = 'sync'"
        )
    if not ft.enable or inference:
        return None
    if ft.replica_id >= ft.group_count:
        return (
            f"fault_tolerance.replica_id = {ft.replica_id} is not below fault_tolerance.group_count = "
            f"{ft.group_count}; valid: 0 to {ft.group_count - 1}"
        )
    if ft.min_replicas > ft.group_count:
        return (
            f"fault_tolerance.min_replicas = {ft.min_replicas} is more than fault_tolerance.group_count = "
            f"{ft.group_count}: no step could ever be taken; valid: 1 to {ft.group_count}"
        )
    hang, wait = cfg.training.hang_timeout_seconds, longest_quorum_wait(ft)
    if 0 < hang < wait:
        return (
            f"training.hang_timeout_seconds = {hang:g} is shorter than a group may wait for a quorum (about 2 x "
            f"fault_tolerance.quorum_timeout_seconds = {ft.quorum_timeout_seconds:g}): the hang watch would end a "
            f"waiting group without a save; valid: 0 (off) or at least {wait:g}, or lower "
            "fault_tolerance.quorum_timeout_seconds"
        )
    problem = _unsupported(cfg, dims)
    if problem or not check_lighthouse:
        return problem
    if importlib.util.find_spec("torchft") is None:
        return (
            "fault_tolerance.enable = true needs torchft, which is not installed: pip install -e '.[ft]' "
            "(or pip install torchft), or set fault_tolerance.enable = false"
        )
    if problem := torchft_version_problem():
        return problem
    return lighthouse_problem(ft)


TESTED_TORCHFT = "0.2"  # compat.py reads the Manager's private _quorum_future and _quorum_id, which 0.3 reworked


def torchft_version_problem(installed: str | None = None) -> str | None:
    """Why the installed torchft is not one titanlite works with (0.2.x), or None."""
    installed = installed or importlib.metadata.version("torchft")
    if installed.split(".")[:2] == TESTED_TORCHFT.split("."):
        return None
    return (
        f"fault_tolerance.enable = true: torchft {installed} is installed, but titanlite works with torchft "
        f"{TESTED_TORCHFT}.x only (it reads the Manager's quorum internals, which 0.3 reworked; a lighthouse and "
        f"replicas of different versions would not agree): pip install 'torchft>={TESTED_TORCHFT},<0.3' (the "
        "ft extra pins it), for the lighthouse too"
    )


def data_slice(cfg, dims, dp_rank: int) -> tuple[int, int]:
    """(this rank's data-parallel rank, the number of them) over every replica group: a fault-tolerant group reads
    its part of the global batch (without fault tolerance: this job's own)."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return dp_rank, dims.dp_degree
    return ft.replica_id * dims.dp_degree + dp_rank, ft.group_count * dims.dp_degree
