"""Pipeline parallelism: the same losses and gradient norms as one process (fp32, 6 steps, 1e-5) with every
schedule, with accumulation, composed with FSDP, TP and the delayed all-reduce, with tied embeddings; exact resume; a
PP(2) x FSDP(2) checkpoint resumed in one process and the reverse (tied too); validation under pp; the split by size
and the checks.

One spawned world per size (1, 2 and 4, gloo), each running several configurations."""

import shutil
import types

import pytest

from helpers import make_trainer, run_distributed, run_module, tiny_argv

# The debug model (6 blocks) at seq 32: 4 sequences per local batch = 4 pipeline microbatches; global batch 8.
BASE = ("--model.flavor", "debugmodel", "--training.local_batch_size", "4", "--training.global_batch_size", "8",
        "--training.steps", "6")  # fmt: skip
VALIDATE = ("--validation.enable", "--validation.freq", "3", "--validation.steps", "1")
CKPT = ("--checkpoint.enable", "--checkpoint.interval", "3")
TIE = ("--model.tie_embeddings", "true")


def _pp(schedule="1F1B", *extra):
    return ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", schedule, *extra)


def _argv(folder, *extra):
    argv = tiny_argv(folder, *BASE, *extra)
    argv[argv.index("--model.flavor") + 1] = "debugmodel"  # tiny_argv's flavor is overridden by BASE's
    return argv


def _run(cases):
    """cases: (name, dump folder, extra argv); per name the logged losses, gradient norms and validation losses, the
    pipeline schedule run (None without pp), this rank's parameter tensors and its all-reduce calls (FSDP's across
    replicas among them)."""
    import torch.distributed as dist

    out = {}
    for name, folder, extra in cases:
        trainer = make_trainer(_argv(folder, *extra))
        norms, calls, by_call = {}, [0], {True: [], False: []}
        step, all_reduce = trainer.train_step, dist.all_reduce
        if trainer.pipeline is not None:  # the all-reduces of each pipeline pass, by whether it all-reduces replicas
            pass_step = trainer.pipeline.step

            def counted_pass(*a, _step=pass_step, _calls=calls, _by=by_call, **k):
                before = _calls[0]
                loss = _step(*a, **k)
                _by[k.get("all_reduce", a[2] if len(a) > 2 else True)].append(_calls[0] - before)
                return loss

            trainer.pipeline.step = counted_pass

        def recorded(*a, _step=step, _trainer=trainer, _norms=norms, **k):
            result = _step(*a, **k)
            _norms[_trainer.step] = result.grad_norm.item()
            return result

        def counted(*a, _calls=calls, _all_reduce=all_reduce, **k):
            _calls[0] += 1
            return _all_reduce(*a, **k)

        trainer.train_step, dist.all_reduce = recorded, counted
        try:
            losses = trainer.train()
        finally:
            dist.all_reduce = all_reduce
        out[name] = {
            "loss": losses,
            "norm": norms,
            "val": dict(trainer.val_losses),
            "schedule": trainer.pipeline.schedule_name if trainer.pipeline else None,
            "params": len(list(trainer.model.parameters())),
            "all_reduces": by_call,
            "group_keys": sorted(trainer.optimizer.param_groups[0]),
            "stages": len(trainer.pipeline.stage_to_rank) if trainer.pipeline else 1,
            "tied_identical": _tied_copies_identical(trainer.pipeline),
            "experts_per_rank": _experts_per_rank(trainer.model),
            "cp": trainer.dims.cp if trainer.model.cp_group is not None else 1,
            "trained": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad),
        }
    return out


def _experts_per_rank(model) -> int | None:
    """The experts of each MoE block this rank computes (its token exchange's group: parallel/ep.py); None for a
    dense model."""
    import torch.distributed as dist

    experts = model.expert_units() if model.args.moe else []
    if not experts:
        return None
    group = getattr(experts[0], "ep_group", None)
    return model.args.n_experts // (dist.get_world_size(group) if group is not None else 1)


