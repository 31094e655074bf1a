import numpy as np
import pytest

from minifield.attempt import environment
from minifield.inputs import examples
from minifield.state import export


def test_prepared_examples_roundtrip_memory_mapped_and_verified(tmp_path):
    arrays = {"x": np.arange(6, dtype=np.float32), "tokens": np.ones((2, 3), np.int32)}
    examples.write(tmp_path, arrays, {"source": "test"}, "e" * 64)
    loaded, manifest = examples.load(tmp_path, "e" * 64)
    assert isinstance(loaded["x"], np.memmap)
    np.testing.assert_array_equal(loaded["tokens"], arrays["tokens"])
    assert manifest["meta"] == {"source": "test"}
    with pytest.raises(examples.ExamplesError, match="differs from the recipe"):
        examples.load(tmp_path, "f" * 64)
    raw = bytearray((tmp_path / "x.npy").read_bytes())
    raw[-1] ^= 1
    (tmp_path / "x.npy").write_bytes(bytes(raw))
    with pytest.raises(examples.ExamplesError, match="x.npy"):
        examples.load(tmp_path, "e" * 64)


def test_export_roundtrip_and_tamper_detection(tmp_path):
    params = {"w": np.array([1.5], np.float32), "b": np.array([0.25], np.float32)}
    export.write(tmp_path, params, {"strategy": "linear-momentum"})
    loaded, config = export.read(tmp_path)
    assert config == {"strategy": "linear-momentum"}
    assert loaded["w"][0] == np.float32(1.5) and loaded["b"][0] == np.float32(0.25)
    weight = next((tmp_path / "weights").iterdir())
    weight.write_bytes(weight.read_bytes()[:-1] + b"\x00")
    with pytest.raises(export.ExportError, match="sha256 mismatch"):
        export.read(tmp_path)


def test_fingerprint_differences_name_bit_defining_fields_only():
    recorded = environment.fingerprint()
    current = {
        **recorded,
        "xla_flags": "--xla_force_host_platform_device_count=4",
        "cpu_count": 99,
        "source_revision": "other",
    }
    diff = environment.differences(recorded, current)
    assert diff == {
        "xla_flags": {
            "recorded": recorded["xla_flags"],
            "current": "--xla_force_host_platform_device_count=4",
        }
    }
    assert environment.differences(recorded, dict(recorded)) == {}
    for key in (
        "jax",
        "jaxlib",
        "optax",
        "backend",
        "device_kind",
        "device_count",
        "threads",
        "prng_impl",
    ):
        assert key in recorded
