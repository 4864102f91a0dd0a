"""Chat data: conversations rendered with a chat template into tokens and a loss mask.

A record is a conversation: a list of {role, content} messages in `data.messages_field`, or a
prompt/response pair in `data.prompt_field` / `data.response_field` (with an optional system message
in `data.system_field`). It is rendered with the tokenizer's Jinja chat template (tokenizer_config.json's
`chat_template`), `data.chat_template` (a .jinja file), or titanlite's template for the byte tokenizer
(`BYTE_CHAT_TEMPLATE`). Only the assistant's replies, end-of-turn token included, count in the loss
(`training.loss_on = "assistant"`; "last_assistant": only the last reply; "all": every token).

The mask comes from rendering prefixes: the text up to an assistant reply with the generation prompt
(A) and up to the end of that reply (B); B without A is the reply. Each piece is tokenized on its
own, so a token never straddles a prompt and a reply. A reply is what the template writes after the
generation prompt up to the end of its turn: the reply, its end-of-turn token, and what the template
writes after that token (ChatML's newline after `<|im_end|>`, the built-in template's blank line).

Finding every reply this way needs a template that renders a conversation as a growing prefix. Some
do not: Qwen3's drops the reasoning block (`<think>...</think>`) of a reply once a later user turn
follows it. With such a template `training.loss_on = "last_assistant"` (and "all") split the
conversation only at its last reply (three renders), which works; "assistant" stops with a message
naming the template and the record.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from datetime import date

from titanlite.data.datasets_io import DatasetSpec
from titanlite.data.encoders import SkippedRecords
from titanlite.data.template_sandbox import LimitedSandbox, RenderLimitExceeded, TemplateError
from titanlite.errors import ConfigError

ROLES = ("system", "user", "assistant")
# The byte tokenizer's template: <s> and </s> are its BOS and EOS; </s> ends every assistant reply.
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}### System:\n{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}### User:\n{{ m['content'] }}\n\n"
    "{% else %}### Assistant:\n{{ m['content'] }}{{ eos_token }}\n\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)
LOSS_ON = ("assistant", "last_assistant", "all")


class TemplateRejected(ConfigError):
    """A conversation that the chat template refuses (with `raise_exception(...)`); `reason` is the template's text."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


class ChatTemplate:
    """A Jinja chat template, rendered in a sandbox as transformers does.

    origin names where it comes from (a file, a key) in messages."""

    def __init__(self, source: str, bos_token: str, eos_token: str, origin: str):
        env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: date(2024, 7, 26).strftime(fmt)  # deterministic renders
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False)
        try:
            self._env, self._template = env, env.from_string(source)
        except TemplateError as e:
            raise ConfigError(f"the chat template from {origin} does not compile: {e}") from None
        self.source, self.bos_token, self.eos_token, self.origin = source, bos_token, eos_token, origin
        self.identity = hashlib.sha256(source.encode()).hexdigest()[:16]

    def render(self, messages: list[dict], add_generation_prompt: bool = False, where: str = "") -> str:
        """The conversation as text; TemplateRejected when the template refuses it, ConfigError naming the template
        (and `where`: which record) when the template fails or the sandbox blocks what it does."""
        try:
            return self._env.render_limited(
                self._template,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except RenderLimitExceeded as e:
            raise ConfigError(
                f"the chat template from {self.origin} was stopped{where}: {e}; a chat template renders a "
                f"conversation in a few thousand steps, so look for loops in it that do not end (or use "
                f"data.chat_template = 'builtin')"
            ) from None
        except _Rejection as e:
            reason = str(e)[:200]
            raise TemplateRejected(
                f"the chat template from {self.origin} rejects the conversation{where}: {reason}", reason
            ) from None
        except Exception as e:  # jinja's errors, the sandbox's SecurityError, and whatever the template's code raises
            raise ConfigError(
                f"the chat template from {self.origin} fails{where} ({type(e).__name__}: {str(e)[:300]}); valid: a "
                f"template that renders any conversation of {{role, content}} messages, or data.chat_template = "
                f"'builtin'"
            ) from None


class _Rejection(Exception):
    """What the templates' raise_exception(...) raises."""


def _raise(message):
    raise _Rejection(message)


def load_template(setting: str, tokenizer) -> ChatTemplate:
    """data.chat_template: '' = the tokenizer's own (the byte tokenizer: BYTE_CHAT_TEMPLATE), 'builtin' = that
    one, else a .jinja file."""
    # A model without a BOS (Qwen) has '' as the template's bos_token, as transformers gives it.
    bos = "" if tokenizer.bos_id is None else tokenizer.token_text(tokenizer.bos_id)
    eos = tokenizer.token_text(tokenizer.eos_id)
    if setting == "builtin" or (setting == "" and tokenizer.chat_template is None and not hasattr(tokenizer, "path")):
        return ChatTemplate(BYTE_CHAT_TEMPLATE, bos, eos, "titanlite's built-in template")
    if setting == "":
        if tokenizer.chat_template is None:
            raise ConfigError(
                f"model.tokenizer_path = {str(tokenizer.path)!r} has no chat_template (in tokenizer_config.json "
                f"next to it), which data.format = 'chat' needs; valid: data.chat_template = a .jinja file, or "
                f"'builtin' for titanlite's simple template"
            )
        origin = f"{tokenizer.path.parent}/tokenizer_config.json (model.tokenizer_path)"
        return ChatTemplate(tokenizer.chat_template, bos, eos, origin)
    path = pathlib.Path(setting).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"data.chat_template = {setting!r}: no such file; valid: '' (the tokenizer's), 'builtin' or a .jinja file"
        )
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"data.chat_template = {setting!r} cannot be read ({type(e).__name__}: {e}); valid: a UTF-8 .jinja file "
            f"you can read"
        ) from None
    return ChatTemplate(source, bos, eos, f"data.chat_template = {setting!r}")