def _tied_copies_identical(pipeline) -> bool | None:
    """Whether this rank's copy of a weight tied across the pipeline (tied embeddings) is bit-identical to the other
    end's copy; None without one."""
    import torch
    import torch.distributed as dist

    if pipeline is None or pipeline.tie_group is None:
        return None
    (weight,) = [s.submod.tied_weight() for s in pipeline.stages if s.submod.tied_weight() is not None]
    high, low = weight.to_local().detach().clone(), weight.to_local().detach().clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=pipeline.tie_group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=pipeline.tie_group)
    return torch.equal(high, low)


def _checkpoint_keys(folder, step: int) -> dict[str, int]:
    """Each name a checkpoint holds, with the number of chunks written for it (by all ranks together)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder / "checkpoint" / f"step-{step}")).read_metadata()
    written = [index.fqn for index in metadata.storage_data]
    return {k: written.count(k) for k in metadata.state_dict_metadata}


def _same(a: dict, b: dict, what: str, steps=range(1, 7), tol=1e-5, norm_tol=None):
    """Losses within tol of b's, step for step, and gradient norms within norm_tol (None: tol)."""
    for key, within in (("loss", tol), ("norm", norm_tol or tol)):
        for s in steps:
            assert abs(a[key][s] - b[key][s]) <= within * max(1.0, abs(b[key][s])), (what, key, s, a[key][s], b[key][s])


def _drop_after(folder, step: int):
    """Remove the checkpoints after `step`, so that a relaunch resumes from it."""
    for path in (folder / "checkpoint").glob("step-*"):
        if int(path.name.split("-")[1]) > step:
            shutil.rmtree(path)


