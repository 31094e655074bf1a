"""Chat examples rendered with a base model's own ``chat_template`` (Jinja).

The environment copies transformers' ``apply_chat_template`` (4.x): a sandboxed, immutable
Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension
and the ``{% generation %}`` block tag,
a ``tojson`` filter that keeps non-ASCII text, and a ``raise_exception`` global; the template
sees ``messages``, ``add_generation_prompt`` and the tokenizer's special token strings
(``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``). The rendered text is tokenized
whole, without adding special tokens (the template writes them), as transformers does.
Unlike transformers, a render is bounded in size and work (:mod:`.template_sandbox`,
:meth:`ChatTemplate.max_chars`): a template that would write more, loop longer or build a
larger value is refused, naming the template (and the example).
``strftime_now`` is left out on purpose: a date in the prompt would make the prepared
examples depend on the day they were prepared.

Which tokens are trained comes from the template itself. Where it marks assistant text with
``{% generation %}`` blocks, the tokens inside them are trained (as transformers'
``return_assistant_tokens_mask``). Otherwise each assistant turn is found by rendering the
conversation up to it with ``add_generation_prompt=True``: that text must be a prefix of the
whole conversation rendered, and the turn's trained tokens run from the end of that prefix up
to and including its end-of-turn token, the first special token after it (``<|eot_id|>``,
``<|im_end|>``, ``<end_of_turn>``, ``</s>``, ``<|end|>``: whatever the template closes the
turn with). ``train_on`` chooses the turns (:data:`TRAIN_ON`); system, user and tool turns are
context. Anything the template writes after the last trained turn is not part of the example.
Evaluation prompts are the conversation before its last assistant turn, so the model is asked
exactly as it was trained.
"""

from __future__ import annotations

import json

from . import template_sandbox
from .sft_data import Encoded

TEMPLATE_VARIABLES = ("bos_token", "eos_token", "pad_token", "unk_token")
#: characters one render may write beyond its messages' text, per position of ``seq_len``
CHARS_PER_POSITION = 32
#: characters one render may write in all (a conversation's text included)
MAX_RENDERED_CHARS = 1 << 20
#: what a conversation trains (the recipe's ``training.train_on``)
TRAIN_ON = ("all_assistant", "last_assistant", "everything")
#: written around a ``{% generation %}`` block's text while spans are found, then removed
#: (private-use code points: no tokenizer gives them meaning)
OPEN_MARK, CLOSE_MARK = "\uf8f0", "\uf8f1"


class ChatTemplateError(Exception):
    """A chat template that does not compile, fails to render, or has no assistant span."""


def _generation_tag():
    """``{% generation %}...{% endgeneration %}`` renders its body, as in transformers; while
    spans are found (``environment.mark_generation``) between :data:`OPEN_MARK` and
    :data:`CLOSE_MARK`."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_render_body")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _render_body(self, caller):
            if self.environment.mark_generation:
                return OPEN_MARK + caller() + CLOSE_MARK
            return caller()

    return GenerationTag


def _environment():
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox with a :class:`~.template_sandbox.Budget` per render."""

        code_generator_class = template_sandbox.code_generator_class()
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        budget = template_sandbox.Budget(0)
        mark_generation = False

        def call_binop(self, context, operator, left, right):
            template_sandbox.check_binop(self.budget, operator, left, right)
            return self.budget.built(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
            template_sandbox.check_call(__self.budget, __obj, args, kwargs)
            return __self.budget.built(super().call(__context, __obj, *args, **kwargs))

        def is_safe_attribute(self, obj, attr, value):
            if isinstance(obj, str) and attr in template_sandbox.UNSAFE_METHODS:
                return False
            return super().is_safe_attribute(obj, attr, value)

        def bounded_iter(self, iterable, literal_chars):
            return template_sandbox.bounded_iter(lambda: self.budget, iterable, literal_chars)

        def bounded_concat(self, values):
            parts = [str(v) for v in values]
            self.budget.fits(sum(map(len, parts)), "a concatenation (~)")
            return self.budget.built("".join(parts))

    def raise_exception(message):
        raise ChatTemplateError(f"the template raised: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def bounded_range(*args):
        numbers = range(*args)
        env.budget.fits(len(numbers), "a range")
        env.budget.spend(len(numbers))
        return numbers

    env = BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_generation_tag(), jinja2.ext.loopcontrols],
        # no constant folding at compile time: it would run operators outside the budget
        optimized=False,
    )
    env.filters["tojson"] = tojson
    env.filters = {
        name: template_sandbox.bounded_filter(name, f, lambda: env.budget)
        for name, f in env.filters.items()
    }
    env.globals["raise_exception"] = raise_exception
    env.globals["range"] = bounded_range
    # lipsum(n) writes n paragraphs: not a chat template's business, and unbounded
    del env.globals["lipsum"]
    return env


