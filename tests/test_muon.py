"""optimizer.name = "Muon": the update of one matrix against the papers' formulas (and torch.optim.Muon), the split
between Muon and AdamW, the same losses at every topology, exact resume (also on another topology), and the
refusal to resume another optimizer's state."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import ckpt_argv, make_trainer, run_distributed, tiny_argv, train_all

MU, LR, DECAY = 0.95, 0.02, 0.1


def _reference_orthogonalize(u: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Newton-Schulz as Jordan's post writes it, in float64: X = U / |U|_F (wide), X <- aX + b(XX^T)X + c(XX^T)^2 X."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = u.double()
    tall = x.shape[0] > x.shape[1]
    x = (x.T if tall else x) / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return (x.T if tall else x).float()


def _tiny_model(rows=16, cols=8, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList([torch.nn.Linear(cols, rows, bias=False)])  # layers.0.weight: a block's matrix
    m.norm = torch.nn.LayerNorm(rows)  # AdamW
    return m


def _optimizer(model, adjust="match_rms_adamw"):
    from titanlite.config import load
    from titanlite.optim import build_optimizer

    cfg = load(["--optimizer.name", "muon", "--optimizer.lr", str(LR), "--optimizer.weight_decay", str(DECAY),
                "--optimizer.muon_adjust_lr", adjust])  # fmt: skip
    return build_optimizer(model, cfg.optimizer)


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_one_matrix_follows_the_papers_formulas_over_two_steps(adjust):
    """B = mu B + (1 - mu) G; U = (1 - mu) G + mu B (Nesterov); O = NS5(U); W -= lr wd W + lr s O, with
    s = 0.2 sqrt(max(rows, cols)) (Liu et al.) or sqrt(max(1, rows / cols)) (Jordan): within bf16's precision (3%)
    of the float64 reference, and equal to torch.optim.Muon's own step on the same matrix; the norm's weight takes
    AdamW's step."""
    model, twin = _tiny_model(), _tiny_model()
    opt = _optimizer(model, adjust)
    torch_adamw = torch.optim.AdamW([twin.norm.weight], lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=DECAY)
    torch_muon = torch.optim.Muon([twin.layers[0].weight], lr=LR, weight_decay=DECAY, momentum=MU, adjust_lr_fn=adjust)
    buf = torch.zeros(16, 8)
    scale = 0.2 * math.sqrt(16) if adjust == "match_rms_adamw" else math.sqrt(16 / 8)
    for step in range(2):
        before = model.layers[0].weight.detach().clone()
        g = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        for p in (model.layers[0].weight, twin.layers[0].weight):
            p.grad = g.clone()
        model.norm.weight.grad = twin.norm.weight.grad = torch.linspace(-1, 1, 16)
        opt.step()
        torch_muon.step()
        torch_adamw.step()
        buf = MU * buf + (1 - MU) * g
        want = -LR * DECAY * before - LR * scale * _reference_orthogonalize((1 - MU) * g + MU * buf)
        got = model.layers[0].weight.detach() - before
        assert (got - want).norm() < 0.03 * want.norm(), (step, (got - want).norm() / want.norm())  # bf16 NS
        torch.testing.assert_close(model.layers[0].weight, twin.layers[0].weight, rtol=0, atol=1e-7)
    torch.testing.assert_close(model.norm.weight, twin.norm.weight, rtol=0, atol=1e-7)  # AdamW's own step
    assert set(opt.state[model.norm.weight]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(opt.state[model.layers[0].weight]) == {"momentum_buffer"}


def test_float32_newton_schulz_is_the_float64_iteration_to_1e5():
    """optimizer.muon_ns_dtype = float32: the iteration within 1e-5 of float64's (bfloat16's default: within 3%); the
    optimizer takes the setting from [optimizer]."""
    from titanlite.config import load
    from titanlite.muon import muon_hyperparameters, orthogonalize

    u = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    want = _reference_orthogonalize(u)
    assert (orthogonalize(u, 5, torch.float32) - want).norm() < 1e-5 * want.norm()
    assert (orthogonalize(u, 5) - want).norm() > 1e-4 * want.norm()  # the default is bf16 (torch.optim.Muon's)
    cfg = load(["--optimizer.name", "muon", "--optimizer.muon_ns_dtype", "float32"])
    assert muon_hyperparameters(cfg.optimizer)["ns_dtype"] == "float32"


@pytest.mark.slow
def test_float32_newton_schulz_keeps_losses_topology_invariant_over_20_steps(tmp_path):
    """20 steps at lr 0.03: with a float32 Newton-Schulz, FSDP(2) (each matrix orthogonalised on every rank or on one)
    gives one process's losses within 1e-5, as AdamW does (docs/optimizers.md: bfloat16 drifts by ~2e-3 here)."""
    base = tiny_argv(tmp_path, "--training.global_batch_size", "8", "--training.steps", "20", "--optimizer.lr", "0.03",
                     *_muon("--optimizer.lr", "0.03", "--optimizer.muon_ns_dtype", "float32"))  # fmt: skip
    (one,) = run_distributed(train_all, 1, [base + ["--training.local_batch_size", "8"]])[0]
    every, one_rank = run_distributed(train_all, 2, [
        base + ["--training.local_batch_size", "4"],
        base + ["--training.local_batch_size", "4", "--optimizer.muon_newton_schulz", "one_rank"],
    ])[0]  # fmt: skip
    assert one[20] < one[1] - 1, one  # it trains
    assert every == one_rank
    for step, loss in one.items():
        assert abs(every[step] - loss) <= 1e-5 * loss, (step, every[step], loss)


def test_experts_are_one_matrix_each_and_the_split_follows_the_model():
    """A 3-D experts weight [experts, in, out] is orthogonalised per expert (each as its own matrix would be); Muon
    takes the blocks' matrices (attention, MLP, experts), AdamW the embeddings, output, norms and routers."""
    from dataclasses import replace

    from titanlite.models.registry import FAMILIES, model_class
    from titanlite.muon import is_muon_matrix, lr_scale, orthogonalize

    stack = torch.randn(3, 8, 16)
    each = torch.stack([orthogonalize(stack[i], 5) for i in range(3)])
    assert torch.equal(orthogonalize(stack, 5), each)
    assert lr_scale(torch.Size([3, 8, 16]), "original") == math.sqrt(16 / 8)  # (out, in) as a Linear's
    args = replace(FAMILIES["qwen3_moe"].flavors["tiny"], vocab_size=64)
    with torch.device("meta"):
        model = model_class("qwen3_moe")(args)
    muon = {n.split(".", 2)[-1] for n, p in model.named_parameters() if is_muon_matrix(n, p)}
    assert muon == {"attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
                    "feed_forward.experts.w1", "feed_forward.experts.w2", "feed_forward.experts.w3"}  # fmt: skip


def _muon(*extra):
    return ("--optimizer.name", "muon", "--optimizer.lr", "3e-3", *extra)


@pytest.mark.slow
def test_same_losses_at_every_topology_and_exact_resume(tmp_path):
    """fp32, 6 steps: one process, FSDP(2), TP(2), PP(2), EP(2) (an MoE: whole experts on each rank, orthogonalised
    there), HSDP(2 x 2) and FSDP(2) x TP(2) give the same losses within 1e-5; FSDP(2) and FSDP(2) x TP(2) with each
    matrix orthogonalised on one rank give the same bits as on every rank; FSDP(2) resumed at step 3 repeats steps 4
    to 6 exactly, and FSDP(4) resumed from that checkpoint within 1e-5."""
    base = tiny_argv(tmp_path, "--training.global_batch_size", "8", "--training.steps", "6", *_muon())
    moe = ("--model.name", "qwen3_moe", "--moe.load_balance", "none")
    ref, ref_moe = run_distributed(train_all, 1, [base + ["--training.local_batch_size", "8"],
                                                  base + ["--training.local_batch_size", "8", *moe]])[0]  # fmt: skip
    two = run_distributed(
        _two,
        2,
        base,
        moe,
        ckpt_argv(tmp_path / "ckpt", "--training.local_batch_size", "4", *_muon()),
    )[0]
    four = run_distributed(_four, 4, base, ckpt_argv(tmp_path / "ckpt", "--training.local_batch_size", "2", *_muon()))[
        0
    ]
    assert ref[6] < ref[1] - 0.05, ref  # it trains
    runs = {**two["runs"], **four["runs"]}
    for name in ("fsdp2", "fsdp2_tp2"):  # orthogonalised on one rank and broadcast: the same bits
        assert runs[f"{name}_one_rank"] == runs[name], name
    for name, losses in {**two["runs"], **four["runs"]}.items():
        want = ref_moe if name == "ep2" else ref
        for step, loss in want.items():
            assert abs(losses[step] - loss) <= 1e-5 * loss, (name, step, losses[step], loss)
    saved = two["saved"]
    for name, resumed in (("fsdp2", two["resumed"]), ("fsdp4", four["resumed"])):
        assert sorted(resumed) == [4, 5, 6], name
        for step, loss in resumed.items():
            assert abs(loss - saved[step]) <= (0 if name == "fsdp2" else 1e-5 * loss), (name, step, loss, saved)


def _two(base, moe, ckpt):
    runs = dict(zip(
        ("fsdp2", "tp2", "pp2", "ep2", "fsdp2_one_rank"),
        train_all([
            base + ["--training.local_batch_size", "4"],
            base + ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"],
            base + ["--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2"],
            base + ["--training.local_batch_size", "4", *moe, "--parallelism.expert_parallel_degree", "2"],
            base + ["--training.local_batch_size", "4", "--optimizer.muon_newton_schulz", "one_rank"],
        ]),
    ))  # fmt: skip
    saved = make_trainer(ckpt + ["--checkpoint.interval", "3"]).train()
    resumed = make_trainer(ckpt + ["--checkpoint.load_step", "3"]).train()
    return {"runs": runs, "saved": saved, "resumed": resumed}


def _four(base, ckpt):
    runs = dict(zip(
        ("hsdp2x2", "fsdp2_tp2", "fsdp2_tp2_one_rank"),
        train_all([
            base + ["--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree", "2"],
            base + ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"],
            base + ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2",
                    "--optimizer.muon_newton_schulz", "one_rank"],
        ]),
    ))  # fmt: skip
    resumed = make_trainer(ckpt + ["--checkpoint.load_step", "3"]).train()
    return {"runs": runs, "resumed": resumed}


