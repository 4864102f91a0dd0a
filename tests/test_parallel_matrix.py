"""The parity matrix of pipeline parallelism composed with the other kinds (fp32, gloo, 6 steps): the same losses and
gradient norms (1e-5) as one process for PP(2) x CP(2), PP(2) x FSDP(2) x EP(2) with an MoE's aux loss (and
exact resume, and a one-process checkpoint resumed there), PP(2) x FSDP(2) with aux-loss-free balancing and
interleaved stages, PP(2) x FSDP(2) with LoRA, PP(2) x FSDP(2) of DeepSeek-V3 with a stage of its dense block
only, and PP(2) x FSDP(2) x EP(2) of gpt-oss. Each case asserts that the combination really ran (stages,
experts per rank, cp, what trains). Tied embeddings under pp: tests/test_pipeline.py; fault-tolerant groups with
MoE, CP, LoRA and pp: tests/test_fault_tolerance.py.

Two spawned worlds (1 and 4 ranks), each running several configurations."""

import shutil

import pytest
from test_pipeline import _checkpoint_keys, _drop_after, _pp, _run, _same

from helpers import run_distributed

pytestmark = pytest.mark.slow  # spawned gloo ranks

MOE = ("--model.name", "qwen3_moe", "--model.flavor", "debugmodel")
AUX = (*MOE, "--moe.load_balance", "aux_loss")
FREE = (*MOE, "--moe.load_balance", "aux_free")
# DeepSeek-V3 with its dense first block alone on the first stage: those ranks hold no MoE block, pass the aux loss's
# statistics on and still join the step's sums over the ranks
DEEPSEEK = ("--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--moe.load_balance", "aux_loss")
# gpt-oss: sinks and sliding windows of 4 on each stage, biased experts split over ep
GPT_OSS = ("--model.name", "gpt_oss", "--model.flavor", "tiny", "--moe.load_balance", "aux_loss")
DENSE_STAGE = ("--parallelism.pipeline_parallel_layers_per_stage", "1,5")
CP2 = ("--parallelism.context_parallel_degree", "2")
EP2 = ("--parallelism.expert_parallel_degree", "2")
STEPS = ("--training.steps", "6")  # the test_pipeline runs' batches, 6 steps: an MoE's routing has moved by then
CKPT = ("--checkpoint.enable", "--checkpoint.interval", "3")
STEP_RANGE = range(1, 7)


def _lora(base):
    return ("--lora.enable", "true", "--lora.rank", "4", "--checkpoint.initial_load_path", str(base))


def _run_copying(cases, copies):
    """_run's cases (each STEPS long), after rank 0 copied each (source step folder, destination checkpoint folder)
    of `copies` once the first case ran: an exact resume at the same topology starts from a copy of its step 3."""
    import torch.distributed as dist

    from titanlite.runtime.distributed import init_distributed

    init_distributed()
    cases = [(name, folder, (*STEPS, *extra)) for name, folder, extra in cases]
    out = _run(cases[:1])
    if dist.get_rank() == 0:
        for source, target in copies:
            shutil.copytree(source, target / source.name)
    dist.barrier()
    return out | _run(cases[1:])


def test_pipeline_composes_with_moe_ep_cp_and_lora(tmp_path):
    one, moe, free = tmp_path / "one", tmp_path / "moe", tmp_path / "free"
    base = one / "checkpoint" / "step-3"
    refs = run_distributed(
        _run_copying,
        1,
        [
            ("one", one, CKPT),
            ("lora", tmp_path / "lora", (*_lora(base), *CKPT)),  # on the dense run's step-3 weights, saved just before
            ("moe", moe, (*AUX, *CKPT)),
            ("free", free, FREE),
            ("deepseek", tmp_path / "ds", DEEPSEEK),
            ("gpt_oss", tmp_path / "go", GPT_OSS),
        ],
        [],
    )[0]
    _drop_after(moe, 3)  # resumed below at PP(2) x FSDP(2) x EP(2)
    ep = tmp_path / "ep"
    four = run_distributed(
        _run_copying,
        4,
        [
            ("ep", ep, (*_pp("1F1B"), *AUX, *EP2, *CKPT)),
            ("ep_resumed", tmp_path / "ep_resumed", (*_pp("1F1B"), *AUX, *EP2, *CKPT)),
            ("ep_from_one", moe, (*_pp("1F1B"), *AUX, *EP2, *CKPT)),
            ("cp", tmp_path / "cp", (*_pp("1F1B"), *CP2)),
            ("free_interleaved", tmp_path / "fi", (*_pp("Interleaved1F1B"), *FREE)),
            ("lora", tmp_path / "pl", (*_pp("1F1B"), *_lora(base), *CKPT)),
            ("deepseek_dense_stage", tmp_path / "pds", (*_pp("1F1B"), *DEEPSEEK, *DENSE_STAGE)),
            ("gpt_oss_ep", tmp_path / "pgo", (*_pp("1F1B"), *GPT_OSS, *EP2)),
        ],
        [(ep / "checkpoint" / "step-3", tmp_path / "ep_resumed" / "checkpoint")],
    )[-1]  # a last stage's rank: its logged losses are the global ones

    for name, ref in (
        ("ep", "moe"),
        ("cp", "one"),
        ("free_interleaved", "free"),
        ("lora", "lora"),
        ("deepseek_dense_stage", "deepseek"),
        ("gpt_oss_ep", "gpt_oss"),
    ):
        # an MoE's gradient norm: 1e-4, as tests/test_moe_parallel.py's gradients (top-k routing amplifies fp32
        # reduction-order noise; PP(2) x FSDP(2) with aux_free measured 1.6e-5 at step 9)
        moe = "moe" in ref or ref in ("free", "deepseek", "gpt_oss")
        _same(four[name], refs[ref], name, STEP_RANGE, norm_tol=1e-4 if moe else None)
        assert four[name]["stages"] >= 2, name
    assert four["free_interleaved"]["stages"] == 4  # 2 stages per rank
    assert four["ep"]["experts_per_rank"] == 4 and refs["moe"]["experts_per_rank"] == 8  # EP(2) of 8 experts
    assert four["cp"]["cp"] == 2
    trained = four["lora"]["trained"]  # this rank's stage's adapters, and nothing else
    assert trained and set(trained) < set(refs["lora"]["trained"]) and all("lora_" in n for n in trained)
    # the stages' checkpoint holds what a one-process LoRA checkpoint holds: the adapters (FSDP-sharded), no base
    keys = _checkpoint_keys(tmp_path / "pl", 6)
    assert keys.keys() == _checkpoint_keys(tmp_path / "lora", 6).keys()
    assert any("lora_a" in k for k in keys) and not any(k.endswith("attention.wq.weight") for k in keys)
    # the aux loss and the routing-bias update do change the losses (a test that can fail)
    assert abs(refs["moe"]["loss"][6] - refs["free"]["loss"][6]) > 1e-4

    resumed, from_one = four["ep_resumed"], four["ep_from_one"]
    assert min(resumed["loss"]) == min(from_one["loss"]) == 4  # they did resume
    for s in range(4, 7):  # exact resume at PP(2) x FSDP(2) x EP(2), bit for bit
        assert resumed["loss"][s] == four["ep"]["loss"][s] and resumed["norm"][s] == four["ep"]["norm"][s], s
    _same(from_one, refs["moe"], "one process -> PP(2) x FSDP(2) x EP(2)", range(4, 7), norm_tol=1e-4)
