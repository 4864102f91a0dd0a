"""Each benchmark script runs with tiny arguments and prints its table (no timing is asserted)."""

import json
import re
from pathlib import Path

import pytest

from helpers import run_benchmark

pytestmark = pytest.mark.slow  # multi-process (gloo) or torchrun tests

ROOT = Path(__file__).resolve().parent.parent
TINY_SHAPE = ["--layers", "1", "--hidden", "64", "--intermediate", "96", "--seq-len", "16", "--device", "cpu"]


_bench = run_benchmark


def test_delayed_all_reduce_benchmark_prints_its_table():
    out = _bench(
        "delayed_all_reduce.py",
        *TINY_SHAPE,
        "--worlds",
        "2",
        "--reps",
        "2",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--kinds",
        "inhomogeneous",
        "--modes",
        "hsdp",
        "hsdp_delay",
        "fsdp",
        "hsdp_last_only",
    )
    assert "world 2 (replicate 2 x shard 1), inhomogeneous microbatches [replica 0: 1,2  replica 1: 2,1]" in out
    for label in (
        "HSDP 2x1 ",
        "HSDP 2x1 + delayed all-reduce",
        "FSDP over the world (2)",
        "HSDP 2x1 + sync on last microbatch only",
    ):
        assert re.search(
            re.escape(label) + r"\s+[0-9.]+\s+[0-9.]+-[0-9.]+\s+[0-9,]+\s+[0-9,]+-[0-9,]+\s+x[0-9.]+", out
        ), (label, out)
    assert "compute-bound limit of the delayed all-reduce: x1.33" in out


def test_overhead_benchmark_prints_ratio():
    out = _bench("overhead.py", *TINY_SHAPE, "--reps", "2", "--steps", "1", "--warmup", "1")
    assert "FSDP: shard_size=2" in out and "bare FSDP2 loop" in out
    assert re.search(
        r"titanlite / bare: [0-9.]+ median of the per-repetition ratios .* goal <= 1.03: (met|NOT met)", out
    ), out


def test_memory_is_total_over_shard_degree():
    out = _bench("memory.py", "--flavor", "tiny", "--seq-len", "16", "--device", "cpu")
    cells = [re.split(r"\s{2,}", line) for line in out.splitlines() if line.startswith(("FSDP", "HSDP"))]
    rows = {c[0]: [float(x) for x in c[2:]] for c in cells}
    assert len(rows) == 4, out
    for label, values in rows.items():
        ratios = values[2::3]  # params, grads, optimizer state
        assert all(1.0 <= r < 1.01 for r in ratios), (label, values)  # 1/shard, plus dim-0 padding
    assert rows["HSDP 2x2 (shard 2)"] == rows["FSDP shard 2"]


def test_data_loader_benchmark_prints_the_ratio():
    out = _bench(
        "data_loader.py", "--seq-len", "64", "--dps", "1", "4", "--vocab", "400", "--reps", "1", "--build-copies", "1",
        "--rounds", "2", "--steps", "2", "--remote-copies", "1",
    )  # fmt: skip
    assert re.search(r"per-rank cost ratio dp4/dp1: [\d.]+ \(median of 2 interleaved rounds", out), out
    assert re.search(r"moto/local time per step: x[\d.]+ .*fetched [\d.]+ MiB in \d+ ranged reads", out), out
    assert re.search(r"workers 2: [\d,]+ tokens in [\d.]+ s", out), out


def test_attention_benchmark_prints_the_ratio():
    out = _bench("attention.py", "--flavor", "tiny", "--seq-len", "64", "--batch", "2", "--reps", "2")
    assert re.search(r"block_causal / causal: [\d.]+ median", out), out


def test_kv_cache_benchmark_prints_the_ratio():
    out = _bench("kv_cache.py", "--flavor", "tiny", "--prompt-len", "8", "--new-tokens", "8", "--reps", "1")
    assert re.search(r"no KV cache / KV cache total time: [\d.]+ median", out), out


def test_gpu_check_runs_its_sections_at_a_tiny_size(tmp_path):
    # Every section but three that run other scripts, each of which has its own test here: suite (pytest),
    # attention (benchmarks/attention.py) and generate (benchmarks/kv_cache.py).
    sections = "env,e2e,flex,compile,bf16,mfu,profile,chunked,float8,moe"
    out = _bench("gpu_check.py", "--tiny", "--out", str(tmp_path), "--sections", sections)
    report = json.loads((tmp_path / "report.json").read_text())
    assert sorted(report) == sorted(sections.split(",")), sorted(report)
    assert all("error" not in r for r in report.values()), out[-3000:]
    assert report["e2e"]["resume_exact"] and report["compile"]["max_abs_diff"] < 1e-5
    assert all(r["block_masks_per_forward"] == 1 and r["within_tolerance"] for r in report["flex"]["rows"])
    assert report["mfu"]["rows"][0]["tokens_per_sec"] > 0
    assert [r["shape"]["chunk"] for r in report["chunked"]["rows"]] == [16, 0]
    assert all(r["tokens_per_sec"] > 0 for section in ("chunked", "float8", "moe") for r in report[section]["rows"])
    assert report["float8"]["curve"]["steps"] == 6 and report["moe"]["gemm"]["outputs_rel_diff"] < 1e-5
    e2e = report["e2e"]
    assert all(e2e[f"deterministic_{d}"]["repeat_exact"] for d in ("true", "false")), e2e


