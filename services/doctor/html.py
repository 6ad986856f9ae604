"""The doctor's answers as one self-contained HTML file: no external script, style or image
(the plots are PNGs inlined as data URIs), so it opens anywhere and can be attached to a ticket.
A script sets ``data-rendered`` on ``<body>`` once every plot has decoded: what the headless-
browser test reads."""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Any

from services.doctor.diagnosis import Answer
from services.doctor.evidence import Evidence

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 980px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
.verdict { padding: 2px 8px; border-radius: 4px; font-weight: 600; font-size: .85em; }
.fine { background: #dff3e3; color: #17622a; } .look { background: #fde2d6; color: #8a2b07; }
.unknown { background: #eee; color: #555; }
table { border-collapse: collapse; margin: .5em 0; } td { padding: 1px 10px 1px 0; }
td.k { color: #666; } .cause, .action { margin: .3em 0; } img { max-width: 100%; }
"""

_SCRIPT = """
window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.setAttribute("data-rendered", ok + "/" + imgs.length);
});
"""


def render(answers: list[Answer], ev: Evidence) -> str:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>pdserve doctor</title>",
        f"<style>{_STYLE}</style><script>{_SCRIPT}</script></head><body>",
        f"<h1>pdserve doctor</h1><p>{html.escape(ev.source)}</p>",
    ]
    for a in answers:
        cls = {"fine": "fine", "look here": "look", "unknown": "unknown"}[a.verdict]
        parts.append(
            f"<section id='q{a.number}'><h2>{a.number}. {html.escape(a.question)} "
            f"<span class='verdict {cls}'>{html.escape(a.verdict)}</span></h2>"
        )
        rows = "".join(
            f"<tr><td class='k'>{html.escape(k)}</td><td>{html.escape(_fmt(v))}</td></tr>"
            for k, v in a.figures.items()
        )
        parts.append(f"<table>{rows}</table>")
        if a.cause:
            parts.append(f"<p class='cause'><b>Cause:</b> {html.escape(a.cause)}</p>")
        if a.action:
            parts.append(f"<p class='action'><b>Action:</b> {html.escape(a.action)}</p>")
        plot = _plot(a.number, a, ev)
        if plot is not None:
            parts.append(f"<img alt='plot for question {a.number}' src='{plot}'>")
        parts.append("</section>")
    parts.append("</body></html>")
    return "".join(parts)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) or "none"
    return str(v)


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _plot(number: int, a: Answer, ev: Evidence) -> str | None:
    """Question 2: the client's latency CDFs; question 3: decode step time by batch size
    (with and without a prompt chunk) against the bandwidth floor."""
    from services.loadgen.plots import _pyplot

    plt = _pyplot()
    if number == 2 and ev.runs:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
        for ax, key, title in zip(axes, ("ttft_s", "tpot_s"), ("TTFT", "TPOT")):
            xs = sorted(r[key] for r in ev.records() if r.get(key) is not None)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
            ax.set_title(title)
            ax.set_xlabel("seconds")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        uri = _png(fig)
        plt.close(fig)
        return uri
    pure = a.figures.get("decode_step_ms_by_batch") if number == 3 else None
    if pure:
        mixed = a.figures.get("mixed_step_ms_by_batch") or {}
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(list(pure), list(pure.values()), "o-", label="decode steps")
        if mixed:
            ax.plot(list(mixed), list(mixed.values()), "s--", label="with a prompt chunk")
        floor = a.figures.get("bandwidth_floor_ms")
        if floor and not math.isnan(floor):
            ax.axhline(floor, color="grey", ls=":", label="bandwidth floor")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("decode rows in the step")
        ax.set_ylabel("ms per step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        uri = _png(fig)
        plt.close(fig)
        return uri
    return None
