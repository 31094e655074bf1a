"""Assistant-turn spans (:mod:`minifield.data.assistant_turns`) at their edges: a generation
block that leaves the end-of-turn token out, an empty or nested block, a conversation of one
turn, tools and the tokenizer's own special tokens, the defaults, and the full text of every
refusal (the one line a user reads). Expected pieces are written out by hand; token offsets
for the refusal that quotes a token are looked up by brute force over the tokenizer's
offsets."""

from __future__ import annotations

import re

import pytest
from test_chat_template import make_tokenizer
from test_conversation_spans import MISTRAL, QWEN25, TEMPLATES, THREE_TURNS, TOOLS, WITH_TOOL

from minifield.data import assistant_turns, chat_template
from minifield.data.chat_template import ChatTemplateError

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: a generation block around the answer alone: its end-of-turn token is context
BLOCK_WITHOUT_END = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ m['content'] }}{% endgeneration %}{{ '<|im_end|>\\n' }}{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TWO = [
    {"role": "user", "content": "reverse: hello"},
    {"role": "assistant", "content": "olleh"},
    {"role": "user", "content": "and world?"},
    {"role": "assistant", "content": "dlrow"},
]
ONE = TWO[:2]


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    from tokenizers import Tokenizer

    path = make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    return Tokenizer.from_file(str(path))


def _template(source, where="t.json"):
    return chat_template.ChatTemplate(source, {"eos_token": "<|im_end|>"}, where)


def _encode(backend, source, messages, where="row 1", **kwargs):
    eos = backend.token_to_id("<|im_end|>")
    return assistant_turns.encode(messages, _template(source), backend, eos, where, **kwargs)


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


def test_a_generation_block_trains_what_it_encloses_and_not_the_end_token(backend):
    """With ``{% generation %}`` blocks the blocks are the trained text (as transformers'
    assistant mask), even where the end-of-turn token lies outside them; the example ends
    with the last block."""
    encoded = _encode(backend, BLOCK_WITHOUT_END, TWO)
    assert _pieces(backend, encoded) == [
        ("<|im_start|>user\nreverse: hello<|im_end|>\n<|im_start|>assistant\n", False),
        ("olleh", True),
        ("<|im_end|>\n<|im_start|>user\nand world?<|im_end|>\n<|im_start|>assistant\n", False),
        ("dlrow", True),
    ]


def test_one_turn_all_trained_is_flagged_none_and_everything_skips_the_first_token(backend):
    """One answer after the prompt: its tokens are all trained (``trained`` None, no flags).
    ``everything`` on a conversation whose trained part is two tokens ("a", the end token)
    trains the second only."""
    encoded = _encode(backend, CHATML, ONE)
    assert encoded.trained is None
    assert _pieces(backend, encoded) == [
        ("<|im_start|>user\nreverse: hello<|im_end|>\n<|im_start|>assistant\n", False),
        ("olleh<|im_end|>", True),
    ]
    answers_only = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}<|im_end|>"
        "{% endif %}{% endfor %}"
    )
    a, end = backend.token_to_id("a"), backend.token_to_id("<|im_end|>")
    short = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}]
    everything = _encode(backend, answers_only, short, train_on="everything")
    assert (everything.prompt, everything.response, everything.trained) == ([a], [end], None)
    whole = _encode(backend, answers_only, short)
    assert (whole.prompt, whole.response, whole.trained) == ([], [a, end], None)


def test_encode_many_defaults_to_every_assistant_turn_and_keeps_the_order(backend):
    eos = backend.token_to_id("<|im_end|>")
    template = _template(CHATML)
    conversations = [
        assistant_turns.Conversation(TWO, "row 1"),
        assistant_turns.Conversation(ONE, "row 2"),
    ]
    many = assistant_turns.encode_many(conversations, template, backend, eos)
    assert many == [
        assistant_turns.encode(TWO, template, backend, eos, "row 1", "all_assistant"),
        assistant_turns.encode(ONE, template, backend, eos, "row 2", "all_assistant"),
    ]
    assert many[0].trained is not None and sum(many[0].trained) < len(many[0].response)


def test_tools_reach_the_template_through_encode(backend):
    """The tool definitions are rendered into the prompt (Qwen2.5's system message lists
    them); without them the template writes the conversation's own system message."""
    qwen = _template(QWEN25)
    eos = backend.token_to_id("<|im_end|>")
    with_tools = assistant_turns.encode(WITH_TOOL, qwen, backend, eos, "row 1", tools=TOOLS)
    prompt = backend.decode(with_tools.prompt, skip_special_tokens=False)
    assert "# Tools" in prompt and '"name": "reverse"' in prompt
    without = assistant_turns.encode(WITH_TOOL, qwen, backend, eos, "row 1")
    prompt = backend.decode(without.prompt, skip_special_tokens=False)
    assert "# Tools" not in prompt and "be brief" in prompt


def test_the_tokenizers_own_special_tokens_are_not_added(backend):
    """A tokenizer whose post-processor puts ``<s>`` before every text (as Llama 3's adds
    ``<|begin_of_text|>``): the template's text is encoded as written, nothing added."""
    import copy

    from tokenizers import processors

    adding = copy.deepcopy(backend)
    bos = adding.token_to_id("<s>")
    adding.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    assert adding.encode("x").ids[0] == bos  # the premise: plain encoding adds it
    encoded = _encode(adding, CHATML, ONE)
    assert bos not in encoded.tokens
    assert adding.decode(encoded.tokens, skip_special_tokens=False) == (
        "<|im_start|>user\nreverse: hello<|im_end|>\n<|im_start|>assistant\nolleh<|im_end|>"
    )


