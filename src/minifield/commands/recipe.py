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
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import sys
from pathlib import Path

import yaml

from .. import atomic
from .. import recipe as recipes
from ..digest import sha256_file
from ..inputs import pinned

EXIT_STALE = 1
EXIT_REFUSED = 2
#: the config whose ``input_root`` is the default input root, relative to the working directory
CONFIG_FILE = Path("config/config.yaml")
#: the pipeline's default input root (config/README.md: ``input_root``)
DEFAULT_INPUT_ROOT = Path("data")
#: ``model.base`` key -> the name of the input that holds it in a written recipe (the Llama
#: demo's names); shards of a sharded checkpoint are ``base-weights-1`` ... ``base-weights-N``
BASE_INPUTS = {
    "config": "base-config",
    "weights": "base-weights",
    "index": "base-index",
    "tokenizer": "base-tokenizer",
    "tokenizer_config": "base-tokenizer-config",
    "generation_config": "base-generation-config",
}
#: ``model.base`` key -> the HF file name of that role
BASE_FILES = {
    "config": "config.json",
    "weights": "model.safetensors",
    "index": "model.safetensors.index.json",
    "tokenizer": "tokenizer.json",
    "tokenizer_config": "tokenizer_config.json",
    "generation_config": "generation_config.json",
}
#: a chat template saved beside the tokenizer (transformers >= 4.47 writes it there)
CHAT_TEMPLATE_FILE = "chat_template.jinja"
PICKLE_SUFFIXES = (".bin", ".pt", ".ckpt", ".pth", ".pkl")
#: model keys that only restate the base's config.json (packed-sft checks them against it):
#: stated in the --like recipe about its own base, they are dropped with a new --base
BASE_CONFIG_KEYS = (
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "rope_theta",
    "norm_eps",
    "qkv_bias",
    "tie_embeddings",
    "head_dim",
    "qk_norm",
    "sliding_window",
)
#: the inputs --train, --dev and --test replace
DATA_FLAGS = ("train", "dev", "test")
#: what describes how a replaced data file is read: the --like recipe's file, not yours
READ_SETTINGS = ("format", "columns", "roles")
_JOB_ID = re.compile(r"[^A-Za-z0-9._-]+")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
#: characters that would end a comment line of the YAML header (a path may hold them)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class Refusal(Exception):
    """Bad input: the message names the file and what to do; exit 2, nothing written."""


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


def _input_root(args) -> tuple[Path, str]:
    root, source = (args.input_root, "--input-root") if args.input_root else default_input_root()
    if not root.is_dir():
        raise Refusal(
            f"input root {root} ({source}) is not a directory: recipe paths are relative to it; "
            "create it and put your files there, or pass --input-root"
        )
    return root, source


def under_root(path: Path, root: Path, flag: str) -> str:
    """``path`` (as given, relative to the working directory) as a recipe path: relative to
    ``root``, POSIX separators; refuses a path outside the root, saying what to do."""
    for candidate, base in (
        (Path(os.path.abspath(path)), Path(os.path.abspath(root))),
        (path.resolve(), root.resolve()),
    ):
        try:
            relative = candidate.relative_to(base).as_posix()
            break
        except ValueError:
            continue
    else:
        suggestion = root / path.name
        raise Refusal(
            f"{flag} {path}: outside the input root {root} (recipe paths are relative to it, "
            f"without '..' or absolute paths). Copy it there, e.g. `cp -r {shlex.quote(str(path))} "
            f"{shlex.quote(str(suggestion))}`, and give {flag} {suggestion}; or pass "
            "--input-root (the pipeline must use the same one: config input_root)"
        )
    if relative == ".":
        raise Refusal(f"{flag} {path}: is the input root itself, not a file under it")
    try:
        pinned.resolve(root, relative)
    except pinned.InputError as exc:  # a symlink leaving the root
        raise Refusal(
            f"{flag} {path}: {exc}; copy the file itself under the input root (the worker "
            "refuses a symlink that leaves it)"
        ) from None
    return relative