@pytest.mark.slow
def test_pipeline_matches_one_process(tmp_path):
    one, pp_fsdp = tmp_path / "one", tmp_path / "pp_fsdp"
    tied_one, tied_pp = tmp_path / "tied_one", tmp_path / "tied_pp"  # tied embeddings: one process, PP(2)
    BLOCK = ("--model.attention", "block_causal")  # document starts travel to every stage
    HF = ("--checkpoint.last_save_in_hf",)
    refs = run_distributed(
        _run,
        1,
        [
            ("one", one, (*VALIDATE, *CKPT, *HF)),
            ("docs", tmp_path / "docs", BLOCK),
            ("tied", tied_one, (*TIE, *CKPT, *HF)),
        ],
    )[0]
    ref = refs["one"]
    assert ref["val"] and all(v > 0 for v in ref["val"].values())

    two = run_distributed(
        _run,
        2,
        [
            ("GPipe", tmp_path / "g", _pp("GPipe")),
            ("1F1B", tmp_path / "f", (*_pp("1F1B"), *VALIDATE, *CKPT, *HF)),
            # the first stage's embedding is the last stage's output projection: a copy on each rank
            ("1F1B_tied", tied_pp, (*_pp("1F1B"), *TIE, *CKPT, *HF)),
            ("Interleaved1F1B", tmp_path / "i", _pp("Interleaved1F1B")),
            ("ZBVZeroBubble", tmp_path / "z", (*_pp("ZBVZeroBubble"), *VALIDATE)),
            ("block_causal", tmp_path / "b", (*_pp("1F1B"), *BLOCK)),
            # fewer pipeline microbatches (1) than pp: torch runs ZBV (and Interleaved1F1B, below) with them
            (
                "ZBVZeroBubble_full_ac",
                tmp_path / "za",
                (
                    *_pp("ZBVZeroBubble", "--parallelism.pipeline_parallel_microbatches", "1"),
                    "--activation_checkpoint.mode",
                    "full",
                ),
            ),
            # 2 pipeline microbatches of 2 sequences, 3 stages per rank (6 stages of 1 block), op AC, compile
            (
                "op_ac_compiled",
                tmp_path / "c",
                (
                    *_pp("Interleaved1F1B"),
                    "--parallelism.pipeline_parallel_microbatches",
                    "2",
                    "--parallelism.pipeline_parallel_stages_per_rank",
                    "3",
                    "--activation_checkpoint.mode",
                    "selective",
                    "--activation_checkpoint.selective_ac_option",
                    "op",
                    "--compile.enable",
                    "true",
                    "--compile.backend",
                    "aot_eager",
                ),
            ),  # fmt: skip
        ],
    )[-1]  # the last stage's rank logs what rank 0 logs; its norms are the global ones too
    for name, got in two.items():
        _same(got, refs["docs"] if name == "block_causal" else refs["tied"] if "tied" in name else ref, name)
        assert got["schedule"] in name or name in ("block_causal", "op_ac_compiled"), name
        assert got["schedule"] and got["params"] < ref["params"], name  # pipelined: this rank holds some stages
    assert abs(refs["docs"]["loss"][2] - ref["loss"][2]) > 1e-4  # the documents do change the loss
    for name in ("1F1B", "ZBVZeroBubble"):  # ZBV: rank 0 holds the first stage and the last
        assert two[name]["val"].keys() == ref["val"].keys()
        assert all(abs(two[name]["val"][s] - v) < 1e-5 for s, v in ref["val"].items()), name

    # Each stage's ranks write their parameters of the HuggingFace export: the whole model, one process's weights
    from safetensors.torch import load_file

    exports = [
        {k: v for f in (folder / "checkpoint" / "hf-step-6").glob("*.safetensors") for k, v in load_file(f).items()}
        for folder in (one, tmp_path / "f", tied_one, tied_pp)
    ]
    assert exports[0].keys() == exports[1].keys() and len(exports[0]) > 50
    assert exports[2].keys() == exports[3].keys() == exports[0].keys() - {"lm_head.weight"}
    for a, b in (exports[:2], exports[2:]):
        assert all((a[k] - b[k]).abs().max() < 1e-5 for k in a)

    # Tied embeddings at PP(2): two stages, both copies of the tied weight still bit-identical after 6 steps, and
    # the checkpoint holds what one process's does (the weight under its names, its optimizer state once), each
    # chunk written once although both ranks hold it
    tied = two["1F1B_tied"]
    assert tied["stages"] == 2 and tied["tied_identical"] is True and refs["tied"]["tied_identical"] is None
    tied_keys, one_keys = _checkpoint_keys(tied_pp, 6), _checkpoint_keys(tied_one, 6)
    assert tied_keys == one_keys and set(tied_keys.values()) == {1}
    assert "optimizer.state.tok_embeddings.weight.exp_avg" in tied_keys and not any(
        k.startswith("optimizer.state.output.") for k in tied_keys
    )

    # Exact resume at PP(2): steps 4-6 from the step-3 checkpoint are the uninterrupted run's, bit for bit.
    f = tmp_path / "f"
    _drop_after(f, 3)
    four_cases = [
        ("fsdp", pp_fsdp, (*_pp("1F1B"), *CKPT)),
        (
            "tp",
            tmp_path / "t",
            (
                *_pp("Interleaved1F1B", "--parallelism.pipeline_parallel_microbatches", "1"),
                "--parallelism.tensor_parallel_degree",
                "2",
                *VALIDATE,
            ),
        ),
        (
            "hsdp_delayed",
            tmp_path / "d",
            (
                *_pp("GPipe"),
                "--parallelism.data_parallel_replicate_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
                "--training.local_batch_size",
                "2",
                "--parallelism.gradient_sync",
                "delay_all_reduce",
            ),
        ),  # fmt: skip
        ("from_one", one, (*_pp("1F1B"), *CKPT)),  # resumes the one-process run's step-3 checkpoint at PP(2) x FSDP(2)
    ]
    INIT = ("--checkpoint.initial_load_path", str(one / "checkpoint" / "step-3"))  # a new run from its weights
    _drop_after(one, 3)
    _drop_after(tied_one, 3)
    _drop_after(tied_pp, 3)
    again = run_distributed(
        _run,
        2,
        [
            ("resumed", f, (*_pp("1F1B"), *VALIDATE, *CKPT)),
            ("init", tmp_path / "n", (*_pp("1F1B"), *INIT)),
            ("tied_resumed", tied_pp, (*_pp("1F1B"), *TIE, *CKPT)),
            ("tied_from_one", tied_one, (*_pp("1F1B"), *TIE, *CKPT)),  # the one-process tied step-3 checkpoint at PP(2)
        ],
    )[-1]
    for name, run in (("resumed", "1F1B"), ("tied_resumed", "1F1B_tied")):
        resumed = again[name]
        assert min(resumed["loss"]) == 4, name  # it did resume
        for s in range(4, 7):
            assert resumed["loss"][s] == two[run]["loss"][s] and resumed["norm"][s] == two[run]["norm"][s], (name, s)
    assert again["resumed"]["group_keys"] == two["1F1B"]["group_keys"]  # every rank's optimizer settings survive
    assert min(again["tied_from_one"]["loss"]) == 4 and again["tied_from_one"]["tied_identical"] is True
    _same(again["tied_from_one"], refs["tied"], "tied: one process -> PP(2)", steps=range(4, 7))

    four = run_distributed(_run, 4, four_cases)[-1]
    for name in ("fsdp", "tp", "hsdp_delayed"):
        _same(four[name], ref, name)
        assert four[name]["schedule"], name
    assert all(abs(four["tp"]["val"][s] - v) < 1e-5 for s, v in ref["val"].items())  # interleaved stages, TP
    assert min(four["from_one"]["loss"]) == 4
    _same(four["from_one"], ref, "one process -> PP(2) x FSDP(2)", steps=range(4, 7))
    # the delayed all-reduce: FSDP all-reduces across the replicas on the last of 2 accumulation microbatches only
    delayed = four["hsdp_delayed"]["all_reduces"]
    assert len(delayed[False]) == len(delayed[True]) == 6 and set(delayed[False]) == {0} and min(delayed[True]) > 0

    # PP(2) x FSDP(2)'s step-3 checkpoint, resumed in one process; a one-process run from the same initial weights
    _drop_after(pp_fsdp, 3)
    _drop_after(tied_pp, 3)  # (the exact resume above saved its steps 4-6 again)
    last = run_distributed(
        _run, 1, [("back", pp_fsdp, CKPT), ("init", tmp_path / "n1", INIT), ("tied_back", tied_pp, (*TIE, *CKPT))]
    )[0]
    for name, run in (("back", four["fsdp"]), ("tied_back", refs["tied"])):
        assert min(last[name]["loss"]) == 4, name
        _same(last[name], run, f"{name}: PP(2) -> one process", steps=range(4, 7))
    _same(again["init"], last["init"], "initial weights at PP(2)")
    assert abs(last["init"]["loss"][1] - ref["loss"][1]) > 0.1  # they are the trained weights, not a fresh init

    # generate runs without pp: a PP(2) x FSDP(2) run's checkpoint (the one-process resume's step 6), as one model
    def generate(*extra):
        return run_module("titanlite.generate", "--config", "debug_model", *_argv(pp_fsdp), "--checkpoint",
                          str(pp_fsdp / "checkpoint"), "--prompt", "The", "--max-new-tokens", "8", "--temperature",
                          "0", *extra)  # fmt: skip

    with_pp = generate(*_pp("1F1B"))
    assert with_pp.returncode == 0 and with_pp.stdout.startswith("The"), with_pp.stderr[-2000:]
    assert "pipeline_parallel_degree = 2 is a training setting: generation runs without it" in with_pp.stderr


