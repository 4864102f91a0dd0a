"""Run many short 2-rank jobs through run_train.sh and count how they end (a check for rare aborts).

    python benchmarks/stress_runs.py [--runs 100] [--keep-logs DIR]

Each run trains the tiny model for a few steps with validation and checkpoints on (what ends a run:
the last validation, the last save, leaving the process groups), in a fresh dump folder. Prints one
line per run that did not exit 0 (with the end of its log) and a summary line
`N of N runs exited 0`.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--keep-logs", default="", help="folder for the logs of runs that did not exit 0")
    opts = p.parse_args()
    env = {**os.environ, "NGPU": "2", "LOG_RANK": "0,1", "HF_HUB_OFFLINE": "1", "TITANLITE_DEVICE": "cpu"}
    codes, t0 = collections.Counter(), time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(opts.runs):
            args = [
                "--model.flavor",
                "tiny",
                "--training.seq_len",
                "64",
                "--training.steps",
                str(opts.steps),
                "--training.local_batch_size",
                "4",
                "--metrics.log_freq",
                "1",
                "--validation.freq",
                "2",
                "--validation.steps",
                "2",
                "--checkpoint.interval",
                "2",
                "--job.dump_folder",
                f"{tmp}/run{i}",
            ]
            r = subprocess.run(
                ["./run_train.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
            )
            codes[r.returncode] += 1
            if r.returncode != 0:
                tail = (r.stdout + r.stderr)[-1500:]
                print(f"run {i}: exit status {r.returncode}\n{tail}\n", flush=True)
                if opts.keep_logs:
                    Path(opts.keep_logs).mkdir(parents=True, exist_ok=True)
                    Path(opts.keep_logs, f"run{i}.log").write_text(r.stdout + r.stderr)
    print(f"{codes[0]} of {opts.runs} runs exited 0 ({dict(codes)}), {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
