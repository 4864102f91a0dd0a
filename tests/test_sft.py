"""Block-causal attention over packed documents, chat data with prompt masking, SFT packing (gloo, CPU)."""

import json

import pytest
import torch

from titanlite.config import load
from titanlite.data.build import build_loader, check_data
from titanlite.data.tokenizers import ByteTokenizer
from titanlite.errors import ConfigError
from titanlite.loss import IGNORE_INDEX

from helpers import capture_logs, compute_device, make_trainer, run_distributed, tiny_argv, train_all

DOC_LENGTHS = [(10, 23, 31), (40, 24)]  # two packed sequences of 64 tokens
LLAMA3_TEMPLATE = (  # Llama 3 Instruct's template (without tool use)
    "{{- bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def _tiny_model(attention="block_causal", seed=0, device="cpu"):
    from titanlite.models.decoder import Transformer
    from titanlite.models.llama3 import LLAMA3_FLAVORS

    model = Transformer(LLAMA3_FLAVORS["tiny"].with_overrides(vocab_size=258, attention=attention))
    model.init_weights(seed)  # drawn on the CPU, then moved: the same weights on every device
    model.to(device)
    model.init_buffers()
    return model


def _device_of(model):
    return next(model.parameters()).device


def _packed_batch(device="cpu"):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (len(DOC_LENGTHS), 64), generator=g)
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in DOC_LENGTHS])
    labels = torch.roll(tokens, -1, dims=1)
    labels[positions.roll(-1, dims=1) == 0] = IGNORE_INDEX  # a document's last token predicts nothing
    return tokens.to(device), labels.to(device), positions.to(device)


def _per_document_reference(model):
    """Logits, summed loss and gradients from running each document alone with causal attention."""
    device = _device_of(model)
    tokens, labels, _ = _packed_batch(device)
    model.zero_grad()
    logits, loss = torch.empty(*tokens.shape, 258, device=device), torch.zeros((), device=device)
    for b, row in enumerate(DOC_LENGTHS):
        start = 0
        for n in row:
            out = model(tokens[b : b + 1, start : start + n])
            logits[b, start : start + n] = out[0].detach()
            doc_loss = torch.nn.functional.cross_entropy(out[0, :-1], tokens[b, start + 1 : start + n], reduction="sum")
            doc_loss.backward()
            loss += doc_loss.detach()
            start += n
    return logits, loss, {k: p.grad.clone() for k, p in model.named_parameters()}


def _packed_run(model, kernel="sdpa"):
    from titanlite.loss import summed_cross_entropy

    tokens, labels, positions = _packed_batch(_device_of(model))
    model.attention_kernel = kernel
    model.zero_grad()
    logits = model(tokens, positions)
    loss = summed_cross_entropy(logits, labels)
    loss.backward()
    grads = {
        k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for k, p in model.named_parameters()
    }
    return logits.detach(), loss.detach(), grads


def _assert_close(a, b, what):
    (la, sa, ga), (lb, sb, gb) = a, b
    assert (la - lb).abs().max() < 1e-5, what
    assert abs(sa - sb) < 1e-5 * max(1.0, abs(sb)), what
    for k in ga:
        assert (ga[k] - gb[k]).abs().max() < 1e-5, (what, k)


def test_block_causal_equals_each_document_alone():
    device = compute_device()
    model = _tiny_model(device=device)
    ref = _per_document_reference(model)
    _assert_close(_packed_run(model, "sdpa"), ref, "sdpa mask")
    if device.type == "cuda":  # the GPU kernel, forward and backward
        _assert_close(_packed_run(model, "auto"), ref, "FlexAttention")
    else:  # FlexAttention has no backward on the CPU: its forward is checked here
        tokens, _, positions = _packed_batch()
        model.attention_kernel = "flex"
        with torch.no_grad():
            assert (model(tokens, positions) - ref[0]).abs().max() < 1e-5
    # causal attention over the same packed batch does see the other documents
    causal = _tiny_model("causal", device=device)
    assert (causal(_packed_batch(device)[0]) - ref[0]).abs().max() > 1e-3


