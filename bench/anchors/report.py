"""The rounds' table: per (group, system, unit) each round's value and its ratios to the baselines of the same round,
min / median / max, the ratios' median (min-max), targets and verdicts."""

from __future__ import annotations

import re
from typing import Any

from bench.anchors.common import median

TARGETS = {"train": {"mtpipe fp32": 1.5, "mtpipe bf16": 3.0}, "data": {"mtpipe bpe+bucket": 3.0}}


def side_by_side(system: str) -> int:
    """Processes (mtpipe, "..., N processes") or replicas (CTranslate2, "..., N replicas") of a decoding row."""
    m = re.search(r", (\d+) (?:processes|replicas)$", system)
    return int(m[1]) if m else 1


def summarise(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for g in (g for g in rounds[0] if g != "started"):
        part = g.split()[0]
        for system in rounds[0][g]:
            base = {"train": [("fairseq", "fairseq fp32")], "data": [("fairseq", "fairseq-preprocess")],
                    "decode": [("fairseq", "fairseq fp32"), ("ct2 fp32", "CTranslate2 float32")]}.get(part, [])
            n = side_by_side(system)
            if part == "decode" and n > 1 and system.startswith("mtpipe"):  # decode.processes: against replicas too
                base.append((f"ct2 fp32, {n} replicas", f"CTranslate2 float32, {n} replicas"))
            units = [("tgt tok/s", "tgt_tok_s"), ("sent/s", "sent_s")] if part == "decode" else [
                ({"machine": "GFLOP/s", "data": "s (wall)"}.get(part, "src+tgt tok/s"), "value")]
            for unit, key in units:
                vals = [rd[g][system][key] for rd in rounds]
                ratios = {label: [(rd[g][ref][key] / rd[g][system][key]) if part == "data"  # times: fairseq / mtpipe
                                  else rd[g][system][key] / rd[g][ref][key] for rd in rounds]
                          for label, ref in base if ref != system and ref in rounds[0][g]}
                target = TARGETS.get(part, {}).get(system)
                rows.append({"group": g, "system": system, "unit": unit, "values": vals, "median": median(vals),
                             "min": min(vals), "max": max(vals), "ratios": ratios, "target": target,
                             "median_ratios": {k: median(v) for k, v in ratios.items()},
                             **({"pass": median(ratios["fairseq"]) >= target} if target and "fairseq" in ratios
                                else {})})
    return rows


def fmt_num(x: float) -> str:
    return "nan" if x != x else f"{x:,.0f}" if abs(x) >= 100 else f"{x:,.1f}" if abs(x) >= 10 else f"{x:.2f}"


def table_rows(rows: list[dict[str, Any]], n_rounds: int) -> tuple[list[str], list[list[str]]]:
    header = ["part", "system", "unit", *[f"round {i + 1}" for i in range(n_rounds)], "min / median / max",
              "ratio: median (min-max)", "target"]
    out = []
    for row in rows:
        per = [fmt_num(v) + (" (" + ", ".join(f"{r[i]:.2f}x {k}" for k, r in row["ratios"].items()) + ")"
                             if row["ratios"] else "") for i, v in enumerate(row["values"])]
        ratio = ", ".join(f"{median(r):.2f}x {k} ({min(r):.2f}-{max(r):.2f})" for k, r in row["ratios"].items())
        verdict = "" if "pass" not in row else f">= {row['target']:g}x fairseq: " + (
            "pass" if row["pass"] else "MISSED")
        out.append([row["group"], row["system"], row["unit"], *per,
                    " / ".join(fmt_num(row[k]) for k in ("min", "median", "max")), ratio, verdict])
    return header, out


def decode_verdict(rows: list[dict[str, Any]], rounds: list[dict[str, Any]]) -> str:
    """The decoding targets per model, on target tokens/s: mtpipe fp32 (and compiled, and in N processes against N
    replicas) >= 1.0x CTranslate2 fp32; mtpipe's best mode >= 1.0x CTranslate2's best (each side's fastest in that
    round); mtpipe's best in one process >= 3x fairseq (which decodes in one)."""
    def ok(x: float, target: float) -> str:
        return f"{x:.2f}x (>= {target:g}x: {'pass' if x >= target else 'MISSED'})"

    lines = []
    for g in sorted({r["group"] for r in rows if r["group"].startswith("decode")}):
        mine = {r["system"]: r for r in rows if r["group"] == g and r["unit"] == "tgt tok/s"}
        if "mtpipe fp32" not in mine:
            continue
        parts = [f"{g}: mtpipe fp32 = {ok(mine['mtpipe fp32']['median_ratios'].get('ct2 fp32', float('nan')), 1)} "
                 "CTranslate2 fp32"]
        for s, r in mine.items():
            if s.split(",")[0] in ("mtpipe fp32 compiled", "mtpipe fp32") and s != "mtpipe fp32":
                n = side_by_side(s)
                ref = f"ct2 fp32, {n} replicas" if n > 1 else "ct2 fp32"
                parts.append(f"{s} = {ok(r['median_ratios'].get(ref, float('nan')), 1)} {ref}")
        best = [max(v["tgt_tok_s"] for k, v in rd[g].items() if k.startswith("mtpipe"))
                / max(v["tgt_tok_s"] for k, v in rd[g].items() if k.startswith("CTranslate2")) for rd in rounds]
        parts.append(f"best mode vs best mode (processes / replicas counted) = {ok(median(best), 1)}")
        if all("fairseq fp32" in rd[g] for rd in rounds):
            fs = [max(v["tgt_tok_s"] for k, v in rd[g].items() if k.startswith("mtpipe") and side_by_side(k) == 1)
                  / rd[g]["fairseq fp32"]["tgt_tok_s"] for rd in rounds]
            parts.append(f"best in one process vs fairseq = {ok(median(fs), 3)}")
        lines.append("; ".join(parts))
    return "\n".join(lines)


def print_rounds(title: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The table and the verdicts on the console; returns the summary rows."""
    from rich.console import Console
    from rich.table import Table

    rows = summarise(result["rounds"])
    header, body = table_rows(rows, len(result["rounds"]))
    t = Table(title=title, title_justify="left")
    for i, h in enumerate(header):
        t.add_column(h, justify="left" if i < 3 else "right")
    for b in body:
        t.add_row(*b)
    con = Console(stderr=True, width=max(200, Console(stderr=True).width), highlight=False)
    con.print(t)
    if verdict := decode_verdict(rows, result["rounds"]):
        con.print(verdict)
    return rows
