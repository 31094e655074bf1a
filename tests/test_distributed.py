"""Multi-process topology from explicit settings, MINIFIELD_* variables or a SLURM step."""

from __future__ import annotations

import pytest

from minifield.supervision import distributed as d

SLURM_STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "3",
    "SLURM_STEP_NODELIST": "gpu[007-009,012],login1",
}


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("node001", "node001"),
        ("node001,host2", "node001"),
        ("node[001-015],host2", "node001"),
        ("node[007,009-011]", "node007"),
        ("vm", "vm"),
    ],
)
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert d.first_host(nodelist) == host


def test_no_settings_is_a_single_process():
    topology = d.from_environment({})
    assert (topology.num_processes, topology.process_id, topology.source) == (1, 0, "single")
    assert topology.is_writer and not topology.is_multi_process
    assert d.initialize(topology) is topology  # nothing to start


def test_a_one_task_slurm_job_is_a_single_process():
    env = {**SLURM_STEP, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}
    assert d.from_environment(env).source == "single"


def test_slurm_step_gives_first_host_and_job_derived_port():
    topology = d.from_environment(SLURM_STEP)
    # port: 4242 mod 4096 = 146, placed in the top 4096 ports: 146 + 61440
    assert topology.coordinator == "gpu007:61586"
    assert (topology.num_processes, topology.process_id, topology.source) == (4, 3, "slurm")
    assert not topology.is_writer


def test_minifield_variables_win_over_slurm():
    env = {
        **SLURM_STEP,
        d.ENV_COORDINATOR: "10.0.0.1:1234",
        d.ENV_NUM_PROCESSES: "2",
        d.ENV_PROCESS_ID: "0",
    }
    topology = d.from_environment(env)
    assert (topology.coordinator, topology.num_processes, topology.source) == (
        "10.0.0.1:1234",
        2,
        "environment",
    )
    assert topology.is_writer


def test_explicit_arguments_win_over_everything():
    env = {**SLURM_STEP, d.ENV_COORDINATOR: "x:1", d.ENV_NUM_PROCESSES: "2", d.ENV_PROCESS_ID: "1"}
    topology = d.from_environment(env, coordinator="h:9", num_processes=3, process_id=2)
    assert (topology.coordinator, topology.num_processes, topology.process_id) == ("h:9", 3, 2)
    assert topology.source == "explicit"


@pytest.mark.parametrize(
    ("env", "kwargs", "message"),
    [
        ({d.ENV_COORDINATOR: "h:1"}, {}, "but not"),
        ({}, {"coordinator": "h:1", "num_processes": 2}, "incomplete"),
        ({}, {"coordinator": "h:1", "num_processes": 2, "process_id": 2}, "not in [0, 2)"),
        ({}, {"coordinator": "nohostport", "num_processes": 2, "process_id": 0}, "host:port"),
        ({}, {"coordinator": "h:1", "num_processes": 0, "process_id": 0}, ">= 1"),
        (
            {d.ENV_COORDINATOR: "h:1", d.ENV_NUM_PROCESSES: "two", d.ENV_PROCESS_ID: "0"},
            {},
            "integer",
        ),
        ({**SLURM_STEP, "SLURM_JOB_ID": ""}, {}, "SLURM_JOB_ID"),
    ],
)
def test_incomplete_or_inconsistent_settings_are_refused(env, kwargs, message):
    with pytest.raises(d.DistributedError, match=message.replace("[", r"\[").replace(")", r"\)")):
        d.from_environment(env, **kwargs)


def test_cli_prints_the_topology(capsys, monkeypatch):
    for key in list(SLURM_STEP) + [d.ENV_COORDINATOR, d.ENV_NUM_PROCESSES, d.ENV_PROCESS_ID]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert d.main([]) == 0
    assert '"source": "single"' in capsys.readouterr().out
    monkeypatch.setenv(d.ENV_COORDINATOR, "h:1")
    assert d.main([]) == 2
    assert "but not" in capsys.readouterr().err


def test_texts_cross_processes_intact_or_cut_to_the_buffer():
    for text in ("", "ok:a20261130T074128Z-9f3590", "naïve ✓ " * 3):
        assert d._decode(d._encode(text)) == text
    long = "x" * (d.TEXT_BYTES + 50)
    assert d._decode(d._encode(long)) == "x" * d.TEXT_BYTES


def test_a_group_of_one_decides_alone_without_jax():
    group = d.Group()
    assert (group.size, group.rank, group.is_writer) == (1, 0, True)
    assert group.broadcast_text("id") == "id"
    assert group.gather_texts("why") == ["why"]
    assert group.gather_ints(3) == [3]
    group.barrier("nothing to wait for")
