"""``minifield recipe new`` and ``minifield recipe repin`` (docs/own-data.md): a newcomer's own
data and base model as a complete, pinned recipe, through the real CLI (``cli.main`` in this
process; the end-to-end test starts the installed ``minifield`` and Snakemake).

Every pin is checked against ``hashlib`` on the file itself; every refusal is exit 2 with one
message naming the file, no traceback and nothing written. The base model is a copy of the
shipped HF directory ``data/llama-base`` (a sharded one is made from it with ``safetensors``);
the data are a few dozen chat rows of a task the base has not seen ("double: ab" -> "aabb").
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from safetensors.numpy import load_file, save_file

from minifield import cli
from minifield import recipe as recipes

LIKE = REPO / "config" / "recipes" / "llama-sft-demo.yaml"
HF_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
#: input name -> the base file it pins (the names ``recipe new`` gives)
BASE_INPUTS = {
    "base-config": "config.json",
    "base-weights": "model.safetensors",
    "base-tokenizer": "tokenizer.json",
    "base-tokenizer-config": "tokenizer_config.json",
    "base-generation-config": "generation_config.json",
}


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def chat_rows(count: int, seed: int) -> str:
    """``count`` chat rows (OpenAI messages) of "double: ab" -> "aabb", lowercase letters only
    (the shipped base's tokenizer knows them, the colon and the space)."""
    draw = random.Random(seed)
    lines = []
    for _ in range(count):
        word = "".join(draw.choices(string.ascii_lowercase, k=draw.randint(2, 5)))
        messages = [
            {"role": "user", "content": f"double: {word}"},
            {"role": "assistant", "content": "".join(c + c for c in word)},
        ]
        lines.append(json.dumps({"messages": messages}) + "\n")
    return "".join(lines)


def make_project(root: Path, base_files=HF_FILES) -> Path:
    """A fresh project directory: ``data/my-base`` (the shipped base's HF files) and
    ``data/mine/{train,dev,test}.jsonl``; no config (the input root is then ``data``)."""
    base = root / "data" / "my-base"
    base.mkdir(parents=True)
    for name in base_files:
        shutil.copy(REPO / "data" / "llama-base" / name, base / name)
    data = root / "data" / "mine"
    data.mkdir()
    for split, count, seed in (("train", 48, 1), ("dev", 8, 2), ("test", 8, 3)):
        (data / f"{split}.jsonl").write_text(chat_rows(count, seed))
    return root


def new_args(*extra: str, base="data/my-base", out="config/recipes/mine.yaml") -> list[str]:
    args = ["recipe", "new", "--like", str(LIKE)]
    if base is not None:
        args += ["--base", base]
    args += ["--train", "data/mine/train.jsonl", "--dev", "data/mine/dev.jsonl"]
    return [*args, "--test", "data/mine/test.jsonl", "-o", out, *extra]


def minifield(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return make_project(tmp_path)


def refused(code: int, err: str, *named: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("minifield recipe "), err
    assert len(err.strip().splitlines()) == 1, err
    for text in named:
        assert text in err, (text, err)


# ----------------------------------------------------------------------------- new


def test_new_pins_every_base_file_and_data_file_and_keeps_the_rest(project, capsys):
    code, out, err = minifield(capsys, *new_args())
    assert code == 0, err
    path = project / "config" / "recipes" / "mine.yaml"
    written = yaml.safe_load(path.read_text())
    like = yaml.safe_load(LIKE.read_text())
    like_product = like["product"]["name"]

    # every input under the input root (data), pinned by its own bytes
    inputs = {item["name"]: item for item in written["inputs"]}
    expected_paths = {
        **{split: f"mine/{split}.jsonl" for split in ("train", "dev", "test")},
        **{name: f"my-base/{file}" for name, file in BASE_INPUTS.items()},
    }
    assert {name: item["path"] for name, item in inputs.items()} == expected_paths
    for name, item in inputs.items():
        assert set(item) == {"name", "path", "sha256"}
        assert item["sha256"] == sha(project / "data" / item["path"]), name
        assert item["sha256"] in out and item["path"] in out  # every pin printed
    assert written["model"]["base"] == {
        "config": "base-config",
        "weights": ["base-weights"],
        "tokenizer": "base-tokenizer",
        "tokenizer_config": "base-tokenizer-config",
        "generation_config": "base-generation-config",
    }

    # a new identity; every other setting of the --like recipe as it was written
    assert written["job_id"] == "mine" != like["job_id"]
    for document in (written, like):
        for key in ("job_id", "inputs"):
            document.pop(key)
        document["model"].pop("base")
    assert written == like

    # valid for the library and for the worker's own check (the Snakefile validates the same)
    checked = recipes.load(path)
    assert checked.computation_digest != recipes.load(LIKE).computation_digest
    # no digest: the edits a new recipe is written for change it; validate prints it
    assert checked.computation_digest[:16] not in out
    assert "minifield validate config/recipes/mine.yaml" in out
    # the next steps' config file is named after the recipe (a second one's is its own)
    assert "printf 'recipes:\\n  - config/recipes/mine.yaml\\n' > config/mine.yaml\n" in out
    assert "--configfile config/mine.yaml" in out
    assert f"product {like_product!r}" in out  # kept from --like, and said
    assert "'messages'" in out  # the detected format of the data, said
    assert path.read_text().startswith("# Written by `minifield recipe new --like ")


def test_new_reads_the_input_root_from_config_and_writes_json(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    make_project(tmp_path / "inputs-tmp")
    (tmp_path / "inputs").mkdir()
    for part in ("my-base", "mine"):
        shutil.move(tmp_path / "inputs-tmp" / "data" / part, tmp_path / "inputs" / part)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text("recipes: []\ninput_root: inputs\n")
    args = ["recipe", "new", "--like", str(LIKE), "--base", "inputs/my-base"]
    args += ["--train", "inputs/mine/train.jsonl", "--dev", "inputs/mine/dev.jsonl"]
    args += ["--job-id", "own.data-1", "-o", "own.json"]
    code, out, err = minifield(capsys, *args)
    assert code == 0, err
    written = json.loads((tmp_path / "own.json").read_text())
    assert written["job_id"] == "own.data-1"
    paths = {item["name"]: item["path"] for item in written["inputs"]}
    assert paths["train"] == "mine/train.jsonl" and paths["base-config"] == "my-base/config.json"
    # no --test: the dev file is the test input too, and it says so
    assert paths["test"] == paths["dev"] == "mine/dev.jsonl"
    assert "no --test given" in out and "input_root of config/config.yaml" in out
    for item in written["inputs"]:
        assert item["sha256"] == sha(tmp_path / "inputs" / item["path"])
    recipes.load(tmp_path / "own.json")


def test_new_pins_every_shard_and_the_index_of_a_sharded_base(project, capsys):
    base = project / "data" / "my-base"
    tensors = load_file(base / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2]}
    shards["model-00002-of-00002.safetensors"] = names[1::2]
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, base / file)
        weight_map.update(dict.fromkeys(part, file))
    (base / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (base / "model.safetensors").unlink()
    (base / "generation_config.json").unlink()  # optional: not pinned when absent

    code, _, err = minifield(capsys, *new_args())
    assert code == 0, err
    written = yaml.safe_load((project / "config" / "recipes" / "mine.yaml").read_text())
    inputs = {item["name"]: item for item in written["inputs"]}
    assert written["model"]["base"] == {
        "config": "base-config",
        "weights": ["base-weights-1", "base-weights-2"],
        "index": "base-index",
        "tokenizer": "base-tokenizer",
        "tokenizer_config": "base-tokenizer-config",
    }
    assert inputs["base-index"]["path"] == "my-base/model.safetensors.index.json"
    assert inputs["base-weights-1"]["path"] == "my-base/model-00001-of-00002.safetensors"
    assert inputs["base-weights-2"]["path"] == "my-base/model-00002-of-00002.safetensors"
    for item in written["inputs"]:
        assert item["sha256"] == sha(project / "data" / item["path"])
    recipes.load(project / "config" / "recipes" / "mine.yaml")


def test_new_takes_a_chat_template_for_a_base_without_one(project, capsys):
    config_path = project / "data" / "my-base" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    template = config.pop("chat_template")
    config_path.write_text(json.dumps(config))
    code, _, err = minifield(capsys, *new_args())
    refused(code, err, str(Path("data/my-base/tokenizer_config.json")), "--chat-template")
    assert not (project / "config").exists()

    (project / "template.jinja").write_text(template)
    code, _, err = minifield(capsys, *new_args("--chat-template", "template.jinja"))
    assert code == 0, err
    written = yaml.safe_load((project / "config" / "recipes" / "mine.yaml").read_text())
    assert written["model"]["chat_template"] == template

    # transformers' own place for it, beside the tokenizer: used, and said
    (project / "data" / "my-base" / "chat_template.jinja").write_text(template)
    code, out, err = minifield(capsys, *new_args("--force", out="other.yaml"))
    assert code == 0, err
    assert yaml.safe_load((project / "other.yaml").read_text())["model"]["chat_template"] == (
        template
    )
    assert "chat_template.jinja" in out


def test_new_without_base_keeps_the_like_recipes_base_when_its_files_are_there(project, capsys):
    shutil.copytree(REPO / "data" / "llama-base", project / "data" / "llama-base")
    code, _, err = minifield(capsys, *new_args(base=None))
    assert code == 0, err
    written = yaml.safe_load((project / "config" / "recipes" / "mine.yaml").read_text())
    like = yaml.safe_load(LIKE.read_text())
    assert written["model"] == like["model"]
    kept = {item["name"]: item for item in like["inputs"] if item["name"].startswith("base-")}
    assert [item for item in written["inputs"] if item["name"] in kept] == list(kept.values())


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("train outside the input root", ["--train", "outside.jsonl", "cp -r"]),
        ("missing train file", ["--train data/mine/nope.jsonl", "no such file"]),
        ("base is not an HF directory", [str(Path("data/mine/config.json")), "missing"]),
        ("no base directory", ["--base data/absent", "no such directory"]),
        ("pickle weights only", ["pytorch_model.bin", "safetensors"]),
        ("no tokenizer.json", [str(Path("data/my-base/tokenizer.json")), "missing"]),
        ("unsupported family", [str(Path("data/my-base/config.json")), "gpt2"]),
        ("output exists", ["config/recipes/mine.yaml", "--force"]),
        ("like recipe without a base", ["sft-demo.yaml", "model.base"]),
        ("unknown input", ["no input named 'extra'"]),
        ("bad input spec", ["--input 'train'", "NAME=FILE"]),
        ("a base file by --input", ["--input base-config=", "--base replaces whole"]),
        ("symlink out of the input root", ["--dev", "outside the input root"]),
        ("data file not a format", [str(Path("data/mine/train.jsonl")) + ":1", "not those"]),
        ("recipe suffix", ["mine.txt", ".yaml"]),
    ],
)
def test_new_refuses_bad_input_naming_the_file_and_writes_nothing(project, capsys, case, named):
    out = "config/recipes/mine.yaml"
    args = new_args(out=out)
    base = project / "data" / "my-base"
    if case == "train outside the input root":
        (project / "outside.jsonl").write_text(chat_rows(4, 9))
        args[args.index("data/mine/train.jsonl")] = "outside.jsonl"
    elif case == "missing train file":
        args[args.index("data/mine/train.jsonl")] = "data/mine/nope.jsonl"
    elif case == "base is not an HF directory":
        args[args.index("data/my-base")] = "data/mine"
    elif case == "no base directory":
        args[args.index("data/my-base")] = "data/absent"
    elif case == "pickle weights only":
        (base / "model.safetensors").rename(base / "pytorch_model.bin")
    elif case == "no tokenizer.json":
        (base / "tokenizer.json").unlink()
    elif case == "unsupported family":
        config = json.loads((base / "config.json").read_text())
        config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
        (base / "config.json").write_text(json.dumps(config))
    elif case == "output exists":
        (project / out).parent.mkdir(parents=True)
        (project / out).write_text("# mine, by hand\n")
    elif case == "like recipe without a base":
        args[args.index(str(LIKE))] = str(REPO / "config" / "recipes" / "sft-demo.yaml")
    elif case == "unknown input":
        args += ["--input", "extra=data/mine/test.jsonl"]
    elif case == "bad input spec":
        args += ["--input", "train"]
    elif case == "a base file by --input":
        args += ["--input", "base-config=data/my-base/config.json"]
    elif case == "symlink out of the input root":
        (project / "elsewhere.jsonl").write_text(chat_rows(4, 9))
        (project / "data" / "mine" / "link.jsonl").symlink_to(project / "elsewhere.jsonl")
        args[args.index("data/mine/dev.jsonl")] = "data/mine/link.jsonl"
    elif case == "data file not a format":
        (project / "data" / "mine" / "train.jsonl").write_text('{"question": "a", "b": 1}\n')
    elif case == "recipe suffix":
        args[args.index(out)] = out = "mine.txt"
    before = sorted(p.relative_to(project) for p in project.rglob("*"))
    contents = {p: p.read_bytes() for p in project.rglob("*") if p.is_file()}
    code, _, err = minifield(capsys, *args)
    refused(code, err, *named)
    assert sorted(p.relative_to(project) for p in project.rglob("*")) == before
    assert {p: p.read_bytes() for p in project.rglob("*") if p.is_file()} == contents


def test_new_replaces_an_existing_output_with_force(project, capsys):
    target = project / "config" / "recipes" / "mine.yaml"
    target.parent.mkdir(parents=True)
    target.write_text("# mine, by hand\n")
    code, _, err = minifield(capsys, *new_args("--force"))
    assert code == 0, err
    recipes.load(target)


# ----------------------------------------------------------------------------- repin


@pytest.fixture
def written(project, capsys) -> Path:
    code, _, err = minifield(capsys, *new_args())
    assert code == 0, err
    return project / "config" / "recipes" / "mine.yaml"


def test_repin_check_says_every_stale_pin_and_exits_1_writing_nothing(written, capsys):
    project = written.parents[2]
    code, out, _ = minifield(capsys, "recipe", "repin", str(written), "--check")
    assert code == 0 and "0 stale pin(s), 8 current" in out
    old = {item["name"]: item["sha256"] for item in yaml.safe_load(written.read_text())["inputs"]}
    train = project / "data" / "mine" / "train.jsonl"
    train.write_text(train.read_text() + chat_rows(2, 7))
    config = project / "data" / "my-base" / "generation_config.json"
    config.write_text(config.read_text().replace("\n", "\n ", 1))
    before = written.read_bytes()

    code, out, _ = minifield(capsys, "recipe", "repin", str(written), "--check")
    assert code == 1
    assert written.read_bytes() == before
    stale = re.findall(r"^stale: input (\S+) \((\S+)\): sha256 (\w+) -> (\w+)$", out, re.M)
    assert stale == [
        ("train", "mine/train.jsonl", old["train"], sha(train)),
        (
            "base-generation-config",
            "my-base/generation_config.json",
            old["base-generation-config"],
            sha(config),
        ),
    ]


def test_repin_changes_only_the_stale_hashes_and_prints_each(written, capsys):
    project = written.parents[2]
    dev = project / "data" / "mine" / "dev.jsonl"
    old = sha(dev)
    dev.write_text(chat_rows(9, 5))
    before = written.read_text()

    code, out, err = minifield(capsys, "recipe", "repin", str(written))
    assert code == 0, err
    after = written.read_text()
    # one line changed: the dev pin, in place (comments and layout kept)
    changed = [
        (a, b) for a, b in zip(before.splitlines(), after.splitlines(), strict=True) if a != b
    ]
    assert changed == [(f"  sha256: {old}", f"  sha256: {sha(dev)}")]
    assert f"re-pinned: input dev (mine/dev.jsonl): sha256 {old} -> {sha(dev)}" in out
    assert "1 pin(s) changed, 7 unchanged" in out
    for item in yaml.safe_load(after)["inputs"]:
        assert item["sha256"] == sha(project / "data" / item["path"])
    assert f"-> {recipes.load(written).computation_digest[:16]}" in out

    # nothing stale: nothing written, and it says so
    stamp = written.stat().st_mtime_ns
    code, out, _ = minifield(capsys, "recipe", "repin", str(written))
    assert code == 0 and "not rewritten" in out and written.stat().st_mtime_ns == stamp
    code, _, _ = minifield(capsys, "recipe", "repin", str(written), "--check")
    assert code == 0


def test_repin_follows_an_edited_path_and_fills_a_missing_pin(written, capsys):
    project = written.parents[2]
    shutil.copy(project / "data" / "mine" / "train.jsonl", project / "data" / "mine" / "v2.jsonl")
    with (project / "data" / "mine" / "v2.jsonl").open("a") as handle:
        handle.write(chat_rows(3, 11))
    document = yaml.safe_load(written.read_text())
    document["inputs"][0]["path"] = "mine/v2.jsonl"
    del document["inputs"][1]["sha256"]  # a pin left out by hand
    document["inputs"][2]["sha256"] = None  # and one left to be filled
    before = "# by hand\n" + yaml.safe_dump(document, sort_keys=False)
    written.write_text(before)

    code, out, err = minifield(capsys, "recipe", "repin", str(written))
    assert code == 0, err
    old_train = document["inputs"][0]["sha256"]
    v2, dev, test = (
        sha(project / "data" / "mine" / f) for f in ("v2.jsonl", "dev.jsonl", "test.jsonl")
    )
    assert f"input train (mine/v2.jsonl): sha256 {old_train} -> {v2}" in out
    assert f"input dev (mine/dev.jsonl): sha256 (none) -> {dev}" in out
    assert f"input test (mine/test.jsonl): sha256 (none) -> {test}" in out
    # the pins written into the text as it was: its comment and every other line kept
    assert "rewritten whole" not in out
    assert written.read_text() == (
        before.replace(old_train, v2)
        .replace("  path: mine/dev.jsonl\n", f"  path: mine/dev.jsonl\n  sha256: {dev}\n")
        .replace("  sha256: null\n", f"  sha256: {test}\n")
    )
    for item in yaml.safe_load(written.read_text())["inputs"]:
        assert item["sha256"] == sha(project / "data" / item["path"])
    recipes.load(written)


def test_repin_of_a_json_recipe_edits_it_in_place(project, capsys):
    code, _, err = minifield(capsys, *new_args(out="mine.json"))
    assert code == 0, err
    recipe = project / "mine.json"
    test = project / "data" / "mine" / "test.jsonl"
    old = sha(test)
    test.write_text(chat_rows(8, 4))
    before = recipe.read_text()
    code, out, err = minifield(capsys, "recipe", "repin", str(recipe))
    assert code == 0, err
    assert recipe.read_text() == before.replace(old, sha(test))
    assert "rewritten whole" not in out


@pytest.mark.parametrize("case", ["missing file", "escapes the root", "invalid recipe"])
def test_repin_refuses_naming_the_file_and_writes_nothing(written, capsys, case):
    project = written.parents[2]
    document = yaml.safe_load(written.read_text())
    if case == "missing file":
        (project / "data" / "mine" / "test.jsonl").unlink()
        named = [str(Path("data/mine/test.jsonl")), "does not exist"]
    elif case == "escapes the root":
        document["inputs"][2]["path"] = "../outside.jsonl"
        named = ["'..'"]
    else:
        document["training"]["batch_size"] = 0
        named = ["/training/batch_size", "nothing written"]
    (project / "data" / "mine" / "dev.jsonl").write_text(chat_rows(3, 8))  # a stale pin too
    written.write_text(yaml.safe_dump(document, sort_keys=False))
    before = written.read_bytes()
    for check in ([], ["--check"]):
        code, _, err = minifield(capsys, "recipe", "repin", str(written), *check)
        assert code == 2 and "Traceback" not in err, err
        for text in named:
            assert text in err, (text, err)
        assert written.read_bytes() == before


def _prompts(project: Path, rows: list[dict]) -> None:
    for split in ("train", "dev", "test"):
        text = "".join(json.dumps(row) + "\n" for row in rows)
        (project / "data" / "mine" / f"{split}.jsonl").write_text(text)


def test_new_like_the_grpo_demo_refuses_prompts_without_the_reward_column(project, capsys):
    """The grpo demo's exact_match reward reads the column `answer`: a prompt row without it
    is refused at `recipe new` (and at `validate --input-root`), naming file:line and reward,
    as the prepare stage would refuse it later."""
    _prompts(project, [{"prompt": "mirror: ab", "answer": "abba"}, {"prompt": "mirror: cd"}])
    args = new_args()
    args[args.index("--like") + 1] = str(REPO / "config" / "recipes" / "grpo-demo.yaml")
    code, _, err = minifield(capsys, *args)
    refused(code, err, "data/mine/train.jsonl:2: no column 'answer'", "rl.rewards[0]")
    assert not (project / "config" / "recipes" / "mine.yaml").exists()

    _prompts(project, [{"prompt": "mirror: ab", "answer": "abba"}])
    code, out, err = minifield(capsys, *args)
    assert code == 0, err
    assert "product 'string-mirror-rl'" in out  # the demo's product name, said to be its
    (project / "data" / "mine" / "dev.jsonl").write_text('{"prompt": "mirror: cd"}\n')
    code, _, err = minifield(capsys, "recipe", "repin", "config/recipes/mine.yaml")
    assert code == 0, err
    written = "config/recipes/mine.yaml"
    code, _, err = minifield(capsys, "validate", written, "--input-root", "data")
    assert code == 2 and "Traceback" not in err, err
    assert "data/mine/dev.jsonl:1: no column 'answer'" in err


def test_validate_prints_the_digests_paths_are_named_by(written, capsys):
    code, out, err = minifield(capsys, "validate", str(written))
    assert code == 0, err
    printed = json.loads(out)
    checked = recipes.load(written)
    assert printed["cdigest"] == checked.computation_digest[:16]
    assert printed["edigest"] == checked.examples_digest[:16]


def test_the_suggested_config_file_is_named_after_the_recipe():
    from minifield.commands.recipe import config_file_for

    assert config_file_for(Path("config/recipes/mine.yaml")) == Path("config/mine.yaml")
    assert config_file_for(Path("theirs.json")) == Path("config/theirs.yaml")
    # never the recipe itself, nor the pipeline's own config
    assert config_file_for(Path("config/x.yaml")) == Path("config/x-run.yaml")
    assert config_file_for(Path("config/config.yaml")) == Path("config/config-run.yaml")


# ----------------------------------------------------------------------------- end to end


OWN_DATA = REPO / "docs" / "own-data.md"


def own_data_commands() -> list[str]:
    """Every command of docs/own-data.md's code blocks, in page order, continuation lines
    joined; usage synopses (``[--flag ...]``) are not commands."""
    commands, pending = [], ""
    for raw in OWN_DATA.read_text(encoding="utf-8").splitlines():
        if not raw.startswith("    ") or raw.strip().startswith("#"):
            continue
        text = raw.strip()
        pending = f"{pending} {text}".strip() if pending else text
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        if "[--" not in pending and re.match(r"(uv|cp|mkdir|printf|minifield) ", pending):
            commands.append(pending)
        pending = ""
    return commands


def as_run_here(command: str, cdigest: str | None = None) -> str:
    """A command of the page for this environment: ``uv run --locked`` is this interpreter's
    environment (its scripts; Snakemake on the repository's Snakefile, the project being a
    fresh directory), ``<cdigest>`` the computation's."""
    bin_dir = Path(sys.executable).parent
    command = command.replace(
        "uv run --locked snakemake ",
        f"{sys.executable} -m snakemake --snakefile {REPO / 'Snakefile'} ",
    ).replace("uv run --locked ", f"{bin_dir}/")
    return command.replace("<cdigest>", cdigest) if cdigest else command


def crash_proof_only(project: Path) -> None:
    with (project / "config" / "mine.yaml").open("a") as handle:
        handle.write("qualification:\n  mode: crash\n")


@pytest.mark.slow  # starts the installed `minifield` and Snakemake
def test_own_base_and_data_through_the_pipeline_to_a_trained_export(tmp_path):
    """docs/own-data.md as a newcomer follows it, every command of the page as written: a
    fresh project (the pipeline's config and the --like recipe, as in a clone), an HF base
    model and a few dozen chat rows in ``~``, `minifield recipe new`, a few settings edited,
    `recipe repin --check`, the config file, `snakemake`, `minifield generate`, the report."""
    started = time.monotonic()
    made, home = make_project(tmp_path / "made"), tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (made / "data" / "my-base").rename(home / "models" / "my-base")
    (made / "data" / "mine").rename(home / "my-data")
    project = tmp_path / "project"
    (project / "config" / "recipes").mkdir(parents=True)
    (project / "data").mkdir()
    shutil.copy(REPO / "config" / "config.yaml", project / "config" / "config.yaml")
    shutil.copy(LIKE, project / "config" / "recipes" / LIKE.name)
    commands = own_data_commands()
    env = {**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1"}
    env["SLURM_CONF"] = str(REPO / "tests" / "slurm" / "no-controller.conf")
    ran: list[str] = []

    def run(command: str, cdigest: str | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            ["bash", "-c", as_run_here(command, cdigest)],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (command, proc.stderr)
        ran.append(command)
        return proc

    # the files in place, the recipe written from the page's own commands
    for command in commands[:3]:
        made = run(command)
    assert commands[2].startswith("uv run --locked minifield recipe new "), commands
    assert "printf 'recipes:\\n  - config/recipes/mine.yaml\\n' > config/mine.yaml" in made.stdout
    recipe_path = project / "config" / "recipes" / "mine.yaml"
    worker = Path(sys.executable).parent / "minifield-worker"
    checked = subprocess.run(
        [worker, "--job", recipe_path, "--validate-only"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert checked.returncode == 0 and json.loads(checked.stdout)["valid"] is True

    # the settings a first small run changes (by hand, as a user would): no pin changes
    text = recipe_path.read_text()
    document = yaml.safe_load(text)
    document["training"].update(batch_size=4, warmup_steps=1)
    document["limits"] = {"max_steps": 4}
    document["checkpoint"] = {"every_steps": 2, "keep": 2}
    # a threshold four updates cannot reach: the model is published, not activated, and the
    # run's end says so
    document["evaluation"] = {"eval_every": 2, "min_dev_exact_match": 1.0}
    header = "".join(line for line in text.splitlines(True) if line.startswith("#"))
    recipe_path.write_text(header + yaml.safe_dump(document, sort_keys=False))
    check = run("uv run --locked minifield recipe repin config/recipes/mine.yaml --check")
    assert "0 stale pin(s)" in check.stdout, check.stdout
    # the page's config file, then (only here) the short recovery proof: test_proof.py
    # covers both kinds
    run(commands[3])
    crash_proof_only(project)
    before_pipeline = time.monotonic()
    pipeline = run(commands[4])
    pipeline_seconds = time.monotonic() - before_pipeline

    digest = recipes.load(recipe_path).computation_digest
    cdir = project / "results" / "computations" / digest[:16]
    result = json.loads((cdir / "train" / "result.json").read_text())
    assert result["status"] == "completed" and result["steps_completed"] == 4
    assert result["computation_digest"] == digest
    export = cdir / "train" / "export"
    assert {p.name for p in export.iterdir()} >= {*HF_FILES, "model.json"}
    base = project / "data" / "my-base"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert sha(export / name) == sha(base / name), name
    trained, shipped = (
        load_file(export / "model.safetensors"),
        load_file(base / "model.safetensors"),
    )
    assert trained.keys() == shipped.keys()
    assert any((trained[n] != shipped[n]).any() for n in trained)  # trained, not copied
    listed = json.loads((export / "model.json").read_text())["files"]
    for entry in listed:
        assert entry["sha256"] == sha(export / entry["file"])
    assert (cdir / "eval" / "metrics.json").is_file() and (cdir / "publication.json").is_file()
    # the run's end says what it did: the acceptance missed, so published, not activated
    metrics = json.loads((cdir / "eval" / "metrics.json").read_text())
    (check,) = [c for c in metrics["acceptance"]["checks"] if c["name"] == "dev_exact_match"]
    assert metrics["acceptance"]["passed"] is False and check["value"] < 1.0
    content_id = json.loads((cdir / "publication.json").read_text())["content_id"]
    closing = pipeline.stderr.split("minifield: what this run did, per computation:\n")[1]
    assert closing.splitlines()[0] == (
        f"  mine ({cdir.name}): trained (4 updates); recovery proof passed; acceptance FAILED: "
        f"dev_exact_match {check['value']:.6g} (threshold 1); published {content_id[:16]}, "
        "not activated (activation refuses a model that fails acceptance)"
    )

    # the rest of the page: the model tried, the config file and run again (nothing to do),
    # the report (its first item: the same line)
    for command in commands[5:]:
        proc = run(command, cdir.name)
        if command.startswith("printf "):
            crash_proof_only(project)  # as the run before: nothing to do
        if command.startswith("uv run --locked minifield generate "):
            assert proc.stdout.strip(), command
        if command == commands[4]:  # run again: nothing to do
            assert "Nothing to be done" in proc.stderr, proc.stderr[-2000:]
    assert set(commands) <= set(ran), set(commands) - set(ran)
    report = (project / "results" / "report-mine.html").read_text(errors="replace")
    assert "0. What the run did" in report
    print(
        f"own-data end to end: {time.monotonic() - started:.0f} s in all, "
        f"snakemake {pipeline_seconds:.0f} s (load average {os.getloadavg()[0]:.1f})"
    )


def test_the_own_data_page_commands_are_those_the_end_to_end_test_runs():
    """The commands the slow test finds on the page, in order: a command added to the page
    is run by it (or this fails, naming the command)."""
    commands = own_data_commands()
    starts = [
        "cp -r ~/models/my-base data/my-base",
        "mkdir -p data/mine && cp ~/my-data/{train,dev,test}.jsonl data/mine/",
        "uv run --locked minifield recipe new --like config/recipes/llama-sft-demo.yaml",
        "printf 'recipes:\\n  - config/recipes/mine.yaml\\n' > config/mine.yaml",
        "uv run --locked snakemake --cores 2 --configfile config/mine.yaml",
        "uv run --locked minifield generate --model results/computations/<cdigest>/train/",
        "printf 'recipes:\\n  - config/recipes/mine.yaml\\n' > config/mine.yaml",
        "uv run --locked snakemake --cores 2 --configfile config/mine.yaml",
        "uv run --locked snakemake --configfile config/mine.yaml --report results/report-mine",
    ]
    assert len(commands) == len(starts), commands
    for command, start in zip(commands, starts, strict=True):
        assert command.startswith(start), (command, start)
    assert "\\" not in commands[2] and commands[2].endswith("-o config/recipes/mine.yaml")
