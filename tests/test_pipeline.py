"""Pipeline parallelism: the same losses and gradient norms as one process (fp32, 10 steps, 1e-5) with every
schedule, with accumulation, composed with FSDP, TP and the delayed all-reduce; exact resume; a PP(2) x FSDP(2)
checkpoint resumed in one process and the reverse; validation under pp; the split by size and the checks.

One spawned world per size (1, 2 and 4, gloo), each running several configurations."""

import shutil
import types

import pytest

from helpers import make_trainer, run_distributed, run_module, tiny_argv

# The debug model (6 blocks) at seq 32: 4 sequences per local batch = 4 pipeline microbatches; global batch 8.
BASE = ("--model.flavor", "debugmodel", "--training.local_batch_size", "4", "--training.global_batch_size", "8")
VALIDATE = ("--validation.enable", "--validation.freq", "5", "--validation.steps", "1")
CKPT = ("--checkpoint.enable", "--checkpoint.interval", "5")


def _pp(schedule="1F1B", *extra):
    return ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", schedule, *extra)


def _argv(folder, *extra):
    argv = tiny_argv(folder, *BASE, *extra)
    argv[argv.index("--model.flavor") + 1] = "debugmodel"  # tiny_argv's flavor is overridden by BASE's
    return argv


def _run(cases):
    """cases: (name, dump folder, extra argv); per name the logged losses, gradient norms and validation losses."""
    out = {}
    for name, folder, extra in cases:
        trainer = make_trainer(_argv(folder, *extra))
        norms = {}
        step = trainer.train_step

        def recorded(*a, _step=step, _trainer=trainer, _norms=norms, **k):
            result = _step(*a, **k)
            _norms[_trainer.step] = result.grad_norm.item()
            return result

        trainer.train_step = recorded
        losses = trainer.train()
        out[name] = {"loss": losses, "norm": norms, "val": dict(trainer.val_losses)}
    return out


def _same(a: dict, b: dict, what: str, steps=range(1, 11), tol=1e-5):
    for key in ("loss", "norm"):
        for s in steps:
            assert abs(a[key][s] - b[key][s]) <= tol * max(1.0, abs(b[key][s])), (what, key, s, a[key][s], b[key][s])


def _drop_after(folder, step: int):
    """Remove the checkpoints after `step`, so that a relaunch resumes from it."""
    for path in (folder / "checkpoint").glob("step-*"):
        if int(path.name.split("-")[1]) > step:
            shutil.rmtree(path)


@pytest.mark.slow
def test_pipeline_matches_one_process(tmp_path):
    one, pp_fsdp = tmp_path / "one", tmp_path / "pp_fsdp"
    BLOCK = ("--model.attention", "block_causal")  # document starts travel to every stage
    refs = run_distributed(_run, 1, [("one", one, (*VALIDATE, *CKPT)), ("docs", tmp_path / "docs", BLOCK)])[0]
    ref = refs["one"]
    assert ref["val"] and all(v > 0 for v in ref["val"].values())

    two = run_distributed(
        _run,
        2,
        [
            ("GPipe", tmp_path / "g", _pp("GPipe")),
            ("1F1B", tmp_path / "f", (*_pp("1F1B"), *VALIDATE, *CKPT)),
            ("Interleaved1F1B", tmp_path / "i", _pp("Interleaved1F1B")),
            ("ZBVZeroBubble", tmp_path / "z", _pp("ZBVZeroBubble")),
            ("block_causal", tmp_path / "b", (*_pp("1F1B"), *BLOCK)),
            ("ZBV_full_ac", tmp_path / "za", (*_pp("ZBVZeroBubble"), "--activation_checkpoint.mode", "full")),
            (
                "op_ac_compiled",
                tmp_path / "c",
                (
                    *_pp("Interleaved1F1B"),
                    "--activation_checkpoint.mode",
                    "selective",
                    "--compile.enable",
                    "true",
                    "--compile.backend",
                    "aot_eager",
                ),
            ),
            # 2 pipeline microbatches of 2 sequences; 3 stages per rank (6 of 1 block each)
            (
                "fewer",
                tmp_path / "m",
                _pp(
                    "Interleaved1F1B",
                    "--parallelism.pipeline_parallel_microbatches",
                    "2",
                    "--parallelism.pipeline_parallel_stages_per_rank",
                    "3",
                ),
            ),  # fmt: skip
        ],
    )[-1]  # the last stage's rank logs what rank 0 logs; its norms are the global ones too
    for name, got in two.items():
        _same(got, refs["docs"] if name == "block_causal" else ref, name)
    assert abs(refs["docs"]["loss"][2] - ref["loss"][2]) > 1e-4  # the documents do change the loss
    assert two["1F1B"]["val"].keys() == ref["val"].keys()
    assert all(abs(two["1F1B"]["val"][s] - v) < 1e-5 for s, v in ref["val"].items())

    # Exact resume at PP(2): steps 6-10 from the step-5 checkpoint are the uninterrupted run's, bit for bit.
    f = tmp_path / "f"
    _drop_after(f, 5)
    four_cases = [
        ("fsdp", pp_fsdp, (*_pp("1F1B"), *CKPT)),
        ("tp", tmp_path / "t", (*_pp("Interleaved1F1B"), "--parallelism.tensor_parallel_degree", "2")),
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
        ("from_one", one, (*_pp("1F1B"), *CKPT)),  # resumes the one-process run's step-5 checkpoint at PP(2) x FSDP(2)
    ]
    _drop_after(one, 5)
    resumed = run_distributed(_run, 2, [("resumed", f, (*_pp("1F1B"), *VALIDATE, *CKPT))])[-1]["resumed"]
    for s in range(6, 11):
        assert resumed["loss"][s] == two["1F1B"]["loss"][s] and resumed["norm"][s] == two["1F1B"]["norm"][s], s

    four = run_distributed(_run, 4, four_cases)[-1]
    for name in ("fsdp", "tp", "hsdp_delayed"):
        _same(four[name], ref, name)
    _same(four["from_one"], ref, "one process -> PP(2) x FSDP(2)", steps=range(6, 11))

    # PP(2) x FSDP(2)'s step-5 checkpoint, resumed in one process
    _drop_after(pp_fsdp, 5)
    back = run_distributed(_run, 1, [("back", pp_fsdp, ())])[0]["back"]
    _same(back, four["fsdp"], "PP(2) x FSDP(2) -> one process", steps=range(6, 11))

    # generate runs without pp: a PP(2) x FSDP(2) run's checkpoint (the one-process resume's step 10), as one model
    def generate(*extra):
        return run_module("titanlite.generate", "--config", "debug_model", *_argv(pp_fsdp), "--checkpoint",
                          str(pp_fsdp / "checkpoint"), "--prompt", "The", "--max-new-tokens", "8", "--temperature",
                          "0", *extra)  # fmt: skip

    plain, with_pp = generate(), generate(*_pp("1F1B"))
    assert plain.returncode == 0 and with_pp.returncode == 0, with_pp.stderr[-2000:]
    assert with_pp.stdout == plain.stdout and plain.stdout.startswith("The")
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
    assert [d.pp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert d.describe() == "PP: pipeline_parallel_size=2; FSDP: shard_size=2"
