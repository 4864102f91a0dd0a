"""Preference data: (prompt, chosen, rejected) records tokenized into two documents that share the prompt's tokens.

A record holds `data.prompt_field`, `data.chosen_field` and `data.rejected_field` (and an optional system message in
`data.system_field`). The prompt is a string (one user message) or a list of {role, content} messages; a response is
a string or a list holding one assistant message. A record without a prompt whose chosen and rejected are whole
conversations (TRL's implicit-prompt form) takes their shared leading messages as the prompt.

Each response is rendered with the chat template after the prompt (the same template code as chat SFT): the prompt
with the generation prompt is tokenized once, each response's text after it on its own, so both documents start with
the same prompt tokens and a token never straddles the prompt and a response. Only the response's tokens (its
end-of-turn included) count; the store holds document 2i = pair i's chosen, 2i+1 = its rejected. Whole conversations
in chosen and rejected beside a prompt field (UltraFeedback's layout) are read as the implicit form.
"""

from __future__ import annotations

from titanlite.data.chat import ROLES, ChatEncoder, TemplateRejected
from titanlite.data.datasets_io import DatasetSpec
from titanlite.data.encoders import SkippedRecords


class PreferenceEncoder:
    """Preference records -> [chosen (tokens, mask), rejected (tokens, mask)], or [None] for a skipped record."""

    has_mask = True

    def __init__(self, tokenizer, spec: DatasetSpec, data_cfg):
        self.chat = ChatEncoder(tokenizer, spec, data_cfg, "last_assistant")
        self.tokenizer, self.spec, self.template = tokenizer, spec, self.chat.template
        self.fields = (data_cfg.prompt_field, data_cfg.chosen_field, data_cfg.rejected_field, data_cfg.system_field)
        self.identity = f"preference:{self.template.identity}:{':'.join(self.fields)}"
        self.skipped = SkippedRecords()

    def pair(self, record: dict) -> tuple[list[dict], dict, dict] | str:
        """(prompt messages, chosen reply, rejected reply) of a record, or why it is skipped."""
        prompt_field, chosen_field, rejected_field, system_field = self.fields
        chosen, rejected = record.get(chosen_field), record.get(rejected_field)
        if chosen is None or rejected is None:
            missing = [f for f, v in ((chosen_field, chosen), (rejected_field, rejected)) if v is None]
            return f"no '{missing[0]}' field"
        prompt = record.get(prompt_field)
        whole = all(isinstance(v, list) and len(v) > 1 for v in (chosen, rejected))
        if (prompt is None or whole) and isinstance(chosen, list) and isinstance(rejected, list):
            # the implicit prompt: the leading messages both conversations share (a prompt field beside whole
            # conversations, as UltraFeedback's, repeats their first user turn)
            shared = 0
            while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
                shared += 1
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if prompt is None:
            return f"no '{prompt_field}' field"
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
            return f"'{prompt_field}' is not a string or a non-empty list of {{role, content}} messages"
        if record.get(system_field) and prompt[0].get("role") != "system":
            prompt = [{"role": "system", "content": record[system_field]}, *prompt]
        for m in prompt:
            if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                return f"a prompt message that is not {{role: {'/'.join(ROLES)}, content: text}}"
        replies = []
        for name, value in ((chosen_field, chosen), (rejected_field, rejected)):
            reply = _reply(value)
            if reply is None:
                return f"'{name}' is not a string or one assistant message"
            if not reply["content"].strip():
                return f"an empty '{name}' response"
            replies.append(reply)
        prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
        return prompt, replies[0], replies[1]

    def encode(self, prompt: list[dict], chosen: dict, rejected: dict, index: int | None = None) -> list:
        """[(tokens, mask) of prompt + chosen, (tokens, mask) of prompt + rejected]; TemplateRejected when the
        template refuses the conversation."""
        where = "" if index is None else f" on record {index} of {self.spec.key} = {self.spec.name!r}"
        prompt_text = self.template.render(prompt, True, where)
        prompt_ids = self.tokenizer.encode_with_specials(prompt_text)
        bos = self.tokenizer.bos_id
        if bos is not None and prompt_ids[:1] != [bos]:  # the template does not write the BOS itself: prepended
            prompt_ids = [bos, *prompt_ids]
        out = []
        for reply in (chosen, rejected):
            full = self.template.render([*prompt, reply], False, where)
            if not full.startswith(prompt_text):
                raise self.chat._reply_not_after_prompt(where)
            response = self.tokenizer.encode_with_specials(full[len(prompt_text) :])
            if not response:
                raise TemplateRejected(f"the chat template renders an empty response{where}", "an empty response")
            out.append(([*prompt_ids, *response], [0] * len(prompt_ids) + [1] * len(response)))
        return out

    def __call__(self, records: dict, first_index: int = 0) -> list:
        """Two documents (chosen, rejected) per usable record of a batch (a dict of columns), one None per skipped
        record."""
        columns = list(records)
        out = []
        for i in range(len(records[columns[0]]) if columns else 0):
            pair = self.pair({c: records[c][i] for c in columns})
            if not isinstance(pair, str):
                try:
                    out += self.encode(*pair, index=first_index + i)
                    continue
                except TemplateRejected as e:
                    pair = f"a conversation the chat template rejects ({e.reason})"
            self.skipped.add(pair, first_index + i)
            out.append(None)
        return out

    def skip_report(self) -> dict[str, list[int]]:
        """{reason: [count, first record index]} of the records skipped so far."""
        return self.skipped.report()


def _reply(value) -> dict | None:
    """A response as one assistant message, or None when it is not a string or one assistant message."""
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        m = value[0]
        if m.get("role") == "assistant" and isinstance(m.get("content"), str):
            return {"role": "assistant", "content": m["content"]}
    return None