@pytest.mark.slow
def test_a_checkpoint_of_another_optimizer_is_refused_unless_its_state_is_left_out(tmp_path):
    """An AdamW checkpoint resumed as Muon: one message naming both and the way out; with
    checkpoint.exclude_from_loading = optimizer, Muon starts fresh from its weights; as Adam it resumes."""

    run_distributed(_adamw_then_muon, 1, str(tmp_path))


def _adamw_then_muon(tmp):
    from titanlite.config import ConfigError

    argv = ckpt_argv(tmp, "--training.steps", "2", "--training.local_batch_size", "8")
    make_trainer(argv).train()
    more = argv + ["--training.steps", "3", *_muon()]
    with pytest.raises(ConfigError, match=r"saved with optimizer.name = 'AdamW', this run has 'muon'.*"
                                          r"exclude_from_loading optimizer"):  # fmt: skip
        make_trainer(more)
    assert make_trainer(argv + ["--optimizer.name", "Adam"]).step == 2  # Adam and AdamW keep the same moments
    t = make_trainer(more + ["--checkpoint.exclude_from_loading", "optimizer"])
    assert t.step == 2 and 3 in t.train()


@pytest.mark.slow
def test_the_dry_run_counts_one_state_per_matrix_and_the_newton_schulz_flops(capsys):
    """Llama 3 8B on 8 ranks: Muon keeps one fp32 state per block matrix (AdamW two for the rest), and the report
    gives the Newton-Schulz FLOPs a rank spends: 5 x (4 m^2 n + 2 m^3) per m x n matrix (m <= n), all 32 blocks,
    on each rank (every_rank) or over the 8 (one_rank; here with 4 iterations)."""
    from test_dry_run import _main, _table

    rows = {}
    for name in ("AdamW", "Muon"):
        code, out, _ = _main(capsys, 8, "--job.config_file", "llama8b_fsdp", "--optimizer.name", name)
        assert code == 0, out
        rows[name] = _table(out)["optimizer"]
    blocks = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336)  # wq wo, wk wv, w1 w2 w3
    other = 8_030_261_248 - blocks
    assert rows["Muon"] == pytest.approx((blocks * 4 + other * 8) / 8 / 2**30, abs=0.01)
    assert rows["AdamW"] == pytest.approx(8_030_261_248 * 8 / 8 / 2**30, abs=0.01)

    def ns(m, n):
        return 5 * (4 * m * m * n + 2 * m**3)

    flops = 32 * (2 * ns(4096, 4096) + 2 * ns(1024, 4096) + 3 * ns(4096, 14336))
    assert f"Muon: Newton-Schulz {flops / 1e12:.2f} TFLOPs per step on each rank (every matrix" in out
    _, out, _ = _main(capsys, 8, "--job.config_file", "llama8b_fsdp", "--optimizer.name", "muon",
                      "--optimizer.muon_newton_schulz", "one_rank", "--optimizer.muon_ns_steps", "4")  # fmt: skip
    assert f"Muon: Newton-Schulz {flops * 4 / 5 / 8 / 1e12:.2f} TFLOPs per step on each rank (its share" in out
