"""Shared test helpers: tiny configs, trainers, spawned gloo ranks, reading checkpoints and logs.

Test modules import from here (and never from each other); fixtures live in conftest.py.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from titanlite.runtime.distributed import exit_process, free_port, shutdown

ROOT = Path(__file__).resolve().parent.parent
FAULTS_DIR = Path(__file__).resolve().parent / "faults"

# Where single-process tests compute: TITANLITE_TEST_DEVICE=cuda runs them on the GPU (the GPU check does);
# multi-rank tests stay on gloo/CPU (several ranks cannot share one GPU under NCCL).
TEST_DEVICE = os.environ.get("TITANLITE_TEST_DEVICE", "cpu")


def compute_device() -> torch.device:
    """The device single-process tests compute on: cpu unless TITANLITE_TEST_DEVICE says otherwise."""
    return torch.device(TEST_DEVICE)


def tiny_argv(tmp, *extra):
    """10 fp32 steps of the tiny model at seq 32, logged every step, outputs under tmp."""
    return [
        "--model.flavor",
        "tiny",
        "--training.seq_len",
        "32",
        "--training.steps",
        "10",
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        "--lr_scheduler.warmup_steps",
        "2",
        "--optimizer.lr",
        "3e-3",
        "--job.dump_folder",
        str(tmp),
        *extra,
    ]


def ckpt_argv(tmp, *extra):
    """6 fp32 steps, global batch 8, checkpointing on under tmp."""
    return tiny_argv(tmp, "--training.steps", "6", "--training.global_batch_size", "8", "--checkpoint.enable", *extra)


def make_trainer(argv):
    """A Trainer for these overrides (in a process group set up by run_distributed)."""
    from titanlite.config import load
    from titanlite.trainer import Trainer

    return Trainer(load(argv))


def train_all(argv_list):
    """Train one run per argv in this process group; the logged losses of each."""
    return [make_trainer(argv).train() for argv in argv_list]


def full_model(trainer) -> dict:
    """The trainer's model as full (unsharded) tensors; a collective, call on every rank."""
    return {k: v.full_tensor() for k, v in trainer.model.state_dict().items()}


def assert_same_hf_weights(a, b) -> None:
    """Two HF safetensors folders hold the same tensors, bit for bit (however they are split into files)."""
    from safetensors.torch import load_file

    one = {k: v for f in Path(a).glob("*.safetensors") for k, v in load_file(f).items()}
    two = {k: v for f in Path(b).glob("*.safetensors") for k, v in load_file(f).items()}
    assert one.keys() == two.keys(), sorted(one.keys() ^ two.keys())[:5]
    assert all(torch.equal(one[k], two[k]) for k in one), [k for k in one if not torch.equal(one[k], two[k])][:5]


def load_everything(path) -> dict:
    """Everything a DCP checkpoint folder holds, loaded in this process."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return sd


def capture_logs() -> list[str]:
    """Collect the titanlite log messages of this process from now on."""
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    log = logging.getLogger("titanlite")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return messages


def subprocess_env(**extra) -> dict:
    """The environment for titanlite subprocesses: this checkout on PYTHONPATH, offline, CPU, one thread.

    Pass TITANLITE_DEVICE=TEST_DEVICE for a single-process run that may use the test device."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TITANLITE_DEVICE": "cpu",
        **extra,
    }


def run_module(module: str, *args, env: dict | None = None, timeout: float = 300):
    """Run `python -m module args` from the checkout, one process on the test device (unless env is given);
    output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=ROOT,
        env=env if env is not None else subprocess_env(TITANLITE_DEVICE=TEST_DEVICE),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_benchmark(script: str, *args, timeout: float | None = 300) -> str:
    """Run `python benchmarks/<script> args` from the checkout (its own device choice); its stdout, after
    asserting it exited 0. timeout None: no wall-clock limit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return r.stdout


def faults_env(spec: str, **extra) -> dict:
    """subprocess_env plus fault injection (tests/faults/sitecustomize.py reads TITANLITE_FAULTS)."""
    return subprocess_env(PYTHONPATH=f"{FAULTS_DIR}{os.pathsep}{ROOT}", TITANLITE_FAULTS=spec, **extra)


def torchrun_cmd(*args, nproc=2, module="titanlite.train"):
    """A `python -m torch.distributed.run` command line for nproc local ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        "localhost:0",
        "-m",
        module,
        *args,
    ]


def _job_child() -> None:
    # In the child before exec: SIGINT at its default. A test run from a background job inherits it ignored, and a
    # shell started with a signal ignored can never trap it (run_train.sh passes Ctrl-C on to torchrun).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_job(cmd, *, env: dict, cwd=ROOT, **popen_kw) -> subprocess.Popen:
    """Start a job (run_train.sh, torchrun) in a process group of its own with SIGINT deliverable; stop it with
    stop_job (the `job` context manager does) so that a failing test leaves nothing running."""
    return subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True, preexec_fn=_job_child, **popen_kw)


def _descendants(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(x) for x in f.read().split()]
    except OSError:
        return []
    return [d for c in children for d in (c, *_descendants(c))]


def stop_job(proc: subprocess.Popen) -> None:
    """SIGKILL a job started by start_job: its process group and every descendant (run_train.sh's torchrun runs in
    a session of its own), then reap it."""
    victims = _descendants(proc.pid)  # before the kill: orphans leave the tree
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def job(cmd, *, env: dict, cwd=ROOT, **popen_kw):
    """start_job as a context: the job is stopped on leaving, however the test ends."""
    proc = start_job(cmd, env=env, cwd=cwd, **popen_kw)
    try:
        yield proc
    finally:
        if proc.poll() is None or _descendants(proc.pid):
            stop_job(proc)


def run_job(cmd, *, env: dict, timeout: float, cwd=ROOT, merge_output: bool = False) -> subprocess.CompletedProcess:
    """subprocess.run for a job: output captured as text (stderr into stdout with merge_output), and on a timeout
    or any error the whole job is stopped before the error propagates."""
    err = subprocess.STDOUT if merge_output else subprocess.PIPE
    with job(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=err, text=True) as proc:
        out, errs = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, errs)


def sigint_ignored(pid: int) -> bool:
    """Whether process pid ignores SIGINT (its /proc status' SigIgn mask)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(line.split()[1] for line in f if line.startswith("SigIgn:"))
    return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))


