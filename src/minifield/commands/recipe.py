"""``minifield recipe new`` and ``minifield recipe repin``: your own data and base model.

``new`` writes a complete, pinned recipe from a shipped one (``--like``) and paths: every
setting of the ``--like`` recipe is kept except its identity (a new ``job_id``, no
``attempt_id``), the inputs you replace (``--train``, ``--dev``, ``--test``, ``--input
NAME=FILE``) and, with ``--base DIR``, its base model: the HF directory's files
(``config.json``, ``model.safetensors`` or the index and every shard it names,
``tokenizer.json``, ``tokenizer_config.json`` and, when present, ``generation_config.json``)
become pinned inputs that ``model.base`` names. Every path is written relative to the
pipeline's input root (``input_root`` of ``config/config.yaml``, or ``--input-root``) and every
file is pinned by the sha256 of its bytes. A file outside the input root is refused, saying
how to copy it there (a symlink that leaves the root is refused by the worker too).

``repin`` re-hashes an edited recipe's local inputs and prints every pin it changes (old ->
new sha256) before writing the recipe back; ``--check`` writes nothing and exits 1 when a pin
is stale. Comments and layout are kept: only the hashes are replaced in the text (checked by
parsing the result; where that cannot be done, the recipe is rewritten whole, and it says so).

Bad input (a missing file, a directory that is not an HF model, an output that exists without
``--force``, a recipe that does not validate) is refused with one message naming the file,
exit 2, and nothing written: the recipe is validated before it is written, atomically.

This module is the command: its arguments, what it prints, its exit codes. The recipe is
derived by :mod:`minifield.own_recipe`, the base directory's files found by
:mod:`minifield.hf.base_files`, the inputs pinned by :mod:`minifield.inputs.repin`.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import sys
from pathlib import Path

import yaml

from .. import atomic, own_recipe
from .. import recipe as recipes
from ..hf.base_files import BaseFilesError
from ..inputs import repin as pins
from ..own_recipe import DATA_FLAGS

EXIT_STALE = 1
EXIT_REFUSED = 2
#: the config whose ``input_root`` is the default input root, relative to the working directory
CONFIG_FILE = Path("config/config.yaml")
#: the pipeline's default input root (config/README.md: ``input_root``)
DEFAULT_INPUT_ROOT = Path("data")
_JOB_ID = re.compile(r"[^A-Za-z0-9._-]+")
#: characters that would end a comment line of the YAML header (a path may hold them)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class Refusal(Exception):
    """Bad input: the message names the file and what to do; exit 2, nothing written."""


#: what the library refuses with, said as a :class:`Refusal` is
REFUSED = (Refusal, own_recipe.OwnRecipeError, BaseFilesError, pins.PinError)


# ----------------------------------------------------------------------------- shared


def default_input_root() -> tuple[Path, str]:
    """The input root the pipeline uses from this directory, and where that was read."""
    try:
        config = yaml.safe_load(CONFIG_FILE.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return DEFAULT_INPUT_ROOT, "the pipeline's default; no config/config.yaml here"
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise Refusal(
            f"{CONFIG_FILE}: cannot read its input_root ({exc}); pass --input-root"
        ) from None
    root = config.get("input_root", str(DEFAULT_INPUT_ROOT)) if isinstance(config, dict) else None
    if not isinstance(root, str) or not root:
        raise Refusal(f"{CONFIG_FILE}: input_root is not a path; pass --input-root")
    return Path(root), f"input_root of {CONFIG_FILE}"


def _add_input_root(parser) -> None:
    """``--input-root``, read by :func:`_input_root`."""
    parser.add_argument(
        "--input-root",
        type=Path,
        metavar="DIR",
        help="the pipeline's input root (default: input_root of config/config.yaml, else data)",
    )


def _input_root(args) -> tuple[Path, str]:
    root, source = (args.input_root, "--input-root") if args.input_root else default_input_root()
    if not root.is_dir():
        raise Refusal(
            f"input root {root} ({source}) is not a directory: recipe paths are relative to it; "
            "create it and put your files there, or pass --input-root"
        )
    return root, source


def _write(path: Path, text: str) -> None:
    try:
        atomic.write_bytes(path, text.encode("utf-8"))
    except OSError as exc:
        raise Refusal(f"cannot write {exc.filename or path}: {exc.strerror or exc}") from None


def _validated(document: dict, source: str) -> recipes.Recipe:
    try:
        return recipes.validate(document, source)
    except recipes.RecipeError as exc:
        raise Refusal(f"{exc}\nnothing written") from None


def _read_recipe(path: Path, flag: str) -> dict:
    try:
        document = recipes.read_document(path)
    except recipes.RecipeError as exc:
        raise Refusal(f"{flag} {exc}".strip()) from None
    if not isinstance(document, dict):
        raise Refusal(f"{flag} {path}: a recipe must be a JSON/YAML object".strip())
    return document


# ----------------------------------------------------------------------------- new


def _job_id(args) -> str:
    if args.job_id:
        return args.job_id
    return _JOB_ID.sub("-", args.output.stem).strip("-.")[:128] or "my-recipe"


def _data_paths(args, names: set[str]) -> tuple[dict[str, Path], list[str]]:
    """Input name -> the file given for it, and notes to print."""
    given, notes = {}, []
    for flag in DATA_FLAGS:
        if getattr(args, flag) is not None:
            given[flag] = getattr(args, flag)
    for text in args.input or []:
        name, sep, file = text.partition("=")
        if not sep or not name or not file:
            raise Refusal(f"--input {text!r}: expected NAME=FILE (e.g. --input train=data/x.jsonl)")
        if name in given:
            raise Refusal(f"--input {text!r}: input {name!r} is given twice")
        given[name] = Path(file)
    if args.test is None and "test" in names and "dev" in given and "test" not in given:
        given["test"] = given["dev"]
        notes.append(
            "no --test given: the dev file is pinned as the test input too (TEST figures then "
            "repeat DEV's; give --test FILE for held-out ones)"
        )
    return given, notes


def build(args, root: Path) -> tuple[dict, list[dict], list[str]]:
    """The new recipe (as written), one row per pinned input it holds, and notes to print."""
    like = _read_recipe(args.like, "--like")
    _validated(copy.deepcopy(like), f"--like {args.like}")
    given, notes = _data_paths(args, own_recipe.input_names(like))
    document, rows, derived_notes = own_recipe.derive(
        like, args.like, given, args.base, args.chat_template, root, _job_id(args)
    )
    return document, rows, notes + derived_notes


def _command(args) -> str:
    """The command line that wrote the recipe (for its header)."""
    words = ["minifield", "recipe", "new", "--like", str(args.like)]
    for flag in ("base", *DATA_FLAGS, "chat_template", "job_id", "input_root"):
        value = getattr(args, flag)
        if value is not None:
            words += [f"--{flag.replace('_', '-')}", str(value)]
    for text in args.input or []:
        words += ["--input", text]
    return shlex.join([*words, "-o", str(args.output)])


def _data_warnings(checked: recipes.Recipe, root: Path, output: Path) -> list[str]:
    """What the prepare stage will refuse of the new recipe's data (text its tokenizer cannot
    spell, a bad row), or count (:meth:`Strategy.unknown_tokens`): the recipe is written
    all the same, to be fixed by editing the data (then repin) or the recipe."""
    from ..data.tokenizer import TokenizerError
    from ..inputs import pinned

    try:
        counts = checked.strategy.unknown_tokens(
            checked.data, pinned.files_by_name(checked.data, root)
        )
    except (pinned.InputError, TokenizerError) as exc:
        return [
            f"{exc}. The prepare stage refuses the data as it is; after editing it, re-pin: "
            f"uv run --locked minifield recipe repin {output}"
        ]
    return [
        f"input {name}: {count['rows']} rows hold text the tokenizer cannot spell "
        f"({', '.join(map(repr, count['characters']))}): trained as the unknown token "
        "(training.allow_unknown_tokens), counted in the prepared examples' manifest"
        for name, count in counts.items()
        if count["rows"]
    ]


def run_new(args) -> int:
    output = args.output
    if not own_recipe.is_yaml(output) and output.suffix.lower() != ".json":
        raise Refusal(f"-o {output}: name the recipe .yaml, .yml or .json (its format)")
    if output.is_dir():
        raise Refusal(f"-o {output}: is a directory; give the recipe file to write")
    if os.path.lexists(output) and not args.force:
        raise Refusal(f"-o {output}: exists; pass --force to replace it")
    root, root_source = _input_root(args)
    document, rows, notes = build(args, root)
    checked = _validated(document, str(output))
    own_recipe.check_reward_columns(
        checked.data,
        {row["name"]: root / row["path"] for row in rows},
        f"give every row that column, or copy --like {args.like} and edit its rl.rewards; "
        "nothing written",
    )
    lines = (
        f"Written by `{_command(args)}`.",
        f"Every input is pinned by sha256 under the input root {root} ({root_source}).",
        f"After changing an input file, re-pin: uv run --locked minifield recipe repin {output}",
    )
    header = "".join(f"# {_CONTROL.sub('?', line)}\n" for line in lines)
    _write(output, own_recipe.dump(document, output, header))
    width = max(len(row["name"]) for row in rows) if rows else 0
    # no digest here: the edits a new recipe is written for change it (validate prints it)
    print(f"wrote {output}: job_id {document['job_id']}, like {args.like}")
    print(f"input root: {root} ({root_source}); every path below is relative to it")
    for row in rows:
        print(f"  {row['name']:<{width}}  {row['sha256']}  {row['path']}")
    for note in notes:
        print(f"note: {note}")
    for warning in _data_warnings(checked, root, output):
        print(f"minifield recipe new: warning: {warning}", file=sys.stderr)
    config = config_file_for(output)
    print(
        f"next: edit it, then `uv run --locked minifield validate {output}` prints its "
        "computation digest (the <cdigest> of results/computations/<cdigest>/); list it in a "
        "config file and run the pipeline, e.g.\n"
        f"  printf 'recipes:\\n  - {output}\\n' > {config}\n"
        f"  uv run --locked snakemake --cores 2 --configfile {config}"
    )
    return 0


def config_file_for(output: Path) -> Path:
    """The config file the next steps suggest for the recipe ``output``: named after it, so a
    second recipe's does not overwrite the first's (``config/mine.yaml`` for
    ``config/recipes/mine.yaml``), never the recipe itself."""
    config = CONFIG_FILE.parent / f"{output.stem}.yaml"
    if config in (output, CONFIG_FILE):
        config = CONFIG_FILE.parent / f"{output.stem}-run.yaml"
    return config


# ----------------------------------------------------------------------------- repin


def run_repin(args) -> int:
    path = args.recipe
    document = _read_recipe(path, "")
    root, root_source = _input_root(args)
    updated, local = pins.rehash(document, root, path)
    checked = _validated(updated, str(path))
    try:
        before = recipes.validate(document, str(path)).computation_digest[:16]
    except recipes.RecipeError:
        before = "(not valid before)"
    changes = pins.changed_pins(document, local)
    verb = "stale" if args.check else "re-pinned"
    for name, where, old, new in changes:
        print(f"{verb}: input {name} ({where}): sha256 {old or '(none)'} -> {new}")
    remote = [item["name"] for item in updated["inputs"] if "path" not in item]
    if remote:
        print(f"not re-pinned (remote, pinned by their url's publisher): {', '.join(remote)}")
    current = len(local) - len(changes)
    if args.check:
        print(
            f"{path}: {len(changes)} stale pin(s), {current} current (input root {root}, "
            f"{root_source})"
        )
        return EXIT_STALE if changes else 0
    if not changes:
        print(f"{path}: all {len(local)} local pins current (input root {root}); not rewritten")
        return 0
    text = path.read_text(encoding="utf-8")
    edited, kept = own_recipe.repinned_text(text, path, document, updated, local)
    if not kept:
        print(
            f"note: {path} rewritten whole (its pins could not be edited in place): comments dropped"
        )
    _write(path, edited)
    print(
        f"{path}: {len(changes)} pin(s) changed, {current} unchanged; computation "
        f"{before} -> {checked.computation_digest[:16]}"
    )
    return 0


# ----------------------------------------------------------------------------- the command


def run(args) -> int:
    try:
        return args.action(args)
    except REFUSED as exc:
        print(f"minifield recipe {args.recipe_command}: {exc}", file=sys.stderr)
        return EXIT_REFUSED


def register(sub) -> None:
    parser = sub.add_parser(
        "recipe",
        help="write a pinned recipe for your own data and base model; re-pin an edited one",
        description="Recipes for your own data (docs/own-data.md).",
    )
    actions = parser.add_subparsers(dest="recipe_command", required=True, metavar="ACTION")
    new = actions.add_parser(
        "new",
        help="a complete, pinned recipe from a shipped one and your paths",
        description="Write a recipe like --like with your files, each pinned by sha256 under "
        "the input root. Refuses (exit 2, nothing written) a missing file, a directory that is "
        "not an HF model, a path outside the input root, an existing output without --force.",
    )
    new.add_argument(
        "--like",
        type=Path,
        required=True,
        metavar="RECIPE",
        help="the recipe to start from (e.g. config/recipes/llama-sft-demo.yaml); every setting "
        "is kept but its job_id and the inputs you give",
    )
    new.add_argument(
        "--base",
        type=Path,
        metavar="DIR",
        help="your HF base model directory under the input root: replaces the --like recipe's "
        "model.base with its config.json, safetensors weights (or index + shards), "
        "tokenizer.json, tokenizer_config.json and generation_config.json (when present)",
    )
    for flag in DATA_FLAGS:
        new.add_argument(
            f"--{flag}",
            type=Path,
            metavar="FILE",
            help=f"your {flag} data (JSONL or Parquet) under the input root: replaces input "
            f"{flag!r}"
            + ("; default: the --dev file (said when written)" if flag == "test" else ""),
        )
    new.add_argument(
        "--input",
        action="append",
        metavar="NAME=FILE",
        help="replace the --like recipe's input NAME by FILE (repeatable)",
    )
    new.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE",
        help="a Jinja chat template written into model.chat_template (for a base model whose "
        "tokenizer_config.json has none)",
    )
    new.add_argument(
        "--job-id",
        metavar="ID",
        help="the new recipe's job_id (default: the output file's name without its suffix)",
    )
    _add_input_root(new)
    new.add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        metavar="RECIPE",
        help="the recipe to write (.yaml, .yml or .json)",
    )
    new.add_argument("--force", action="store_true", help="replace -o when it exists")
    new.set_defaults(func=run, action=run_new)
    repin = actions.add_parser(
        "repin",
        help="re-hash an edited recipe's local inputs, printing every pin it changes",
        description="Re-hash every local input of RECIPE under the input root; print each "
        "changed pin (old -> new sha256) and write the recipe back (only its hashes change).",
    )
    repin.add_argument("recipe", type=Path, metavar="RECIPE")
    repin.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 when a pin is stale (0 when every pin is current)",
    )
    _add_input_root(repin)
    repin.set_defaults(func=run, action=run_repin)
