"""The S3D8 rows of the anchors report (issue 49, item 2): each row's worst case over its variants, its ratios to
the stock anchors, and the targets it is held to, from the results JSON (pure: no tool runs)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from anchors.model import S3D8_ROWS  # type: ignore[import-not-found]
from anchors.variants import identical_groups, s3d8_groups, worst_case  # type: ignore[import-not-found]

#: the stock rows each S3D8 worst case is divided by: (project, qtype, name in the report)
ANCHORS = (("mainline", "iq2_s", "IQ2_S"), ("mainline", "q2_k", "Q2_K"), ("ik", "iq2_kl", "IQ2_KL"),
           ("mainline", "iq2_m", "IQ2_M mix"))


@dataclass(frozen=True)
class Target:
    group: str  #: an S3D8_ROWS key
    anchor: tuple[str, str]  #: (project, qtype) of the stock row
    factor: float  #: worst KLD <= factor x the anchor's KLD
    text: str
    goal: bool = False  #: a goal beyond the target (reported, not a failure)
    matched_bpw: bool = False  #: held at S3D8's bpw: the anchor is mainline's stock frontier there (matched_anchor)


TARGETS = (
    Target("last", ("mainline", "iq2_s"), 0.9, "S3D8 + last-layer X^T X ≤ 0.9 × IQ2_S + imatrix"),
    Target("last", ("mainline", "q2_k"), 1.0, "S3D8 + last-layer X^T X ≤ Q2_K + imatrix"),
    Target("gptq", ("ik", "iq2_kl"), 1.0, "S3D8 GPTQ on every S3D8 matrix (all ffn_down) ≤ IQ2_KL"),
    Target("gptq", ("ik", "iq2_kl"), 0.9, "S3D8 GPTQ on every S3D8 matrix (all ffn_down) ≤ 0.9 × IQ2_KL",
           goal=True),
    Target("mix", ("mainline", "iq2_s"), 1.0, "S3D8 default mix (imatrix only) ≤ IQ2_S + imatrix at matched bpw "
           "(mainline's stock rows' lower hull at S3D8's bpw)", matched_bpw=True),
)


def find(rows: list[dict[str, Any]], project: str, qtype: str) -> dict[str, Any] | None:
    """The stock row of a project's type (not an S3D8 row), measured."""
    return next((r for r in rows if r["project"] == project and r["qtype"] == qtype and not r.get("group")
                 and not r["error"] and not math.isnan(r["kld"])), None)


def stock_hull(rows: list[dict[str, Any]], project: str = "mainline") -> list[tuple[float, float]]:
    """The lower convex hull of a project's measured stock rows in (bpw, KLD), by increasing bpw: what mixing
    that project's types tensor by tensor reaches at each size, to a linear estimate."""
    pts = sorted({(r["variant_bpw"], r["kld"]) for r in rows if r["project"] == project and not r.get("group")
                  and not r["error"] and not math.isnan(r["kld"])})
    hull: list[tuple[float, float]] = []
    for p in pts:
        if hull and p[0] == hull[-1][0]:
            continue  # the same size twice: the first (lower KLD) stays
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (p[1] - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])) <= 0:
            hull.pop()
        hull.append(p)
    return hull


def matched_anchor(rows: list[dict[str, Any]], anchor: dict[str, Any], bpw: float) -> dict[str, Any]:
    """The anchor at ``bpw``: the anchor itself when it spends as many bits or more; else the stock hull
    (``stock_hull`` of the anchor's project) interpolated linearly at ``bpw``, never above the anchor's own KLD
    (``bpw`` beyond the hull's last point: that point's KLD, and ``extrapolated``)."""
    if bpw <= anchor["variant_bpw"] + 1e-3:
        return {"kld": anchor["kld"], "bpw": anchor["variant_bpw"], "how": "measured"}
    hull = stock_hull(rows, anchor["project"])
    for (b0, k0), (b1, k1) in zip(hull, hull[1:]):
        if b0 <= bpw <= b1:
            kld = k0 + (k1 - k0) * (bpw - b0) / (b1 - b0)
            return {"kld": min(kld, anchor["kld"]), "bpw": bpw, "how": f"between {b0:.4f} and {b1:.4f} bpw"}
    last = hull[-1] if hull else (anchor["variant_bpw"], anchor["kld"])
    return {"kld": min(last[1], anchor["kld"]), "bpw": bpw, "how": "extrapolated"}


