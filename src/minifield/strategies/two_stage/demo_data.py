"""The two-stage demo data: real text (Python standard library docstrings) and pairs from it.

``data/two-stage/corpus/{train,dev,test}.jsonl`` (shipped, pinned by sha256) hold one
document per line, ``{"text": "<module>.<name><signature>\\n\\n<docstring>"}``, made once with
:func:`stdlib_documents` from CPython 3.11.7's standard library; the docstrings are
Python Software Foundation text, redistributed under the PSF License Agreement
(``data/two-stage/LICENSE-PSF.txt``). Another Python version has other docstrings, which is
why the corpus is shipped rather than regenerated.

The supervised pairs of stage 2 are derived from the corpus byte-identically by
:func:`write_pairs` (``minifield make-demo-data --two-stage``): the task is *word completion
in context*: the prompt is the 40 characters of a document that end four letters into a word
of at least seven letters, the response is the rest of that word. About one such word in
three is taken (by the sha256 of its place), in document order, up to 1500/150/150 pairs;
each split's pairs come from the corpus split of the same name, so DEV and TEST complete
words in documents neither stage trained on: what stage 1 contributes is the language of
the documentation, not a memorised answer (the comparison in docs/two-stage.md).
"""

from __future__ import annotations

import hashlib
import inspect
import re
from pathlib import Path

from ..lm import demo_files

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
#: characters of the document a prompt ends with (the word's first letters included)
CONTEXT_CHARS = 40
#: about one word in this many becomes a pair (chosen by the sha256 of its place)
PICK_ONE_IN = 3
#: pairs per split
PAIRS = {"train": 1500, "dev": 150, "test": 150}
_WORD = re.compile(r"[A-Za-z]+")


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


def read_corpus_split(path: Path) -> list[str]:
    from .corpus import read_documents

    return read_documents(path)


def supervised_pairs(documents: list[str], limit: int, context: int = CONTEXT_CHARS) -> list[dict]:
    """Word-completion pairs from ``documents`` (module docstring), at most ``limit``."""
    rows = []
    for index, text in enumerate(documents):
        for match in _WORD.finditer(text):
            word = match.group()
            if len(word) < MIN_WORD_LETTERS:
                continue
            cut = match.start() + PREFIX_LETTERS
            key = f"{index}:{match.start()}"
            if int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % PICK_ONE_IN:
                continue
            rows.append(
                {"prompt": text[max(0, cut - context) : cut], "response": word[PREFIX_LETTERS:]}
            )
            if len(rows) == limit:
                return rows
    return rows


def write_pairs(corpus_dir: Path, out_dir: Path) -> dict[str, str]:
    """``{train,dev,test}.jsonl`` of pairs derived from the corpus split of the same name."""
    files = {}
    for split in SPLITS:
        documents = read_corpus_split(corpus_dir / f"{split}.jsonl")
        files[f"{split}.jsonl"] = demo_files.jsonl(supervised_pairs(documents, PAIRS[split]))
    return {Path(name).stem: pin for name, pin in demo_files.write(out_dir, files).items()}
