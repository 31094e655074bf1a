"""Tokenizers: the built-in byte tokenizer and a pinned tokenizer.json (built here, no download)."""

from __future__ import annotations

import pytest

from minifield.data import tokenizer as tk


def test_byte_tokenizer_round_trips_text_and_names_its_special_ids():
    tok = tk.byte_tokenizer()
    text = "reverse: olleh, ünïcode ✓"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))  # ids 0..255 are exactly the UTF-8 bytes
    assert tok.decode(ids) == text
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.sep_id, tok.vocab_size) == (
        256,
        257,
        258,
        259,
        260,
    )
    # special tokens are dropped when decoding
    assert tok.decode([tok.bos_id, *ids, tok.sep_id, tok.eos_id, tok.pad_id]) == text
    assert tk.from_config(tok.config(), None).config() == {"kind": "byte", "vocab_size": 260}


def _write_bpe(path, specials=("<pad>", "<bos>", "<eos>", "<sep>", "<unk>")):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(["hello world", "abc cba", "reverse this string"], trainer)
    backend.save(str(path))
    return path


def test_tokenizers_json_round_trips_and_resolves_special_tokens(tmp_path):
    path = _write_bpe(tmp_path / "tokenizer.json")
    tok = tk.from_settings({"kind": "tokenizers-json", "input": "tok"}, {"tok": path})
    assert tok.kind == "tokenizers-json"
    # the trainer gives special tokens the first ids, in the order listed
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.sep_id) == (0, 1, 2, 3)
    for text in ("hello world", "abc zz qq", "reverse ✓"):
        assert tok.decode(tok.encode(text)) == text
    again = tk.from_bytes(path.read_bytes())
    assert again.encode("hello abc") == tok.encode("hello abc")
    assert tk.from_config(tok.config("tokenizer.json"), tmp_path).vocab_size == tok.vocab_size


def test_tokenizers_json_without_a_special_token_is_refused_by_name(tmp_path):
    path = _write_bpe(tmp_path / "tokenizer.json", specials=("<pad>", "<bos>", "<eos>", "<unk>"))
    with pytest.raises(
        tk.TokenizerError, match=r"sep='<sep>' is not in the tokenizer's vocabulary"
    ):
        tk.from_file(path)
    tok = tk.from_file(path, {"sep": "<unk>"})
    assert tok.sep_id == 3


def test_unreadable_tokenizer_file_is_named(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(tk.TokenizerError, match="tokenizer.json: not a loadable tokenizer.json"):
        tk.from_file(bad)
