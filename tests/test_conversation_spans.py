"""Every assistant turn of a conversation is trained, with its end-of-turn token.

For five chat templates written as their models' ``tokenizer_config.json`` files carry them
(Llama 3, Qwen2.5 ChatML, Gemma 3, Mistral ``[INST]``, Phi-3), the rendered conversation is
spelled out by hand below as (text, trained) pieces: the trained pieces are each assistant
answer and the token that closes its turn, the rest (system, user, headers, the newline
after an end-of-turn token) is context. The rendering itself is checked against transformers'
``apply_chat_template``; for a template with ``{% generation %}`` blocks the trained tokens are
checked against its ``return_assistant_tokens_mask``; a tool call is trained, its result not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_chat_template import GENERATION_TAG, LLAMA3, SPECIALS, make_tokenizer

from minifield.data import (
    assistant_turns,
    chat_template,
    formats,
)
from minifield.data import (
    encoding as sft_data,
)
from minifield.data import tokenizer as tk

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501 - the template as the model's tokenizer_config.json carries it

GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# Mistral's [INST] format, the system message before the first user message
MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""  # noqa: E501

PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)

THREE_TURNS = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "reverse: hello"},
    {"role": "assistant", "content": "olleh"},
    {"role": "user", "content": "and world?"},
    {"role": "assistant", "content": "dlrow"},
    {"role": "user", "content": "and hi?"},
    {"role": "assistant", "content": "ih"},
]
TWO_TURNS = THREE_TURNS[:5]


def _turns(head, user_open, user_close, answer_open, answers, end, between=""):
    """Hand-written pieces: ``head`` (through the first answer's opening), then each answer
    with its end-of-turn token (trained) and the next user turn around it (context)."""
    pieces = [(head, False)]
    for index, (question, answer) in enumerate(answers):
        if index:
            pieces.append((f"{between}{user_open}{question}{user_close}{answer_open}", False))
        pieces.append((f"{answer}{end}", True))
    return pieces


ANSWERS = [("reverse: hello", "olleh"), ("and world?", "dlrow"), ("and hi?", "ih")]
#: name -> (template, special token strings, end-of-turn token, pieces of THREE_TURNS)
TEMPLATES = {
    "llama3": (
        LLAMA3,
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "<|eot_id|>",
        [
            (
                "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nreverse: hello<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n",
                False,
            ),
            ("olleh<|eot_id|>", True),
            (
                "<|start_header_id|>user<|end_header_id|>\n\nand world?<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n",
                False,
            ),
            ("dlrow<|eot_id|>", True),
            (
                "<|start_header_id|>user<|end_header_id|>\n\nand hi?<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n",
                False,
            ),
            ("ih<|eot_id|>", True),
        ],
    ),
    "qwen2.5-chatml": (
        QWEN25,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "<|im_end|>",
        _turns(
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nreverse: hello<|im_end|>\n"
            "<|im_start|>assistant\n",
            "<|im_start|>user\n",
            "<|im_end|>\n",
            "<|im_start|>assistant\n",
            ANSWERS,
            "<|im_end|>",
            between="\n",
        ),
    ),
    "gemma3": (
        GEMMA3,
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
        "<end_of_turn>",  # not the eos: the turn closes with its own token
        _turns(
            "<bos><start_of_turn>user\nbe brief\n\nreverse: hello<end_of_turn>\n"
            "<start_of_turn>model\n",
            "<start_of_turn>user\n",
            "<end_of_turn>\n",
            "<start_of_turn>model\n",
            ANSWERS,
            "<end_of_turn>",
            between="\n",
        ),
    ),
    "mistral-inst": (
        MISTRAL,
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        "</s>",
        _turns(
            "<s> [INST] be brief\n\nreverse: hello [/INST]",
            " [INST] ",
            " [/INST]",
            "",
            [(q, " " + a) for q, a in ANSWERS],
            "</s>",
        ),
    ),
    "phi3": (
        PHI3,
        {"bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>"},
        "<|end|>",  # the eos the template writes after the last turn is not trained
        _turns(
            "<|system|>\nbe brief<|end|>\n<|user|>\nreverse: hello<|end|>\n<|assistant|>\n",
            "<|user|>\n",
            "<|end|>\n",
            "<|assistant|>\n",
            ANSWERS,
            "<|end|>",
            between="\n",
        ),
    ),
}
MORE_SPECIALS = ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<|end|>"]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return make_tokenizer(path, specials=[*SPECIALS, *MORE_SPECIALS])


def _ours(tokenizer_file, name):
    from tokenizers import Tokenizer

    template, specials, _, _ = TEMPLATES[name]
    backend = Tokenizer.from_file(str(tokenizer_file))
    return backend, chat_template.ChatTemplate(template, specials, f"{name} template")


def _encode(tokenizer_file, name, messages, **kwargs):
    backend, template = _ours(tokenizer_file, name)
    eos = backend.token_to_id(TEMPLATES[name][1]["eos_token"])
    return backend, assistant_turns.encode(messages, template, backend, eos, "row 1", **kwargs)


def _pieces(backend, encoded) -> list[tuple[str, bool]]:
    """The example decoded as runs of context and trained tokens."""
    flags = [0] * len(encoded.prompt) + encoded.response_mask()
    runs, start = [], 0
    for index in range(1, len(flags) + 1):
        if index == len(flags) or flags[index] != flags[start]:
            text = backend.decode(encoded.tokens[start:index], skip_special_tokens=False)
            runs.append((text, bool(flags[start])))
            start = index
    return runs


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("messages", [TWO_TURNS, THREE_TURNS], ids=["two", "three"])
def test_rendering_equals_transformers(tokenizer_file, name, messages):
    from transformers import PreTrainedTokenizerFast

    template, specials, _, _ = TEMPLATES[name]
    ref = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), **specials)
    ref.chat_template = template
    _, ours = _ours(tokenizer_file, name)
    for generation_prompt, shown in ((False, messages), (True, messages[:-1])):
        expected = ref.apply_chat_template(
            shown, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert ours.render(shown, add_generation_prompt=generation_prompt) == expected


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("turns", [2, 3])
def test_every_assistant_turn_is_trained_as_written_by_hand(tokenizer_file, name, turns):
    _, _, end, pieces = TEMPLATES[name]
    messages = THREE_TURNS if turns == 3 else TWO_TURNS
    backend, encoded = _encode(tokenizer_file, name, messages)
    expected = pieces if turns == 3 else pieces[:-2]  # without the third question and answer
    assert _pieces(backend, encoded) == expected
    # the end-of-turn token closes every trained run, and every run is an answer's
    end_id = backend.token_to_id(end)
    flags = [0] * len(encoded.prompt) + encoded.response_mask()
    run_ends = [
        i for i in range(len(flags)) if flags[i] and (i + 1 == len(flags) or not flags[i + 1])
    ]
    assert len(run_ends) == turns
    assert all(encoded.tokens[i] == end_id for i in run_ends)


def test_last_assistant_trains_the_last_turn_and_everything_all_but_the_first_token(
    tokenizer_file,
):
    _, _, _, pieces = TEMPLATES["llama3"]
    backend, last = _encode(tokenizer_file, "llama3", THREE_TURNS, train_on="last_assistant")
    context = "".join(text for text, _ in pieces[:-1])
    assert _pieces(backend, last) == [(context, False), pieces[-1]]
    _, everything = _encode(tokenizer_file, "llama3", THREE_TURNS, train_on="everything")
    whole = "".join(text for text, _ in pieces)
    assert _pieces(backend, everything) == [
        ("<|begin_of_text|>", False),
        (whole.removeprefix("<|begin_of_text|>"), True),
    ]
    # evaluation asks the last answer with the whole conversation before it as the prompt
    assert _pieces(backend, last) == _pieces(
        backend, _encode(tokenizer_file, "llama3", THREE_TURNS)[1].last_turn()
    )


def test_generation_blocks_give_the_spans_transformers_masks(tokenizer_file):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token="<|im_end|>")
    ref.chat_template = GENERATION_TAG
    backend = Tokenizer.from_file(str(tokenizer_file))
    ours = chat_template.ChatTemplate(GENERATION_TAG, {"eos_token": "<|im_end|>"}, "gen")
    for messages in (TWO_TURNS, THREE_TURNS):
        out = ref.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        eos = backend.token_to_id("<|im_end|>")
        encoded = assistant_turns.encode(messages, ours, backend, eos, "row 1")
        mask = [0] * len(encoded.prompt) + encoded.response_mask()
        assert encoded.tokens == list(out["input_ids"])[: len(encoded)]
        assert mask == list(out["assistant_masks"])[: len(encoded)]
        assert not any(out["assistant_masks"][len(encoded) :])  # nothing trained is cut off
        assert sum(mask) > 0


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "reverse",
            "description": "reverse a text",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
        },
    }
]
CALL = {"type": "function", "function": {"name": "reverse", "arguments": {"text": "hello"}}}
WITH_TOOL = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "reverse: hello"},
    {"role": "assistant", "tool_calls": [CALL]},
    {"role": "tool", "content": "olleh"},
    {"role": "assistant", "content": "it is olleh"},
]


def test_a_tool_call_is_trained_and_its_result_is_not(tokenizer_file):
    from transformers import PreTrainedTokenizerFast

    _, specials, _, _ = TEMPLATES["qwen2.5-chatml"]
    ref = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), **specials)
    ref.chat_template = QWEN25
    backend, ours = _ours(tokenizer_file, "qwen2.5-chatml")
    assert ours.render(WITH_TOOL, tools=TOOLS) == ref.apply_chat_template(
        WITH_TOOL, tools=TOOLS, tokenize=False
    )
    eos = backend.token_to_id("<|im_end|>")
    encoded = assistant_turns.encode(WITH_TOOL, ours, backend, eos, "row 1", tools=TOOLS)
    runs = _pieces(backend, encoded)
    assert [text for text, trained in runs if trained] == [
        '<tool_call>\n{"name": "reverse", "arguments": {"text": "hello"}}\n</tool_call><|im_end|>',
        "it is olleh<|im_end|>",
    ]
    assert runs[2] == (
        "\n<|im_start|>user\n<tool_response>\nolleh\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
        False,
    )
    with pytest.raises(chat_template.ChatTemplateError, match="row 1: .*tool's output"):
        assistant_turns.encode(WITH_TOOL, ours, backend, eos, "row 1", "everything", TOOLS)


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer_file):
    # the system message joins the *last* user message: adding a turn moves it, so the
    # conversation up to the first answer is no prefix of the whole
    moving = MISTRAL.replace("loop.first and system_message", "loop.last and system_message")
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(tokenizer_file))
    ours = chat_template.ChatTemplate(moving, TEMPLATES["mistral-inst"][1], "moving.json")
    with pytest.raises(chat_template.ChatTemplateError, match="row 7: .*message 2.*not a prefix"):
        assistant_turns.encode(THREE_TURNS, ours, backend, backend.token_to_id("</s>"), "row 7")


def test_without_a_template_every_turn_follows_sep_and_ends_with_eos():
    tok = tk.byte_tokenizer()
    example = formats.chat_example(TWO_TURNS, "row 1")

    def b(text):
        return list(text.encode())

    encoded = sft_data.encode(example, tok)
    assert encoded.prompt == [tk.BOS_ID, *b("system: be brief\nuser: reverse: hello\n"), tk.SEP_ID]
    assert encoded.response == [
        *b("olleh"), tk.EOS_ID, *b("user: and world?\n"), tk.SEP_ID, *b("dlrow"), tk.EOS_ID
    ]  # fmt: skip
    assert encoded.trained == (1,) * 6 + (0,) * 18 + (1,) * 6
    last = sft_data.encode(example, tok, "last_assistant")
    earlier = "system: be brief\nuser: reverse: hello\nassistant: olleh\nuser: and world?\n"
    assert last.prompt == [tk.BOS_ID, *b(earlier), tk.SEP_ID]
    assert (last.response, last.trained) == ([*b("dlrow"), tk.EOS_ID], None)


def test_the_token_at_a_boundary_is_the_first_starting_at_or_after_it(tmp_path):
    """The boundary lookup (the tokenizer's char→token lookup where that is exact, else a
    bisection of every token's start) against its definition, by brute force over the
    offsets, at every character of a text with multi-byte characters (one character, several
    byte tokens), runs of spaces and special tokens: the same token, or the same refusal."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(make_tokenizer(tmp_path / "tokenizer.json")))
    text = "<|im_start|>user\nnaïve 日本語 🙂🙂  two   spaces<|im_end|>\n<|im_start|>x"
    encoding = backend.encode(text, add_special_tokens=False)
    offsets = encoding.offsets
    looked_up = 0
    for boundary in range(len(text) + 1):
        expected = next((i for i, (s, _) in enumerate(offsets) if s >= boundary), len(offsets))
        token_index = assistant_turns._TokenIndex(encoding, text)
        if expected > 0 and offsets[expected - 1][1] > boundary:
            with pytest.raises(chat_template.ChatTemplateError, match="a token spans"):
                token_index(boundary)
        else:
            assert token_index(boundary) == expected
            looked_up += token_index._offsets is None  # answered without listing offsets
    assert 0 < looked_up < len(text)  # both ways were taken
