"""The trained tokens of a conversation rendered with its chat template: every assistant turn.

Where the template marks assistant text with ``{% generation %}`` blocks, the tokens inside
them are trained (as transformers' ``return_assistant_tokens_mask``). Otherwise each assistant
turn is found by rendering the conversation up to it with ``add_generation_prompt=True``: that
text must be a prefix of the whole conversation rendered, and the turn's trained tokens run
from the end of that prefix up to and including its end-of-turn token, the first special token
after it (``<|eot_id|>``, ``<|im_end|>``, ``<end_of_turn>``, ``</s>``, ``<|end|>``: whatever
the template closes the turn with; :func:`end_of_turn_ids`; never ``<unk>``). System, user and tool turns are
context; anything the template writes after the last trained turn is not part of the example.

``train_on`` (:data:`TRAIN_ON`, the recipe's ``training.train_on``) chooses what is trained:
every assistant turn, the last one, or every token but the first (refused for a conversation
with tool messages: a tool's output is never trained). Conversations are rendered one by one
and tokenized in batches (:func:`encode_many`); one error names the example (``where``).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from .chat_template import CLOSE_MARK, OPEN_MARK, ChatTemplate, ChatTemplateError
from .encoding import Encoded
from .tokenizer import unknown_id

TRAIN_ON = ("all_assistant", "last_assistant", "everything")


@dataclass(frozen=True)
class Conversation:
    """One conversation to encode: its messages, tool definitions and where it comes from."""

    messages: list[dict]
    where: str
    tools: list | None = None


@dataclass(frozen=True)
class Rendered:
    """A conversation's text, with the character offset where each assistant turn to train
    starts (``starts``, incremental renders) or the generation blocks' spans (``blocks``)."""

    text: str
    starts: list[tuple[int, int]] | None = None  # (message index, character offset)
    blocks: list[tuple[int, int]] | None = None


