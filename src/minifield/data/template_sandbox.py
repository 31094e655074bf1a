"""A Jinja sandbox whose renders are bounded in size and in work, deterministically.

A chat template is code from a downloaded file. jinja2's sandbox keeps it from reaching
Python's internals but not from spending time and memory: ``{{ 'x' * 10000000 }}`` renders,
``range(1000000)`` ends in an ``OverflowError``. Here every render has a :class:`Budget`:

- **characters**: no string or list built while rendering (by ``*``, ``+``, ``~``, ``%``,
  ``format``, a filter or a method call) and no rendered text may exceed ``max_chars``; the
  operations whose result size is known in advance (repetition, concatenation, joining,
  replacing, padding, format widths, integer arguments) are refused *before* they allocate;
- **work**: a count of operations, the same on every machine (no clock): each loop
  iteration (plus the loop body's literal text), call, filter, intercepted operator and
  ``range`` element costs one unit, and every value built costs one more unit per
  :data:`CHARS_PER_UNIT` characters; past :data:`MAX_WORK` units the render is refused.

Integers are bounded too (:data:`MAX_INT_BITS`): ``9 ** 9 ** 9`` is refused, not computed.
Any failure is a :class:`BudgetExceeded` or another exception, which :mod:`.chat_template`
turns into one error naming the template.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

#: work units one render may spend (a real template spends a few hundred per message)
MAX_WORK = 1_000_000
#: characters of built text that cost one unit of work
CHARS_PER_UNIT = 64
#: the largest integer a template may build, in bits
MAX_INT_BITS = 4096
_DIGITS = re.compile(r"\d+")
#: str methods refused outright: their result size is a product of two inputs
UNSAFE_METHODS = frozenset({"expandtabs"})


class BudgetExceeded(Exception):
    """A render that would pass its :class:`Budget`; the message says which limit."""


class Budget:
    """What one render may still spend (see the module docstring)."""

    def __init__(self, max_chars: int):
        self.max_chars = max_chars
        self.work = MAX_WORK

    def spend(self, units: int = 1) -> None:
        self.work -= units
        if self.work < 0:
            raise BudgetExceeded(
                f"rendering takes more than {MAX_WORK:,} operations (a loop, a range or a "
                "recursion too long)"
            )

    def fits(self, chars: int, what: str) -> None:
        """Refuse a value of ``chars`` characters (or items) before it is built."""
        if chars > self.max_chars:
            raise BudgetExceeded(
                f"{what} would build {chars:,} characters or items, more than the "
                f"{self.max_chars:,} one render may"
            )

    def built(self, value):
        """Charge a built value's size (and check it); returns the value."""
        if isinstance(value, str | list | tuple):
            self.fits(len(value), "an expression")
            self.spend(1 + len(value) // CHARS_PER_UNIT)
        elif type(value) is int and value.bit_length() > MAX_INT_BITS:
            raise BudgetExceeded(f"an integer of more than {MAX_INT_BITS} bits")
        return value

    def argument(self, value, what: str) -> None:
        """An integer argument is a size (a width, a count) at most ``max_chars``."""
        if type(value) is int and abs(value) > self.max_chars:
            raise BudgetExceeded(
                f"{what} {value:,} is more than the {self.max_chars:,} characters or items "
                "one render may build"
            )

    def format_string(self, text: str, what: str) -> None:
        """Widths and precisions written in a format string are sizes too."""
        for digits in _DIGITS.findall(text):
            if len(digits) > 12 or int(digits) > self.max_chars:
                raise BudgetExceeded(
                    f"{what} has a width or precision of {digits} characters, more than the "
                    f"{self.max_chars:,} one render may build"
                )


def _int_result_bits(operator: str, left: int, right: int) -> int:
    if operator == "*":
        return left.bit_length() + right.bit_length()
    if operator == "**":
        return left.bit_length() * max(right, 0) if abs(left) > 1 else 1
    return max(left.bit_length(), right.bit_length()) + 1


def _size(value) -> int:
    """Characters ``value`` takes when written: a list's are its items' (a list of ten long
    strings is long, however few its items)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list | tuple):
        return max(len(value), sum(_size(item) for item in value))
    return len(str(value))


def check_binop(budget: Budget, operator: str, left, right) -> None:
    """Refuse ``left operator right`` if its result would pass the budget."""
    budget.spend()
    if type(left) is int and type(right) is int:
        if _int_result_bits(operator, left, right) > MAX_INT_BITS:
            raise BudgetExceeded(f"an integer {operator} of more than {MAX_INT_BITS} bits")
    elif operator == "*":
        sized, count = (left, right) if type(right) is int else (right, left)
        if isinstance(sized, str | list | tuple) and type(count) is int:
            budget.fits(_size(sized) * max(count, 0), "a repetition (*)")
    elif operator == "+" and isinstance(left, str | list | tuple):
        budget.fits(_size(left) + _size(right), "a concatenation (+)")
    elif operator == "%" and isinstance(left, str):
        budget.format_string(left, "a % format")
        for value in right if isinstance(right, tuple) else (right,):
            budget.argument(value, "a % format argument")


def join_strings(budget: Budget, left: str, right: str) -> str:
    """``left + right`` of two plain strings, charged exactly as :func:`check_binop` and then
    :meth:`Budget.built` charge it (one unit, the size refused first, the built value's units)."""
    size = len(left) + len(right)
    cost = 2 + size // CHARS_PER_UNIT
    if size <= budget.max_chars and budget.work >= cost:  # exactly when nothing below raises
        budget.work -= cost
        return left + right
    budget.spend()
    budget.fits(size, "a concatenation (+)")
    budget.spend(cost - 1)
    return left + right


def join_all(budget: Budget, operands: tuple, add) -> object:
    """``operands[0] + operands[1] + …``, left to right, charged exactly as that chain of
    binary ``+`` is: when every operand is a plain string and no step would pass the budget
    (the sizes and charges of the steps only grow, so the last step decides), joined at once
    with the steps' charges summed; otherwise step by step with ``add(left, right)``, which
    charges and refuses as each ``+`` does."""
    size = cost = 0
    for operand in operands:  # one pass: the type check, the sizes and the charges
        if type(operand) is not str:
            break
        size += len(operand)
        cost += 2 + size // CHARS_PER_UNIT
    else:
        cost -= 2 + len(operands[0]) // CHARS_PER_UNIT  # the first operand is no step
        if size <= budget.max_chars and budget.work >= cost:
            budget.work -= cost
            return "".join(operands)
    result = operands[0]
    for operand in operands[1:]:
        result = add(result, operand)
    return result


def check_call(budget: Budget, obj, args: tuple, kwargs: dict) -> None:
    """Refuse a call whose result would pass the budget: integer arguments are sizes, a
    format string's widths too, and ``replace``/``join`` results are counted first."""
    budget.spend()
    for value in (*args, *kwargs.values()):
        budget.argument(value, "an integer argument")
    obj = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format on access
    receiver, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(receiver, str):
        return
    if name in ("format", "format_map"):
        budget.format_string(receiver, "a format()")
    elif name == "replace" and len(args) >= 2:
        check_replace(budget, receiver, args[0], args[1])
    elif name == "join" and args:
        check_join(budget, receiver, args[0])


def check_replace(budget: Budget, text, old, new) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        count = len(text) + 1 if not old else text.count(old)
        budget.fits(len(text) + count * max(len(new) - len(old), 0), "a replace")


def check_join(budget: Budget, separator: str, items) -> None:
    if isinstance(items, list | tuple | str):
        total = len(separator) * max(len(items) - 1, 0) + sum(_size(i) for i in items)
        budget.fits(total, "a join")


def bounded_filter(name: str, function, budget_of):
    """``function`` (a Jinja filter) charged, and checked beforehand where its result size
    is a product (``replace``, ``join``, ``indent``, ``wordwrap``, ``format``)."""

    @functools.wraps(function)  # keeps jinja's pass_context/pass_environment marks
    def bounded(*args, **kwargs):
        budget = budget_of()
        budget.spend()
        values = [a for a in args if not _is_jinja_context(a)]
        for value in (*values[1:], *kwargs.values()):
            budget.argument(value, f"the {name} filter's integer argument")
        subject = values[0] if values else None
        if name == "replace" and len(values) >= 3:
            check_replace(budget, subject, values[1], values[2])
        elif name == "join" and isinstance(subject, list | tuple):
            check_join(budget, str(values[1]) if len(values) > 1 else "", subject)
        elif name == "format" and isinstance(subject, str):
            budget.format_string(subject, "the format filter")
        elif name in ("indent", "wordwrap", "tojson"):
            check_line_prefixes(
                budget, name, subject, values[2:] if name == "wordwrap" else values[1:], kwargs
            )
        return budget.built(function(*args, **kwargs))

    return bounded


def check_line_prefixes(budget: Budget, name: str, subject, args, kwargs) -> None:
    """``indent`` and ``tojson(indent=)`` repeat a prefix on every line, ``wordwrap`` its
    ``wrapstring``: the result's size from the line count, before it is built."""
    given = [*args, *kwargs.values()]
    if name == "indent" and isinstance(subject, str):
        width = next((v for v in given if type(v) in (int, str)), 4)
        each = width if type(width) is int else len(width)
        budget.fits(len(subject) + (subject.count("\n") + 1) * max(each, 0), "the indent filter")
    elif name == "tojson":
        indent = kwargs.get("indent", args[1] if len(args) > 1 else None)
        if type(indent) is int and indent > 0:
            import json

            # with indent k a document is its indent=0 text plus k per nesting level per line
            flat = len(json.dumps(subject, indent=0, default=str))
            levels = len(json.dumps(subject, indent=1, default=str)) - flat
            budget.fits(flat + indent * levels, "the tojson filter")
    elif name == "wordwrap" and isinstance(subject, str):
        wrap = kwargs.get("wrapstring", args[1] if len(args) > 1 else None)
        if isinstance(wrap, str) and len(wrap) > 1:  # at most a line per character
            budget.fits(len(subject) + (len(subject) + 1) * len(wrap), "the wordwrap filter")


@functools.cache
def _jinja_contexts() -> tuple[type, ...]:
    from jinja2.environment import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    return Context, EvalContext, Environment


def _is_jinja_context(value) -> bool:
    """The context, eval context or environment jinja passes a ``pass_*`` filter first."""
    return isinstance(value, _jinja_contexts())


def bounded_iter(budget_of, iterable: Iterable, literal_chars: int):
    """A loop's iterable, charged per item (one unit plus the body's literal text)."""
    cost = 1 + literal_chars // CHARS_PER_UNIT
    for item in iterable:
        budget = budget_of()
        budget.work -= cost  # Budget.spend written out (called past the limit, for its error)
        if budget.work < 0:
            budget.spend(0)
        yield item


#: the environment's methods the code generator's rewrite calls (:func:`code_generator_class`)
REWRITTEN = frozenset({"bounded_iter", "bounded_concat", "bounded_add"})


def code_generator_class():
    """jinja2's code generator, which first rewrites the template's loops, ``~``
    concatenations and chains of ``+`` into calls the budget sees
    (``environment.bounded_iter``/``_concat``/``_add``, each given the context first)."""
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.visitor import NodeTransformer

    def call(attribute: str, *args):
        return nodes.Call(nodes.EnvironmentAttribute(attribute), list(args), [], None, None)

    class Bound(NodeTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            literal = sum(len(d.data) for d in node.find_all(nodes.TemplateData))
            node.iter = call("bounded_iter", node.iter, nodes.Const(literal))
            return node

        def visit_Concat(self, node):
            node = self.generic_visit(node)
            return call("bounded_concat", nodes.List(node.nodes))

        def visit_Add(self, node):
            # a chain a + b + c + … (a chat template writes one per message) is one call
            # that joins it at once when it can, charged as the chain (join_all)
            operands = []
            while isinstance(node, nodes.Add):
                operands.append(node.right)
                node = node.left
            operands = [self.visit(o) for o in [node, *reversed(operands)]]
            if len(operands) == 2:
                return nodes.Add(*operands)
            return call("bounded_add", *operands)

    class BoundedCodeGenerator(CodeGenerator):
        def visit_Template(self, node, frame=None):
            super().visit_Template(Bound().visit(node), frame)

        def visit_Call(self, node, frame, forward_caller=False):
            # the rewrite's own calls (a template cannot name them) go straight to the
            # environment, which charges them, not through the sandbox's call(): a template
            # makes one per loop and one per message
            target = node.node
            if not isinstance(target, nodes.EnvironmentAttribute) or target.name not in REWRITTEN:
                return super().visit_Call(node, frame, forward_caller=forward_caller)
            self.write(f"environment.{node.node.name}(context")
            for argument in node.args:
                self.write(", ")
                self.visit(argument, frame)
            self.write(")")
            return None

    return BoundedCodeGenerator