def group_summaries(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each S3D8 row's worst case (``variants.worst_case``) with its label, by S3D8_ROWS key, in row order."""
    out = {}
    for key, group in s3d8_groups(rows).items():
        summary = worst_case(group)
        summary["label"] = S3D8_ROWS[key].label if key in S3D8_ROWS else key
        summary["rows"] = group
        out[key] = summary
    return out


def display_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The main table's rows: every stock and extra row, and one per S3D8 row, its worst variant (``worst_of``
    names it and how many variants there were; ``incomplete`` when one failed); a row whose variants all failed
    shows the first failure."""
    out = [r for r in rows if not r.get("group")]
    for s in group_summaries(rows).values():
        if s["worst"] is None:
            first = s["rows"][0]
            out.append(dict(first, variant="", worst_of=""))
            continue
        w = s["worst"]
        out.append(dict(w, worst_of=(f"worst of {s['n']}: {w['variant']}" if s["n"] > 1 else "")
                        + ("" if s["complete"] else ", incomplete")))
    return out


def identical_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per set of files with the same bytes (measured once)."""
    lines = []
    for g in identical_groups(rows):
        names = [f"{r['label']}" + (f" ({r['variant']})" if r.get("variant") else "") for r in g]
        if len({r.get("sha256") for r in g}) == 1:
            lines.append(f"- Same bytes, measured once: {', '.join(names)}")
        else:
            lines.append(f"- Same tensors, measured once (the files differ only in their metadata, e.g. "
                         f"`quantize.imatrix.file`, the imatrix file's name): {', '.join(names)}")
    return lines


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def evaluate(target: Target, models: list[dict[str, Any]]) -> dict[str, Any]:
    """A target over every model: per model the S3D8 worst case, the anchor, their ratio and whether it holds;
    ``passed`` True / False, or None when some model lacks a complete worst case or the anchor."""
    per_model, verdicts = [], []
    for mod in models:
        s = group_summaries(mod["rows"]).get(target.group)
        a = find(mod["rows"], *target.anchor)
        entry: dict[str, Any] = {"model": mod["title"], "s3d8": None, "anchor": None}
        if s and s["worst"] is not None:
            entry["s3d8"] = {"kld": s["worst"]["kld"], "bpw": s["worst"]["variant_bpw"],
                             "variant": s["worst"]["variant"], "complete": s["complete"]}
        if a:
            entry["anchor"] = {"kld": a["kld"], "bpw": a["variant_bpw"]}
            if target.matched_bpw and entry["s3d8"]:
                entry["anchor"]["matched"] = matched_anchor(mod["rows"], a, entry["s3d8"]["bpw"])
        if entry["s3d8"] and entry["anchor"] and entry["s3d8"]["complete"]:
            held = entry["anchor"].get("matched", entry["anchor"])
            entry["ratio"] = ratio(entry["s3d8"]["kld"], held["kld"])
            entry["passed"] = entry["s3d8"]["kld"] <= target.factor * held["kld"]
        else:
            entry["passed"] = None
        verdicts.append(entry["passed"])
        per_model.append(entry)
    passed = None if not verdicts or any(v is None for v in verdicts) else all(verdicts)
    return {"target": target.text, "goal": target.goal, "passed": passed, "models": per_model,
            "matched_bpw": target.matched_bpw}