def _sharded_block_causal(replicate):
    from titanlite.model_builder import build_model
    from titanlite.models.llama3 import LLAMA3_FLAVORS
    from titanlite.parallel.dims import ParallelDims
    from titanlite.runtime.distributed import init_distributed

    env = init_distributed()
    cfg = load(["--training.mixed_precision_param", "float32", "--model.flavor", "tiny"])
    dims = ParallelDims(dp_replicate=replicate, dp_shard=env.world_size // replicate, world_size=env.world_size)
    args = LLAMA3_FLAVORS["tiny"].with_overrides(vocab_size=258, attention="block_causal")
    model = build_model(cfg, args, dims.build_meshes("cpu")).model
    model.to_empty(device="cpu")
    model.init_weights(0)
    return _packed_run(model)  # every rank the same batch: averaged gradients are that batch's


@pytest.mark.slow
def test_block_causal_sharded_equals_each_document_alone():
    ref = _per_document_reference(_tiny_model())
    for world, replicate in ((2, 1), (4, 2)):
        for rank, result in enumerate(run_distributed(_sharded_block_causal, world, replicate)):
            _assert_close(result, ref, (world, replicate, rank))


# ----------------------------------------------------------------------------- chat rendering and masks


def _encoder(tmp_path, *extra, tokenizer=None):
    from titanlite.data.build import make_encoder, training_specs

    cfg = load(["--data.format", "chat", "--training.dataset", str(tmp_path / "chat.jsonl"), *extra])
    return make_encoder(cfg, tokenizer or ByteTokenizer(), training_specs(cfg)[0][0])


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi?"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye?"},
    {"role": "assistant", "content": "Bye."},
]


def _counted_text(tokens, mask, tok):
    return tok.decode([t for t, m in zip(tokens, mask) if m]), [t for t, m in zip(tokens, mask) if m]


def test_byte_template_masks_exactly_the_replies(tmp_path):
    tok = ByteTokenizer()
    tokens, mask = _encoder(tmp_path).encode(CONVERSATION)
    text, counted = _counted_text(tokens, mask, tok)
    assert tokens[0] == tok.bos_id and mask[0] == 0
    assert text == "Hello.\n\nBye.\n\n" and counted.count(tok.eos_id) == 2  # each reply ends with EOS
    assert tok.decode(tokens).startswith("### System:\nBe brief.\n\n### User:\nHi?\n\n### Assistant:\nHello.")
    tokens, mask = _encoder(tmp_path, "--training.loss_on", "last_assistant").encode(CONVERSATION)
    assert _counted_text(tokens, mask, tok)[0] == "Bye.\n\n"
    tokens, mask = _encoder(tmp_path, "--training.loss_on", "all").encode(CONVERSATION)
    assert sum(mask) == len(tokens) - 1  # all but the BOS prepended for the template


def _llama3_tokenizer(folder, chat_template=LLAMA3_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["Hello there. Bye now. Be brief. system user assistant"] * 20, trainer)
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    if chat_template:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    from titanlite.data.tokenizers import build_tokenizer

    return build_tokenizer(str(folder))


def test_llama3_template_masks_replies_and_eot(tmp_path):
    tok = _llama3_tokenizer(tmp_path / "tok")
    tokens, mask = _encoder(tmp_path, tokenizer=tok).encode(CONVERSATION)
    assert tokens[0] == tok.bos_id and tokens.count(tok.bos_id) == 1  # the template's BOS, not a second one
    eot = tok._tok.token_to_id("<|eot_id|>")
    counted = [t for t, m in zip(tokens, mask) if m]
    assert counted.count(eot) == 2 and tok._tok.decode(counted, skip_special_tokens=True) == "Hello.Bye."
    header = tok._tok.token_to_id("<|start_header_id|>")
    assert all(m == 0 for t, m in zip(tokens, mask) if t == header)
    with pytest.raises(ConfigError, match="has no chat_template .*tokenizer_config.json.*data.chat_template"):
        _encoder(tmp_path, tokenizer=_llama3_tokenizer(tmp_path / "plain", chat_template=None))
    with pytest.raises(ConfigError, match="data.chat_template = .*nope.jinja.*no such file"):
        _encoder(tmp_path, "--data.chat_template", str(tmp_path / "nope.jinja"), tokenizer=tok)


def _chat_cfg(tmp_path, path, *extra):
    """Chat data from path, seq 64, global batch 2 in one microbatch, stores under tmp_path."""
    return load(
        [
            "--data.format",
            "chat",
            "--training.dataset",
            str(path),
            "--training.seq_len",
            "64",
            "--training.global_batch_size",
            "2",
            "--training.local_batch_size",
            "2",
            "--data.store_folder",
            str(tmp_path / "stores"),
            "--data.prefetch",
            "0",
            *extra,
        ]
    )


