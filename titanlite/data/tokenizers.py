"""Tokenizers: the built-in byte tokenizer and Hugging Face tokenizer.json files; `build_tokenizer` picks one."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
from collections.abc import Iterable

import torch

from titanlite.errors import ConfigError


class ByteTokenizer:
    """UTF-8 byte tokenizer: ids 0-255 are bytes, 256 is BOS and 257 is EOS. Needs no files."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257
    stop_ids = (257,)  # generation stops at these
    chat_template = None  # chat data uses titanlite's built-in template (titanlite.data.chat)
    SPECIALS = {"<s>": 256, "</s>": 257}  # how chat templates write BOS and EOS for this tokenizer
    identity = "titanlite-byte-tokenizer-v1"  # what a token store built with it records

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as ids, without BOS/EOS."""
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of each text."""
        return [list(t.encode("utf-8")) for t in texts]

    def encode_with_specials(self, text: str) -> list[int]:
        """encode(), with <s> and </s> in the text read as BOS and EOS (rendered chat templates)."""
        ids = []
        for piece in re.split("(<s>|</s>)", text):
            ids += [self.SPECIALS[piece]] if piece in self.SPECIALS else list(piece.encode("utf-8"))
        return ids

    def token_text(self, token_id: int) -> str:
        """The text that stands for a token id in a template (<s>, </s>, or the byte)."""
        return {v: k for k, v in self.SPECIALS.items()}.get(token_id) or bytes([token_id]).decode("latin-1")

    def with_bos(self, ids: list[int]) -> list[int]:
        """``ids`` as a sequence to continue (a prompt): BOS first, unless they start with it."""
        return ids if ids[:1] == [self.bos_id] else [self.bos_id, *ids]

    def decode(self, ids: Iterable[int]) -> str:
        """Return the text of ``ids``, skipping BOS/EOS; invalid UTF-8 becomes U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` package.

    BOS/EOS are taken from a ``tokenizer_config.json`` next to the file if it names
    them, else from the first well-known special token the vocabulary has; a
    tokenizer with a single ``<|endoftext|>``-style token uses it for both.
    ``"bos_token": null`` there (Qwen) means the model has no BOS: ``bos_id`` is None
    and documents and conversations start without one. An end-of-turn token named as
    ``eos_token`` (Llama 3 instruct's ``<|eot_id|>``, ChatML's ``<|im_end|>``) ends
    turns, not documents: documents end with the family's end of text, and
    generation stops at both (``stop_ids``).
    """

    # End-of-turn tokens -> the end of text that ends documents of the same family; generation stops at both.
    TURN_END = {
        "<|eot_id|>": "<|end_of_text|>",  # Llama 3 instruct
        "<|eom_id|>": "<|end_of_text|>",  # Llama 3.1 (end of a tool-calling message)
        "<|im_end|>": "<|endoftext|>",  # ChatML: Qwen
    }
    BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "<|endoftext|>")
    EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>")

    def __init__(self, path: str | os.PathLike):
        try:
            import tokenizers  # lazy: an optional package (pip install tokenizers)
        except ImportError as e:
            raise ImportError(
                f"model.tokenizer_path = {str(path)!r} is a Hugging Face tokenizer, which needs the "
                "`tokenizers` package: pip install tokenizers (or set model.tokenizer_path = '' "
                "for the built-in byte tokenizer)"
            ) from e
        self.path = pathlib.Path(path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:
            raise ConfigError(f"model.tokenizer_path = {str(path)!r} is not a valid tokenizer.json: {e}") from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        named = self._config_special_tokens()
        if "bos_token" in named and named["bos_token"] is None:
            self.bos_id = None  # "bos_token": null (Qwen): trained without a BOS, so documents get none
        else:
            self.bos_id = self._find_special("bos", named.get("bos_token"), self.BOS_CANDIDATES)
        configured_eos = named.get("eos_token")
        document_end = self.TURN_END.get(configured_eos)  # an instruct model's end of turn: documents end with text's
        if document_end is None or self._tok.token_to_id(document_end) is None:
            document_end = configured_eos
        self.eos_id = self._find_special("eos", document_end, self.EOS_CANDIDATES)
        stops = [self.eos_id, *(self._tok.token_to_id(t) for t in self.TURN_END), *self._generation_eos()]
        self.stop_ids = tuple(dict.fromkeys(i for i in stops if i is not None))
        h = hashlib.sha256(self.path.read_bytes())
        config = self.path.parent / "tokenizer_config.json"
        if config.is_file():
            h.update(config.read_bytes())
        if self.bos_id is None or (configured_eos == "<|im_end|>" and document_end != configured_eos):
            # Documents framed otherwise than titanlite did before it knew of models without a BOS and of ChatML's
            # end of turn: token stores and data positions made then do not match these.
            h.update(f"documents: bos {self.bos_id}, eos {self.eos_id}".encode())
        self.identity = f"hf-tokenizer-{h.hexdigest()}"  # the files' content, wherever they are
        self.chat_template = self._config_chat_template()

    def _beside(self, name: str) -> dict:
        """A JSON file next to the tokenizer ({} when there is none); ConfigError naming it when it is not a JSON
        object (its special tokens and chat template would otherwise be dropped without a word)."""
        path = self.path.parent / name
        if not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{path} (beside model.tokenizer_path = {str(self.path)!r}) cannot be read as JSON: {e}"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path} (beside model.tokenizer_path) holds a {type(data).__name__}, not a JSON object")
        return data

    def _config_special_tokens(self) -> dict[str, str | None]:
        """bos_token / eos_token of tokenizer_config.json: the token's text, None where it says null (no such
        token); absent where it names none."""
        data = self._beside("tokenizer_config.json")
        out = {}
        for key in ("bos_token", "eos_token"):
            token = data.get(key)
            if isinstance(token, dict):  # AddedToken serialised as {"content": ...}
                token = token.get("content")
            if isinstance(token, str) or (key in data and data[key] is None):
                out[key] = token
        return out

    def _config_chat_template(self) -> str | None:
        """tokenizer_config.json's chat_template (its 'default' one when it names several), or None."""
        template = self._beside("tokenizer_config.json").get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        return template if isinstance(template, str) else None

    def _generation_eos(self) -> list[int]:
        """eos_token_id of a generation_config.json next to the tokenizer (a HF model folder), if any."""
        ids = self._beside("generation_config.json").get("eos_token_id")
        ids = [ids] if isinstance(ids, int) else ids or []
        return [i for i in ids if isinstance(i, int) and 0 <= i < self.vocab_size]

    def _find_special(self, kind: str, configured: str | None, candidates: tuple[str, ...]) -> int:
        if configured and self._tok.token_to_id(configured) is None:  # never another token in its place
            present = [t for t in candidates if self._tok.token_to_id(t) is not None]
            raise ConfigError(
                f"{self.path.parent / 'tokenizer_config.json'} names {kind}_token = {configured!r}, which the "
                f"vocabulary of model.tokenizer_path = {str(self.path)!r} does not hold; name one of its tokens "
                f"there ({', '.join(map(repr, present)) or 'it has none of ' + str(list(candidates))}), or use the "
                f"tokenizer_config.json that came with this tokenizer.json"
            )
        for token in ((configured,) if configured else ()) + candidates:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        raise ConfigError(
            f"model.tokenizer_path = {str(self.path)!r}: found no {kind.upper()} token; "
            f"expected one of {list(candidates)} in the vocabulary, or {kind}_token in a "
            "tokenizer_config.json next to it"
        )

    def encode(self, text: str) -> list[int]:
        """Return the token ids of ``text``, without BOS/EOS."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of each text, in parallel threads (the tokenizers library's own)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_with_specials(self, text: str) -> list[int]:
        """encode(); special tokens written in the text (<|eot_id|>, ...) become their ids, as in encode()."""
        return self.encode(text)

    def token_text(self, token_id: int | None) -> str:
        """The text of a token id (a special token's name); '' for None (a BOS the model does not have)."""
        return "" if token_id is None else self._tok.id_to_token(token_id)

    def with_bos(self, ids: list[int]) -> list[int]:
        """``ids`` as a sequence to continue (a prompt): BOS first, unless they start with it. A model without a BOS
        continues them as they are, and nothing as its end of text (what precedes a document in pre-training)."""
        if self.bos_id is None:
            return list(ids) or [self.eos_id]
        return ids if ids[:1] == [self.bos_id] else [self.bos_id, *ids]

    def decode(self, ids: Iterable[int]) -> str:
        """Return the text of ``ids``, skipping special tokens."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        specials = (self.bos_id, self.eos_id)
        return self._tok.decode([i for i in ids if i not in specials], skip_special_tokens=True)


def build_tokenizer(path: str) -> ByteTokenizer | HFTokenizer:
    """Return the tokenizer for ``model.tokenizer_path``.

    ``""`` gives the built-in ByteTokenizer; a tokenizer.json file, or a directory
    holding one, gives an HFTokenizer.
    """
    if not path:
        return ByteTokenizer()
    valid = "'' (built-in byte tokenizer), a tokenizer.json file, or a directory containing tokenizer.json"
    file = pathlib.Path(path).expanduser()
    if file.is_dir():
        if not (file / "tokenizer.json").is_file():
            raise ConfigError(f"model.tokenizer_path = {path!r} is a directory without tokenizer.json; valid: {valid}")
        file = file / "tokenizer.json"
    elif not file.is_file():
        raise ConfigError(f"model.tokenizer_path = {path!r} does not exist; valid: {valid}")
    return HFTokenizer(file)
