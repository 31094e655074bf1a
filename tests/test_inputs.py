import hashlib

import pytest

from minifield.inputs import pinned as inputs


def pinned(tmp_path, name="examples", rel="d/x.jsonl", data=b'{"x": 1, "y": 3}\n'):
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"name": name, "path": rel, "sha256": hashlib.sha256(data).hexdigest()}


def test_verified_inputs_report_their_hash_and_size(tmp_path):
    item = pinned(tmp_path)
    [record] = inputs.verify({"inputs": [item]}, tmp_path)
    assert record["sha256"] == item["sha256"] and record["size"] == 17


def test_mismatch_and_missing_are_all_named(tmp_path):
    good = pinned(tmp_path)
    wrong = {**pinned(tmp_path, name="other", rel="o.txt"), "sha256": "0" * 64}
    missing = {"name": "gone", "path": "nope.txt", "sha256": "1" * 64}
    with pytest.raises(inputs.InputError) as info:
        inputs.verify({"inputs": [good, wrong, missing]}, tmp_path)
    text = str(info.value)
    assert "'other'" in text and "recipe pins " + "0" * 64 in text
    assert "'gone'" in text and "does not exist" in text


def test_symlink_escaping_the_root_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "secret").write_text("s")
    (root / "link").symlink_to(tmp_path / "secret")
    with pytest.raises(inputs.InputError, match="outside the input root"):
        inputs.resolve(root, "link")
    with pytest.raises(inputs.InputError):
        inputs.resolve(root, "../secret")