def test_an_added_token_that_is_not_special_does_not_end_the_turn(backend):
    """Qwen3's ``<think>`` is an added token with ``special: false``: inside an answer it is
    answer text, and the turn runs on to the special token that closes it."""
    import copy

    from tokenizers import AddedToken

    thinking = copy.deepcopy(backend)
    thinking.add_tokens([AddedToken("<think>", special=False)])
    assert thinking.token_to_id("<think>") is not None  # the premise: one token
    answer = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>ok"}]
    encoded = _encode(thinking, CHATML, answer)
    assert _pieces(thinking, encoded)[-1] == ("<think>ok<|im_end|>", True)


def test_the_eos_closes_a_turn_even_when_it_is_not_an_added_token(backend):
    """The end-of-turn ids are the eos and every special added token: a template that
    closes turns with a newline, the newline being the eos (a plain byte token), trains each
    answer through it."""
    lines = "{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
    lines += "{% if add_generation_prompt %}assistant:\n{% endif %}"
    newline = backend.token_to_id("\u010a")  # byte-level BPE spells "\n" as "Ċ"
    assert backend.encode("\n").ids == [newline]  # the premise: one plain token
    encoded = assistant_turns.encode(ONE, _template(lines), backend, newline, "row 1")
    assert _pieces(backend, encoded) == [
        ("user:\nreverse: hello\nassistant:\n", False),
        ("olleh\n", True),
    ]


# -- refusals, in full --------------------------------------------------------------------------


def _refusal(call) -> str:
    with pytest.raises((ChatTemplateError, ValueError)) as raised:
        call()
    return str(raised.value)


def test_an_empty_or_nested_generation_block_is_refused(backend):
    empty = BLOCK_WITHOUT_END.replace(
        "{{ m['content'] }}{% endgeneration %}", "{% endgeneration %}"
    )
    assert _refusal(lambda: _encode(backend, empty, TWO, "row 5")) == (
        "row 5: no assistant turn to train on"
    )
    nested = BLOCK_WITHOUT_END.replace(
        "{% generation %}{{ m['content'] }}{% endgeneration %}",
        "{% generation %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endgeneration %}",
    )
    assert _refusal(lambda: _encode(backend, nested, TWO, "row 6")) == (
        "row 6: a {% generation %} block opens inside another"
    )


def test_an_empty_answer_and_a_turn_without_an_end_token_are_refused(backend):
    empty = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    assert _refusal(lambda: _encode(backend, CHATML, empty, "row 7")) == (
        "row 7: the assistant turn (message 1) is empty (nothing to train on)"
    )
    unclosed = CHATML.replace("'<|im_end|>\\n'", "'\\n'")
    assert _refusal(lambda: _encode(backend, unclosed, ONE, "row 2")) == (
        "row 2: the rendered assistant turn (message 1) has no end-of-turn token (a special "
        "token such as the eos); the template must close the turn with one"
    )


def test_everything_with_a_tool_message_and_an_unknown_train_on_are_refused(backend):
    qwen, eos = _template(QWEN25), backend.token_to_id("<|im_end|>")
    assert _refusal(
        lambda: assistant_turns.encode(WITH_TOOL, qwen, backend, eos, "row 3", "everything", TOOLS)
    ) == (
        "row 3: training.train_on=everything would train a tool's output; use all_assistant or "
        "last_assistant for conversations with tool messages"
    )
    assert _refusal(lambda: _encode(backend, CHATML, ONE, train_on="all")) == (
        "train_on must be one of ('all_assistant', 'last_assistant', 'everything'), got 'all'"
    )


def test_a_moving_prefix_and_a_token_across_the_boundary_are_refused(backend):
    moving = MISTRAL.replace("loop.first and system_message", "loop.last and system_message")
    template = chat_template.ChatTemplate(moving, TEMPLATES["mistral-inst"][1], "moving.json")
    eos = backend.token_to_id("</s>")
    assert _refusal(
        lambda: assistant_turns.encode(THREE_TURNS, template, backend, eos, "row 7")
    ) == (
        "row 7: rendering the conversation before message 2 (with add_generation_prompt) is "
        "not a prefix of the whole conversation rendered, so the assistant's turn cannot be "
        "found (moving.json)"
    )
    # "assistant: " + "olleh": the space and the answer's first letters are one token
    spaced = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
    spaced += "{% if add_generation_prompt %}assistant: {% endif %}"
    text = _template(spaced).render(ONE)
    boundary = len("user: reverse: hello<|im_end|>assistant: ")
    offsets = backend.encode(text, add_special_tokens=False).offsets
    (across,) = [text[s:e] for s, e in offsets if s < boundary < e]
    assert _refusal(lambda: _encode(backend, spaced, ONE, "row 4")) == (
        f"row 4: a token spans the end of the prompt and the start of the assistant's turn "
        f"({across!r}), so the trained tokens cannot be separated from the prompt"
    )
    assert re.fullmatch(r" o\w*", across)
