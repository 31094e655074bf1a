"""Chat template renders are bounded in size and work: a template that would write, build or
loop more is refused naming the template (and the example), never run to exhaustion.

The bounds as documented (docs/pretrained.md, chat_template.py): a render writes at most
32 characters per position of ``seq_len`` beyond its messages' text and 2**20 in all; no
value built on the way may be larger; at most 1,000,000 operations."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from test_base_model import _prepare, base_recipe
from test_base_model import root as root  # noqa: F401 - the fixture
from test_chat_template import CASES, CHATML

from minifield import cli
from minifield.data.chat_template import ChatTemplate, ChatTemplateError
from minifield.hf import pinned_base

MESSAGES = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "olleh"}]
BOUNDS = "T.json: chat_template exceeds its bounds: "


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ 'x' * 10000000 }}", "a repetition .* would build 10,000,000 characters"),
        ("{% for i in range(1000000) %}{% endfor %}", "an integer argument 1,000,000 is more"),
        (
            "{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}",
            "rendering takes more than 1,000,000 operations",
        ),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            r"a concatenation \(~\) would build 4,096 characters",
        ),
        (
            "{% set ns = namespace(s=[1]) %}{% for i in range(40) %}"
            "{% set ns.s = ns.s + ns.s %}{% endfor %}",
            r"a concatenation \(\+\) would build 4,096 characters",
        ),
        ("{{ 'x'|center(10**9) }}", "the center filter's integer argument 1,000,000,000"),
        ("{{ 'x'.ljust(2059) }}", "an integer argument 2,059 is more than the 2,058"),
        ("{{ '%99999s' % 'x' }}", "a % format has a width or precision of 99999 characters"),
        ("{{ '{:>99999}'.format('x') }}", r"a format\(\) has a width or precision of 99999"),
        ("{{ ('x' * 100).replace('', 'y' * 30) }}", "a replace would build 3,130 characters"),
        ("{{ 2 ** 5000 }}", "an integer .* of more than 4096 bits"),
        # 3 lines of 'x' * 600 (1,802 characters), each indented by 100: 2,102
        ("{{ ((('x' * 600) ~ '\n') * 3)|indent(100, true) }}", "the indent filter would build"),
        # the messages as JSON: each nesting level's line indented 1,000 deep
        ("{{ messages|tojson(indent=1000) }}", "the tojson filter would build"),
        # 500 copies of the two messages, each written as its dict (over 30 characters)
        ("{{ messages * 500 }}", r"a repetition \(\*\) would build [0-9,]{6} characters"),
        # the rendered text itself, written two characters at a time
        ("{% for i in range(2000) %}xy{% endfor %}", "the rendered text would build 2,060"),
    ],
)
def test_a_template_past_its_bounds_is_refused_naming_it(template, message):
    # seq_len 64: 64 * 32 = 2048 characters beyond the messages' 5 + 5, so 2058 in all
    bounded = ChatTemplate(template, {}, "T.json", positions=64)
    with pytest.raises(ChatTemplateError, match="^" + BOUNDS + message):
        bounded.render(MESSAGES)


def test_other_failures_name_the_template_and_the_exception():
    for template, message in [
        ("{{ lipsum(1000) }}", r"UndefinedError: 'lipsum' is undefined"),  # unbounded: absent
        ("{{ 1 // 0 }}", "ZeroDivisionError"),
        ("{{ ('a\tb').expandtabs(9) }}", "SecurityError: access to attribute 'expandtabs'"),
        ("{{ 2.0 ** 5000 }}", "OverflowError"),
    ]:
        with pytest.raises(ChatTemplateError, match=r"^T.json: chat_template failed to render \("):
            ChatTemplate(template, {}, "T.json", positions=64).render(MESSAGES)
        with pytest.raises(ChatTemplateError, match=message):
            ChatTemplate(template, {}, "T.json", positions=64).render(MESSAGES)


def test_the_size_limit_is_the_documented_one_exactly():
    at = ChatTemplate("{{ 'x' * 2058 }}", {}, "T.json", positions=64)
    assert at.render(MESSAGES) == "x" * 2058
    past = ChatTemplate("{{ 'x' * 2059 }}", {}, "T.json", positions=64)
    with pytest.raises(ChatTemplateError, match="would build 2,059 characters or items, more"):
        past.render(MESSAGES)
    # without seq_len (an export's template in minifield generate): 2**20 in all
    assert len(ChatTemplate("{{ 'x' * 1048576 }}", {}, "T.json").render(MESSAGES)) == 1 << 20
    with pytest.raises(ChatTemplateError, match="would build 1,048,577 characters"):
        ChatTemplate("{{ 'x' * 1048577 }}", {}, "T.json").render(MESSAGES)


RICH = (
    "{% set ns = namespace(sys='', n=0) %}{% for m in messages if m.role != 'tool' %}"
    "{% if loop.first and m.role == 'system' %}{% set ns.sys = m.content|trim %}{% endif %}"
    "{% set ns.n = ns.n + m.content|length %}"
    "<{{ m.role|upper }} {{ loop.index }}/{{ loop.length }}{{ ' last' if loop.last }}>"
    "{{ '%s:%03d' % (m.role[:2], loop.index0) }}{{ m.content.strip().split(' ')|join('_') }}"
    "{{ '{}|{:>4}'.format(ns.n, 'x') ~ eos_token }}{{ m|tojson }}\n{% endfor %}"
    "{{ range(3)|list|join(',') }}{{ ns.sys|replace('be', 'BE')|center(20) }}"
    "{{ (messages|map(attribute='role')|list) * 2 }}{{ 7 ** 3 }}{{ messages|tojson(indent=2) }}"
    "{{ messages[1].content|indent(2, true) }}{{ messages[1].content|wordwrap(5, wrapstring='|') }}"
)


@pytest.mark.parametrize("template", [RICH, CHATML, *(c[0] for c in CASES.values())])
def test_real_templates_render_as_jinja_renders_them_unbounded(template):
    """The reference: jinja2's own immutable sandbox, with transformers' settings."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from minifield.data.chat_template import _generation_tag

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_tag(), loopcontrols]
    )
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    messages = [
        {"role": "system", "content": " be brief "},
        {"role": "user", "content": "reverse: hello world"},
        {"role": "tool", "content": "ignored"},
        {"role": "assistant", "content": "dlrow olleh"},
    ]
    specials = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": None, "unk_token": None}
    for prompt in (False, True):
        expected = env.from_string(template).render(
            messages=messages, add_generation_prompt=prompt, tools=None, documents=None, **specials
        )
        ours = ChatTemplate(template, specials, "T.json", positions=64)
        assert ours.render(messages, add_generation_prompt=prompt) == expected


