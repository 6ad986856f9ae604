"""Tokenizer: byte-level BPE from tokenizer.json (HF folders) or GGUF metadata, plus chat templates.

A GGUF file's vocabulary, merges and special tokens are turned into a ``tokenizer.json`` (with
the pre-tokenizer its ``tokenizer.ggml.pre`` names) once, when the GGUF is converted, so there
is a single runtime path: ``Tokenizer.from_folder``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from services.engine.errors import InvalidRequestError, ModelLoadError

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt2", "default", "gpt-2"):
        return byte_level
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3", "qwen2"):
        pattern = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ModelLoadError(
        f"unsupported GGUF pre-tokenizer {pre!r}; supported: gpt2, smollm, llama-bpe, qwen2"
    )


def tokenizer_files_from_gguf(meta: dict[str, Any], folder: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json for a GGUF's tokenizer into ``folder``."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"unsupported GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2') is read from "
            "GGUF; use a Hugging Face folder with tokenizer.json for other tokenizers"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    tok = HFTokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    tok.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "gpt2")))
    tok.decoder = decoders.ByteLevel()
    # GGUF token types: 3 = control (special), 4 = user-defined (added, not special).
    added = [
        AddedToken(tokens[i], special=types[i] == 3, normalized=False)
        for i in range(len(tokens))
        if types[i] in (3, 4)
    ]
    tok.add_tokens(added)
    tok.save(str(folder / "tokenizer.json"))

    def name(key: str) -> str | None:
        i = meta.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config = {
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


class Tokenizer:
    """Encode/decode and chat templating for one model."""

    def __init__(self, tok: HFTokenizer, config: dict[str, Any]) -> None:
        self._tok = tok
        self.bos_token: str | None = _token_str(config.get("bos_token"))
        self.eos_token: str | None = _token_str(config.get("eos_token"))
        self.add_bos = bool(config.get("add_bos_token", False))
        # NOTE: without add_bos_token in its config, a tokenizer's special tokens come from
        # tokenizer.json's post-processor, as transformers' fast tokenizers do (Llama-3's
        # TemplateProcessing writes <|begin_of_text|>; a ByteLevel one adds nothing)
        self._post_processor_adds = "add_bos_token" not in config
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token_id = tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._compiled_template: Any = None
        self._trims: bool | None = None  # whether the template strips message content
        self._as_text_tok: HFTokenizer | None = None
        # NOTE: the decoder object's type, not a parse of the whole tokenizer JSON at start-up
        self._byte_level = type(tok.decoder).__name__ == "ByteLevel"
        self._special_ids = {
            i for i, t in tok.get_added_tokens_decoder().items() if getattr(t, "special", False)
        }

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder} has no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception on bad JSON
            raise ModelLoadError(f"cannot read {path}: {e}") from None
        cfg_path = folder / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        jinja = folder / "chat_template.jinja"
        if not config.get("chat_template") and jinja.is_file():
            config["chat_template"] = jinja.read_text()
        return cls(tok, config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if add_special_tokens and self._post_processor_adds:
            return self._tok.encode(text, add_special_tokens=True).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (the grammar engine reads it)."""
        return self._tok.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a UTF-8 character for some byte-level
        tokens): what OpenAI's logprobs report as ``bytes``."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._special_ids:
            return piece.encode()
        if self._byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode()

    def apply_chat_template(
        self, messages: Sequence[ChatMessage | dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render messages with the model's chat template (no tokenization)."""
        if not self.chat_template:
            raise InvalidRequestError("messages", "this model has no chat template; send a prompt")
        if not messages:
            raise InvalidRequestError("messages", "must contain at least one message")
        msgs = [
            m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages
        ]
        if self._compiled_template is None:
            self._compiled_template = _jinja_env().from_string(self.chat_template)
        return self._compiled_template.render(
            messages=msgs,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def _as_text(self) -> HFTokenizer:
        """A second tokenizer that reads special-token text as plain text (message content),
        made on first use: only the gateway encodes chats. NOTE: a flag on the one instance
        would race between the gateway's worker threads."""
        if self._as_text_tok is None:
            tok = HFTokenizer.from_str(self._tok.to_str())
            tok.encode_special_tokens = True
            self._as_text_tok = tok
        return self._as_text_tok

    def _template_trims(self) -> bool:
        if self._trims is None:
            self._trims = _trims(self)
        return self._trims

    def encode_chat(
        self,
        messages: Sequence[ChatMessage | dict[str, str]],
        special_tokens_in_content: bool = False,
    ) -> list[int]:
        """The chat prompt's token ids. Only the template's own markup yields control tokens:
        ``<|im_start|>system`` typed inside a message is text (its characters' ordinary
        tokens), so a user cannot forge a turn. ``special_tokens_in_content``: the old, unsafe
        behaviour (the whole rendered prompt tokenized at once, as HF does)."""
        # NOTE: templates write their own BOS, so no special tokens are added (as in HF).
        if special_tokens_in_content:
            return self.encode(self.apply_chat_template(messages), add_special_tokens=False)
        msgs = [
            m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages
        ]
        # each content is rendered as a marker the template passes through untouched, then
        # the markup between markers is tokenized with control tokens and the contents without
        marks = [f"\ue000{i}\ue001" for i in range(len(msgs))]
        text = self.apply_chat_template(
            [{**m, "content": mark} for m, mark in zip(msgs, marks, strict=True)]
        )
        ids: list[int] = []
        for i, mark in enumerate(marks):
            head, sep, text = text.partition(mark)
            if not sep:  # the template dropped or changed this message's content
                raise InvalidRequestError(
                    "messages", f"the chat template does not render message {i}'s content as is"
                )
            ids += self._tok.encode(head, add_special_tokens=False).ids if head else []
            content = str(msgs[i].get("content", ""))
            if self._template_trims():
                content = content.strip()
            ids += self._as_text().encode(content, add_special_tokens=False).ids if content else []
        if text:
            ids += self._tok.encode(text, add_special_tokens=False).ids
        return ids


def _trims(tok: Tokenizer) -> bool:
    probe = " \ue000x\ue001 "
    return probe not in tok.apply_chat_template([{"role": "user", "content": probe}])


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):  # older tokenizer_config.json: {"content": "<s>", ...}
        return v.get("content")
    return v


def _jinja_env() -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise InvalidRequestError("messages", message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
        x, indent=indent, ensure_ascii=False
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    Keeps a short window (``prefix_offset``..``read_offset``) so byte-level tokens that split a
    UTF-8 character are held back until the character is complete.
    """

    tokenizer: Tokenizer
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""


_BYTE_DECODER: dict[str, int] = {}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the inverse of its bytes_to_unicode)."""
    if not _BYTE_DECODER:
        keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
        shift = 0
        for b in range(256):
            if b in keep:
                _BYTE_DECODER[chr(b)] = b
            else:
                _BYTE_DECODER[chr(256 + shift)] = b
                shift += 1
    return _BYTE_DECODER