def test_moe_benchmark_prints_its_tables():
    out = _bench("moe.py", "--reps", "1", "--balance-steps", "2", "--tokens", "64", "--hidden", "64",
                 "--expert-hidden", "64", "--seq-len", "32", "--batch", "1")  # fmt: skip
    assert re.search(r"per-expert loop / grouped GEMM: [\d.]+ median", out), out
    assert re.search(r"FSDP\(2\) x EP\(2\)\s+\d+\s+\d+-\d+\s+x[\d.]+", out), out
    assert re.search(r"the token exchange moves [\d.]+ MiB", out), out
    for mode, setting in (("aux_free", "bias_update_rate 0.01"), ("aux_loss", "aux_loss_coef 0.001"), ("none", "-")):
        assert re.search(rf"{mode}\s+{setting}\s+[\d.]+\s+[\d.]+", out), (mode, out)


def test_lora_benchmark_prints_its_table():
    out = _bench("lora.py", "--reps", "2", "--layers", "1", "--hidden", "128", "--intermediate", "256",
                 "--vocab", "1024", "--seq-len", "64", "--batch", "1", "--rank", "4", "--nf4-block", "16",
                 "--nf4-scaler-block", "8")  # fmt: skip
    full = re.search(r"full fine-tuning\s+[\d.]+M of [\d.]+M\s+\d+\s+x1\.00\s+(\d+)", out)
    lora = re.search(r"\nLoRA r=4\s+0\.0\dM of [\d.]+M\s+\d+\s+x[\d.]+\s+(\d+)\s+(\d+)\s+\d+\s+(\d+)", out)
    qlora = re.search(r"QLoRA r=4\s+0\.0\dM of [\d.]+M\s+\d+\s+x[\d.]+\s+(\d+)\s+(\d+)\s+\d+\s+(\d+)", out)
    assert full and lora and qlora, out
    assert int(lora.group(3)) < 1 and int(qlora.group(3)) < 1  # no optimizer state for the base
    assert int(qlora.group(2)) <= int(lora.group(2))  # the 4-bit base holds no more than the full-precision one


def test_context_parallel_benchmark_prints_its_tables():
    out = _bench("context_parallel.py", "--seq-len", "128", "--layers", "1", "--hidden", "64", "--intermediate",
                 "128", "--vocab", "512", "--steps", "1", "--rounds", "1")  # fmt: skip
    assert re.search(r"CP\(2\), 2 processes\s+\d+\s+[\d,]+\s+x[\d.]+", out), out
    assert re.search(r"4\s+two chunks, one from each end\s+[\d. ]+\s+1\.00", out), out
    assert re.search(r"4\s+one contiguous block\s+[\d. ]+\s+1\.7\d", out), out  # the last of 4 blocks: 1.75x


def test_pipeline_benchmark_prints_each_schedule_against_fsdp():
    out = _bench(
        "pipeline.py", *TINY_SHAPE, "--layers", "4", "--reps", "1", "--steps", "1", "--warmup", "1", "--batch", "2"
    )
    assert "world 2, global batch 4 x" in out and "(4 pipeline microbatches at PP(2))" in out
    assert re.search(r"FSDP\(2\)\s+[\d.]+", out), out
    for schedule, bubble in (
        ("GPipe", "20.0%"),
        ("1F1B", "20.0%"),
        ("Interleaved1F1B", "11.1%"),
        ("ZBVZeroBubble", "0.0%"),
    ):
        assert re.search(rf"PP\(2\) {schedule}\s+[\d.]+\s+[\d.-]+\s+x[\d.]+\s+[\d.]+%\s+{re.escape(bubble)}", out), out


def test_dpo_benchmark_prints_the_references_table():
    out = _bench(
        "dpo.py", "--layers", "1", "--hidden", "64", "--intermediate", "96", "--seq-len", "128", "--device", "cpu",
        "--pairs", "8", "--rank", "4", "--reps", "1", "--steps", "1", "--warmup", "0",
    )  # fmt: skip
    for reference in ("copy", "base", "precomputed"):
        assert re.search(rf"^{reference}\s+\d+\s+x[\d.]+$", out, re.M), out
    assert re.search(r"precomputed: the table of 8 pairs took [\d.]+ s before step 1", out), out


def test_backend_verdicts_size_a_published_shape_three_ways(tmp_path):
    """Gemma 3 27B's text config at a short sequence: full fine-tuning on 8 GPUs, LoRA and QLoRA on one, each sized
    with the activations measured on fake tensors; the 4-bit base holds less than the bf16 one."""
    pytest.importorskip("transformers")
    out = tmp_path / "verdicts.json"
    _bench("backend_verdicts.py", "--models", "gemma3_27b", "--seq-len", "512", "--json", str(out))
    figures = json.loads(out.read_text())
    assert len(figures) == 3 and all(f["fits"] and f["params"].startswith("27.") for f in figures.values()), figures
    lora, qlora = (next(f for k, f in figures.items() if kind in k) for kind in ("/ LoRA", "/ QLoRA"))
    assert qlora["peak_gib"] < lora["peak_gib"] - 20 and qlora["largest_batch"] > lora["largest_batch"], figures
