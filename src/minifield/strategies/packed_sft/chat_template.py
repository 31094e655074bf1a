"""Chat examples rendered with a base model's own ``chat_template`` (Jinja).

The environment copies transformers' ``apply_chat_template`` (4.x): a sandboxed, immutable
Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension
and the ``{% generation %}`` block tag,
a ``tojson`` filter that keeps non-ASCII text, and a ``raise_exception`` global; the template
sees ``messages``, ``add_generation_prompt`` and the tokenizer's special token strings
(``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``). The rendered text is tokenized
whole, without adding special tokens (the template writes them), as transformers does.
``strftime_now`` is left out on purpose: a date in the prompt would make the prepared
examples depend on the day they were prepared.

Which tokens are trained (the assistant span) is found by rendering twice: the conversation
without its last (assistant) message with ``add_generation_prompt=True`` must be a prefix of
the whole conversation rendered; the loss covers the tokens from the end of that prefix up to
and including the first end-of-turn token (the tokenizer's ``eos_token``). Anything the
template writes after it (a trailing newline) is not part of the example. Evaluation prompts
are that prefix, so the model is asked exactly as it was trained.
"""

from __future__ import annotations

import json

from .sft_data import Encoded

TEMPLATE_VARIABLES = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatTemplateError(Exception):
    """A chat template that does not compile, fails to render, or has no assistant span."""


def _generation_tag():
    """``{% generation %}...{% endgeneration %}`` renders its body, as in transformers (which
    uses the tag to mark assistant tokens; the span here comes from the prefix render)."""
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
            return caller()

    return GenerationTag


def _environment():
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(f"the template raised: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_generation_tag(), jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


class ChatTemplate:
    """A compiled template plus the special token strings it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str | None], where: str):
        import jinja2

        self.source, self.where = source, where
        self.variables = {k: special_tokens.get(k) for k in TEMPLATE_VARIABLES}
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{where}: chat_template does not compile ({exc})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        import jinja2

        try:
            return self._template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.variables,
            )
        except ChatTemplateError as exc:
            raise ChatTemplateError(
                f"{self.where}: chat_template failed to render: {exc}"
            ) from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise ChatTemplateError(
                f"{self.where}: chat_template failed to render ({type(exc).__name__}: {exc})"
            ) from None


def encode(messages: list[dict], template: ChatTemplate, backend, eos_id: int, where: str):
    """``Encoded(prompt, response)`` of one conversation whose last message is the assistant's.

    ``prompt`` is every token before the assistant span, ``response`` the span's tokens through
    the first ``eos_id``; ``where`` (``file:line``) goes into every error.
    """
    try:
        prompt_text = template.render(messages[:-1], add_generation_prompt=True)
        full_text = template.render(messages)
    except ChatTemplateError as exc:
        raise ChatTemplateError(f"{where}: {exc}") from None
    if not full_text.startswith(prompt_text):
        raise ChatTemplateError(
            f"{where}: rendering the conversation without its last message (with "
            "add_generation_prompt) is not a prefix of the whole conversation rendered, so the "
            f"assistant's turn cannot be found ({template.where})"
        )
    encoding = backend.encode(full_text, add_special_tokens=False)
    ids, offsets = list(encoding.ids), list(encoding.offsets)
    boundary = len(prompt_text)
    start = next((i for i, (s, _) in enumerate(offsets) if s >= boundary), len(ids))
    if start > 0 and offsets[start - 1][1] > boundary:
        raise ChatTemplateError(
            f"{where}: a token spans the end of the prompt and the start of the assistant's "
            f"turn ({full_text[offsets[start - 1][0] : offsets[start - 1][1]]!r}), so the "
            "trained tokens cannot be separated from the prompt"
        )
    try:
        end = ids.index(eos_id, start)
    except ValueError:
        raise ChatTemplateError(
            f"{where}: the rendered assistant turn has no end-of-turn token (eos id {eos_id}); "
            f"the template ({template.where}) must close the turn with eos_token"
        ) from None
    if end == start:
        raise ChatTemplateError(f"{where}: the assistant turn is empty (nothing to train on)")
    return Encoded(ids[:start], ids[start : end + 1])
