"""Tokenizers and chat templates from the model folders of each family: Qwen (ChatML, no BOS), Mistral, Llama 3.

The templates are the `chat_template` strings of the models' tokenizer_config.json, verbatim:
- Qwen/Qwen2.5-7B-Instruct, as vendored in public repositories (e.g. a commented copy of its tokenizer_config.json).
- Qwen/Qwen3-8B: the template of the Qwen3 tokenizer_config.json (the body as shipped with Qwen3-8B and the
  Qwen3-2507 models; its assistant block checked against a quote of Qwen3-8B's at commit 895c8d17) with Qwen3-8B's
  generation prompt (`<|im_start|>assistant\n`, plus an empty think block when enable_thinking is false).
- mistralai/Mistral-7B-Instruct-v0.3: mistralai's "v3" template (tool use included; llama.cpp's chat-template
  tests carry it for Mistral-Large-Instruct-2407).
Rendered in titanlite's sandbox they equal transformers' apply_chat_template (the last test, with transformers).
The tokenizers are small BPEs with the families' special tokens, next to a tokenizer_config.json and a
generation_config.json as the models ship them.
"""

import hashlib
import itertools
import json
import re

import pytest
import torch

from titanlite.config import load
from titanlite.data.build import build_loader, check_data, make_encoder, training_specs
from titanlite.data.chat import load_template
from titanlite.data.datasets_io import DatasetSpec
from titanlite.data.encoders import TextEncoder
from titanlite.data.packing import PackedDataLoader
from titanlite.data.tokenizers import ByteTokenizer, build_tokenizer
from titanlite.errors import ConfigError

pytest.importorskip("tokenizers")

QWEN25_TEMPLATE = (  # Qwen/Qwen2.5-7B-Instruct
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are '
    'provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role '
    '== "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

QWEN3_TEMPLATE = (  # Qwen/Qwen3-8B
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    '    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are '
    'provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    '    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and '
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n"
    "        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = "
    "content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n"
    "                {%- endif %}\n"
    "                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n"
    "                {%- endif %}\n"
    '                {{- \'<tool_call>\\n{"name": "\' }}\n'
    "                {{- tool_call.name }}\n"
    '                {{- \'", "arguments": \' }}\n'
    "                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n"
    "                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n"
    "                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}"
)

MISTRAL_V3_TEMPLATE = (  # mistralai/Mistral-7B-Instruct-v0.3
    '{%- if messages[0]["role"] == "system" %}\n'
    '    {%- set system_message = messages[0]["content"] %}\n'
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "{%- if not tools is defined %}\n"
    "    {%- set tools = none %}\n"
    "{%- endif %}\n"
    '{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}\n'
    "\n"
    "{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}\n"
    "{%- set ns = namespace() %}\n"
    "{%- set ns.index = 0 %}\n"
    "{%- for message in loop_messages %}\n"
    '    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is '
    "defined and message.tool_calls is not none)) %}\n"
    '        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}\n'
    '            {{- raise_exception("After the optional system message, conversation roles must alternate '
    'user/assistant/user/assistant/...") }}\n'
    "        {%- endif %}\n"
    "        {%- set ns.index = ns.index + 1 %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    '    {%- if message["role"] == "user" %}\n'
    "        {%- if tools is not none and (message == user_messages[-1]) %}\n"
    '            {{- "[AVAILABLE_TOOLS] [" }}\n'
    "            {%- for tool in tools %}\n"
    "                {%- set tool = tool.function %}\n"
    '                {{- \'{"type": "function", "function": {\' }}\n'
    '                {%- for key, val in tool.items() if key != "return" %}\n'
    "                    {%- if val is string %}\n"
    "                        {{- '\"' + key + '\": \"' + val + '\"' }}\n"
    "                    {%- else %}\n"
    "                        {{- '\"' + key + '\": ' + val|tojson }}\n"
    "                    {%- endif %}\n"
    "                    {%- if not loop.last %}\n"
    '                        {{- ", " }}\n'
    "                    {%- endif %}\n"
    "                {%- endfor %}\n"
    '                {{- "}}" }}\n'
    "                {%- if not loop.last %}\n"
    '                    {{- ", " }}\n'
    "                {%- else %}\n"
    '                    {{- "]" }}\n'
    "                {%- endif %}\n"
    "            {%- endfor %}\n"
    '            {{- "[/AVAILABLE_TOOLS]" }}\n'
    "            {%- endif %}\n"
    "        {%- if loop.last and system_message is defined %}\n"
    '            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}\n'
    "        {%- else %}\n"
    '            {{- "[INST] " + message["content"] + "[/INST]" }}\n'
    "        {%- endif %}\n"
    "    {%- elif message.tool_calls is defined and message.tool_calls is not none %}\n"
    '        {{- "[TOOL_CALLS] [" }}\n'
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- set out = tool_call.function|tojson %}\n"
    "            {{- out[:-1] }}\n"
    "            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}\n"
    '                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}\n'
    "            {%- endif %}\n"
    "            {{- ', \"id\": \"' + tool_call.id + '\"}' }}\n"
    "            {%- if not loop.last %}\n"
    '                {{- ", " }}\n'
    "            {%- else %}\n"
    '                {{- "]" + eos_token }}\n'
    "            {%- endif %}\n"
    "        {%- endfor %}\n"
    '    {%- elif message["role"] == "assistant" %}\n'
    '        {{- " " + message["content"]|trim + eos_token}}\n'
    '    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}\n'
    "        {%- if message.content is defined and message.content.content is defined %}\n"
    "            {%- set content = message.content.content %}\n"
    "        {%- else %}\n"
    "            {%- set content = message.content %}\n"
    "        {%- endif %}\n"
    '        {{- \'[TOOL_RESULTS] {"content": \' + content|string + ", " }}\n'
    "        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}\n"
    '            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}\n'
    "        {%- endif %}\n"
    "        {{- '\"call_id\": \"' + message.tool_call_id + '\"}[/TOOL_RESULTS]' }}\n"
    "    {%- else %}\n"
    '        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial '
    'optional system message!") }}\n'
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)


