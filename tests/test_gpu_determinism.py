"""GPU determinism flags: added to XLA_FLAGS before JAX starts, only for a run on a GPU."""

from __future__ import annotations

from minifield.attempt import environment


def test_a_gpu_run_gets_the_determinism_flags_after_the_users_own():
    env = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert environment.add_gpu_determinism_flags(env) == ["--xla_gpu_deterministic_ops=true"]
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_gpu_deterministic_ops=true"
    # idempotent: a second call (a resumed attempt in the same process) adds nothing
    assert environment.add_gpu_determinism_flags(env) == []
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_gpu_deterministic_ops=true"


def test_a_flag_the_user_set_is_kept():
    env = {"JAX_PLATFORMS": "gpu", "XLA_FLAGS": "--xla_gpu_deterministic_ops=false"}
    assert environment.add_gpu_determinism_flags(env) == []
    assert env["XLA_FLAGS"] == "--xla_gpu_deterministic_ops=false"


def test_a_cpu_run_is_left_alone():
    for env in ({"JAX_PLATFORMS": "cpu"}, {"JAX_PLATFORMS": "cpu,cuda", "XLA_FLAGS": "-x"}):
        before = dict(env)
        assert environment.add_gpu_determinism_flags(env) == []
        assert env == before


def test_without_jax_platforms_the_installed_plugin_decides():
    # this project's test environment has no CUDA plugin: a CPU run, fingerprint unchanged
    assert all(environment._version(name) is None for name in environment.CUDA_PLUGINS)
    assert environment.cuda_plugins() == {}
    env: dict[str, str] = {}
    assert environment.add_gpu_determinism_flags(env) == [] and env == {}
    assert not set(environment.OPTIONAL_BIT_DEFINING) & set(environment.fingerprint())


def test_a_changed_cuda_plugin_is_a_bit_defining_difference():
    recorded = {"jax": "0.10.2", "jax_cuda12_plugin": "0.10.2"}
    assert environment.differences(recorded, dict(recorded)) == {}
    changed = {**recorded, "jax_cuda12_plugin": "0.10.3"}
    assert environment.differences(recorded, changed) == {
        "jax_cuda12_plugin": {"recorded": "0.10.2", "current": "0.10.3"}
    }
    # a host's own CUDA 13 plugin (an offline GPU host) is compared the same way
    cuda13 = {"jax": "0.11.2", "jax_cuda13_plugin": "0.11.2"}
    assert environment.differences(cuda13, {**cuda13, "jax_cuda13_plugin": "0.11.3"}) == {
        "jax_cuda13_plugin": {"recorded": "0.11.2", "current": "0.11.3"}
    }
    cpu = {"jax": "0.10.2"}  # CPU fingerprints have no plugin field on either side
    assert environment.differences(cpu, dict(cpu)) == {}