class ChatTemplate:
    """A compiled template plus the special token strings it may refer to.

    ``positions`` (the recipe's ``seq_len``; None for an export's template in ``minifield
    generate``) bounds what one render may write beyond the messages' own text:
    :data:`CHARS_PER_POSITION` characters per position, and :data:`MAX_RENDERED_CHARS` in
    all, whatever ``positions`` is."""

    def __init__(
        self,
        source: str,
        special_tokens: dict[str, str | None],
        where: str,
        positions: int | None = None,
    ):
        import jinja2

        self.source, self.where, self.positions = source, where, positions
        self.variables = {k: special_tokens.get(k) for k in TEMPLATE_VARIABLES}
        self._env = _environment()
        try:
            self._template = self._env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{where}: chat_template does not compile ({exc})") from None

    def max_chars(self, messages: list[dict]) -> int:
        """How many characters rendering ``messages`` may produce (see the class)."""
        if self.positions is None:
            return MAX_RENDERED_CHARS
        own = sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
        return min(MAX_RENDERED_CHARS, own + CHARS_PER_POSITION * self.positions)

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = False,
        tools: list | None = None,
        mark_generation: bool = False,
    ) -> str:
        limit = self.max_chars(messages)
        self._env.budget = budget = template_sandbox.Budget(limit)
        self._env.mark_generation = mark_generation
        parts, length = [], 0
        try:
            for part in self._template.generate(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.variables,
            ):
                length += len(part)
                budget.fits(length, "the rendered text")
                budget.spend(1 + len(part) // template_sandbox.CHARS_PER_UNIT)
                parts.append(part)
        except ChatTemplateError as exc:
            raise ChatTemplateError(
                f"{self.where}: chat_template failed to render: {exc}"
            ) from None
        except template_sandbox.BudgetExceeded as exc:
            raise ChatTemplateError(
                f"{self.where}: chat_template exceeds its bounds: {exc}"
            ) from None
        except (Exception, RecursionError, MemoryError) as exc:  # noqa: BLE001 - untrusted code
            raise ChatTemplateError(
                f"{self.where}: chat_template failed to render ({type(exc).__name__}: {exc})"
            ) from None
        return "".join(parts)


def _generation_spans(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without its generation marks, and the character spans the marks enclosed."""
    import re

    text, spans, start, length = [], [], None, 0
    for piece in re.split(f"([{OPEN_MARK}{CLOSE_MARK}])", marked):
        if piece == OPEN_MARK:
            if start is not None:
                raise ChatTemplateError("a {% generation %} block opens inside another")
            start = length
        elif piece == CLOSE_MARK:
            spans.append((start, length))
            start = None
        else:
            text.append(piece)
            length += len(piece)
    return "".join(text), spans


def _token_index(offsets, boundary: int, text: str) -> int:
    """The first token starting at or after character ``boundary``; a token across it is an
    error (the trained tokens could not be separated from the context)."""
    index = next((i for i, (s, _) in enumerate(offsets) if s >= boundary), len(offsets))
    if index > 0 and offsets[index - 1][1] > boundary:
        start, end = offsets[index - 1]
        raise ChatTemplateError(
            "a token spans the end of the prompt and the start of the assistant's "
            f"turn ({text[start:end]!r}), so the trained tokens cannot be separated from the "
            "prompt"
        )
    return index


def assistant_spans(
    messages: list[dict], template: ChatTemplate, backend, end_ids, tools=None
) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of the rendered conversation and ``(start, end)`` token spans of every
    assistant turn, end-of-turn token included (see the module docstring)."""
    marked = template.render(messages, tools=tools, mark_generation=True)
    if OPEN_MARK in marked:
        full_text, char_spans = _generation_spans(marked)
    else:
        full_text, char_spans = marked, None
    encoding = backend.encode(full_text, add_special_tokens=False)
    ids, offsets = list(encoding.ids), list(encoding.offsets)
    if char_spans is not None:
        return ids, [
            (
                _token_index(offsets, s, full_text),
                _token_index(offsets, e, full_text),
            )
            for s, e in char_spans
        ]
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt_text = template.render(messages[:index], add_generation_prompt=True, tools=tools)
        if not full_text.startswith(prompt_text):
            raise ChatTemplateError(
                f"rendering the conversation before message {index} (with "
                "add_generation_prompt) is not a prefix of the whole conversation rendered, so "
                f"the assistant's turn cannot be found ({template.where})"
            )
        start = _token_index(offsets, len(prompt_text), full_text)
        end = next((i for i in range(start, len(ids)) if ids[i] in end_ids), None)
        if end is None:
            raise ChatTemplateError(
                f"the rendered assistant turn (message {index}) has no end-of-turn "
                f"token (a special token such as the eos); the template ({template.where}) must "
                "close the turn with one"
            )
        if end == start:
            raise ChatTemplateError(
                f"the assistant turn (message {index}) is empty (nothing to train on)"
            )
        spans.append((start, end + 1))
    return ids, spans


def end_of_turn_ids(backend, eos_id: int) -> frozenset[int]:
    """The ids that may close an assistant turn: the eos and every special added token."""
    added = backend.get_added_tokens_decoder()
    return frozenset({eos_id, *(i for i, token in added.items() if token.special)})


def encode(
    messages: list[dict],
    template: ChatTemplate,
    backend,
    eos_id: int,
    where: str,
    train_on: str = "all_assistant",
    tools: list | None = None,
    end_ids: frozenset[int] | None = None,
):
    """``Encoded`` of one conversation whose last message is the assistant's.

    ``prompt`` is every token before the first trained one; ``response`` runs through the
    last trained turn's end-of-turn token, its flags marking the trained turns (``train_on``);
    ``where`` (``file:line``) goes into every error. ``end_ids`` (default
    :func:`end_of_turn_ids`) may be passed in to spare the lookup per conversation.
    """
    if end_ids is None:
        end_ids = end_of_turn_ids(backend, eos_id)
    try:
        ids, spans = assistant_spans(messages, template, backend, end_ids, tools)
    except ChatTemplateError as exc:
        raise ChatTemplateError(f"{where}: {exc}") from None
    spans = [(s, e) for s, e in spans if e > s]
    if not spans:
        raise ChatTemplateError(f"{where}: no assistant turn to train on ({template.where})")
    if train_on == "last_assistant":
        spans = spans[-1:]
    elif train_on == "everything":
        if any(m["role"] == "tool" for m in messages):
            raise ChatTemplateError(
                f"{where}: training.train_on=everything would train a tool's output; use "
                "all_assistant or last_assistant for conversations with tool messages"
            )
        spans = [(min(1, spans[-1][1] - 1), spans[-1][1])]
    first, last = spans[0][0], spans[-1][1]
    flags = [0] * (last - first)
    for s, e in spans:
        flags[s - first : e - first] = [1] * (e - s)
    trained = None if all(flags) else tuple(flags)
    return Encoded(ids[:first], ids[first:last], trained)
