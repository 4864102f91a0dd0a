"""A real two-node SLURM cluster on this machine for the tests: Debian's slurmctld, two slurmd daemons (node1, node2)
at 127.0.0.1 on their own ports, and munge, all started here and stopped at the end.

The packages are installed with apt-get when they are missing and this process may (root, apt-get present); where
it cannot, `unavailable()` says why in one line and the SLURM tests skip with it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
NODES = ("node1", "node2")
HOSTS = Path("/etc/hosts")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unavailable() -> str | None:
    """Why a SLURM cluster cannot be started here (after installing the packages where possible), or None."""
    if all(shutil.which(t) for t in ("slurmctld", "slurmd", "sbatch", "munged")):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "SLURM is not installed and apt-get cannot install it here (needs root and apt-get): " + " ".join(
            PACKAGES
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", *PACKAGES]
    done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=900)
        done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        return f"apt-get install {' '.join(PACKAGES)} failed: {done.stderr.strip().splitlines()[-1:]}"
    return None


def _config(root: Path, ctld_port: int, node_ports: dict[str, int], cpus: int, munge_socket: Path) -> str:
    nodes = "\n".join(
        f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={cpus} State=UNKNOWN"
        for n, p in node_ports.items()
    )
    return f"""ClusterName=titanlite-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket},cred_expire=15
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=30
{nodes}
PartitionName=debug Nodes={",".join(node_ports)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class Cluster:
    """A running cluster: `env` holds SLURM_CONF for its client commands (sbatch, squeue, scancel)."""

    def __init__(self, root: Path):
        self.root = root
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
        self._procs: list[subprocess.Popen] = []
        self._hosts_before: str | None = None
        self._munge: Path | None = None

    def start(self, timeout: float = 60) -> Cluster:
        """Start munge, the controller and both nodes; wait until both nodes are idle (what started is stopped again
        when one does not come up)."""
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> Cluster:
        for sub in ("state", "spool/node1", "spool/node2"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._name_nodes()
        ports = {n: _free_port() for n in NODES}
        conf = self.root / "slurm.conf"
        self._munge = munge = Path(tempfile.mkdtemp(prefix="titanlite-munge-"))  # munged's user reaches it (a test's
        shutil.chown(munge, "munge", "munge")  # temporary folder is root's alone; clients need to enter it)
        munge.chmod(0o755)
        socket_path = munge / "munge.socket"
        conf.write_text(_config(self.root, _free_port(), ports, max(2, os.cpu_count() or 2), socket_path))
        self._spawn(["runuser", "-u", "munge", "--", "munged", "-F", "--socket", str(socket_path),
                     "--pid-file", str(munge / "munged.pid"), "--log-file", str(munge / "munged.log"),
                     "--seed-file", str(munge / "munged.seed")])  # fmt: skip
        self._wait(lambda: socket_path.exists(), timeout, "munged's socket")
        self._spawn(["slurmctld", "-D", "-i", "-f", str(conf)])
        for node in NODES:
            self._spawn(["slurmd", "-D", "-N", node, "-f", str(conf)])
        self._wait(lambda: self.idle_nodes() == len(NODES), timeout, "both nodes idle in sinfo")
        return self

    def idle_nodes(self) -> int:
        """How many nodes sinfo reports idle."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout
        return sum(1 for line in out.splitlines() if line.split()[-1:] == ["idle"])

    def run(self, cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        return subprocess.run(cmd, env={**self.env, **kw.pop("env", {})}, capture_output=True, text=True,
                              check=check, **kw)  # fmt: skip

    def sbatch(self, *args: str, cwd: str | Path, env: dict | None = None) -> int:
        """Submit a batch job (sbatch's options, the script, its arguments); its job id."""
        done = self.run(["sbatch", "--parsable", *args], cwd=cwd, env=env or {}, check=False)
        if done.returncode:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {done.stderr.strip()}")
        out = done.stdout
        return int(out.strip().split(";")[0])

    def state(self, job: int) -> str:
        """The job's state (PENDING, RUNNING, COMPLETED, FAILED, ...), or '' once the controller forgot it."""
        for _ in range(10):  # a busy controller's failed answer is asked again; a forgotten job is said so
            done = self.run(["scontrol", "show", "job", str(job)], check=False)
            if done.returncode == 0 or "Invalid job id" in done.stderr:
                break
            time.sleep(1)
        out = done.stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return ""

    def wait_done(self, job: int, timeout: float = 300) -> str:
        """Wait until the job left the queue; its last state."""
        last, deadline = "", time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state(job)
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"):
                return state
            last = state or last
            if not state:
                return last
            time.sleep(1)
        raise TimeoutError(f"SLURM job {job} still {last} after {timeout} s")

    def stop(self) -> None:
        """Cancel every job (a test that failed half-way leaves its 100000-step run), stop every daemon this cluster
        started and restore /etc/hosts."""
        if self._procs:
            self.run(["scancel", "--signal=KILL", "--full", "--user", "root"], check=False)
            deadline = time.monotonic() + 30
            while self.run(["squeue", "-h"], check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for p in reversed(self._procs):
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        for p in reversed(self._procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self._hosts_before is not None:
            HOSTS.write_text(self._hosts_before)
        if self._munge is not None:
            shutil.rmtree(self._munge, ignore_errors=True)

    def _name_nodes(self) -> None:
        text = HOSTS.read_text()
        names = {w for line in text.splitlines() if line.startswith("127.0.0.1") for w in line.split()[1:]}
        if not set(NODES) <= names:
            self._hosts_before = text
            HOSTS.write_text(text.rstrip("\n") + "\n127.0.0.1 " + " ".join(NODES) + "\n")

    def _spawn(self, cmd: list[str]) -> None:
        log = open(self.root / f"{Path(cmd[0]).name}-{len(self._procs)}.out", "w")  # noqa: SIM115
        self._procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            if dead := [p.args for p in self._procs if p.poll() is not None]:
                raise RuntimeError(f"a SLURM daemon exited while waiting for {what}: {dead[0]}; logs in {self.root}")
            time.sleep(0.5)
        raise TimeoutError(f"no {what} after {timeout} s; logs in {self.root}")