H, E = "<|im_start|>", "<|im_end|>"
QWEN_SPECIALS = ["<|endoftext|>", H, E]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi?"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye?"},
    {"role": "assistant", "content": "Bye."},
]
CORPUS = ["Hello there. Bye now. Be brief. Hi? Bye? system user assistant You are Qwen, created by Alibaba Cloud."]


def _tokenizer(folder, specials, config, generation=None, added=(), metaspace=False):
    """A small BPE tokenizer.json with these special tokens (and plain added tokens) next to a tokenizer_config.json
    and, given generation(ids of the specials), a generation_config.json; loaded as titanlite does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if metaspace:  # SentencePiece-like, as Mistral's and Llama 2's tokenizer.json
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
        tok.decoder = decoders.Metaspace(prepend_scheme="first", split=False)
        alphabet = []
    else:  # byte-level, as Qwen's and Llama 3's
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=alphabet)
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])  # Qwen3's <think>, </think>
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(
            json.dumps(generation({t: tok.token_to_id(t) for t in specials}))
        )
    return build_tokenizer(str(folder))


def _qwen(folder, template=QWEN25_TEMPLATE, eos=E, bos_null=True, generation=True):
    """A Qwen2.5 / Qwen3 tokenizer folder: tokenizer_config.json as Qwen ships it (instruct and hybrid models:
    eos <|im_end|>; base models: <|endoftext|>), generation_config.json with eos_token_id [<|im_end|>,
    <|endoftext|>]."""
    config = {
        "add_prefix_space": False,
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos,
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    if not bos_null:
        del config["bos_token"]

    def generation_config(ids):
        end = ids["<|endoftext|>"]
        return {"bos_token_id": end, "pad_token_id": end, "do_sample": True, "eos_token_id": [ids[E], end]}

    added = ("<think>", "</think>") if template is QWEN3_TEMPLATE else ()
    return _tokenizer(folder, QWEN_SPECIALS, config, generation_config if generation else None, added)


def _ids(tok, *tokens):
    return [tok._tok.token_to_id(t) for t in tokens]


def _encoder(tmp_path, tok, loss_on="assistant"):
    cfg = load(
        ["--data.format", "chat", "--training.dataset", str(tmp_path / "chat.jsonl"), "--training.loss_on", loss_on]
    )
    return make_encoder(cfg, tok, training_specs(cfg)[0][0])


def _pieces(tok, *pieces):
    """Tokens and mask of rendered pieces (text, counts), each tokenized on its own; the first token never counts."""
    tokens, mask = [], []
    for text, counts in pieces:
        ids = tok.encode(text)
        tokens += ids
        mask += [int(counts)] * len(ids)
    mask[0] = 0
    return tokens, mask


def _counted(tokens, mask):
    return [t for t, m in zip(tokens, mask) if m]


# ----------------------------------------------------------------------------- tokenizers: BOS, document end, stops


def test_qwen_has_no_bos_documents_end_with_endoftext_and_generation_stops_at_both(tmp_path):
    for kind, eos, generation in (("instruct", E, True), ("base", "<|endoftext|>", False)):
        tok = _qwen(tmp_path / kind, eos=eos, generation=generation)
        endoftext, im_end = _ids(tok, "<|endoftext|>", E)
        assert tok.bos_id is None and tok.eos_id == endoftext, kind
        assert sorted(tok.stop_ids) == sorted([endoftext, im_end]), kind  # the end of turn and the end of text
        assert tok.token_text(tok.bos_id) == "" and tok.with_bos([]) == [endoftext]  # nothing: after a document
    # plain-text documents are the text then <|endoftext|>: in token stores ...
    out = TextEncoder(tok, DatasetSpec("t.jsonl"))({"text": ["Hello there.", None, ""]})
    assert out == [([*tok.encode("Hello there."), endoftext], None), None, ([endoftext], None)]
    # ... and streamed (data.store = "none")
    docs = ["Hello there.", "Bye now.", "Be brief."]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    loader = PackedDataLoader(tok, str(tmp_path / "t.jsonl"), 8, 4, 2, 0, 1)
    steps = [loader.next_step() for _ in range(3)]
    stream = torch.cat([torch.cat([mb.inputs, mb.labels[:, -1:]], 1) for s in steps for mb in s.microbatches])
    expected = [t for d in docs for t in [*tok.encode(d), endoftext]]
    assert stream.flatten().tolist() == list(itertools.islice(itertools.cycle(expected), stream.numel()))
    # only "bos_token": null says "no BOS": a config that names none keeps the old guess (<|endoftext|>)
    assert _qwen(tmp_path / "unsaid", bos_null=False).bos_id == endoftext


def test_llama3_and_byte_tokenizers_are_unchanged(tmp_path):
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    tok = _tokenizer(tmp_path, specials, config, lambda ids: {"eos_token_id": [ids["<|end_of_text|>"], 7]})
    begin, end, eot = _ids(tok, "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")
    assert (tok.bos_id, tok.eos_id, tok.stop_ids) == (begin, end, (end, eot, 7))
    files = (tmp_path / "tokenizer.json").read_bytes() + (tmp_path / "tokenizer_config.json").read_bytes()
    assert tok.identity == f"hf-tokenizer-{hashlib.sha256(files).hexdigest()}"  # the same token stores as before
    assert TextEncoder(tok, DatasetSpec("t.jsonl"))({"text": ["Hello."]}) == [
        ([begin, *tok.encode("Hello."), end], None)
    ]
    assert tok.with_bos(tok.encode("Hi")) == [begin, *tok.encode("Hi")] and tok.with_bos([begin, 5]) == [begin, 5]
    byte = ByteTokenizer()
    assert byte.with_bos([104, 105]) == [256, 104, 105] and byte.with_bos([256, 104]) == [256, 104]


# ----------------------------------------------------------------------------- Qwen2.5: ChatML


def test_qwen25_template_counts_each_reply_with_its_im_end(tmp_path):
    tok = _qwen(tmp_path / "tok")
    im_start, im_end = _ids(tok, H, E)
    tokens, mask = _encoder(tmp_path, tok).encode(CONVERSATION)
    system_to_reply = f"{H}system\nBe brief.{E}\n{H}user\nHi?{E}\n{H}assistant\n"
    # each reply counts with its <|im_end|> and the newline the template writes after it (the prefix split falls
    # there); the <|im_start|>assistant\n header and the other turns never count
    assert (tokens, mask) == _pieces(
        tok,
        (system_to_reply, False),
        (f"Hello.{E}\n", True),
        (f"{H}user\nBye?{E}\n{H}assistant\n", False),
        (f"Bye.{E}\n", True),
    )
    assert tokens[0] == im_start  # no BOS: Qwen has none
    newline = tok.encode("\n")
    assert _counted(tokens, mask) == [*tok.encode("Hello."), im_end, *newline, *tok.encode("Bye."), im_end, *newline]
    tokens, mask = _encoder(tmp_path, tok, "last_assistant").encode(CONVERSATION)
    assert _counted(tokens, mask) == [*tok.encode("Bye."), im_end, *newline]
    tokens, mask = _encoder(tmp_path, tok, "all").encode(CONVERSATION)
    assert sum(mask) == len(tokens) - 1 and tokens[0] == im_start
    # without a system message the template writes Qwen's own
    tokens, mask = _encoder(tmp_path, tok).encode(CONVERSATION[1:3])
    default = f"{H}system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.{E}\n"
    assert (tokens, mask) == _pieces(tok, (f"{default}{H}user\nHi?{E}\n{H}assistant\n", False), (f"Hello.{E}\n", True))


# ----------------------------------------------------------------------------- Qwen3: reasoning blocks


def test_qwen3_single_turn_works_with_every_loss_on(tmp_path):
    tok = _qwen(tmp_path / "tok", QWEN3_TEMPLATE)
    think, end_think = _ids(tok, "<think>", "</think>")
    prompt = f"{H}system\nBe brief.{E}\n{H}user\nHi?{E}\n{H}assistant\n"
    reply = f"<think>\n\n</think>\n\nHello.{E}\n"  # the template writes an empty reasoning block into the reply
    for loss_on in ("assistant", "last_assistant", "all"):
        tokens, mask = _encoder(tmp_path, tok, loss_on).encode(CONVERSATION[:3])
        expected = _pieces(tok, (prompt, loss_on == "all"), (reply, True))
        assert (tokens, mask) == expected, loss_on
        assert tokens.count(think) == tokens.count(end_think) == 1
    # reasoning given in the reply is kept in it
    thought = [*CONVERSATION[:2], {"role": "assistant", "content": "<think>\nSay hi.\n</think>\n\nHello."}]
    tokens, mask = _encoder(tmp_path, tok).encode(thought)
    assert (tokens, mask) == _pieces(tok, (prompt, False), (f"<think>\nSay hi.\n</think>\n\nHello.{E}\n", True))


def test_qwen3_multi_turn_trains_the_last_reply_and_refuses_every_reply(tmp_path):
    tok = _qwen(tmp_path / "tok", QWEN3_TEMPLATE)
    history = f"{H}system\nBe brief.{E}\n{H}user\nHi?{E}\n{H}assistant\nHello.{E}\n{H}user\nBye?{E}\n{H}assistant\n"
    reply = f"<think>\n\n</think>\n\nBye.{E}\n"  # the earlier reply as the history renders it: no reasoning block
    tokens, mask = _encoder(tmp_path, tok, "last_assistant").encode(CONVERSATION)
    assert (tokens, mask) == _pieces(tok, (history, False), (reply, True))
    tokens, mask = _encoder(tmp_path, tok, "all").encode(CONVERSATION)
    assert (tokens, mask) == _pieces(tok, (history, True), (reply, True))
    # an earlier reply's reasoning is dropped from the history, as Qwen3 renders it
    thought = [*CONVERSATION[:2], {"role": "assistant", "content": "<think>\nSay hi.\n</think>\n\nHello."}]
    tokens, mask = _encoder(tmp_path, tok, "last_assistant").encode([*thought, *CONVERSATION[3:]])
    assert (tokens, mask) == _pieces(tok, (history, False), (reply, True))
    # every reply cannot be found in one rendering: stopped, saying why and what works
    origin = re.escape(f"{tmp_path / 'tok'}/tokenizer_config.json (model.tokenizer_path)")
    with pytest.raises(ConfigError) as e:
        _encoder(tmp_path, tok).encode(CONVERSATION, 4)
    assert re.search(
        rf"the chat template from {origin} renders earlier turns differently once later turns follow on record 4 of "
        rf"training.dataset = '.*chat.jsonl' \(as Qwen3's does.*reasoning.*training.loss_on = 'last_assistant'.*"
        rf"one assistant reply each",
        str(e.value),
    ), str(e.value)
    # turns after the last reply count in nothing: left out when they would change how the reply renders
    tokens, mask = _encoder(tmp_path, tok).encode(CONVERSATION[:4])
    assert (tokens, mask) == _pieces(
        tok, (history[: history.index("Hello.")], False), (f"<think>\n\n</think>\n\nHello.{E}\n", True)
    )


def _chat_cfg(tmp_path, tok_folder, records, *extra):
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": r}) + "\n" for r in records))
    return load(
        [
            "--data.format",
            "chat",
            "--training.dataset",
            str(tmp_path / "chat.jsonl"),
            "--model.tokenizer_path",
            str(tok_folder),
            "--training.seq_len",
            "127",
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


def test_qwen3_sft_data_and_chat_prompt(tmp_path):
    folder = tmp_path / "qwen3"
    tok = _qwen(folder, QWEN3_TEMPLATE)
    endoftext, im_end = _ids(tok, "<|endoftext|>", E)
    records = [CONVERSATION, CONVERSATION[1:3]]
    cfg = _chat_cfg(tmp_path, folder, records, "--training.loss_on", "last_assistant")
    check_data(cfg, tok)
    loader = build_loader(cfg, tok, "training", dp_rank=0, dp_degree=1)
    layout, encoder = loader.layouts[0], make_encoder(cfg, tok, training_specs(cfg)[0][0])
    window, filled = layout.read(0), 0
    for doc in layout.order[layout.bounds[0] : layout.bounds[1]].tolist():  # the store holds what the encoder made
        tokens, mask = encoder.encode(encoder.conversation({"messages": records[doc]}))
        assert window.tokens[filled : filled + len(tokens)].tolist() == tokens
        assert window.mask[filled : filled + len(tokens)].tolist() == mask
        filled += len(tokens)
    assert layout.store.num_documents == 2 and window.filled == filled < len(window.tokens)
    assert set(window.tokens[filled:].tolist()) == {endoftext} and not window.mask[filled:].any()  # Qwen's pad
    # loss_on = 'assistant' stops at the check, naming the first record
    with pytest.raises(ConfigError, match="renders earlier turns differently .* on record 0 of training.dataset"):
        check_data(_chat_cfg(tmp_path, folder, records), tok)
    # generate --chat: the prompt ends with the assistant header, no BOS; generation stops at <|im_end|>
    text = load_template("", tok).render([CONVERSATION[1]], add_generation_prompt=True)
    assert text == f"{H}user\nHi?{E}\n{H}assistant\n"
    assert tok.with_bos(tok.encode_with_specials(text)) == tok.encode(text)
    assert im_end in tok.stop_ids and endoftext in tok.stop_ids
    assert tok.decode([*tok.encode("<think>\n\n</think>\n\nHello."), im_end]) == "<think>\n\n</think>\n\nHello."


# ----------------------------------------------------------------------------- Mistral: [INST] ... [/INST]


def _mistral(folder):
    """A Mistral-7B-Instruct-v0.3-like folder: SentencePiece-style tokens, <s> BOS, </s> EOS, [INST] controls."""
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "chat_template": MISTRAL_V3_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        "legacy": False,
        "tokenizer_class": "LlamaTokenizer",
        "unk_token": "<unk>",
    }
    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
    generation = lambda ids: {"bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"]}  # noqa: E731
    return _tokenizer(folder, specials, config, generation, metaspace=True)


def test_mistral_v3_template_counts_each_reply_with_its_eos(tmp_path):
    tok = _mistral(tmp_path / "tok")
    bos, eos = _ids(tok, "<s>", "</s>")
    assert (tok.bos_id, tok.eos_id, tok.stop_ids) == (bos, eos, (eos,))
    conversation = CONVERSATION[1:]
    tokens, mask = _encoder(tmp_path, tok).encode(conversation)
    assert (tokens, mask) == _pieces(
        tok,
        ("<s>[INST] Hi?[/INST]", False),
        (" Hello.</s>", True),
        ("[INST] Bye?[/INST]", False),
        (" Bye.</s>", True),
    )
    assert tokens[0] == bos and tokens.count(bos) == 1  # the template's BOS, not a second one
    assert tokens == tok.encode("<s>[INST] Hi?[/INST] Hello.</s>[INST] Bye?[/INST] Bye.</s>")  # no stray ▁ per piece
    assert _counted(tokens, mask) == [*tok.encode(" Hello."), eos, *tok.encode(" Bye."), eos]
    tokens, mask = _encoder(tmp_path, tok, "last_assistant").encode(conversation)
    assert _counted(tokens, mask) == [*tok.encode(" Bye."), eos]
    prompt = load_template("", tok).render(conversation[:1], add_generation_prompt=True)
    assert tok.with_bos(tok.encode_with_specials(prompt)) == tok.encode("<s>[INST] Hi?[/INST]")
    # v0.3's template writes a system message into the last user turn of a prompt only: no reply can be found
    for loss_on in ("assistant", "last_assistant"):
        with pytest.raises(ConfigError, match="does not render a conversation with a reply as the conversation before"):
            _encoder(tmp_path, tok, loss_on).encode(CONVERSATION)


def test_the_templates_render_as_transformers_renders_them(tmp_path):
    transformers = pytest.importorskip("transformers")
    families = [
        (_qwen(tmp_path / "qwen25"), QWEN25_TEMPLATE, {}),
        (_qwen(tmp_path / "qwen3", QWEN3_TEMPLATE), QWEN3_TEMPLATE, {}),
        (_mistral(tmp_path / "mistral"), MISTRAL_V3_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"}),
    ]
    thought = {"role": "assistant", "content": "<think>\nSay hi.\n</think>\n\nHello."}
    conversations = [CONVERSATION, CONVERSATION[1:], [*CONVERSATION[:2], thought, *CONVERSATION[3:]]]
    for tok, source, specials in families:
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok.path), **specials)
        ours = load_template("", tok)
        for conversation in conversations:
            for n in range(1, len(conversation) + 1):
                for prompt in (False, True):
                    try:
                        theirs = hf.apply_chat_template(
                            conversation[:n], chat_template=source, tokenize=False, add_generation_prompt=prompt
                        )
                    except Exception:  # the template refuses the conversation (Mistral: roles must alternate)
                        with pytest.raises(ConfigError, match="rejects the conversation"):
                            ours.render(conversation[:n], prompt)
                        continue
                    assert ours.render(conversation[:n], prompt) == theirs, (tok.path, n, prompt)
