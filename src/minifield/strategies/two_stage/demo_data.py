"""The two-stage demo data: real text (Python standard library docstrings) and pairs from it.

``data/two-stage/corpus/{train,dev,test}.jsonl`` (shipped, pinned by sha256) hold one
document per line, ``{"text": "<module>.<name><signature>\\n\\n<docstring>"}``, made once with
:func:`stdlib_documents` from CPython 3.11.7's standard library; the docstrings are
Python Software Foundation text, redistributed under the PSF License Agreement
(``data/two-stage/LICENSE-PSF.txt``). Another Python version has other docstrings, which is
why the corpus is shipped rather than regenerated.

The supervised pairs of stage 2 are derived from the corpus byte-identically by
:func:`write_pairs` (``minifield make-demo-data --two-stage``): the task is *word completion*:
the prompt is the first four letters of a word of the documentation, the response is the
word of at least seven letters with that prefix that occurs most often in the stage-1 TRAIN
documents (ties: alphabetical). Prefixes are split into train/dev/test by their sha256, so
DEV and TEST ask for words the SFT training never showed, but stage 1 read: the point of the
comparison with a random initialisation (docs/two-stage.md).
"""

from __future__ import annotations

import collections
import hashlib
import inspect
import json
import re
from pathlib import Path

from ...atomic import write_bytes
from ...digest import sha256_bytes

SPLITS = ("train", "dev", "test")
#: modules whose public functions and classes give the documents
MODULES = (
    "argparse",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "difflib",
    "enum",
    "filecmp",
    "fnmatch",
    "fractions",
    "functools",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "inspect",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "math",
    "operator",
    "os",
    "os.path",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "secrets",
    "shlex",
    "shutil",
    "socket",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "time",
    "timeit",
    "tokenize",
    "typing",
    "unicodedata",
    "urllib.parse",
    "uuid",
    "warnings",
    "weakref",
    "zipfile",
    "zlib",
)
PREFIX_LETTERS = 4
MIN_WORD_LETTERS = 7
_WORD = re.compile(r"[a-z]+")


def _split_of(key: str, dev_share: int = 10, test_share: int = 10) -> str:
    """A stable split from the sha256 of ``key`` (percent buckets)."""
    bucket = int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:8], 16) % 100
    if bucket < dev_share:
        return "dev"
    if bucket < dev_share + test_share:
        return "test"
    return "train"


def stdlib_documents(max_chars: int = 1200) -> dict[str, list[str]]:
    """Documents from the running interpreter's standard library docstrings, split by name."""
    import importlib

    splits: dict[str, list[str]] = {s: [] for s in SPLITS}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(getattr(module, "__all__", None) or dir(module)):
            if name.startswith("_"):
                continue
            obj = getattr(module, name, None)
            if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 40:
                continue
            try:
                signature = str(inspect.signature(obj))
            except (TypeError, ValueError):
                signature = ""
            text = f"{module_name}.{name}{signature}\n\n{doc.strip()}"[:max_chars]
            if not text.isascii():
                continue
            key = f"{module_name}.{name}"
            splits[_split_of(key)].append(text)
    return splits


def write_corpus(directory: Path, documents: dict[str, list[str]]) -> dict[str, str]:
    pins = {}
    for split, texts in documents.items():
        data = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode("utf-8")
        write_bytes(directory / f"{split}.jsonl", data)
        pins[split] = sha256_bytes(data)
    return pins


def read_corpus_split(path: Path) -> list[str]:
    from .corpus import read_documents

    return read_documents(path)


def supervised_pairs(train_documents: list[str]) -> dict[str, list[dict]]:
    """Word-completion pairs from the stage-1 TRAIN documents (module docstring)."""
    counts: collections.Counter = collections.Counter()
    for text in train_documents:
        counts.update(w for w in _WORD.findall(text.lower()) if len(w) >= MIN_WORD_LETTERS)
    best: dict[str, tuple[int, str]] = {}
    for word, count in counts.items():
        if count < 2:
            continue
        prefix = word[:PREFIX_LETTERS]
        current = best.get(prefix)
        if current is None or (-count, word) < (-current[0], current[1]):
            best[prefix] = (count, word)
    splits: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for prefix in sorted(best):
        splits[_split_of("prefix:" + prefix, 15, 15)].append(
            {"prompt": prefix, "response": best[prefix][1]}
        )
    return splits


def write_pairs(corpus_dir: Path, out_dir: Path) -> dict[str, str]:
    """``{train,dev,test}.jsonl`` of pairs derived from ``corpus_dir/train.jsonl``."""
    pairs = supervised_pairs(read_corpus_split(corpus_dir / "train.jsonl"))
    pins = {}
    for split, rows in pairs.items():
        data = "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8")
        write_bytes(out_dir / f"{split}.jsonl", data)
        pins[split] = sha256_bytes(data)
    return pins
