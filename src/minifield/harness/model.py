"""The lm-evaluation-harness model backed by minifield: ``lm_eval --model minifield``.

Importing this module registers :class:`MinifieldLM` under the name ``minifield`` in lm-eval's
model registry (lm-eval 0.4.13 discovers models by import only: its registry has no entry-point
group), which ``minifield-lm-eval`` (:mod:`.cli`) and :mod:`.run` do before handing over.

Scoring runs our forward over whole rows, ``batch_size`` requests at a time, rows padded to a
multiple of 32 positions and batches to ``batch_size`` rows, so a handful of compilations serve a
whole task. Generation is the export's greedy generation (a Llama model's key/value cache),
batched by token budget, batches filled to ``batch_size`` rows; a stop sequence cuts the decoded text at its first occurrence, which is what greedy
generation token by token would have returned.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from ..models.model import padded_length
from . import loading


class HarnessModelError(ValueError):
    """A request the model cannot serve (names the argument and what it must be)."""


@functools.partial(jax.jit, static_argnums=(1,))
def _score_rows(params, cfg, inputs_BxT, targets_BxT):
    """Per position: log p(target | inputs up to it) and whether the target is the argmax."""
    logits_BxTxV = loading.forward(params, cfg, inputs_BxT)
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    logp_BxT = jnp.take_along_axis(logp_BxTxV, targets_BxT[:, :, None], axis=-1)[:, :, 0]
    return logp_BxT, jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT


def _positive_int(name: str, value) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or str(number) != str(value).strip():
        raise HarnessModelError(f"model argument {name}={value!r}: expected a positive integer")
    return number


def _flag(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no"):
        return False
    raise HarnessModelError(f"model argument {name}={value!r}: expected true or false")


#: what lm-eval 0.4.13 adds to every model's arguments (``simple_evaluate``: its
#: ``batch_size``, ``max_batch_size`` and ``device``, when not None); the last two mean nothing
#: here (batches are ``batch_size`` rows; JAX runs on its default device)
LM_EVAL_SETTINGS = ("max_batch_size", "device")


@register_model("minifield")
class MinifieldLM(TemplateLM):
    """An exported minifield model (``path``: the export directory) as an lm-eval model.

    ``dtype``: the compute dtype, ``auto`` (the export's declared one, ``config.json``'s
    ``torch_dtype``, as lm-eval's ``hf`` model loads it), ``float32`` or ``bfloat16``;
    ``batch_size`` requests per forward or generation batch; ``add_bos_token`` puts the
    tokenizer's ``<bos>`` before every context (as training did); ``cache``: a Llama model
    generates with its key/value cache (the same tokens either way). Any other argument is
    refused by name, except lm-eval's own ``max_batch_size`` and ``device`` (accepted, unused).
    """

    ARGUMENTS = ("path", "dtype", "batch_size", "add_bos_token", "cache", "max_gen_toks")

    def __init__(
        self,
        path: str | None = None,
        dtype="auto",
        batch_size=8,
        add_bos_token=True,
        cache=True,
        max_gen_toks=64,
        **settings,
    ):
        super().__init__()
        unknown = sorted(set(settings) - set(LM_EVAL_SETTINGS))
        if unknown:
            raise HarnessModelError(_unknown_arguments(unknown, self.ARGUMENTS))
        if path is None:
            raise HarnessModelError("model argument path=EXPORT_DIR is required")
        if dtype not in loading.DTYPES:
            raise HarnessModelError(
                f"model argument dtype={dtype!r}: expected {', '.join(loading.DTYPES)} "
                "(auto: the export's declared dtype)"
            )
        self.batch_size = _positive_int(
            "batch_size", 8 if batch_size in (None, "auto") else batch_size
        )
        self.add_bos_token = _flag("add_bos_token", add_bos_token)
        self.cache = _flag("cache", cache)
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        self.loaded = loading.load(path, dtype)
        self.cfg = loading.scoring_config(self.loaded.cfg)

    # -- tokens ------------------------------------------------------------------------------

    @property
    def max_length(self) -> int:
        return self.cfg.max_len

    @property
    def eot_token_id(self) -> int:
        return self.loaded.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.loaded.tokenizer.bos_id
        return self.eot_token_id if bos is None else bos

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_) -> list[int]:
        ids = self.loaded.tokenizer.encode(string)
        bos = self.loaded.tokenizer.bos_id
        wants_bos = self.add_bos_token if add_special_tokens is None else add_special_tokens
        if wants_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.loaded.tokenizer.decode(ids)

    # -- chat template -----------------------------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        return str(self.loaded.directory)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        template = self.loaded.template
        return None if template is None else template.source

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt=True) -> str:
        if self.loaded.template is None:
            raise HarnessModelError(
                f"{self.loaded.directory}: the export has no chat template "
                "(--apply_chat_template needs a run from a base model with one)"
            )
        return self.loaded.template.render(chat_history, add_generation_prompt)

    # -- scoring -----------------------------------------------------------------------------

    def score_tokens(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation | context), whether each continuation token is the
        argmax)`` for ``(context_ids, continuation_ids)`` pairs, longest rows first in batches.

        A row longer than the model's ``max_len`` + 1 keeps its last tokens (the context is cut
        from the left, as lm-eval's HF model does)."""
        rows = []
        for context, continuation in pairs:
            if not continuation:
                raise HarnessModelError("a loglikelihood request has an empty continuation")
            whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
            rows.append((whole, min(len(continuation), len(whole) - 1)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chosen = order[start : start + self.batch_size]
            longest = len(rows[chosen[0]][0]) - 1
            T = padded_length(longest, self.max_length)
            inputs = np.zeros((self.batch_size, T), np.int32)
            targets = np.zeros((self.batch_size, T), np.int32)
            for b, i in enumerate(chosen):
                whole = rows[i][0]
                inputs[b, : len(whole) - 1] = whole[:-1]
                targets[b, : len(whole) - 1] = whole[1:]
            logp, greedy = _score_rows(
                self.loaded.params, self.cfg, jnp.asarray(inputs), jnp.asarray(targets)
            )
            logp, greedy = np.asarray(logp, np.float64), np.asarray(greedy)
            for b, i in enumerate(chosen):
                whole, scored = rows[i]
                span = slice(len(whole) - 1 - scored, len(whole) - 1)
                results[i] = (float(logp[b, span].sum()), bool(greedy[b, span].all()))
        return results  # type: ignore[return-value]

    def _loglikelihood_tokens(self, requests, **_options):
        results = self.score_tokens([(ctx, cont) for _, ctx, cont in requests])
        for (strings, _, _), result in zip(requests, results, strict=True):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, result)
        return results

    def loglikelihood_rolling(self, requests, **_options) -> list[float]:
        """Each document's log-likelihood over disjoint windows of at most ``max_len``
        predictions, every token predicted once (lm-eval's rolling windows)."""
        windows, owner = [], []
        for number, request in enumerate(requests):
            ids = self.tok_encode(request.args[0], add_special_tokens=False)
            for pair in lm_utils.get_rolling_token_windows(
                ids, self.prefix_token_id, self.max_length, 1
            ):
                windows.append(lm_utils.make_disjoint_window(pair))
                owner.append(number)
        totals = [0.0] * len(requests)
        for number, (logp, _) in zip(owner, self.score_tokens(windows), strict=True):
            totals[number] += logp
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), total)
        return totals

    # -- generation --------------------------------------------------------------------------

    def _generation_settings(self, gen_kwargs: dict) -> tuple[tuple[str, ...], int]:
        kwargs = dict(gen_kwargs or {})
        until = kwargs.pop("until", None) or []
        until = (until,) if isinstance(until, str) else tuple(until)
        max_gen = _positive_int("max_gen_toks", kwargs.pop("max_gen_toks", self.max_gen_toks))
        if _flag("do_sample", kwargs.pop("do_sample", False)) or float(
            kwargs.pop("temperature", 0.0) or 0.0
        ):
            raise HarnessModelError(
                "generation_kwargs: minifield generates greedily (do_sample: false, temperature: 0)"
            )
        return until, max_gen

    def generate_until(self, requests, **_options) -> list[str]:
        """Greedy continuations, cut at the first stop sequence (``until``), at most
        ``max_gen_toks`` tokens, ending early at ``<eos>``.

        Requests are batched by token budget alone (stop sequences only cut the decoded text)
        and every batch is filled up to ``batch_size`` rows, so a task compiles one generation
        loop per buffer length, not one per batch size or per set of stop sequences."""
        groups: dict[int, list[int]] = {}
        settings = [self._generation_settings(request.args[1]) for request in requests]
        for number, (_, max_gen) in enumerate(settings):
            groups.setdefault(max_gen, []).append(number)
        out: list[str | None] = [None] * len(requests)
        for max_gen, numbers in groups.items():
            room = self.max_length - max_gen
            if room < 1:
                raise HarnessModelError(
                    f"max_gen_toks={max_gen} leaves no room for a context "
                    f"(the model's max_len is {self.max_length})"
                )
            numbers = sorted(numbers, key=lambda n: -len(requests[n].args[0]))
            for start in range(0, len(numbers), self.batch_size):
                chosen = numbers[start : start + self.batch_size]
                prompts = [self.tok_encode(requests[n].args[0])[-room:] for n in chosen]
                # filler rows repeat the first prompt (rows are independent); their output is dropped
                filler = [prompts[0]] * (self.batch_size - len(prompts))
                generated = loading.generate(self.loaded, prompts + filler, max_gen, self.cache)
                for n, new in zip(chosen, generated[: len(chosen)], strict=True):
                    out[n] = cut_at_stop(self.tok_decode(new), settings[n][0])
                    self.cache_hook.add_partial("generate_until", requests[n].args, out[n])
        return out  # type: ignore[return-value]


def _unknown_arguments(names: list[str], known: tuple[str, ...]) -> str:
    """One line naming each unknown model argument (with the known name it is closest to)."""
    import difflib

    parts = []
    for name in names:
        close = difflib.get_close_matches(name, known, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    plural = "s" if len(names) > 1 else ""
    return (
        f"unknown model argument{plural} {', '.join(parts)}: the minifield model takes "
        f"{', '.join(known)}"
    )


def cut_at_stop(text: str, until: tuple[str, ...]) -> str:
    """``text`` up to the earliest occurrence of any stop sequence."""
    for stop in until:
        if stop:
            text = text.split(stop, 1)[0]
    return text
