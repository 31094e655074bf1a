import hashlib

from minifield.digest import canonical_json, sha256_file, sha256_json, short


def test_canonical_json_ignores_key_order_and_whitespace():
    a = {"b": 1, "a": {"y": [1, 2], "x": "é"}}
    b = {"a": {"x": "é", "y": [1, 2]}, "b": 1}
    assert canonical_json(a) == canonical_json(b) == '{"a":{"x":"é","y":[1,2]},"b":1}'


def test_sha256_json_is_sha256_of_the_canonical_utf8_bytes():
    value = {"z": 0.5, "a": True}
    expected = hashlib.sha256(b'{"a":true,"z":0.5}').hexdigest()
    assert sha256_json(value) == expected
    assert short(expected) == expected[:16]


def test_sha256_file_matches_hashlib(tmp_path):
    path = tmp_path / "blob"
    data = bytes(range(256)) * 5000  # several read chunks
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()
