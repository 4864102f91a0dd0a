"""The output projection and loss in chunks of tokens: the same loss and gradients as the plain loss, less memory."""

import pytest
import torch
import torch.nn.functional as F

from titanlite.loss import IGNORE_INDEX, microbatch_loss
from titanlite.models.chunked_loss import chunked_linear_cross_entropy

from helpers import run_distributed, tiny_argv, train_all


def _plain(hidden, weight, labels):
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum", ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_equals_plain_loss_and_gradients_fp32(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(61, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (61,), generator=g)
    labels[::5] = IGNORE_INDEX  # masked labels (prompt tokens, padding) count in neither
    plain = _plain(hidden, weight, labels)
    ref = torch.autograd.grad(plain * 0.37, (hidden, weight))
    ours = chunked_linear_cross_entropy(hidden, weight, labels, chunk, IGNORE_INDEX)
    grads = torch.autograd.grad(ours * 0.37, (hidden, weight))
    assert abs(ours.item() - plain.item()) <= 1e-6 * plain.item()
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_chunked_bf16_is_as_close_as_the_plain_loss_in_bf16():
    g = torch.Generator().manual_seed(1)
    hidden32, weight32 = torch.randn(128, 32, generator=g), torch.randn(300, 32, generator=g)
    labels = torch.randint(0, 300, (128,), generator=g)
    exact = _plain(hidden32, weight32, labels)
    hidden, weight = hidden32.bfloat16(), weight32.bfloat16()
    plain = _plain(hidden, weight, labels)
    ours = chunked_linear_cross_entropy(hidden, weight, labels, 16, IGNORE_INDEX)
    assert ours.dtype == torch.float32 and abs(ours - plain) <= 1e-6 * plain  # the same per-token values
    assert abs(ours - exact) <= 1e-2 * exact


def _model_loss_and_grads(chunk, attention="causal"):
    from titanlite.models.decoder import Transformer
    from titanlite.models.llama3 import LLAMA3_FLAVORS

    model = Transformer(LLAMA3_FLAVORS["tiny"].with_overrides(vocab_size=300, attention=attention))
    model.init_weights(seed=0)
    model.loss_chunk_tokens = chunk
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 300, (3, 40), generator=g)
    labels = torch.randint(0, 300, (3, 40), generator=g)
    labels[:, :9] = IGNORE_INDEX
    positions = torch.cat([torch.arange(15), torch.arange(25)]).repeat(3, 1)
    loss, _ = microbatch_loss(model, (tokens, labels, positions), torch.device("cpu"))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_backward_scales_in_place_and_a_second_backward_is_refused():
    """The saved gradients are scaled in place (no second copy of the output's gradient at the peak); autograd
    then refuses a retain_graph second pass rather than scaling them twice."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(8, 4, generator=g, requires_grad=True)
    weight = torch.randn(10, 4, generator=g, requires_grad=True)
    labels = torch.randint(0, 10, (8,), generator=g)
    loss = chunked_linear_cross_entropy(hidden, weight, labels, 3, IGNORE_INDEX)
    (loss * 0.5).backward(retain_graph=True)
    plain = F.cross_entropy(hidden.detach() @ weight.detach().T, labels, reduction="sum")
    ref_h, ref_w = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    (F.cross_entropy(ref_h @ ref_w.T, labels, reduction="sum") * 0.5).backward()
    torch.testing.assert_close(loss.detach(), plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_w.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("attention", ["causal", "block_causal"])
def test_model_loss_in_chunks_equals_the_plain_loss(attention):
    ref_loss, ref_grads = _model_loss_and_grads(0, attention)
    loss, grads = _model_loss_and_grads(16, attention)
    assert abs(loss - ref_loss) <= 1e-6 * ref_loss
    for name, g in ref_grads.items():
        scale = g.abs().max().item()  # sum order: elementwise within 1e-5 of the gradient's size
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5 * scale, msg=name)


@pytest.mark.slow
def test_training_losses_equal_with_and_without_chunks(tmp_path):
    """10 fp32 steps: the plain loss, chunks in one process, chunks under FSDP(2) with 2 microbatches."""
    base = tiny_argv(tmp_path, "--training.global_batch_size", "8")
    plain, chunked = run_distributed(
        train_all,
        1,
        [
            base + ["--training.local_batch_size", "8", "--training.loss_chunk_tokens", "0"],
            base + ["--training.local_batch_size", "8", "--training.loss_chunk_tokens", "37"],
        ],
    )[0]
    (fsdp,) = run_distributed(
        train_all, 2, [base + ["--training.local_batch_size", "2", "--training.loss_chunk_tokens", "37"]]
    )[0]
    assert plain[10] < plain[1]
    for step, loss in plain.items():
        assert abs(chunked[step] - loss) <= 1e-6 * loss, (step, chunked[step], loss)
        assert abs(fsdp[step] - loss) <= 1e-5 * loss, (step, fsdp[step], loss)


def _measured_and_estimated(chunk: int, dtype=torch.bfloat16, vocab=4096, batch=4, seq=64):
    """MemTracker's activation peak (Activation + Temp bytes) of one forward and backward, and the dry run's
    estimate, for the tiny shape with a big vocabulary (the loss dominates)."""
    import warnings

    from torch.distributed._tools.mem_tracker import MemTracker

    from titanlite.models.decoder import Transformer
    from titanlite.models.llama3 import LLAMA3_FLAVORS
    from titanlite.sizing.memory import activation_bytes

    args = LLAMA3_FLAVORS["tiny"].with_overrides(vocab_size=vocab)
    model = Transformer(args)
    model.init_weights(seed=0)
    with warnings.catch_warnings():  # .to(bf16) casts the complex RoPE table too; init_buffers rebuilds it
        warnings.simplefilter("ignore", UserWarning)
        model.to(dtype)
    model.init_buffers()
    model.loss_chunk_tokens = chunk
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(2))
    tracker = MemTracker()
    tracker.track_external(model, tokens)
    with tracker:
        loss, _ = microbatch_loss(model, (tokens, labels), torch.device("cpu"))
        loss.backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    measured = sum(v for k, v in peak.items() if k != "Total" and k.value in ("Activation", "Temp"))
    if chunk:  # the output weight's gradient, made inside backward here; in a run it is FSDP's unsharded gradient
        measured -= vocab * args.dim * dtype.itemsize
    estimated = activation_bytes(args, batch * seq, dtype.itemsize, [], False, loss_chunk_tokens=chunk)["total"]
    return measured, estimated


def test_chunks_cut_the_measured_peak_by_the_predicted_amount():
    whole, whole_est = _measured_and_estimated(0)
    chunked, chunked_est = _measured_and_estimated(32)
    assert chunked < 0.5 * whole  # the loss dominated: most of it is gone
    assert 0.9 < (whole - chunked) / (whole_est - chunked_est) < 1.1, (whole, chunked, whole_est, chunked_est)
    assert 0.9 < chunked_est / chunked < 1.15 and 0.9 < whole_est / whole < 1.15
