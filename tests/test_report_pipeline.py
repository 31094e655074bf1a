"""The real pipeline on the linear demo, then ``snakemake --report``, opened in headless Chromium.

Chromium (Debian package ``chromium``) is needed for the browser part; without
it that test is skipped with the reason. Set MINIFIELD_SCREENSHOT_DIR to keep
the screenshots for a look.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import copy_run, read_events, run_snakemake

pytestmark = pytest.mark.slow  # real Snakemake runs

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
REPORT_ITEMS = {
    "loss.png": "image/png",
    "goodput.png": "image/png",
    "throughput.html": "text/html",
    "recovery.html": "text/html",
    "evaluation.html": "text/html",
    "publication.html": "text/html",
}
TAB_RED = np.array([0xD6, 0x27, 0x28]) / 255  # matplotlib "tab:red": the DEV curve in loss.png


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, linear_demo_run) -> Path:
    """The linear demo run end to end plus the report, in a private copy."""
    workdir = copy_run(linear_demo_run, tmp_path_factory.mktemp("report") / "project")
    run_snakemake(workdir, check=True)
    run_snakemake(workdir, "--report", "results/report.html", check=True)
    return workdir


def embedded_results(report: Path) -> dict:
    """The report's ``results`` table: path -> {mime_type, data_uri, labels, ...}."""
    found = re.search(r"var results = (\{.*?\});\s*</script>", report.read_text(), re.S)
    assert found, "no results table in the report"
    return json.loads(found.group(1))


def test_summary_matches_raw_events(pipeline):
    (computation,) = list((pipeline / "results" / "computations").iterdir())
    summary = json.loads((computation / "summary.json").read_text())
    result = json.loads((computation / "train" / "result.json").read_text())
    events = read_events(pipeline / result["attempt_dir"] / "events.jsonl")
    updates = [e for e in events if e["type"] == "update"]
    assert summary["computation_digest"] == result["computation_digest"]
    assert summary["updates_count"] == len(updates) == 8
    assert summary["processed_examples_count"] == 8 * 8  # 8 updates of minibatch 8
    assert summary["update_time_s"] == pytest.approx(sum(e["seconds"] for e in updates))
    wall = events[-1]["mono"] - events[0]["mono"]
    assert summary["job_wall_time_s"] == pytest.approx(wall)
    assert 0 < summary["update_duty_fraction"] < 1
    assert summary["uncheckpointed_updates_count"] == 0
    assert summary["final_status"] == "completed"


def test_report_embeds_every_item(pipeline):
    report = pipeline / "results" / "report.html"
    results = embedded_results(report)
    (computation,) = list((pipeline / "results" / "computations").iterdir())
    expected = {
        f"results/computations/{computation.name}/report/{name}": mime
        for name, mime in REPORT_ITEMS.items()
    }
    expected["results/report/capacity.html"] = "text/html"
    expected["results/report/outcome.html"] = "text/html"
    assert {path: entry["mime_type"] for path, entry in results.items()} == expected
    for path, entry in results.items():
        payload = base64.b64decode(entry["data_uri"].split("base64,", 1)[1])
        assert payload == (pipeline / path).read_bytes(), f"{path} is not embedded as written"
    loss = (pipeline / f"results/computations/{computation.name}/report/loss.png").read_bytes()
    assert loss.startswith(b"\x89PNG\r\n\x1a\n")
    evaluation = (computation / "report" / "evaluation.html").read_text()
    metrics = json.loads((computation / "eval" / "metrics.json").read_text())
    assert (
        "DEV-selected" in evaluation and f"step <b>{metrics['selection']['step']}</b>" in evaluation
    )
    recovery = (computation / "report" / "recovery.html").read_text()
    assert "has no <code>qualify</code> rule" in recovery or "Verdict" in recovery
    # Items fed by other rules show those rules' records when the workflow has them.
    publication = (computation / "report" / "publication.html").read_text()
    if (computation / "publication.json").exists():
        record = json.loads((computation / "publication.json").read_text())
        assert record["content_id"] in publication
    else:
        assert "has no <code>publish</code> rule" in publication
    # the first item: what the run did, the computation's line as the run printed it
    outcome = (pipeline / "results" / "report" / "outcome.html").read_text()
    assert f"linear-demo ({computation.name}): trained (8 updates); " in outcome
    assert "acceptance passed" in outcome
    capacity = (pipeline / "results" / "report" / "capacity.html").read_text()
    if (pipeline / "results" / "capacity.csv").exists():
        assert f"{computation.name}" in capacity and "<th>seconds_per_job</th>" in capacity
    else:
        assert "has no <code>capacity_table</code> rule" in capacity


def chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def screenshot(browser: str, page: Path, out: Path, profile: Path) -> np.ndarray:
    proc = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--window-size=1400,1000",
            "--virtual-time-budget=5000",
            f"--screenshot={out}",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert out.is_file(), (
        f"no screenshot from {browser} (exit {proc.returncode}): {proc.stderr[-2000:]}"
    )
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    import matplotlib.image

    pixels = matplotlib.image.imread(out)[..., :3]
    keep = os.environ.get("MINIFIELD_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(out, Path(keep) / out.name)
    return pixels


def showing(report: Path, out: Path, path: str, content: str) -> Path:
    """A copy of the report that opens one result in the report's own viewer on load."""
    html = report.read_text()
    script = (
        "<script>setTimeout(function(){"
        f"app.setView({{content: {json.dumps(content)}, contentPath: results[{json.dumps(path)}].data_uri, "
        f"resultPath: {json.dumps(path)}}});}}, 300);</script></body>"
    )
    at = html.rfind("</body>")
    out.write_text(html[:at] + script + html[at + len("</body>") :])
    return out


def test_report_opens_in_headless_chromium_and_shows_the_plots(pipeline, tmp_path):
    browser = chromium()
    if browser is None:
        message = (
            "chromium not installed (apt-get install -y chromium): report screenshot not taken"
        )
        print(message)
        pytest.skip(message)
    report = pipeline / "results" / "report.html"
    (computation,) = list((pipeline / "results" / "computations").iterdir())
    loss = f"results/computations/{computation.name}/report/loss.png"
    evaluation = f"results/computations/{computation.name}/report/evaluation.html"

    landing = screenshot(browser, report, tmp_path / "report-landing.png", tmp_path / "p1")
    assert landing.std() > 0.05, "landing page screenshot is blank"
    assert len(np.unique((landing * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > 50

    page = showing(report, tmp_path / "loss-view.html", loss, "img")
    plot = screenshot(browser, page, tmp_path / "report-loss-plot.png", tmp_path / "p2")
    red = np.all(np.abs(plot - TAB_RED) < 0.06, axis=-1).sum()
    assert red > 200, f"the loss plot's DEV curve is not visible in the report ({red} red pixels)"

    page = showing(report, tmp_path / "evaluation-view.html", evaluation, "html")
    table = screenshot(browser, page, tmp_path / "report-evaluation.png", tmp_path / "p3")
    selected_row = np.all(np.abs(table - np.array([0xFF, 0xF6, 0xD6]) / 255) < 0.02, axis=-1)
    assert selected_row.sum() > 500, "the evaluation table's DEV-selected row is not visible"
