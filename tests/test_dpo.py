"""Preference fine-tuning ([dpo]): the pair losses against a hand computation and TRL's own loss code, the pair data
(encoding, truncation, order), the same losses, gradient norms and rewards at 1 process, FSDP, HSDP and TP with
the copy, precomputed, LoRA and QLoRA references, ln 2 at the first step, exact resume (the precomputed reference
included) and resume on another topology, and the bad-input catalogue."""

import json
import math
import types
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

from titanlite.config import load
from titanlite.data.build import build_loader, training_specs
from titanlite.data.formats import make_encoder
from titanlite.data.tokenizers import ByteTokenizer
from titanlite.errors import ConfigError
from titanlite.loss import IGNORE_INDEX
from titanlite.preference.losses import pair_losses, sequence_logps

from bad_inputs import Case, check
from helpers import capture_logs, ckpt_argv, make_trainer, run_distributed, run_module, tiny_argv

COUNTRIES = ["France", "Japan", "Italy", "Spain", "Egypt", "Peru", "Kenya", "Chile", "Chad", "Laos", "Iran", "Oman"]
CAPITALS = ["Paris", "Tokyo", "Rome", "Madrid", "Cairo", "Lima", "Nairobi", "Santiago", "Ndjamena", "Vientiane"]


def _pairs(n: int, offset: int = 0) -> list[dict]:
    """n preference records in the three forms (strings; messages; TRL's implicit prompt), short and of mixed length."""
    out = []
    for i in range(offset, offset + n):
        country, capital = COUNTRIES[i % len(COUNTRIES)], CAPITALS[i % len(CAPITALS)]
        question = f"What is the capital of {country}? ({i})"
        chosen, rejected = f"The capital of {country} is {capital}.", "I" + " do not know" * (1 + i % 3) + "."
        if i % 3 == 0:
            out.append({"prompt": question, "chosen": chosen, "rejected": rejected})
        elif i % 3 == 1:
            out.append(
                {
                    "prompt": [{"role": "user", "content": question}],
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}],
                }
            )
        else:
            user = {"role": "user", "content": question}
            out.append(
                {
                    "chosen": [user, {"role": "assistant", "content": chosen}],
                    "rejected": [user, {"role": "assistant", "content": rejected}],
                }
            )
    return out


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def dpo_argv(tmp, *extra):
    """The tiny model, 4 steps of 8 pairs (fp32) on short pairs at seq 128, reference copy, plus extra."""
    train = tmp / "pairs.jsonl"
    if not train.exists():
        tmp.mkdir(parents=True, exist_ok=True)
        _write(train, _pairs(48))
        _write(tmp / "held_out.jsonl", _pairs(8, offset=100))
    return tiny_argv(
        tmp / "run",
        "--training.dataset",
        str(train),
        "--data.format",
        "preference",
        "--dpo.enable",
        "--dpo.reference",
        "copy",
        "--training.seq_len",
        "128",
        "--training.steps",
        "4",
        "--training.global_batch_size",
        "8",
        "--optimizer.lr",
        "1e-2",
        "--data.store_folder",
        str(tmp / "stores"),
        *extra,
    )


# ------------------------------------------------------------------------------------------------ the losses


class _Accelerator:
    device = torch.device("cpu")

    def gather_for_metrics(self, x):
        return x

    gather = gather_for_metrics


