"""A chain of ``+`` in a chat template (``a + b + c``, one per message in most templates) is
rendered as one join, charged exactly as the chain of binary ``+`` it stands for.

References: the same sums written one ``+`` at a time (``{% set %}`` between them, so
nothing is chained), whose charges and refusals are those of the plain binary operator;
jinja2's own sandbox for the values.
"""

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from minifield.data.chat_template import ChatTemplate, ChatTemplateError

MESSAGES = [{"role": "user", "content": "hello"}]
PARTS = {"a": "x" * 700, "b": "y" * 650, "c": "z" * 500, "d": "w" * 150}
CHAINED = "{{ a + b + c + d }}"
STEPWISE = "{% set s = a + b %}{% set s = s + c %}{{ s + d }}"


def _render(source: str, positions: int, **variables) -> tuple[str, int]:
    """The text and the work units left after the render."""
    template = ChatTemplate(source, {}, "T.json", positions=positions)
    template._globals.update(variables)  # plain values the template reads
    text = template.render(MESSAGES)
    return text, template._env.budget.work


def test_a_chain_renders_and_is_charged_as_its_steps():
    chained = _render(CHAINED, 64, **PARTS)
    assert chained == _render(STEPWISE, 64, **PARTS)
    assert chained[0] == "".join(PARTS.values())
    # a loop of chains, as a chat template writes them
    loop = "{% for m in messages * 3 %}{{ '<' + m.role + '>' + m.content + '</' + m.role + '>' }}{% endfor %}"
    steps = (
        "{% for m in messages * 3 %}{% set s = '<' + m.role %}{% set s = s + '>' %}"
        "{% set s = s + m.content %}{% set s = s + '</' %}{% set s = s + m.role %}"
        "{{ s + '>' }}{% endfor %}"
    )
    assert _render(loop, 64) == _render(steps, 64)


def test_a_chain_past_the_size_limit_is_refused_as_its_step_would_be():
    # 2,000 characters in all pass the limit of positions=60 (1,920 + the messages' 5)
    for source in (CHAINED, STEPWISE):
        with pytest.raises(ChatTemplateError, match="a concatenation \\(\\+\\) would build 2,000"):
            _render(source, 60, **PARTS)


@pytest.mark.parametrize(
    "source",
    ["{{ 1 + 2 + 3 }}", "{{ [1] + [2] + [3] }}", "{{ 'a' + 'b' + 1|string + 'c' }}"],
)
def test_chains_of_other_values_are_what_jinja_makes_of_them(source):
    reference = ImmutableSandboxedEnvironment().from_string(source).render()
    assert _render(source, 64)[0] == reference


def test_a_chain_of_a_string_and_a_number_fails_as_jinja_does():
    with pytest.raises(ChatTemplateError, match="TypeError"):
        _render("{{ 'a' + 'b' + 1 }}", 64)