def _generation_spans(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without its generation marks, and the character spans the marks enclosed."""
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


def render(conversation: Conversation, template: ChatTemplate, train_on: str) -> Rendered:
    """The conversation rendered, and where its trained turns start (see the module)."""
    messages, tools = conversation.messages, conversation.tools
    marked = template.render(messages, tools=tools, mark_generation=True)
    if OPEN_MARK in marked:
        text, blocks = _generation_spans(marked)
        return Rendered(text, blocks=blocks)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "last_assistant":
        turns = turns[-1:]
    starts = []
    for index in turns:
        prompt = template.render(messages[:index], add_generation_prompt=True, tools=tools)
        if not marked.startswith(prompt):
            raise ChatTemplateError(
                f"rendering the conversation before message {index} (with "
                "add_generation_prompt) is not a prefix of the whole conversation rendered, so "
                f"the assistant's turn cannot be found ({template.where})"
            )
        starts.append((index, len(prompt)))
    return Rendered(marked, starts=starts)


class _TokenIndex:
    """The first token of an encoding starting at or after a character boundary; a token
    across it is an error (the trained tokens could not be separated from the context).

    By bisecting every token's start, or, where it gives the same answer, the tokenizer's own
    lookup of the token holding the boundary's character (three calls, where listing every
    token's offsets costs half as much as the rest of finding the spans): that token starts at
    the boundary and the one before it lies wholly before (token starts never decrease)."""

    def __init__(self, encoding, text: str):
        self.encoding, self.text = encoding, text
        self._offsets = self._starts = None

    def __call__(self, boundary: int) -> int:
        encoding = self.encoding
        token = encoding.char_to_token(boundary)
        if token is not None and encoding.token_to_chars(token)[0] == boundary:
            if token == 0:
                return 0
            start, end = encoding.token_to_chars(token - 1)
            if start < boundary and end <= boundary:
                return token
        return self._bisect(boundary)

    def _bisect(self, boundary: int) -> int:
        if self._offsets is None:
            self._offsets = self.encoding.offsets
            self._starts = [s for s, _ in self._offsets]
        offsets = self._offsets
        index = bisect.bisect_left(self._starts, boundary)
        if index > 0 and offsets[index - 1][1] > boundary:
            start, end = offsets[index - 1]
            raise ChatTemplateError(
                "a token spans the end of the prompt and the start of the assistant's "
                f"turn ({self.text[start:end]!r}), so the trained tokens cannot be separated "
                "from the prompt"
            )
        return index


def token_spans(rendered: Rendered, ids, encoding, end_ids) -> list[tuple[int, int]]:
    """``(start, end)`` token spans of the trained turns, end-of-turn token included
    (``encoding``: the tokenizer's of ``rendered.text``, whose ``ids`` these are)."""
    token_index = _TokenIndex(encoding, rendered.text)
    if rendered.blocks is not None:
        return [(token_index(s), token_index(e)) for s, e in rendered.blocks]
    spans = []
    for index, boundary in rendered.starts:
        start = token_index(boundary)
        end = next((i for i in range(start, len(ids)) if ids[i] in end_ids), None)
        if end is None:
            raise ChatTemplateError(
                f"the rendered assistant turn (message {index}) has no end-of-turn "
                "token (a special token such as the eos); the template must close the turn "
                "with one"
            )
        if end == start:
            raise ChatTemplateError(
                f"the assistant turn (message {index}) is empty (nothing to train on)"
            )
        spans.append((start, end + 1))
    return spans


def special_ids(backend, eos_id: int) -> frozenset[int]:
    """The eos and every special added token."""
    added = backend.get_added_tokens_decoder()
    return frozenset({eos_id, *(i for i, token in added.items() if token.special)})


def end_of_turn_ids(backend, eos_id: int) -> frozenset[int]:
    """The ids that may close an assistant turn: :func:`special_ids` but the unknown token
    (``<unk>`` stands for text the tokenizer cannot spell, inside the turn:
    :mod:`.unknown_text`)."""
    return (special_ids(backend, eos_id) - {unknown_id(backend)}) | {eos_id}


def _encoded(ids: list[int], spans, conversation: Conversation, train_on: str) -> Encoded:
    spans = [(s, e) for s, e in spans if e > s]
    if not spans:
        raise ChatTemplateError("no assistant turn to train on")
    if train_on == "last_assistant":
        spans = spans[-1:]
    elif train_on == "everything":
        if any(m["role"] == "tool" for m in conversation.messages):
            raise ChatTemplateError(
                "training.train_on=everything would train a tool's output; use "
                "all_assistant or last_assistant for conversations with tool messages"
            )
        spans = [(min(1, spans[-1][1] - 1), spans[-1][1])]
    first, last = spans[0][0], spans[-1][1]
    flags = [0] * (last - first)
    for s, e in spans:
        flags[s - first : e - first] = [1] * (e - s)
    trained = None if all(flags) else tuple(flags)
    return Encoded(ids[:first], ids[first:last], trained)


def encode_many(
    conversations: list[Conversation],
    template: ChatTemplate,
    backend,
    eos_id: int,
    train_on: str = "all_assistant",
    end_ids: frozenset[int] | None = None,
) -> list[Encoded]:
    """``Encoded`` of each conversation: ``prompt`` is every token before the first trained
    one, ``response`` runs through the last trained turn's end-of-turn token, its flags
    marking the trained turns. Errors name the conversation's ``where``."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
    if end_ids is None:
        end_ids = end_of_turn_ids(backend, eos_id)
    rendered = []
    for conversation in conversations:
        try:
            rendered.append(render(conversation, template, train_on))
        except ChatTemplateError as exc:
            raise ChatTemplateError(f"{conversation.where}: {exc}") from None
    encodings = backend.encode_batch([r.text for r in rendered], add_special_tokens=False)
    out = []
    for conversation, text, encoding in zip(conversations, rendered, encodings, strict=True):
        ids = list(encoding.ids)
        try:
            spans = token_spans(text, ids, encoding, end_ids)
            out.append(_encoded(ids, spans, conversation, train_on))
        except ChatTemplateError as exc:
            raise ChatTemplateError(f"{conversation.where}: {exc}") from None
    return out


def encode(
    messages: list[dict],
    template: ChatTemplate,
    backend,
    eos_id: int,
    where: str,
    train_on: str = "all_assistant",
    tools: list | None = None,
) -> Encoded:
    """:func:`encode_many` of one conversation whose last message is the assistant's."""
    conversation = Conversation(messages, where, tools)
    return encode_many([conversation], template, backend, eos_id, train_on)[0]