def test_a_template_past_its_bounds_in_prepare_names_the_row_and_template(root):  # noqa: F811
    # the first render (train.jsonl's first row, the whole conversation) trips it
    template = CHATML.replace("{% endfor %}", "{% endfor %}{{ 'x' * 10000000 }}")
    with pytest.raises(pinned_base.BaseModelError) as info:
        _prepare(base_recipe(root, {"chat_template": template}), root)
    train = root / "sft" / "train.jsonl"
    first = json.loads(train.read_text().splitlines()[0])["messages"]
    limit = 32 * 64 + sum(len(m["content"]) for m in first)  # seq_len 64
    assert str(info.value) == (
        f"{train}:1: recipe model.chat_template: chat_template exceeds its bounds: a "
        f"repetition (*) would build 10,000,000 characters or items, more than the {limit:,} "
        "one render may"
    )


def test_generate_on_an_export_whose_template_is_unbounded_exits_2(root, tmp_path):  # noqa: F811
    """An export carrying a template that trips its bounds only for one prompt (training
    rendered every example): ``minifield generate`` ends with exit 2 naming the file."""
    template = CHATML.replace(
        "{% endfor %}",
        "{% endfor %}{% if messages[-1].content == 'boom' %}"
        "{% for i in range(1000000) %}{% endfor %}{% endif %}",
    )
    loaded, (arrays, _) = _prepare(base_recipe(root, {"chat_template": template}), root)
    program = loaded.strategy.build(loaded.data, arrays)
    directory = tmp_path / "export"
    program.export(program.init_state(), directory)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["generate", "--model", str(directory), "--prompt", "boom"])
    assert code == 2 and out.getvalue() == ""
    assert err.getvalue() == (
        f"minifield generate: {directory / 'tokenizer_config.json'}: chat_template exceeds its "
        "bounds: rendering takes more than 1,000,000 operations (a loop, a range or a recursion "
        "too long)\n"
    )