def _write(path: Path, text: str) -> None:
    try:
        atomic.write_bytes(path, text.encode("utf-8"))
    except OSError as exc:
        raise Refusal(f"cannot write {exc.filename or path}: {exc.strerror or exc}") from None


def _is_yaml(path: Path) -> bool:
    return path.suffix.lower() in (".yaml", ".yml")


def _dump(document: dict, path: Path, header: str = "") -> str:
    if _is_yaml(path):
        body = yaml.safe_dump(document, sort_keys=False, allow_unicode=True, width=100)
        return header + body
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


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


def _json_file(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise Refusal(f"{path}: not readable JSON ({exc})") from None


def _check_family(config_path: Path) -> None:
    from ..hf.config import MODEL_TYPES
    from ..models.families import ARCHITECTURES

    config = _json_file(config_path)
    if not isinstance(config, dict):
        raise Refusal(f"{config_path}: expected a JSON object (an HF config.json)")
    model_type, archs = config.get("model_type"), config.get("architectures")
    known = model_type in MODEL_TYPES if isinstance(model_type, str) else None
    if known is None and isinstance(archs, list) and archs:
        known = archs[0] in ARCHITECTURES
    if not known:
        raise Refusal(
            f"{config_path}: model_type {model_type!r} (architectures {archs!r}) is not a family "
            f"minifield fine-tunes (model_type one of {list(MODEL_TYPES)}; see "
            "docs/pretrained.md, families)"
        )


def _shards(index: Path) -> list[Path]:
    document = _json_file(index)
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise Refusal(f"{index}: not a safetensors index (no weight_map)")
    shards = []
    for name in sorted(set(map(str, weight_map.values()))):
        shard = index.parent / name
        if Path(name).name != name or Path(name).suffix != ".safetensors":
            raise Refusal(f"{index}: names shard {name!r}, not a .safetensors file beside it")
        if not shard.is_file():
            raise Refusal(f"{shard}: missing (named by {index})")
        shards.append(shard)
    return shards


def _has_template(tokenizer_config: Path) -> bool:
    config = _json_file(tokenizer_config)
    if not isinstance(config, dict):
        raise Refusal(f"{tokenizer_config}: expected a JSON object")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = template.get("default")
    return isinstance(template, str) and bool(template)


def base_files(directory: Path) -> dict[str, list[Path] | Path]:
    """``model.base`` key -> the file(s) of the HF directory that play that role; refuses a
    directory that is not an HF model minifield reads (the message names the file)."""
    described = (
        "an HF model directory: config.json, model.safetensors (or model.safetensors.index.json "
        "and its shards), tokenizer.json, tokenizer_config.json"
    )
    if not directory.is_dir():
        state = "not a directory" if directory.exists() else "no such directory"
        raise Refusal(f"--base {directory}: {state} (give {described})")
    files: dict[str, list[Path] | Path] = {}
    config = directory / BASE_FILES["config"]
    if not config.is_file():
        raise Refusal(f"{config}: missing, so {directory} is not {described}")
    _check_family(config)
    files["config"] = config
    single, index = directory / BASE_FILES["weights"], directory / BASE_FILES["index"]
    if single.is_file():
        files["weights"] = [single]
    elif index.is_file():
        files["index"], files["weights"] = index, _shards(index)
    else:
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise Refusal(
                f"{directory / pickles[0]}: a pickle checkpoint, refused (unpickling runs "
                "arbitrary code); save the model as safetensors first (transformers: "
                "model.save_pretrained(DIR, safe_serialization=True))"
            )
        raise Refusal(f"{single}: missing (nor {index.name}), so {directory} is not {described}")
    for key in ("tokenizer", "tokenizer_config"):
        path = directory / BASE_FILES[key]
        if not path.is_file():
            raise Refusal(
                f"{path}: missing, so {directory} is not {described} (minifield reads the fast "
                "tokenizer's files: AutoTokenizer.from_pretrained(...).save_pretrained(DIR) "
                "writes them)"
            )
        files[key] = path
    generation = directory / BASE_FILES["generation_config"]
    if generation.is_file():
        files["generation_config"] = generation
    return files


def _first_row_format(path: Path) -> str:
    """The supervised format of the file's first row (packed-sft's reader); refuses a file
    it cannot read, naming file and line."""
    from ..data import formats as data_formats

    source = data_formats.Source()
    try:
        for row, where in data_formats.rows(path, source):
            return data_formats.row_example(row, where, None, source, True)[1]
    except data_formats.DataError as exc:
        raise Refusal(str(exc)) from None
    raise Refusal(f"{path}: no examples (the file is empty)")


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
    document = copy.deepcopy(like)
    notes = []
    items = [item for item in document.get("inputs", []) if isinstance(item, dict)]
    names = {item.get("name") for item in items}
    given, data_notes = _data_paths(args, names)
    notes += data_notes
    unknown = sorted(set(given) - names)
    if unknown:
        raise Refusal(
            f"--like {args.like} has no input named {unknown[0]!r} to replace (its inputs: "
            f"{sorted(n for n in names if isinstance(n, str))})"
        )
    model = document.get("model") if isinstance(document.get("model"), dict) else {}
    old_base = model.get("base")
    base_names: set[str] = set()
    new_base_inputs: list[dict] = []
    template_file = args.chat_template
    if args.base is not None:
        if not isinstance(old_base, dict):
            raise Refusal(
                f"--like {args.like} trains its model from scratch (no model.base): --base needs "
                "a recipe that fine-tunes a base model, e.g. config/recipes/llama-sft-demo.yaml"
            )
        for value in old_base.values():
            base_names.update(value if isinstance(value, list) else [value])
        overlap = sorted(base_names & set(given))
        if overlap:
            raise Refusal(
                f"--input {overlap[0]}=...: part of the --like recipe's model.base, which --base "
                "replaces whole; give the file in the --base directory instead"
            )
        files = base_files(args.base)
        taken = names - base_names
        base = {}
        for key, found in files.items():
            paths = found if isinstance(found, list) else [found]
            input_names = (
                [f"{BASE_INPUTS[key]}-{i}" for i in range(1, len(paths) + 1)]
                if key == "weights" and len(paths) > 1
                else [BASE_INPUTS[key]]
            )
            for name, path in zip(input_names, paths, strict=True):
                if name in taken:
                    raise Refusal(
                        f"--like {args.like}: its input {name!r} is not part of its model.base, "
                        "but a new base model's file needs that name; rename it in a copy of "
                        "the recipe"
                    )
                relative = under_root(path, root, "--base")
                new_base_inputs.append({"name": name, "path": relative, "sha256": None})
            base[key] = input_names if key == "weights" else input_names[0]
        if template_file is None and "chat_template" not in model:
            if not _has_template(files["tokenizer_config"]):
                template_file = args.base / CHAT_TEMPLATE_FILE
                if not template_file.is_file():
                    raise Refusal(
                        f"{files['tokenizer_config']}: no chat_template (a base model often has "
                        "none), and the --like recipe sets no model.chat_template: give one with "
                        "--chat-template FILE (a Jinja template, e.g. the instruct model's "
                        f"{CHAT_TEMPLATE_FILE})"
                    )
                notes.append(
                    f"chat template: {template_file} (tokenizer_config.json has none), written "
                    "into model.chat_template"
                )
        stated = [key for key in BASE_CONFIG_KEYS if key in model]
        for key in stated:
            del model[key]
        if stated:
            notes.append(
                f"dropped model.{', model.'.join(stated)} of --like: the new base's config.json "
                "gives them"
            )
        model["base"] = base
    if template_file is not None:
        if not isinstance(old_base, dict):
            raise Refusal("--chat-template: only for a recipe with a base model (model.base)")
        try:
            model["chat_template"] = template_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise Refusal(f"{template_file}: cannot read the chat template ({exc})") from None
    strategy = (document.get("strategy") or {}).get("name")
    inputs: list[dict] = []
    formats: dict[Path, str] = {}
    for item in document.get("inputs", []):
        name = item.get("name")
        if name in base_names:
            inputs += new_base_inputs  # where the old base's first file was; once
            new_base_inputs = []
            continue
        if name in given:
            flag = f"--{name}" if name in DATA_FLAGS else f"--input {name}="
            path = given[name]
            if not path.is_file():
                state = "not a file" if path.exists() else "no such file"
                raise Refusal(f"{flag} {path}: {state}")
            relative = under_root(path, root, flag.rstrip("="))
            dropped = [key for key in READ_SETTINGS if key in item]
            if dropped:
                notes.append(
                    f"input {name}: dropped {', '.join(dropped)} of --like (they described its "
                    "file; yours is detected from its first row)"
                )
            item = {"name": name, "path": relative, "sha256": None}
            if strategy == "packed-sft" and name in DATA_FLAGS and path not in formats:
                formats[path] = _first_row_format(path)
                notes.append(
                    f"{path}: rows read as {formats[path]!r} (detected from its first row)"
                )
        inputs.append(item)
    document["inputs"] = inputs
    rows = _pin(document, root, args.like)
    document["job_id"] = _job_id(args)
    document.pop("attempt_id", None)  # an execution's identity, never reused
    return _ordered(document, like), rows, notes


def _pin(document: dict, root: Path, like: Path) -> list[dict]:
    """Hash every local input written by this command (sha256 None) and check every one kept
    from the --like recipe against its pin; one row per input."""
    rows, problems, absent = [], [], []
    for item in document["inputs"]:
        if "path" not in item:
            rows.append({"name": item["name"], "path": item.get("url"), "sha256": item["sha256"]})
            continue
        try:
            path = pinned.resolve(root, item["path"])
        except pinned.InputError as exc:
            problems.append(f"input {item['name']!r}: {exc}")
            continue
        if not path.is_file():
            absent.append(f"{item['name']} ({root / item['path']})")
            continue
        actual = sha256_file(path)
        if item["sha256"] is None:
            item["sha256"] = actual
        elif actual != item["sha256"]:
            problems.append(
                f"input {item['name']!r} (kept from --like {like}): {root / item['path']} has "
                f"sha256 {actual}, but --like pins {item['sha256']}; give the file with a flag, "
                "or write the recipe and run `minifield recipe repin` on it"
            )
            continue
        rows.append({"name": item["name"], "path": item["path"], "sha256": actual})
    if absent:
        problems.append(
            f"--like {like} keeps inputs whose files are not under the input root {root}: "
            f"{', '.join(absent)}; give yours (--base, --train, --dev, --test, --input "
            "NAME=FILE) or put those files there"
        )
    if problems:
        raise Refusal("; ".join(problems))
    return rows


def _ordered(document: dict, like: dict) -> dict:
    """``document`` with ``job_id`` first and the rest in the --like recipe's order."""
    order = ["job_id", *(key for key in like if key != "job_id")]
    out = {key: document[key] for key in order if key in document}
    out.update({key: value for key, value in document.items() if key not in out})
    return out


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


def run_new(args) -> int:
    output = args.output
    if not _is_yaml(output) and output.suffix.lower() != ".json":
        raise Refusal(f"-o {output}: name the recipe .yaml, .yml or .json (its format)")
    if output.is_dir():
        raise Refusal(f"-o {output}: is a directory; give the recipe file to write")
    if os.path.lexists(output) and not args.force:
        raise Refusal(f"-o {output}: exists; pass --force to replace it")
    root, root_source = _input_root(args)
    document, rows, notes = build(args, root)
    checked = _validated(document, str(output))
    lines = (
        f"Written by `{_command(args)}`.",
        f"Every input is pinned by sha256 under the input root {root} ({root_source}).",
        f"After changing an input file, re-pin: minifield recipe repin {output}",
    )
    header = "".join(f"# {_CONTROL.sub('?', line)}\n" for line in lines)
    _write(output, _dump(document, output, header))
    width = max(len(row["name"]) for row in rows) if rows else 0
    print(
        f"wrote {output}: job_id {document['job_id']}, computation "
        f"{checked.computation_digest[:16]}, like {args.like}"
    )
    print(f"input root: {root} ({root_source}); every path below is relative to it")
    for row in rows:
        print(f"  {row['name']:<{width}}  {row['sha256']}  {row['path']}")
    for note in notes:
        print(f"note: {note}")
    print(
        "next: list it in a config file and run the pipeline, e.g.\n"
        f"  printf 'recipes:\\n  - {output}\\n' > config/mine.yaml\n"
        "  uv run --locked snakemake --cores 2 --configfile config/mine.yaml"
    )
    return 0


# ----------------------------------------------------------------------------- repin


def _edited_text(text: str, old: list[str], new: list[str]) -> str | None:
    """``text`` with each pin of ``old`` (every local input's, in order) replaced by ``new``'s,
    found in order; None where a pin is not found as written."""
    out, cursor = [], 0
    for before, after in zip(old, new, strict=True):
        if not isinstance(before, str) or not _HEX64.match(before):
            return None
        at = text.find(before, cursor)
        if at < 0:
            return None
        out += [text[cursor:at], after]
        cursor = at + len(before)
    return "".join(out) + text[cursor:]


def _parsed(text: str, path: Path) -> object:
    """``text`` read as ``path``'s format would be (None where it does not parse)."""
    try:
        return yaml.safe_load(text) if _is_yaml(path) else json.loads(text)
    except (ValueError, yaml.YAMLError):
        return None


def run_repin(args) -> int:
    path = args.recipe
    document = _read_recipe(path, "")
    root, root_source = _input_root(args)
    items = document.get("inputs")
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise Refusal(f"{path}: inputs is not a list of {{name, path, sha256}} entries")
    updated = copy.deepcopy(document)
    local = [(i, item) for i, item in enumerate(updated["inputs"]) if "path" in item]
    hashes, problems = {}, []
    for _, item in local:
        name, where = item.get("name"), item.get("path")
        try:
            file = pinned.resolve(root, str(where))
        except pinned.InputError as exc:
            problems.append(f"input {name!r}: {exc}")
            continue
        if not file.is_file():
            problems.append(f"input {name!r}: {root / str(where)} does not exist")
            continue
        if file not in hashes:
            hashes[file] = sha256_file(file)
        item["sha256"] = hashes[file]
    if problems:
        raise Refusal(f"{path}: " + "; ".join(problems) + f" (input root {root}); nothing written")
    checked = _validated(updated, str(path))
    try:
        before = recipes.validate(document, str(path)).computation_digest[:16]
    except recipes.RecipeError:
        before = "(not valid before)"
    changes = [
        (item["name"], item["path"], document["inputs"][i].get("sha256"), item["sha256"])
        for i, item in local
        if document["inputs"][i].get("sha256") != item["sha256"]
    ]
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
    old = [document["inputs"][i].get("sha256") for i, _ in local]
    edited = _edited_text(text, old, [item["sha256"] for _, item in local])
    kept = edited is not None and _parsed(edited, path) == updated
    if not kept:
        edited = _dump(updated, path)
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
    except Refusal as exc:
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
    new.add_argument(
        "--input-root",
        type=Path,
        metavar="DIR",
        help="the pipeline's input root (default: input_root of config/config.yaml, else data)",
    )
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
    repin.add_argument(
        "--input-root",
        type=Path,
        metavar="DIR",
        help="the pipeline's input root (default: input_root of config/config.yaml, else data)",
    )
    repin.set_defaults(func=run, action=run_repin)
