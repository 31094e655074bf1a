"""What every report item shares: the page (one self-contained HTML file, its style), the
table and its cells, number formatting, and PNG output through matplotlib's Agg backend."""

from __future__ import annotations

import html
import io
import math
from pathlib import Path
from typing import Any

from ... import atomic

HEX64_LENGTH = 64
STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:1.2em;color:#222}
h1{font-size:1.25em;margin:0 0 .4em} h2{font-size:1.05em;margin:1.2em 0 .4em}
p.note{color:#555;font-size:.9em;max-width:60em}
table{border-collapse:collapse;font-size:.88em;margin:.3em 0 1em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f0f3f7} td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.selected td{background:#fff6d6;font-weight:600}
.pass{color:#11692b;font-weight:600} .fail{color:#a3161b;font-weight:600}
code{font-size:.95em}
"""


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: figures are rendered to files only
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, out_png: Path) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    atomic.write_bytes(out_png, buffer.getvalue())


def fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
            return f"{value:.4g}"
        return f"{value:.6g}"
    return str(value)


def cell(value: Any) -> str:
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    return f'<td class="num">{html.escape(fmt(value))}</td>' if numeric else text_cell(value)


def text_cell(value: Any) -> str:
    text = fmt(value)
    if isinstance(value, str) and len(value) == HEX64_LENGTH:
        return f'<td><code title="{html.escape(value)}">{html.escape(value[:16])}…</code></td>'
    return f"<td>{html.escape(text)}</td>"


def table(headers: list[str], rows: list[list[Any]], selected: set[int] | None = None) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for index, row in enumerate(rows):
        css = ' class="selected"' if selected and index in selected else ""
        body.append(f"<tr{css}>" + "".join(cell(v) for v in row) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def page(title: str, body: str) -> str:
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>"
        f"<body><h1>{html.escape(title)}</h1>{body}</body></html>\n"
    )


def write_page(out_html: Path, title: str, body: str) -> None:
    atomic.write_bytes(out_html, page(title, body).encode("utf-8"))


def pass_badge(passed: Any) -> str:
    if passed is None:
        return "—"
    return '<span class="pass">passed</span>' if passed else '<span class="fail">FAILED</span>'


def flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Nested JSON as (dotted key, scalar) rows; long lists are summarized, not dumped."""
    if isinstance(value, dict):
        rows = []
        for key in sorted(value):
            rows += flatten(value[key], f"{prefix}.{key}" if prefix else str(key))
        return rows or [(prefix, "{}")]
    if isinstance(value, list):
        if len(value) > 6 or any(isinstance(v, dict | list) for v in value):
            if value and all(isinstance(v, dict | list) for v in value) and len(value) <= 6:
                rows = []
                for index, item in enumerate(value):
                    rows += flatten(item, f"{prefix}[{index}]")
                return rows
            return [(prefix, f"{len(value)} items")]
        return [(prefix, ", ".join(fmt(v) for v in value) if value else "[]")]
    return [(prefix, value)]


def read_optional(path: Path | None) -> Any:
    return atomic.read_json(path) if path is not None else None


def missing_rule_page(out_html: Path, title: str, rule: str) -> None:
    write_page(
        out_html,
        title,
        f'<p class="note">This workflow has no <code>{html.escape(rule)}</code> rule, so there is '
        "nothing to show here.</p>",
    )