def _trl_dpo_loss(kind, beta, per_token, mask, ref):
    """TRL's DPOTrainer loss code (trl 1.x `_compute_loss`) on these per-token log-probabilities (rows: chosen, then
    rejected) and precomputed reference log-probabilities; (loss, TRL's metrics)."""
    from trl.trainer.dpo_trainer import DPOTrainer

    def model(**_):
        shape = per_token.shape
        zeros = torch.zeros(shape)
        return types.SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    model.training = True
    b = len(ref) // 2
    self = types.SimpleNamespace(
        model=model, accelerator=_Accelerator(), aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=[kind], loss_weights=[1.0], beta=beta, label_smoothing=0.0,
        use_weighting=False, _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    inputs = {
        "input_ids": torch.zeros(mask.shape, dtype=torch.long),
        "completion_mask": mask,
        "attention_mask": torch.ones(mask.shape),
        "ref_chosen_logps": ref[:b],
        "ref_rejected_logps": ref[b:],
    }
    return DPOTrainer._compute_loss(self, model, inputs, False), self._metrics["train"]


def _trl_simpo_loss(beta, gamma, smoothing, chosen_mean, rejected_mean):
    """TRL's CPOTrainer loss code for SimPO on mean log-probabilities."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    self = types.SimpleNamespace(
        alpha=0.0,
        loss_type="simpo",
        simpo_gamma=gamma,
        beta=beta,
        label_smoothing=smoothing,
        accelerator=_Accelerator(),
    )
    return CPOTrainer.cpo_loss(self, chosen_mean, rejected_mean)[0]


def test_pair_losses_equal_the_hand_formulas_and_trls_loss_code():
    pytest.importorskip("trl")
    torch.manual_seed(0)
    b, length = 5, 9
    mask = (torch.rand(2 * b, length) > 0.3).long()
    mask[:, 0], mask[:, 1] = 0, 1  # every row counts at least one token
    per_token = -torch.rand(2 * b, length - 1) * mask[:, 1:]
    policy, counts = per_token.sum(1), mask[:, 1:].sum(1)
    reference = -torch.rand(2 * b) * 5
    beta = 0.1
    pc, pr, rc, rr = *policy.chunk(2), *reference.chunk(2)
    nc, nr = counts.float().chunk(2)

    hand = {
        "sigmoid": -F.logsigmoid(beta * ((pc - rc) - (pr - rr))),
        "ipo": ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2,
    }
    for kind, expected in hand.items():
        losses, chosen, rejected = pair_losses(kind, beta, policy, reference, counts)
        assert torch.allclose(losses, expected, atol=1e-6), kind
        trl_loss, trl_metrics = _trl_dpo_loss(kind, beta, per_token, mask, reference)
        assert abs(losses.mean().item() - trl_loss.item()) < 1e-6, kind
        assert abs(chosen.mean().item() - trl_metrics["rewards/chosen"][0]) < 1e-6
        assert abs(rejected.mean().item() - trl_metrics["rewards/rejected"][0]) < 1e-6
        assert abs((chosen > rejected).float().mean().item() - trl_metrics["rewards/accuracies"][0]) < 1e-6

    # cDPO's label smoothing, and SimPO (reference-free, mean log-probabilities) against TRL's CPO trainer
    eps, gamma = 0.2, 0.5
    margin = beta * ((pc - rc) - (pr - rr))
    smoothed = pair_losses("sigmoid", beta, policy, reference, counts, label_smoothing=eps)[0]
    assert torch.allclose(smoothed, -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin), atol=1e-6)
    simpo = pair_losses("simpo", 2.0, policy, None, counts, gamma, eps)[0]
    assert torch.allclose(simpo, _trl_simpo_loss(2.0, gamma, eps, pc / nc, pr / nr), atol=1e-6)

    # gradients: d loss / d policy log-probability, by hand (sigmoid: -beta * sigmoid(-margin), +/- for the sides)
    p = policy.clone().requires_grad_(True)
    pair_losses("sigmoid", beta, p, reference, counts)[0].sum().backward()
    g = -beta * torch.sigmoid(-margin)
    assert torch.allclose(p.grad, torch.cat([g, -g]), atol=1e-7)


def test_sequence_log_probabilities_sum_the_counted_labels():
    torch.manual_seed(1)
    logits = torch.randn(4, 6, 11)
    labels = torch.randint(0, 11, (4, 6))
    labels[:, :2] = IGNORE_INDEX
    labels[3] = IGNORE_INDEX
    logps, counts = sequence_logps(logits, labels)
    expected = [
        sum(logits[r, t].log_softmax(-1)[labels[r, t]].item() for t in range(6) if labels[r, t] != IGNORE_INDEX)
        for r in range(4)
    ]
    assert torch.allclose(logps, torch.tensor(expected), atol=1e-5) and counts.tolist() == [4, 4, 4, 0]


def _tiny_model(seed):
    from titanlite.models.decoder import Transformer
    from titanlite.models.llama3 import LLAMA3_FLAVORS

    model = Transformer(LLAMA3_FLAVORS["tiny"].with_overrides(vocab_size=258))
    model.init_weights(seed)
    model.init_buffers()
    return model


@pytest.mark.parametrize("kind, chunk", [("sigmoid", 0), ("sigmoid", 100), ("ipo", 0), ("simpo", 0)])
def test_the_objective_is_the_hand_formula_on_the_models_own_log_probabilities(tmp_path, kind, chunk):
    """chunk > 0: the model computes each token's log-probability in chunks of tokens (no logits tensor) and its
    backward projects them again; the hand formula takes the logits of the same weights."""
    from titanlite.preference.objective import PreferenceObjective
    from titanlite.preference.reference import FrozenCopy

    cfg = load(dpo_argv(tmp_path, "--training.local_batch_size", "4", "--dpo.loss", kind, "--dpo.beta", "0.5"))
    mb = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1).next_step().microbatches[0]
    policy, reference = _tiny_model(0), _tiny_model(1)
    for model in (policy, reference):
        model.loss_chunk_tokens, model.output.per_token = chunk, True
    objective = PreferenceObjective(cfg.dpo, None if kind == "simpo" else FrozenCopy(reference))
    loss, _ = objective(policy, mb, torch.device("cpu"))
    grads = torch.autograd.grad(loss, list(policy.parameters()))

    def logps(model):  # by hand: log_softmax, the label's entry, summed over the counted positions of each row
        logp = model(mb.inputs).float().log_softmax(-1)
        counted = mb.labels != IGNORE_INDEX
        picked = logp.gather(-1, mb.labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (picked * counted).sum(1), counted.sum(1).float()

    (pc, pr), (nc, nr) = (t.chunk(2) for t in logps(policy))
    beta, gamma = 0.5, cfg.dpo.gamma
    if kind == "simpo":
        hand = -F.logsigmoid(beta * (pc / nc - pr / nr) - gamma)
    else:
        with torch.no_grad():
            rc, rr = logps(reference)[0].chunk(2)
        if kind == "sigmoid":
            hand = -F.logsigmoid(beta * ((pc - rc) - (pr - rr)))
        else:
            hand = ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2
    assert abs(loss.item() - hand.sum().item()) < 1e-5 * max(1.0, abs(loss.item()))
    for g, h in zip(grads, torch.autograd.grad(hand.sum(), list(policy.parameters()))):
        torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-6)
    report = objective.report()
    assert 0.0 <= report["accuracy"] <= 1.0 and abs(report["margin"]) > 0


# ------------------------------------------------------------------------------------------------ the data


def _encoder(tmp, *extra):
    cfg = load(dpo_argv(tmp, *extra))
    return make_encoder(cfg, ByteTokenizer(), training_specs(cfg)[0][0]), cfg


def test_pairs_share_the_prompt_tokens_and_count_only_the_responses(tmp_path):
    encoder, _ = _encoder(tmp_path)
    tok = ByteTokenizer()
    forms = _pairs(3)  # strings, messages, implicit prompt: the same pair three ways
    for record in forms:
        prompt, chosen, rejected = encoder.pair(record)
        (c_tokens, c_mask), (r_tokens, r_mask) = encoder.encode(prompt, chosen, rejected)
        n_prompt = c_mask.index(1)
        assert c_tokens[:n_prompt] == r_tokens[:n_prompt] and r_mask.index(1) == n_prompt
        assert all(c_mask[n_prompt:]) and all(r_mask[n_prompt:])
        assert tok.decode(c_tokens[n_prompt:]).startswith(chosen["content"])
        assert tok.decode(c_tokens[:n_prompt]).endswith("### Assistant:\n")
        assert c_tokens[n_prompt:][-3:] == [tok.eos_id, *b"\n\n"]  # the reply's end of turn counts
    system = encoder.pair({**forms[0], "system": "Be brief."})[0]
    assert system[0] == {"role": "system", "content": "Be brief."}
    # UltraFeedback's layout: a prompt field beside whole conversations is the implicit form
    ultrafeedback = {**forms[2], "prompt": forms[2]["chosen"][0]["content"]}
    assert encoder.pair(ultrafeedback) == encoder.pair(forms[2])


def test_bad_pair_records_are_skipped_and_counted(tmp_path):
    encoder, _ = _encoder(tmp_path)
    good = _pairs(1)[0]
    records = [
        good,
        {"prompt": "q", "chosen": "a"},
        {**good, "rejected": "   "},
        {**good, "chosen": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]},
        {**good, "prompt": [{"role": "robot", "content": "q"}]},
    ]
    out = encoder({k: [r.get(k) for r in records] for k in ("prompt", "chosen", "rejected")})
    assert len(out) == 2 + 4 and out[2:] == [None] * 4  # two documents for the good pair, one None per bad record
    reasons = encoder.skip_report()
    assert set(reasons) == {
        "no 'rejected' field",
        "an empty 'rejected' response",
        "'chosen' is not a string or one assistant message",
        "a prompt message that is not {role: system/user/assistant, content: text}",
    }, reasons


def _layout(tmp, *extra):
    cfg = load(dpo_argv(tmp, *extra))
    loader = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1)
    return loader.layouts[0], cfg


@pytest.mark.parametrize("rule", ["response", "prompt", "drop"])
def test_truncation_rules_cut_between_tokens_or_drop_and_count(tmp_path, rule):
    full, _ = _layout(tmp_path / "full")  # seq 128: every pair fits
    assert full.dropped == full.cut == 0 and full.num_windows == 48
    layout, cfg = _layout(tmp_path / "cut", "--training.seq_len", "100", "--data.pair_truncation", rule)
    assert layout.dropped + layout.num_windows == 48
    if rule == "drop":
        assert layout.cut == 0 and layout.dropped > 0
    else:
        assert layout.cut > 0
    for pair in layout.kept.tolist():
        whole, cut = full.read_pair(pair), layout.read_pair(pair)
        for w_full, w_cut in ((whole.chosen, cut.chosen), (whole.rejected, cut.rejected)):
            tokens = w_full.tokens[: w_full.filled].tolist()
            kept = w_cut.tokens[: w_cut.filled].tolist()
            assert 0 < len(kept) <= 101 and int(w_cut.mask.sum()) > 0
            if rule == "prompt":  # the end of the pair is kept whole: the prompt lost its start
                assert kept == tokens[len(tokens) - len(kept) :]
                assert w_cut.mask[: w_cut.filled].tolist()[-1] == 1
            else:  # the start is kept: the responses lost their end
                assert kept == tokens[: len(kept)]


def test_pair_order_is_the_same_at_every_data_parallel_degree(tmp_path):
    cfg = load(dpo_argv(tmp_path, "--training.local_batch_size", "2"))
    seen = {}
    for degree in (1, 2, 4):
        pairs = []
        for rank in range(degree):
            loader = build_loader(cfg, ByteTokenizer(), "training", dp_rank=rank, dp_degree=degree)
            step = loader.next_step()
            assert step.global_valid_tokens == 8  # the normalization counts pairs
            for mb in step.microbatches:
                b = len(mb.pairs)
                assert mb.inputs.shape[0] == 2 * b
                pairs += mb.pairs[:, 1].tolist()
        seen[degree] = pairs
    assert seen[1] == seen[2] == seen[4] and len(set(seen[1])) == 8


def _dry_run(capsys, *argv):
    import re

    from titanlite.cli import dry_run

    code = dry_run.main(["--world-size", "8", "--job.config_file", "llama8b_fsdp", *argv])
    out = capsys.readouterr().out
    return code, out, {m[1]: float(m[2]) for m in re.finditer(r"^  (\w[\w ]*?)\s{2,}.*?([0-9.]+)$", out, re.M)}


@pytest.mark.slow  # three dry runs of the 8B config: seconds, kept out of the fast loop
def test_the_dry_run_counts_the_reference_and_two_sequences_per_pair(capsys):
    dpo = ("--training.dataset", "builtin_preference", "--data.format", "preference", "--dpo.enable")
    _, sft_out, sft = _dry_run(capsys, "--training.local_batch_size", "2", "--training.global_batch_size", "16")
    _, copy_out, copy = _dry_run(capsys, *dpo, "--dpo.reference", "copy")
    _, pre_out, pre = _dry_run(capsys, *dpo, "--dpo.reference", "precomputed")
    assert copy["reference"] == copy["parameters"] and "reference" not in pre  # the copy's shards; a table on the CPU
    assert "a table in CPU memory, 8 bytes per pair" in pre_out and "a microbatch of 1 pairs is 2 sequences" in pre_out
    assert copy["activations"] == pre["activations"] == sft["activations"]  # 1 pair = 2 sequences of the SFT run
    assert abs(copy["total on GPU"] - pre["total on GPU"] - copy["reference"]) < 0.02


# ------------------------------------------------------------------------------------------------ bad inputs

DUMP = "{tmp}/run"
PAIRS = "{tmp}/pairs.jsonl"


def _bad(*extra):
    return tuple(
        tiny_argv(DUMP, "--training.steps", "1", "--data.store_folder", "{tmp}/stores", "--training.seq_len", "64")
        + ["--training.dataset", PAIRS, "--data.format", "preference", "--dpo.enable", *extra]
    )


def _pairs_file(records):
    return lambda tmp: _write(tmp / "pairs.jsonl", records)


LONG_PROMPT = [{"prompt": "q" * 200, "chosen": "yes", "rejected": "no"}] * 4
CASES = [
    Case(
        "beta-not-positive", "config", "train", _bad("--dpo.reference", "copy", "--dpo.beta", "0"),
        ("dpo.beta = 0.0 is not valid", "a number > 0"), setup=_pairs_file(_pairs(4)),
    ),
    Case(
        "label-smoothing-with-ipo", "config", "train",
        _bad("--dpo.reference", "copy", "--dpo.loss", "ipo", "--dpo.label_smoothing", "0.1"),
        ("dpo.label_smoothing = 0.1 with dpo.loss = 'ipo'", "dpo.label_smoothing = 0"), setup=_pairs_file(_pairs(4)),
    ),
    Case(
        "reference-base-without-lora", "config", "train", _bad(),
        ("dpo.reference = 'base'", "lora.enable = false", "'copy'"), setup=_pairs_file(_pairs(4)),
    ),
    Case(
        "dpo-on-chat-data", "config", "train", _bad("--data.format", "chat", "--dpo.reference", "copy"),
        ("dpo.enable = true", "data.format = 'chat'", "data.format = 'preference'"), setup=_pairs_file(_pairs(4)),
    ),
    Case(
        "preference-data-without-dpo", "config", "train", _bad("--dpo.enable", "false"),
        ("data.format = 'preference'", "dpo.enable = true"), setup=_pairs_file(_pairs(4)),
    ),
    Case(
        "dpo-with-pipeline", "config", "config",
        ("--world-size", "2", *_bad("--dpo.reference", "copy", "--parallelism.pipeline_parallel_degree", "2")),
        ("parallelism.pipeline_parallel_degree = 2", "dpo.enable = true"), setup=_pairs_file(_pairs(4)),
    ),
    Case(
        "first-record-without-rejected", "data", "train", _bad("--dpo.reference", "copy"),
        ("its first record is not a preference pair", "no 'rejected' field", "data.rejected_field"),
        setup=_pairs_file([{"prompt": "q", "chosen": "a"}] + _pairs(3)),
    ),
    Case(
        "first-record-empty-response", "data", "train", _bad("--dpo.reference", "copy"),
        ("its first record is not a preference pair", "an empty 'chosen' response"),
        setup=_pairs_file([{"prompt": "q", "chosen": "", "rejected": "b"}] + _pairs(3)),
    ),
    Case(
        "every-prompt-fills-seq-len", "data", "train", _bad("--dpo.reference", "copy"),
        ("none of its 4 preference pairs fits training.seq_len = 64", "each prompt fills the sequence", PAIRS),
        setup=_pairs_file(LONG_PROMPT),
    ),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case, tmp_path, capsys):
    check(case, tmp_path, capsys)


# ------------------------------------------------------------------------------------------------ training


def _record(trainer):
    """Capture every logged step's metrics (full precision) of a trainer."""
    seen = []
    log = trainer.metrics.log
    trainer.metrics.log = lambda m: (seen.append(m), log(m))[1]
    return seen


def _train(argv_list):
    """Per argv: {step: (loss, grad norm, rewards)} of a run, and its validation result at the end."""
    out = []
    for argv in argv_list:
        t = make_trainer(argv)
        seen = _record(t)
        t.train()
        out.append({m.step: (m.loss, m.grad_norm, m.pairs) for m in seen})
    return out


LN2 = math.log(2)
TP2 = ("--parallelism.tensor_parallel_degree", "2")
HSDP = ("--parallelism.data_parallel_replicate_degree", "2")
NF4 = ("--lora.base_dtype", "nf4", "--lora.nf4_block_size", "16", "--lora.nf4_scaler_block_size", "8")


def _lora(base):
    return ("--lora.enable", "--lora.rank", "4", "--dpo.reference", "base", "--checkpoint.initial_load_path", base)


def _runs(tmp, base, runs):
    """_train of each (name, extra argv) with its own dump folder; {name: result}."""
    return dict(
        zip([n for n, _ in runs], _train([dpo_argv(tmp, *a, "--job.dump_folder", f"{tmp}/{n}") for n, a in runs]))
    )


def _phi3_folder(tmp) -> str:
    """A random Phi-3 saved by transformers (a transformers-backend model: fused qkv and gate_up projections)."""
    import transformers

    config = transformers.Phi3Config(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(f"{tmp}/phi3")
    return f"{tmp}/phi3"


def _backend(tmp):
    """The Phi-3 folder through the transformers backend, LoRA on its own fused linears, the adapter-free reference."""
    return ("--model.name", "transformers", "--model.flavor", "hf", *_lora(f"{tmp}/phi3"),
            "--lora.targets", "qkv_proj,gate_up_proj")  # fmt: skip


def _copy_stays_sharded(tmp) -> bool:
    """After a step, every parameter of the copy reference is a shard again (none left gathered after forward)."""
    from torch.distributed.tensor import DTensor

    t = make_trainer(dpo_argv(tmp, "--training.steps", "1", "--job.dump_folder", f"{tmp}/copy_sharding"))
    t.train()
    return all(isinstance(p, DTensor) for p in t.objective.reference.model.parameters())


def _one_process(tmp, base):
    make_trainer(ckpt_argv(f"{tmp}/base", "--training.steps", "2", "--checkpoint.interval", "2")).train()
    _phi3_folder(tmp)
    assert _copy_stays_sharded(tmp)
    return _runs(tmp, base, [
        ("copy", ("--training.local_batch_size", "4")),
        ("precomputed", ("--dpo.reference", "precomputed", "--training.local_batch_size", "8")),
        ("lora", (*_lora(base), "--training.local_batch_size", "4")),
        ("qlora", (*_lora(base), *NF4, "--training.local_batch_size", "8")),
        ("backend_lora", (*_backend(tmp), "--training.local_batch_size", "4")),
    ])  # fmt: skip


def _resume(tmp):
    """FSDP(2) with the precomputed reference and validation: 4 steps straight, then again from step 2."""
    argv = dpo_argv(
        tmp, "--dpo.reference", "precomputed", "--training.local_batch_size", "2", "--checkpoint.enable",
        "--checkpoint.interval", "2", "--validation.enable", "--validation.dataset", f"{tmp}/held_out.jsonl",
        "--validation.freq", "2", "--validation.steps", "1", "--job.dump_folder", f"{tmp}/resume",
    )  # fmt: skip
    logs = capture_logs()
    straight = make_trainer([*argv, "--metrics.enable_tensorboard"])
    straight_log, straight_losses = _record(straight), straight.train()
    computed = [line for line in logs if line.startswith("Reference log-probabilities")]
    again = make_trainer([*argv, "--checkpoint.load_step", "2"])
    resumed_at = again.step
    resumed_log, _ = _record(again), again.train()
    recomputed = [line for line in logs if line.startswith("Reference log-probabilities")][len(computed) :]
    try:  # another seq_len cuts the pairs otherwise: the saved table is of other tokens, and cannot be computed again
        make_trainer([*argv, "--checkpoint.load_step", "2", "--training.seq_len", "100"])
        other_cut = "no error"
    except ConfigError as e:
        other_cut = str(e)
    return {
        "straight": {m.step: (m.loss, m.grad_norm, m.pairs) for m in straight_log},
        "resumed": {m.step: (m.loss, m.grad_norm, m.pairs) for m in resumed_log},
        "resumed_at": resumed_at,
        "computed": computed,
        "recomputed": recomputed,
        "other_cut": other_cut,
        "validation": (straight.val_losses, again.val_losses),
        "losses": straight_losses,
    }


def _four_ranks(tmp, base):
    resume = ("--dpo.reference", "precomputed", "--checkpoint.enable", "--checkpoint.load_step", "2",
              "--checkpoint.folder", f"{tmp}/resume/checkpoint", "--training.local_batch_size", "1", *HSDP)  # fmt: skip
    return _runs(tmp, base, [
        ("fsdp4", ("--training.local_batch_size", "2")),
        ("hsdp2x2_accum_delay", ("--training.local_batch_size", "1", *HSDP, "--parallelism.hsdp_delay_all_reduce")),
        ("tp2_fsdp2", ("--training.local_batch_size", "2", *TP2)),
        ("hsdp2x2_lora", (*_lora(base), "--training.local_batch_size", "2", *HSDP)),
        ("fsdp4_qlora", (*_lora(base), *NF4, "--training.local_batch_size", "2")),
        ("hsdp2x2_backend_lora", (*_backend(tmp), "--training.local_batch_size", "2", *HSDP)),
        ("resumed_on_hsdp2x2", resume),
    ])  # fmt: skip


def _close(a, b, what, tol=1e-5):
    (loss_a, norm_a, pairs_a), (loss_b, norm_b, pairs_b) = a, b
    assert abs(loss_a - loss_b) < tol and abs(norm_a - norm_b) < tol * max(1.0, norm_b), (what, a, b)
    for key in pairs_b:
        assert abs(pairs_a[key] - pairs_b[key]) < tol, (what, key, pairs_a, pairs_b)


@pytest.mark.slow
def test_dpo_at_every_topology_with_each_reference_and_exact_resume(tmp_path):
    base = str(tmp_path / "base" / "checkpoint" / "step-2")
    one = run_distributed(_one_process, 1, tmp_path, base)[0]
    for name, run in one.items():
        loss, _, pairs = run[1]
        assert abs(loss - LN2) < 1e-6 and pairs["margin"] == 0.0, (name, run[1])  # the policy is its reference
        assert run[4][0] < loss and run[4][2]["accuracy"] > 0.5, (name, run)  # and learns to prefer the chosen
    for name in ("precomputed",):
        for step in range(1, 5):
            _close(one[name][step], one["copy"][step], name)
    _close(one["qlora"][1], one["lora"][1], "qlora", tol=1e-2)  # 4-bit base: a start as close as its rounding

    resume = run_distributed(_resume, 2, tmp_path)[0]
    # the training and validation tables are computed once, and the resumed run reads them from the checkpoint
    assert resume["resumed_at"] == 2 and len(resume["computed"]) == 2 and not resume["recomputed"]
    assert "has other tokens' (another cut of the pairs) as reference log-probabilities" in resume["other_cut"]
    for step in (3, 4):
        assert resume["resumed"][step] == resume["straight"][step], step  # bit for bit
    assert resume["validation"][1][4] == resume["validation"][0][4]
    for step in range(1, 5):
        _close(resume["straight"][step], one["precomputed"][step], "fsdp2_precomputed")
    # TensorBoard holds the step line's rewards and the held-out pairs' (W&B gets the same scalars)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in (tmp_path / "resume").rglob("events.out.tfevents.*")}
    board = EventAccumulator(str(events))
    board.Reload()
    for tag in ("dpo/reward_chosen", "dpo/reward_rejected", "dpo/margin", "dpo/accuracy"):
        written = {e.step: e.value for e in board.Scalars(tag)}
        assert written == pytest.approx({s: v[2][tag[4:]] for s, v in resume["straight"].items()}, abs=1e-6), tag
    assert [e.step for e in board.Scalars("validation/dpo/accuracy")] == [2, 4]
    # a DPO checkpoint (its run state holds the reference table) exports as after SFT; transformers loads it whole
    out = tmp_path / "exported"
    step2 = tmp_path / "resume" / "checkpoint" / "step-2"
    r = run_module("titanlite.checkpoint", "export", "--checkpoint", step2, "--format", "hf", "--output", out)
    assert r.returncode == 0, r.stdout + r.stderr
    transformers = pytest.importorskip("transformers")
    _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info

    four = run_distributed(_four_ranks, 4, tmp_path, base)[0]
    for name, run in four.items():
        kind = next((k for k in ("backend_lora", "qlora", "lora", "precomputed") if name.endswith(k)), "copy")
        expected = resume["straight"] if name.startswith("resumed") else one[kind]
        for step in run:
            _close(run[step], expected[step], (name, step))