def _parallelism(**kw):
    p = dict(
        pipeline_parallel_degree=2,
        pipeline_parallel_schedule="1F1B",
        pipeline_parallel_microbatches=-1,
        pipeline_parallel_stages_per_rank=-1,
        pipeline_parallel_layers_per_stage=[],
    )
    p.update(kw)
    return types.SimpleNamespace(**p)


def test_split_by_size_gives_the_ends_fewer_blocks():
    from titanlite.parallel.pp import split_by_size, stage_blocks

    # 405B-like: 126 blocks of 3.25, embedding and output 2.1 each -> the first and last stages hold fewer
    counts = split_by_size(2100, [3250] * 126, 2100, 8)
    assert sum(counts) == 126 and counts[0] < counts[3] and counts[-1] < counts[3], counts
    assert max(counts) - min(counts) <= 1
    assert split_by_size(0, [1] * 6, 0, 3) == [2, 2, 2]
    assert split_by_size(100, [1] * 4, 0, 2) == [1, 3]  # a heavy embedding: one block with it
    blocks = stage_blocks(_parallelism(pipeline_parallel_layers_per_stage=[2, 4]), (0, [1] * 6, 0))
    assert blocks == [range(0, 2), range(2, 6)]


def test_stage_placement_and_bubble():
    from titanlite.parallel.pp import bubble_fraction, rank_stages

    assert rank_stages(1, 4, 2, "Interleaved1F1B") == [1, 5]
    assert rank_stages(1, 4, 2, "ZBVZeroBubble") == [1, 6]
    assert rank_stages(3, 4, 1, "1F1B") == [3]
    assert bubble_fraction("1F1B", 8, 8, 1) == pytest.approx(7 / 15)
    assert bubble_fraction("Interleaved1F1B", 8, 8, 2) == pytest.approx(7 / 23)
    assert bubble_fraction("ZBVZeroBubble", 4, 8, 2) == 0.0
    assert bubble_fraction("1F1B", 1, 8, 1) == 0.0
    from titanlite.sizing.pipeline import in_flight

    assert [in_flight("GPipe", 8, 0, 32, 1), in_flight("1F1B", 8, 3, 32, 1), in_flight("1F1B", 8, 3, 2, 1)] == [
        32,
        5,
        2,
    ]
    assert in_flight("Interleaved1F1B", 8, 0, 32, 2) == 11.5 and in_flight("ZBVZeroBubble", 8, 5, 32, 2) == 8