def test_bad_records_are_skipped_and_counted(tmp_path):
    records = [
        {"messages": CONVERSATION},
        {"text": "no conversation here"},
        {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"prompt": "2 + 2?", "response": "4", "system": "Math."},
        {"messages": CONVERSATION},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = _chat_cfg(tmp_path, path)
    check_data(cfg, ByteTokenizer())
    logs = capture_logs()
    loader = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1)
    text = "\n".join(logs)
    assert "Skipped 3 records" in text
    assert "1 record(s) with no 'messages' and no 'prompt'/'response' fields (first: record 1)" in text
    assert "unknown role 'tool'" in text and "(first: record 2)" in text
    assert "1 record(s) with no assistant turn (first: record 3)" in text
    assert loader.layouts[0].store.num_documents == 3
    # a first record that is not a conversation stops the check with the fields it has
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"its first record is not a conversation .*fields: \['text'\]"):
        check_data(
            load(
                [
                    "--data.format",
                    "chat",
                    "--training.dataset",
                    str(path),
                    "--data.store_folder",
                    str(tmp_path / "stores2"),
                ]
            ),
            ByteTokenizer(),
        )
    with pytest.raises(ConfigError, match="chat data .* needs token stores"):
        check_data(
            load(["--data.format", "chat", "--training.dataset", str(path), "--data.store", "none"]), ByteTokenizer()
        )


def test_template_failures_name_the_template_and_rejected_records_are_skipped(tmp_path):
    path = tmp_path / "chat.jsonl"
    turns = [[("user", "Hi?"), ("assistant", "Hello.")], [("user", "skip me"), ("assistant", "x")]] * 3
    path.write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in t]}) + "\n" for t in turns))
    template = tmp_path / "t.jinja"

    def cfg_with(source):
        template.write_bytes(source if isinstance(source, bytes) else source.encode())
        return _chat_cfg(tmp_path, path, "--data.chat_template", str(template))

    named = rf"the chat template from data.chat_template = '{template}' fails on record 0 of training.dataset"
    with pytest.raises(ConfigError, match=named + r" .*\(TypeError: "):
        check_data(cfg_with("{{ messages[0]['content'] + 1 }}"), ByteTokenizer())
    with pytest.raises(ConfigError, match=named + r" .*\(SecurityError: access to attribute 'append'"):
        check_data(cfg_with("{{ messages.append(1) }}"), ByteTokenizer())
    with pytest.raises(ConfigError, match=rf"data.chat_template = '{template}' cannot be read .*UnicodeDecodeError"):
        check_data(cfg_with(b"\xff{{ messages }}"), ByteTokenizer())
    # raise_exception(...) in the template refuses a record: skipped and counted like other bad records
    rejecting = (
        "{% for m in messages %}{% if m['content'] == 'skip me' %}{{ raise_exception('no skipping') }}{% endif %}"
        "{{ bos_token if loop.first }}{{ m['content'] }}{{ eos_token if m['role'] == 'assistant' }}{% endfor %}"
    )
    cfg = cfg_with(rejecting)
    check_data(cfg, ByteTokenizer())
    logs = capture_logs()
    loader = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1)
    assert loader.layouts[0].store.num_documents == 3
    assert "3 record(s) with a conversation the chat template rejects (no skipping) (first: record 1)" in "\n".join(
        logs
    )
    # a template that refuses every record leaves nothing to train on: stopped, with the reason
    with pytest.raises(ConfigError, match=r"no document was left .*6 record\(s\) with a conversation the chat templ"):
        build_loader(
            cfg_with("{{ raise_exception('system turn first') }}"), ByteTokenizer(), "training", dp_rank=0, dp_degree=1
        )


# ----------------------------------------------------------------------------- packing and the loss


def _sft_argv(tmp, *extra):
    return tiny_argv(
        tmp,
        "--training.dataset",
        "builtin_chat",
        "--data.format",
        "chat",
        "--model.attention",
        "block_causal",
        "--training.seq_len",
        "512",
        "--training.global_batch_size",
        "8",
        "--training.steps",
        "6",
        *extra,
    )


