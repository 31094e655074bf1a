"""Chat templates: our rendering and token ids against transformers' ``apply_chat_template``.

The reference is transformers' own ``PreTrainedTokenizerFast.apply_chat_template`` (the
test-only ``hf-reference`` group; no torch needed) on the same ``tokenizer.json``. The
assistant span (what is trained) is checked separately, against the text each template is
known to write for the assistant's turn, spelled out by hand below.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minifield.data import assistant_turns, chat_template

# Real-world shapes, copied in spirit from the published tokenizer_config.json files.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Zephyr/SmolLM: one tag per line, so trim_blocks and lstrip_blocks decide the whitespace
ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\\n'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""

# SmolLM3/TRL style: the assistant turn inside transformers' {% generation %} block tag
GENERATION_TAG = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\n' }}{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

#: template -> (special tokens, the text of the trained span for answer "olleh world")
CASES = {
    "llama3": (
        LLAMA3,
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "olleh world<|eot_id|>",
    ),
    "chatml": (
        CHATML,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "olleh world<|im_end|>",
    ),
    "generation-tag": (
        GENERATION_TAG,
        {"eos_token": "<|im_end|>"},
        "olleh world<|im_end|>",
    ),
    "zephyr": (
        ZEPHYR,
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        "olleh world</s>",  # the generation prompt ends "<|assistant|>\n": {{ }} keeps its newline
    ),
}
SPECIALS = [
    "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>",
    "<|user|>", "<|assistant|>", "<|system|>",
]  # fmt: skip
CORPUS = [
    "hello world, you are a helpful assistant.",
    "reverse the word: hello -> olleh",
    "system user assistant be brief please",
    "the quick brown fox jumps over the lazy dog\n\n",
]

CONVERSATIONS = [
    [
        {"role": "user", "content": "reverse: hello world"},
        {"role": "assistant", "content": "olleh world"},
    ],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "reverse: hello"},
        {"role": "assistant", "content": "olleh"},
        {"role": "user", "content": "and hello world?"},
        {"role": "assistant", "content": "olleh world"},
    ],
]


def make_tokenizer(path: Path, vocab_size: int = 320, specials=tuple(SPECIALS)) -> Path:
    """A small byte-level BPE trained here on a few strings, with the templates' specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def _reference(tokenizer_file: Path, template: str, specials: dict):
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), **specials)
    ref.chat_template = template
    return ref


def _ours(tokenizer_file: Path, template: str, specials: dict):
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(tokenizer_file))
    return backend, chat_template.ChatTemplate(template, specials, "test template")


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("conversation", [0, 1])
def test_rendering_and_token_ids_equal_transformers(tokenizer_file, name, conversation):
    template, specials, _ = CASES[name]
    messages = CONVERSATIONS[conversation]
    ref = _reference(tokenizer_file, template, specials)
    backend, ours = _ours(tokenizer_file, template, specials)
    for generation_prompt, shown in ((False, messages), (True, messages[:-1])):
        expected = ref.apply_chat_template(
            shown, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert ours.render(shown, add_generation_prompt=generation_prompt) == expected
    encoded = assistant_turns.encode(
        messages,
        ours,
        backend,
        backend.token_to_id(specials["eos_token"]),
        "row 1",
        train_on="last_assistant",
    )
    whole = ref.apply_chat_template(messages, tokenize=True)
    prompt = ref.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True)
    # the evaluation prompt is exactly transformers' generation prompt
    assert encoded.prompt == list(prompt)
    # the example is transformers' token ids, cut right after the end-of-turn token
    assert encoded.tokens == list(whole)[: len(encoded)]
    assert ref.convert_ids_to_tokens(encoded.response[-1]) == specials["eos_token"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_trained_span_is_the_assistant_turn_and_its_end_of_turn_token(tokenizer_file, name):
    template, specials, trained_text = CASES[name]
    backend, ours = _ours(tokenizer_file, template, specials)
    for messages in CONVERSATIONS:
        eos = backend.token_to_id(specials["eos_token"])
        encoded = assistant_turns.encode(
            messages, ours, backend, eos, "row 1", train_on="last_assistant"
        )
        # the hand-written text of the last assistant turn, and nothing of the earlier ones
        assert backend.decode(encoded.response, skip_special_tokens=False) == trained_text


def test_a_template_that_raises_names_the_template_and_message(tokenizer_file):
    template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "{{ m['content'] }}</s>{% endfor %}"
    )
    backend, ours = _ours(tokenizer_file, template, {"eos_token": "</s>"})
    bad = [{"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}]
    with pytest.raises(chat_template.ChatTemplateError, match="test template.*must alternate"):
        assistant_turns.encode(bad, ours, backend, backend.token_to_id("</s>"), "row 3")


def test_a_template_that_does_not_compile_or_render_is_refused():
    with pytest.raises(chat_template.ChatTemplateError, match="x.json: chat_template does not"):
        chat_template.ChatTemplate("{% for m in messages %}", {}, "x.json")
    broken = chat_template.ChatTemplate("{{ messages[0]['content'] + 1 }}", {}, "x.json")
    with pytest.raises(chat_template.ChatTemplateError, match="x.json: chat_template failed"):
        broken.render([{"role": "user", "content": "a"}])


def test_a_turn_without_the_end_of_turn_token_is_refused(tokenizer_file):
    template = "{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
    template += "{% if add_generation_prompt %}assistant:\n{% endif %}"
    backend, ours = _ours(tokenizer_file, template, {"eos_token": "</s>"})
    with pytest.raises(chat_template.ChatTemplateError, match="row 2: .*no end-of-turn token"):
        assistant_turns.encode(
            CONVERSATIONS[0], ours, backend, backend.token_to_id("</s>"), "row 2"
        )


def test_a_token_across_the_start_of_the_assistant_turn_is_refused(tokenizer_file):
    # "assistant: " + "olleh": byte-level BPE makes " o" one token across the boundary
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    template += "{% if add_generation_prompt %}assistant: {% endif %}"
    backend, ours = _ours(tokenizer_file, template, {"eos_token": "</s>"})
    with pytest.raises(chat_template.ChatTemplateError, match="row 4: a token spans"):
        assistant_turns.encode(
            CONVERSATIONS[0], ours, backend, backend.token_to_id("</s>"), "row 4"
        )


def test_tokenizer_config_special_tokens_may_be_added_token_dicts(tokenizer_file):
    from minifield.data import tokenizer as tokenizers

    config = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"}
    tok, strings = tokenizers.from_base_model(
        tokenizer_file.read_bytes(), config, "tokenizer.json", "tokenizer_config.json"
    )
    vocab = json.loads(tokenizer_file.read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (ids["<s>"], ids["</s>"], ids["</s>"])
    assert strings["bos_token"] == "<s>" and strings["pad_token"] is None
    with pytest.raises(tokenizers.TokenizerError, match="tokenizer_config.json: eos_token="):
        tokenizers.from_base_model(
            tokenizer_file.read_bytes(), {"eos_token": "<nope>"}, "t.json", "tokenizer_config.json"
        )
