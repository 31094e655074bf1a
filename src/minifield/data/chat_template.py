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

Which tokens are trained comes from the template itself (:mod:`.assistant_turns`). Where it marks assistant text with
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

TEMPLATE_VARIABLES = ("bos_token", "eos_token", "pad_token", "unk_token")
#: characters one render may write beyond its messages' text, per position of ``seq_len``
CHARS_PER_POSITION = 32
#: characters one render may write in all (a conversation's text included)
MAX_RENDERED_CHARS = 1 << 20
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
            if getattr(self.environment, "mark_generation", False):
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
            if operator == "+" and type(left) is str and type(right) is str:
                # most of a chat template's work: join_strings' charge, its common case here
                # (no call: a render makes a few dozen of these per message)
                budget, size = self.budget, len(left) + len(right)
                cost = 2 + size // template_sandbox.CHARS_PER_UNIT
                if size <= budget.max_chars and budget.work >= cost:
                    budget.work -= cost
                    return left + right
                return template_sandbox.join_strings(budget, left, right)
            template_sandbox.check_binop(self.budget, operator, left, right)
            return self.budget.built(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
            template_sandbox.check_call(__self.budget, __obj, args, kwargs)
            return __self.budget.built(super().call(__context, __obj, *args, **kwargs))

        def is_safe_attribute(self, obj, attr, value):
            if isinstance(obj, str) and attr in template_sandbox.UNSAFE_METHODS:
                return False
            return super().is_safe_attribute(obj, attr, value)

        def bounded_iter(self, context, iterable, literal_chars):
            # charged as check_call charges any call (one unit, integer arguments are sizes)
            budget = self.budget
            budget.spend()
            budget.argument(iterable, "an integer argument")
            budget.argument(literal_chars, "an integer argument")
            return template_sandbox.bounded_iter(lambda: self.budget, iterable, literal_chars)

        def bounded_add(self, context, *operands):
            return template_sandbox.join_all(
                self.budget, operands, lambda a, b: self.call_binop(context, "+", a, b)
            )

        def bounded_concat(self, context, values):
            # charged as before it was called directly: a call (one unit), then its result
            # as a call's result (once more)
            self.budget.spend()
            parts = [str(v) for v in values]
            self.budget.fits(sum(map(len, parts)), "a concatenation (~)")
            return self.budget.built(self.budget.built("".join(parts)))

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
        # the globals a render sees, merged once: jinja merges its ChainMap on every render,
        # the larger part of a short render's cost
        self._globals = {**self._template.globals, **self.variables}
        from jinja2.runtime import new_context

        self._new_context = new_context

    def max_chars(self, messages: list[dict]) -> int:
        """How many characters rendering ``messages`` may produce (see the class)."""
        if self.positions is None:
            return MAX_RENDERED_CHARS
        own = 0
        for message in messages:
            if isinstance(message, dict):
                content = message.get("content", "")
                own += len(content) if type(content) is str else len(str(content))
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
        template, new_context = self._template, self._new_context
        variables = {
            **self._globals,
            "messages": messages,
            "tools": tools,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            # Template.generate, without its per-render merge of the globals
            context = new_context(self._env, template.name, template.blocks, variables, True)
            # budget.fits and budget.spend per part, written out: they raise only past the
            # limits (called then, for their message), and a render has many short parts
            limit, per_unit = budget.max_chars, template_sandbox.CHARS_PER_UNIT
            for part in template.root_render_func(context):
                length += len(part)
                if length > limit:
                    budget.fits(length, "the rendered text")
                budget.work -= 1 + len(part) // per_unit
                if budget.work < 0:
                    budget.spend(0)
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
