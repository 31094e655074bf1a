"""The accelerator belongs to one process at a time: a worker waits for a chip another process
still holds, retrying only that error, and ends ``device_busy`` naming the holder when it never
gets it; the recovery proof says so instead of blaming the recovery.

No chip is needed: the backend is a fake that raises the text libtpu gave on a TPU v5e host
(issue 46), and ``/proc`` is a directory written here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import linear_recipe

from minifield import api
from minifield.attempt import device_claim
from minifield.proof import runs
from minifield.supervision import supervise

#: what the resumed worker of the recovery proof died of on the chip (issue 46)
LOCKFILE_ERROR = (
    "Unable to initialize backend 'tpu': ABORTED: Internal error when accessing libtpu "
    'multi-process lockfile. Run "$ sudo lsof -w /dev/accel0" to figure out which process '
    "is holding the TPU."
)


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.pauses: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def busy_then(free_after: int, error: str = LOCKFILE_ERROR):
    """An opener refused ``free_after`` times, then opened (returns the tries made)."""
    tries = []

    def open_backend():
        tries.append(1)
        if len(tries) <= free_after:
            raise RuntimeError(error)
        return "devices"

    return open_backend, tries


def test_a_busy_chip_is_waited_for_and_each_wait_reported():
    clock = FakeClock()
    opener, tries = busy_then(3)
    resets, waits = [], []
    claimed = device_claim.claim(
        opener, lambda: resets.append(1), wait_s=60, on_wait=waits.append,
        holders=lambda: ["pid 4242 (python worker)"], clock=clock, sleep=clock.sleep,
    )  # fmt: skip
    assert (claimed.tries, len(tries), len(resets)) == (4, 4, 3)
    # doubling pauses from the first, each reported before it is taken
    assert clock.pauses == [0.5, 1.0, 2.0] == [w.pause_s for w in waits]
    assert claimed.waited_s == 3.5
    assert [w.tries for w in waits] == [1, 2, 3]
    assert all(
        w.error == LOCKFILE_ERROR and w.holders == ["pid 4242 (python worker)"] for w in waits
    )


def test_a_chip_held_past_the_wait_ends_busy_naming_the_holder():
    clock = FakeClock()
    opener, tries = busy_then(10**6)
    with pytest.raises(device_claim.DeviceBusy) as caught:
        device_claim.claim(
            opener, lambda: None, wait_s=10, on_wait=lambda w: None,
            holders=lambda: ["pid 4242 (python worker)"], clock=clock, sleep=clock.sleep,
        )  # fmt: skip
    message = str(caught.value)
    assert "pid 4242 (python worker)" in message and "multi-process lockfile" in message
    assert "runtime.device_wait_seconds" in message
    # 0.5 + 1 + 2 + 4 = 7.5 s waited; the next pause (8 s) would pass the 10 s allowed
    assert clock.pauses == [0.5, 1.0, 2.0, 4.0] and len(tries) == 5


def test_any_other_backend_error_is_raised_at_once():
    opener, tries = busy_then(10**6, error="Unable to initialize backend 'tpu': no TPU found")
    with pytest.raises(RuntimeError, match="no TPU found"):
        device_claim.claim(opener, lambda: None, wait_s=60, on_wait=lambda w: None)
    assert len(tries) == 1


def test_a_signal_ends_the_wait():
    clock = FakeClock()
    opener, tries = busy_then(10**6)
    stop = iter([None, "signal SIGTERM"])
    with pytest.raises(device_claim.DeviceBusy, match="stopped waiting: signal SIGTERM"):
        device_claim.claim(
            opener, lambda: None, wait_s=600, on_wait=lambda w: None,
            should_stop=lambda: next(stop), holders=lambda: [], clock=clock, sleep=clock.sleep,
        )  # fmt: skip
    assert len(tries) == 2


@pytest.mark.parametrize(
    "text",
    [
        LOCKFILE_ERROR,
        "TPU backend already in use by another process",
        "The TPU is already in use by process with pid 77. Not attempting to load libtpu.so",
    ],
)
def test_the_busy_texts_are_recognised(text):
    assert device_claim.is_busy_error(RuntimeError(text))


def test_the_holder_is_found_in_proc(tmp_path):
    lockfile = tmp_path / "libtpu_lockfile"
    lockfile.write_text("")
    proc = tmp_path / "proc"
    for pid, target, command in (
        (17, tmp_path / "other", b"sleep\x00100\x00"),
        (4242, lockfile, b"python\x00-m\x00minifield.worker\x00"),
        (os.getpid(), lockfile, b"this process\x00"),
    ):
        (proc / str(pid) / "fd").mkdir(parents=True)
        (proc / str(pid) / "fd" / "3").symlink_to(target)
        (proc / str(pid) / "cmdline").write_bytes(command)
    (proc / "self").mkdir()  # not a pid: ignored
    assert device_claim.lock_holders(str(lockfile), proc) == [
        "pid 4242 (python -m minifield.worker)"
    ]


def _fake_backend(monkeypatch, free_after: int) -> None:
    import jax

    def open_backend(calls=[]):  # noqa: B006 - counts the calls of this one fake
        calls.append(1)
        if len(calls) <= free_after:
            raise RuntimeError(LOCKFILE_ERROR)
        return jax.devices()

    monkeypatch.setattr(device_claim, "jax_backend", lambda backend: (open_backend, lambda: None))
    monkeypatch.setattr(device_claim, "FIRST_PAUSE_S", 0.01)
    monkeypatch.setattr(device_claim, "lock_holders", lambda: ["pid 4242 (python worker)"])


def _events(attempt_dir: Path) -> list[dict]:
    lines = (attempt_dir / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_an_attempt_waits_for_the_chip_and_records_the_wait(tmp_path, monkeypatch):
    _fake_backend(monkeypatch, free_after=2)
    result = api.run(linear_recipe(), input_root=tmp_path, output_root=tmp_path / "out")
    assert result.status == "completed", result.error
    events = _events(Path(result.attempt_dir))
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["device_wait", "device_wait", "device_claimed"]
    assert events[0]["holders"] == ["pid 4242 (python worker)"]
    assert events[2]["tries"] == 3
    assert kinds.index("device_claimed") < kinds.index("attempt_started")


def test_an_attempt_that_never_gets_the_chip_ends_device_busy(tmp_path, monkeypatch):
    _fake_backend(monkeypatch, free_after=10**6)
    recipe = linear_recipe(runtime={"device_wait_seconds": 0.05})
    result = api.run(recipe, input_root=tmp_path, output_root=tmp_path / "out")
    assert (result.status, result.exit_code) == ("device_busy", 6)
    attempt = Path(result.attempt_dir)
    written = json.loads((attempt / "result.json").read_text())
    assert written["status"] == "device_busy" and written["steps_completed"] == 0
    assert written["error"]["phase"] == "device"
    assert "pid 4242 (python worker)" in written["error"]["message"]
    assert written["environment"]["backend"] is None  # no backend was started
    assert _events(attempt)[-1]["status"] == "device_busy"
    # no attempt.json: the pipeline's next run resumes from the attempt before this one
    assert not (attempt / "attempt.json").exists()


def test_the_supervisor_names_a_busy_device():
    classification, reason = supervise.classify(
        exit_code=6, completed_event=False, supervisor_action=None, forwarded=False
    )
    assert classification == "failed" and "device_busy" in reason


def test_the_proof_says_a_resumed_run_never_got_the_chip(tmp_path):
    """What the proof read on the chip was "the resumed run records no restored checkpoint";
    a device_busy resumed run is now said as what it is."""
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    message = "the accelerator is held by another process (pid 4242 (python worker)); ..."
    (attempt / "result.json").write_text(
        json.dumps({"status": "device_busy", "error": {"phase": "device", "message": message}})
    )
    (attempt / "events.jsonl").write_text("")
    outcome = {
        "run_dir": str(tmp_path), "classification": "failed", "exit_code": 6,
        "reason": "device_busy", "stderr_log": str(tmp_path / "stderr.log"),
    }  # fmt: skip

    class Launcher:
        def launch(self, name, *args, **kwargs):
            return outcome, attempt, []

    section: dict = {}
    with pytest.raises(runs.ProofProblem, match="resumed run could not get the accelerator"):
        runs.run_resumed(Launcher(), section, "resumed", tmp_path / "faulted", {})
    assert section["resumed"]["status"] == "device_busy"
    assert "pid 4242" in section["resumed"]["error"]["message"]