def test_dims_put_pp_outermost():
    from titanlite.parallel.dims import ParallelDims

    p = types.SimpleNamespace(
        data_parallel_shard_degree=-1, data_parallel_replicate_degree=1, tensor_parallel_degree=2,
        pipeline_parallel_degree=2,
    )  # fmt: skip
    d = ParallelDims.from_config(p, 8)
    assert (d.pp, d.dp_shard, d.tp, d.dp_degree) == (2, 2, 2, 2)
    assert d.mesh_dim_names == ("pp", "dp_shard", "tp") and d.mesh_shape == (2, 2, 2)
    assert [d.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]  # both stages of a dp rank read its batch
    assert d.describe() == "PP: pipeline_parallel_size=2; FSDP: shard_size=2"


def test_torchs_shape_learning_forward_is_one_titanlite_marks():
    """An MoE stage must not count the loads of the forward torch's PipelineStage runs once to learn shapes
    (compat.py marks it by name): this torch has one of the names, and the marked stage sets the flag during it."""
    from torch.distributed.pipelining import PipelineStage

    from titanlite.compat import SHAPE_LEARNING_FORWARDS, pipeline_stage_class

    names = [n for n in SHAPE_LEARNING_FORWARDS if hasattr(PipelineStage, n)]
    assert names, "torch renamed PipelineStage's shape-learning forward: add its name to compat.SHAPE_LEARNING_FORWARDS"
    seen = []
    stage = types.SimpleNamespace(submod=types.SimpleNamespace(inferring=False))
    original = getattr(PipelineStage, names[0])
    try:
        setattr(PipelineStage, names[0], lambda self: seen.append(self.submod.inferring))
        pipeline_stage_class.cache_clear()
        getattr(pipeline_stage_class(), names[0])(stage)
    finally:
        setattr(PipelineStage, names[0], original)
        pipeline_stage_class.cache_clear()
    assert seen == [True] and stage.submod.inferring is False