def test_packing_keeps_conversations_whole_and_padding_never_counts(tmp_path):
    cfg = load(_sft_argv(tmp_path, "--training.local_batch_size", "8"))
    loader = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1)
    layout = loader.layouts[0]
    step = loader.next_step()
    mb = step.microbatches[0]
    tok = ByteTokenizer()
    for inputs, labels, positions in zip(mb.inputs, mb.labels, mb.positions):
        starts = (positions == 0).nonzero().flatten().tolist()
        for s in starts:  # a conversation starts with BOS, or it is the padding
            assert inputs[s] == tok.bos_id or (inputs[s:] == tok.eos_id).all()
        assert (labels[:-1][positions[1:] == 0] == IGNORE_INDEX).all()  # nothing predicted across documents
    assert step.global_valid_tokens == int((mb.labels != IGNORE_INDEX).sum())
    assert step.local_tokens < mb.inputs.numel()  # padding is not counted as a token
    assert layout.num_windows < layout.store.num_documents  # several conversations per sequence


def _reference_loss(model, cfg):
    """The loss of the first step computed per conversation from its counted tokens only."""
    from titanlite.data.chat import ChatEncoder
    from titanlite.data.datasets_io import DatasetSpec
    from titanlite.data.sources import DocumentSource

    loader = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1)
    layout = loader.layouts[0]
    total, counted = 0.0, 0
    encoder = ChatEncoder(ByteTokenizer(), DatasetSpec("builtin_chat", text_field=None), cfg.data, "assistant")
    records = list(DocumentSource(DatasetSpec("builtin_chat", text_field=None)).records())
    with torch.no_grad():
        for k in range(cfg.training.global_batch_size):
            w = layout._window_of(k)
            for doc in layout.order[layout.bounds[w] : layout.bounds[w + 1]].tolist():
                tokens, mask = encoder.encode(encoder.conversation(records[doc]))
                tokens, mask = tokens[: cfg.training.seq_len + 1], mask[: cfg.training.seq_len + 1]
                logits = model(torch.tensor([tokens[:-1]], device=_device_of(model)))[0]
                keep = torch.tensor(mask[1:], device=logits.device).bool()
                total += torch.nn.functional.cross_entropy(
                    logits[keep], torch.tensor(tokens[1:], device=logits.device)[keep], reduction="sum"
                ).item()
                counted += int(keep.sum())
    return total / counted


def test_loss_is_the_mean_over_counted_tokens_per_conversation(tmp_path):
    cfg = load(_sft_argv(tmp_path, "--training.local_batch_size", "4"))
    from titanlite.loss import microbatch_loss

    model = _tiny_model(device=compute_device())
    loader = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1)
    step = loader.next_step()
    with torch.no_grad():
        loss = sum(microbatch_loss(model, mb, compute_device())[0] for mb in step.microbatches)
    assert abs(loss.item() / step.global_valid_tokens - _reference_loss(model, cfg)) < 1e-5
    # the counted labels differ between the ranks of a dp-4 step: the invariant is really exercised
    cfg = load(_sft_argv(tmp_path, "--training.local_batch_size", "2"))
    counts = [
        int(
            sum(
                (mb.labels != IGNORE_INDEX).sum()
                for mb in build_loader(cfg, ByteTokenizer(), "training", dp_rank=r, dp_degree=4)
                .next_step()
                .microbatches
            )
        )
        for r in range(4)
    ]
    assert len(set(counts)) > 1 and sum(counts) == step.global_valid_tokens


@pytest.mark.slow
def test_sft_loss_parity_across_topologies(tmp_path):
    base = _sft_argv(tmp_path)
    single = run_distributed(train_all, 1, [base + ["--training.local_batch_size", "8"]])[0][0]
    world4 = run_distributed(
        train_all,
        4,
        [
            base + ["--training.local_batch_size", "2"],  # FSDP(4)
            base + ["--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree", "2"],  # HSDP
            base
            + [
                "--training.local_batch_size",
                "1",
                "--parallelism.data_parallel_replicate_degree",
                "2",
                "--parallelism.hsdp_delay_all_reduce",
            ],  # HSDP, 2 microbatches of uneven counted tokens
        ],
    )[0]
    fsdp2_accum = run_distributed(train_all, 2, [base + ["--training.local_batch_size", "2"]])[0][0]
    assert single[6] < single[1]
    for name, losses in zip(["fsdp4", "hsdp2x2", "hsdp_accum2", "fsdp2_accum2"], world4 + [fsdp2_accum]):
        for step in single:
            assert abs(losses[step] - single[step]) < 1e-5, (name, step, losses[step], single[step])


