"""Tokenizer ids equal the reference tokenizer's (transformers' own GGUF conversion)."""

from __future__ import annotations

import json

import pytest

from services.engine.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\r\nand\n\n\n",
    "Unicode: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, العربية",
    "emoji 🤗🚀👩‍👩‍👧 and symbols ∑∫√ ≠ ≤",
    "numbers 1234567890 3.14159 -42 1e-9 0x1F",
    "def f(x):\n    return [i ** 2 for i in range(x) if i % 2 == 0]  # squares\n",
    'console.log(`template ${literal}`); {"json": [1, 2, {"k": null}]}',
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "It's, don't, won't, they'll, I'd, we've, you're",
    "a" * 200,
]


@pytest.fixture(scope="module")
def tokenizers(smollm_engine, smollm_hf):
    return smollm_engine.tokenizer, smollm_hf[0]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_reference(tokenizers, text):
    ours, ref = tokenizers
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)


def test_chat_template_equals_reference(tokenizers):
    ours, ref = tokenizers
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert ours.encode_chat(msgs) == ref.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    # the default system prompt appears when none is given
    assert "You are a helpful AI assistant named SmolLM" in ours.apply_chat_template(msgs[1:2])


def test_tokenizer_json_folder_path(tokenizers, tmp_path):
    """An HF folder's tokenizer.json + tokenizer_config.json load to the same tokenizer."""
    ours, ref = tokenizers
    ours._tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|im_start|>"},
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
            }
        )
    )
    (tmp_path / "chat_template.jinja").write_text(ours.chat_template)
    again = Tokenizer.from_folder(tmp_path)
    assert again.eos_token_id == 2 and again.bos_token_id == 1
    for text in TEXTS:
        assert again.encode(text) == ref.encode(text)
    assert again.apply_chat_template(
        [{"role": "user", "content": "x"}]
    ) == ours.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("text", TEXTS[3:6])
def test_incremental_detokenizer_equals_full_decode(tokenizers, text):
    ours, _ = tokenizers
    ids = ours.encode(text)
    detok = IncrementalDetokenizer(ours)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) == ours.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