# Ranks start from a fork server that imported torch and titanlite once (a spawned rank re-imports them: seconds
# per world, minutes over the suite); each rank takes the caller's environment and folder, as a spawned one would.
START_METHOD = os.environ.get("TITANLITE_TEST_START_METHOD", "forkserver")
if START_METHOD == "forkserver":
    multiprocessing.set_forkserver_preload(["helpers", "titanlite.trainer"])


def _worker(rank: int, world_size: int, port: int, fn, args, kwargs, out_dir: str, env: dict, cwd: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TITANLITE_DEVICE="cpu",
    )
    torch.set_num_threads(1)
    finished = False
    try:
        result = fn(*args, **kwargs)
        finished = True
    finally:
        shutdown(wait_for_peers=finished)  # after a clean run, the ranks leave together
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    exit_process(0)  # no interpreter teardown racing gloo's threads (see titanlite.runtime.distributed.exit_process)


def run_distributed(fn, world_size: int, *args, **kwargs) -> list:
    """fn(*args, **kwargs) on world_size spawned ranks (env as torchrun sets it); returns each rank's result."""
    with tempfile.TemporaryDirectory() as out_dir:
        setup = (world_size, free_port(), fn, args, kwargs, out_dir, dict(os.environ), os.getcwd())
        mp.start_processes(_worker, args=setup, nprocs=world_size, join=True, start_method=START_METHOD)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def wandb_history(run_folder) -> tuple[str, list[dict], dict]:
    """(run id, history rows, config) of an offline W&B run folder, read from its .wandb file.

    The file is W&B's 7-byte header, then LevelDB's log format (32 KiB blocks of records with a 7-byte
    header: crc, length, type FULL/FIRST/MIDDLE/LAST) holding protobuf `Record`s.
    """
    import struct

    from wandb.proto import wandb_internal_pb2

    (path,) = Path(run_folder).glob("run-*.wandb")
    data, pos, records, pending = path.read_bytes(), 7, [], b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if room < 7 or (kind == 0 and length == 0):
            pos += room
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    run_id, rows, config = None, [], {}
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update({item.key: item.value_json for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: item.value_json for item in record.config.update})
        elif kind == "history":
            rows.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    return run_id, rows, config


class Outage:
    """A TCP relay in front of a server that a test can take down and bring back, from any process: while the file
    `flag` exists its port refuses connections and open ones are cut (an endpoint that is down)."""

    def __init__(self, target_port: int, flag: Path):
        import threading

        self.target, self.flag, self.port = target_port, flag, free_port()
        self.open: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _listen(self):
        import socket

        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(64)
        sock.settimeout(0.05)
        return sock

    def _serve(self) -> None:
        import socket
        import threading

        sock = self._listen()
        while not self._stop.is_set():
            if self.flag.exists():
                if sock is not None:
                    sock.close()
                    sock = None
                    for c in self.open:
                        with contextlib.suppress(OSError):
                            c.shutdown(socket.SHUT_RDWR)
                    self.open.clear()
                time.sleep(0.05)
                continue
            if sock is None:
                sock = self._listen()
            try:
                client, _ = sock.accept()
            except (TimeoutError, OSError):
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()
        if sock is not None:
            sock.close()

    @staticmethod
    def _pipe(a, b) -> None:
        import socket

        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def moto_server(env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """moto's S3 server on a free port of this machine, answering, and dying with this process: (process, URL)."""
    import urllib.request

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,  # never outlives the run, however it ends
    )
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    return server, url


def wait_for_endpoint(url: str, seconds: float = 30) -> None:
    """Wait until the server at url (http://host:port) accepts connections."""
    import socket

    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def s3_server(down_flag: Path, check_keys: bool = False):
    """A real S3 endpoint on this machine: moto's server on a free port with a bucket "titanlite-test", behind an
    Outage relay (down while `down_flag` exists); yields the AWS variables that reach it. check_keys: IAM checks
    on, so that wrong credentials are refused as AWS refuses them (moto 5.2 then also refuses the signatures of
    its own listings: for the credential tests only)."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "INITIAL_NO_AUTH_ACTION_COUNT"}
    if check_keys:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"  # the IAM calls below; every later request must be signed right
    server, url = moto_server(env)
    port = int(url.rsplit(":", 1)[1])
    try:
        import boto3

        iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1", aws_access_key_id="setup",
                           aws_secret_access_key="setup")  # fmt: skip
        iam.create_user(UserName="titanlite")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="titanlite", PolicyName="all", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="titanlite")["AccessKey"]
        variables = {
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_MAX_ATTEMPTS": "2",  # an endpoint that is down fails in seconds, not minutes
        }
        boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id=key["AccessKeyId"],
                     aws_secret_access_key=key["SecretAccessKey"]).create_bucket(Bucket="titanlite-test")  # fmt: skip
        relay = Outage(port, down_flag)
        variables["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{relay.port}"
        yield variables
        relay.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