def _sft_resume(tmp):
    base = _sft_argv(tmp, "--training.local_batch_size", "2", "--checkpoint.enable", "--checkpoint.interval", "3")
    straight = make_trainer(base + ["--checkpoint.folder", "straight"]).train()
    t = make_trainer(base + ["--checkpoint.folder", "straight", "--checkpoint.load_step", "3"])
    return {"straight": straight, "resumed_step": t.step, "resumed": t.train()}


def _sft_other_topology(tmp):
    base = _sft_argv(tmp, "--training.local_batch_size", "1")
    ref = make_trainer(base).train()
    t = make_trainer(base + ["--checkpoint.enable", "--checkpoint.folder", "straight", "--checkpoint.load_step", "3"])
    return {"ref": ref, "resumed": t.train()}


@pytest.mark.slow
def test_sft_exact_resume_and_resume_on_another_topology(tmp_path):
    r = run_distributed(_sft_resume, 2, tmp_path)[0]
    assert r["resumed_step"] == 3 and r["resumed"] == {s: r["straight"][s] for s in (4, 5, 6)}
    o = run_distributed(_sft_other_topology, 4, tmp_path)[0]  # FSDP(2) checkpoint -> FSDP(4), 2 microbatches
    for s in (4, 5, 6):
        assert abs(o["resumed"][s] - o["ref"][s]) < 1e-5, s


CAPITALS = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Egypt", "Cairo"),
    ("Peru", "Lima"),
    ("Kenya", "Nairobi"),
    ("Chile", "Santiago"),
]


def _train_and_chat(tmp):
    from titanlite.data.chat import load_template
    from titanlite.generation import generate

    t = make_trainer(
        tiny_argv(
            tmp,
            "--training.dataset",
            f"{tmp}/capitals.jsonl",
            "--data.format",
            "chat",
            "--model.attention",
            "block_causal",
            "--training.seq_len",
            "128",
            "--training.global_batch_size",
            "8",
            "--training.local_batch_size",
            "4",
            "--training.steps",
            "80",
            "--optimizer.lr",
            "1e-2",
            "--lr_scheduler.warmup_steps",
            "5",
            "--metrics.log_freq",
            "20",
        )
    )
    losses = t.train()
    tok, template = ByteTokenizer(), load_template("", ByteTokenizer())
    replies = []
    for country, _ in CAPITALS[:3]:
        prompt = template.render(
            [{"role": "user", "content": f"What is the capital of {country}?"}], add_generation_prompt=True
        )
        new = generate(t.model, tok.encode_with_specials(prompt), 60, temperature=0.0, stop_ids=tok.stop_ids)
        replies.append((tok.decode(new), new[-1] == tok.eos_id))
    return losses, replies


@pytest.mark.slow
def test_sft_loss_falls_and_samples_follow_the_template(tmp_path):
    (tmp_path / "capitals.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"What is the capital of {c}?"},
                        {"role": "assistant", "content": f"The capital of {c} is {cap}."},
                    ]
                }
            )
            + "\n"
            for c, cap in CAPITALS
        )
    )
    losses, replies = run_distributed(_train_and_chat, 2, tmp_path)[0]
    assert losses[80] < losses[20] / 4, losses  # the loss on the replies falls clearly
    for reply, stopped in replies:  # a reply in the trained form, ended by EOS, with no template markers in it
        assert stopped and reply.startswith("The capital of ") and reply.endswith(".") and "###" not in reply, replies


def _attention_log_line(argv):
    logs = capture_logs()
    make_trainer(argv)
    return [line for line in logs if line.startswith("Attention: ")]


@pytest.mark.slow
def test_the_start_up_log_names_the_attention_that_runs(tmp_path):
    from titanlite.models.rope_attention import describe_attention

    assert describe_attention("block_causal", "auto", "cuda") == "block_causal via FlexAttention"
    assert describe_attention("block_causal", "auto", "cpu") == "block_causal via masked SDPA"
    assert describe_attention("block_causal", "flex", "cpu") == "block_causal via FlexAttention"
    assert describe_attention("causal", "auto", "cuda") == "causal (SDPA)"
    block = run_distributed(_attention_log_line, 1, tiny_argv(tmp_path / "b", "--model.attention", "block_causal"))[0]
    causal = run_distributed(_attention_log_line, 1, tiny_argv(tmp_path / "c"))[0]
    assert block == ["Attention: block_causal via masked SDPA"] and causal == ["Attention: causal (SDPA)"]