def target_lines(models: list[dict[str, Any]]) -> list[str]:
    """The pass/fail line of each target, with every model's numbers."""
    lines = []
    for t in TARGETS:
        e = evaluate(t, models)
        verdict = {True: "PASS", False: "FAIL", None: "NOT DETERMINED"}[e["passed"]]
        parts = []
        for m in e["models"]:
            if not m["s3d8"] or not m["anchor"]:
                parts.append(f"{m['model']}: not measured")
                continue
            s, a = m["s3d8"], m["anchor"]
            text = (f"{m['model']}: {s['kld']:.4f} (worst: {s['variant']}) vs "
                    + (f"{t.factor:g} × {a['kld']:.4f} = {t.factor * a['kld']:.4f}" if t.factor != 1 else
                       f"{a['kld']:.4f}")
                    + f", {ratio(s['kld'], a['kld']):.2f}× at {s['bpw']:.4f} vs {a['bpw']:.4f} bpw")
            mt = a.get("matched")
            interpolated = bool(mt) and mt["how"] != "measured"
            if not s["complete"]:
                text += " (a variant failed: no worst case)"
            elif m["passed"] is not None and not interpolated:
                text += " (holds)" if m["passed"] else " (does not hold)"
            if interpolated:
                text += (f"; at matched bits ({s['bpw']:.4f} bpw, mainline's stock hull {mt['how']}"
                         f"{'' if mt['how'] != 'extrapolated' else ' beyond its last point'}): {mt['kld']:.4f}, "
                         f"{ratio(s['kld'], mt['kld']):.2f}×")
                if m["passed"] is not None:
                    text += " (holds)" if m["passed"] else " (does not hold)"
            parts.append(text)
        lines.append(f"- **{verdict}**{' (goal)' if t.goal else ''}: {t.text}: " + "; ".join(parts))
    return lines


def ratio_table(rows: list[dict[str, Any]]) -> list[str]:
    """Each S3D8 row's worst case divided by each anchor's KLD (the anchors' bpw in the header)."""
    anchors: list[tuple[str, dict[str, Any]]] = []
    for p, q, name in ANCHORS:
        a = find(rows, p, q)
        if a:
            anchors.append((name, a))
    summaries = group_summaries(rows)
    if not summaries or not anchors:
        return []
    head = ("| S3D8 row (worst case) | bpw | KLD | "
            + " | ".join(f"÷ {n} ({a['kld']:.4f} at {a['variant_bpw']:.4f} bpw)" for n, a in anchors) + " |")
    out = [head, "|---|---:|---:|" + "---:|" * len(anchors)]
    for s in summaries.values():
        w = s["worst"]
        if w is None:
            out.append(f"| {s['label']} | – | failed |" + " – |" * len(anchors))
            continue
        cells = " | ".join(f"{ratio(w['kld'], a['kld']):.2f}×" for _, a in anchors)
        note = "" if s["complete"] else " (incomplete)"
        out.append(f"| {s['label']}{note} | {w['variant_bpw']:.4f} | {w['kld']:.4f} | {cells} |")
    return out


def variant_table(rows: list[dict[str, Any]], variants: list[str]) -> list[str]:
    """Each S3D8 row's KLD per variant, the worst and the spread."""
    summaries = group_summaries(rows)
    if not summaries:
        return []
    out = ["| S3D8 row | bpw | " + " | ".join(f"KLD `{v}`" for v in variants) + " | worst | best → worst |",
           "|---|---:|" + "---:|" * len(variants) + "---:|---:|"]
    for s in summaries.values():
        w, b = s["worst"], s["best"]
        bpw = f"{w['variant_bpw']:.4f}" if w else "–"
        cells = []
        for v in variants:
            r = next((r for r in s["rows"] if r.get("variant") == v), None)
            if r is None:
                cells.append("–")
            elif r["error"]:
                cells.append("failed")
            else:
                cells.append(f"{r['kld']:.4f}")
        if s["n"] == 1 and not s["rows"][0].get("variant"):  # made once (no imatrix variants)
            r = s["rows"][0]
            cells = ["–"] * len(variants)
            worst = "failed" if r["error"] else f"{r['kld']:.4f} (one file)"
            spread = "–"
        else:
            worst = (f"**{w['kld']:.4f}** ({w['variant']})" + ("" if s["complete"] else ", incomplete")) if w else "failed"
            spread = f"{b['kld']:.4f} → {w['kld']:.4f}" if w and b else "–"
        out.append(f"| {s['label']} | {bpw} | " + " | ".join(cells) + f" | {worst} | {spread} |")
    return out