class ChatEncoder:
    """Conversation records -> (tokens, loss mask); bad records are skipped and counted by reason."""

    has_mask = True

    def __init__(self, tokenizer, spec: DatasetSpec, data_cfg, loss_on: str):
        self.tokenizer, self.spec, self.loss_on = tokenizer, spec, loss_on
        self.template = load_template(data_cfg.chat_template, tokenizer)
        self.fields = (data_cfg.messages_field, data_cfg.prompt_field, data_cfg.response_field, data_cfg.system_field)
        self.identity = f"chat:{self.template.identity}:{loss_on}:{':'.join(self.fields)}"
        self.skipped = SkippedRecords()

    def conversation(self, record: dict) -> list[dict] | str:
        """The record's messages, or why it is skipped."""
        messages_field, prompt_field, response_field, system_field = self.fields
        if record.get(messages_field) is not None:
            messages = record[messages_field]
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                return f"'{messages_field}' is not a list of {{role, content}} messages"
        elif record.get(prompt_field) is not None and record.get(response_field) is not None:
            messages = [
                {"role": "user", "content": record[prompt_field]},
                {"role": "assistant", "content": record[response_field]},
            ]
            if record.get(system_field):
                messages.insert(0, {"role": "system", "content": record[system_field]})
        else:
            return f"no '{messages_field}' and no '{prompt_field}'/'{response_field}' fields"
        for m in messages:
            if m.get("role") not in ROLES:
                return f"unknown role {m.get('role')!r} (valid: {', '.join(ROLES)})"
            if not isinstance(m.get("content"), str):
                return "a message without text content"
        if not any(m["role"] == "assistant" for m in messages):
            return "no assistant turn"
        return [{"role": m["role"], "content": m["content"]} for m in messages]

    def encode(self, messages: list[dict], index: int | None = None) -> tuple[list[int], list[int]]:
        """Tokens and loss mask of one conversation (record `index`, for messages); TemplateRejected when the
        template refuses it."""
        where = "" if index is None else f" on record {index} of {self.spec.key} = {self.spec.name!r}"

        def render(msgs: list[dict], add_generation_prompt: bool = False) -> str:
            return self.template.render(msgs, add_generation_prompt, where)

        replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        pieces = self._split_at_every_reply(messages, replies, render, where)
        if pieces is None:  # earlier turns render otherwise once later turns follow (Qwen3): the last reply only
            pieces = self._split_at_last_reply(messages, replies[-1], render, where)
        tokens, mask = [], []
        for text, counts in pieces:
            ids = self.tokenizer.encode_with_specials(text)
            tokens += ids
            mask += [int(counts)] * len(ids)
        bos = self.tokenizer.bos_id
        if bos is not None and tokens[:1] != [bos]:  # the template does not write the BOS itself: prepended
            tokens, mask = [bos, *tokens], [0, *mask]
        if not tokens:
            raise TemplateRejected(f"the chat template from {self.template.origin} renders nothing{where}", "no text")
        mask[0] = 0  # the first token is never a label (nothing in the conversation predicts it)
        return tokens, mask

    def _split_at_every_reply(self, messages, replies, render, where) -> list[tuple[str, bool]] | None:
        """The conversation's text in pieces (text, counts in the loss), split before and after every reply; None
        when the template does not render the conversation as a growing prefix and loss_on needs the last reply
        only (ConfigError for loss_on = 'assistant')."""
        pieces, done = [], ""
        for i in replies:
            prompt = render(messages[:i], add_generation_prompt=True)
            if not prompt.startswith(done):
                if self.loss_on == "assistant":
                    raise self._earlier_turns_change(where)
                return None  # the last reply alone can still be found
            upto = render(messages[: i + 1])
            if not upto.startswith(prompt):
                if self.loss_on == "assistant":
                    raise self._reply_not_after_prompt(where)
                return None  # not this reply: the last one may still be found alone
            trained = self.loss_on == "all" or self.loss_on == "assistant" or i == replies[-1]
            pieces += [(prompt[len(done) :], self.loss_on == "all"), (upto[len(prompt) :], trained)]
            done = upto
        full = render(messages)
        if full.startswith(done):
            pieces.append((full[len(done) :], self.loss_on == "all"))
        elif self.loss_on == "all":
            return None
        # else: the turns after the last reply render it otherwise (Qwen3 without its reasoning block); they count
        # in nothing and come after every counted token, so they are left out: the loss is the same.
        return pieces

    def _earlier_turns_change(self, where: str) -> ConfigError:
        return ConfigError(
            f"the chat template from {self.template.origin} renders earlier turns differently once later turns "
            f"follow{where} (as Qwen3's does: an earlier reply loses its <think> reasoning block), so the tokens of "
            f"every assistant reply cannot be found in one rendering, which training.loss_on = 'assistant' needs; "
            f"valid: training.loss_on = 'last_assistant' (the loss on the last reply of each conversation), or "
            f"records with one assistant reply each"
        )

    def _split_at_last_reply(self, messages, last, render, where) -> list[tuple[str, bool]]:
        """Pieces split only before and after the last reply (messages[last]): its prompt (with the generation
        prompt), the reply, and what follows it."""
        everything = self.loss_on == "all"
        prompt = render(messages[:last], add_generation_prompt=True)
        upto = render(messages[: last + 1])
        full = render(messages)
        if not upto.startswith(prompt):
            if everything:  # no reply to find: the whole conversation counts
                return [(full, True)]
            raise self._reply_not_after_prompt(where)
        if not full.startswith(upto):
            if everything:
                return [(full, True)]
            full = upto  # the turns after the last reply count in nothing (see _split_at_every_reply)
        return [(prompt, everything), (upto[len(prompt) :], True), (full[len(upto) :], everything)]

    def _reply_not_after_prompt(self, where: str) -> ConfigError:
        return ConfigError(
            f"the chat template from {self.template.origin} does not render a conversation with a reply as the "
            f"conversation before it with the generation prompt (add_generation_prompt) followed by the reply{where}, "
            f"so the reply's tokens cannot be found (Mistral's v0.3 template, for one, writes a system message into "
            f"the last user turn of a prompt only); valid: data.chat_template = a .jinja template that does, or "
            f"'builtin'; with Mistral's, records without a system message"
        )

    def __call__(self, records: dict, first_index: int = 0) -> list:
        """(tokens, mask) per record of a batch (a dict of columns), None for a skipped record."""
        columns = list(records)
        out = []
        for i in range(len(records[columns[0]]) if columns else 0):
            conv = self.conversation({c: records[c][i] for c in columns})
            if not isinstance(conv, str):
                try:
                    out.append(self.encode(conv, first_index + i))
                    continue
                except TemplateRejected as e:
                    conv = f"a conversation the chat template rejects ({e.reason})"
            self.skipped.add(conv, first_index + i)
            out.append(None)
        return out

    def skip_report(self) -> dict[str, list[int]]:
        """{reason: [count, first record index]} of the records skipped so far."""
        return self.skipped.report()
