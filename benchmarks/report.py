#!/usr/bin/env python3
"""Turns a benchmark's JSON (benchmarks/harness.py) into a table, a plot and its RESULTS.md section; every
script calls :func:`write` on rank 0, and ``python benchmarks/report.py <stem>.json [--results-md ...]`` redoes
a kept JSON's. As torch.utils.benchmark's Compare, a row per case, a column per implementation (median,
p10-p90), then the ratios of medians, the paired differences and the extra figures."""

import argparse
import json
import os
import sys
import textwrap
from typing import Any, Dict, List


def num(v: Any, signed: bool = False) -> str:
    if isinstance(v, str) or v is None:
        return "-" if v is None else v
    text = f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return ("+" + text) if signed and v >= 0 else text


def markdown(table: Dict[str, Any]) -> List[str]:
    rows, unit, impls, ratios = table["rows"], table["unit"], table["impls"], table["ratios"]
    case_keys = list(dict.fromkeys(k for r in rows for k in r["case"]))
    paired = [f"{a} - {b}" for a, b in table["paired"]]
    extra = list(dict.fromkeys(k for r in rows for k in r["extra"]))
    head = (case_keys + [f"{i} {unit}" for i in impls] + [f"{a} / {b}" for a, b in ratios]
            + [f"{p} {unit} (paired)" for p in paired] + extra)
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join(":---" if i < len(case_keys) else "---:" for i in range(len(head))) + "|"]
    for r in rows:
        st = r["stats"]
        cells = [str(r["case"].get(k, "")) for k in case_keys]
        cells += [f"{num(st[i]['median'])} ({num(st[i]['p10'])}-{num(st[i]['p90'])})" if i in st else "-"
                  for i in impls]
        cells += [f"{st[a]['median'] / st[b]['median']:.3g}" if a in st and b in st else "-" for a, b in ratios]
        cells += [num(r["paired"][p]["median"], signed=True) if p in r["paired"] else "-" for p in paired]
        lines.append("| " + " | ".join(cells + [num(r["extra"].get(k)) for k in extra]) + " |")
    return lines


def tables_text(data: Dict[str, Any]) -> List[str]:
    return [line for t in data["tables"]
            for line in ([f"### {t['title']}", ""] if t["title"] else []) + markdown(t) + [""]]


def section(data: Dict[str, Any], png: bool) -> List[str]:
    m, stem = data["machine"], data["stem"]
    return [
        f"## {data['title']}", "", f"Command: `{data['command']}`", "",
        f"Machine: {m['cpu_model']}, {m['cpus_usable']} usable cores, torch {m['torch_version']}, "
        f"Python {m['python_version']}, backend {m['backend']}, world size {m['world_size']}, "
        f"{m['threads_per_rank']} intra-op thread(s) per rank. Date: {data['date']}", "", data["about"], "",
        "Method: benchmarks/harness.py (implementations interleaved per repeat, the slowest rank's time per "
        "repeat). Cells: median (p10-p90) over repeats; `a / b`: ratio of medians; `a - b (paired)`: median of "
        "the per-repeat differences.", "",
        *tables_text(data), *[line for note in data.get("notes", []) for line in (note, "")],
        *([f"![{data['title']}]({stem}.png)", ""] if png else []),
        f"Raw figures and per-repeat times: [{stem}.json]({stem}.json)."]


def plot(data: Dict[str, Any], path: str) -> bool:
    """Lines over x (log-log, a panel per ``panel``) for rows with a numeric x, else bars a panel per table.
    False when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report: matplotlib is not installed, no plot", file=sys.stderr)
        return False
    panels = []
    for t in data["tables"]:
        by_x = all(r["x"] is not None for r in t["rows"])
        for name in dict.fromkeys(r["panel"] for r in t["rows"]) if by_x else [t["title"]]:
            panels.append((t, name, [r for r in t["rows"] if not by_x or r["panel"] == name]))
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 4 * nrows), squeeze=False)
    for ax, (t, name, rows) in zip(axes.flat, panels):
        impls, lines = [i for i in t["impls"] if any(i in r["stats"] for r in rows)], rows[0]["x"] is not None
        for k, impl in enumerate(impls):
            have = [r for r in rows if impl in r["stats"]]
            med = [r["stats"][impl]["median"] for r in have]
            err = [[m - r["stats"][impl]["p10"] for m, r in zip(med, have)],
                   [r["stats"][impl]["p90"] - m for m, r in zip(med, have)]]
            if lines:
                ax.errorbar([r["x"] for r in have], med, yerr=err, marker="o", ms=3, capsize=2, label=impl)
            else:
                width = 0.8 / len(impls)
                xs = [rows.index(r) + (k - (len(impls) - 1) / 2) * width for r in have]
                ax.bar(xs, med, width, yerr=err, capsize=2, label=impl)
        if lines:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("size, bytes", fontsize=8)
        else:
            labels = [" ".join(map(str, r["case"].values())) for r in rows]
            tilt = max(map(len, labels)) * len(labels) > 60  # more than a panel's width holds flat
            ax.set_xticks(range(len(rows)), [textwrap.fill(label, 24) for label in labels], fontsize=7,
                          rotation=30 if tilt else 0, ha="right" if tilt else "center")
        ax.set_title(name, fontsize=9)
        ax.set_ylabel(f"{t['unit']}, median (p10-p90)", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    m = data["machine"]
    title = textwrap.fill(data["title"], 13 * 5 * ncols)  # about 13 characters an inch at this size
    fig.suptitle(f"{title}\n{m['backend']}, world size {m['world_size']}, {m['cpu_model']}, "
                 f"torch {m['torch_version']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)  # small: plots are kept in git and shown in RESULTS.md, then quantized to 256 colours
    plt.close(fig)
    try:
        from PIL import Image
        Image.open(path).convert("RGB").quantize(colors=256).save(path, optimize=True)
    except ImportError:
        pass
    return True


def update_results_md(path: str, tag: str, lines: List[str]) -> None:
    """Replace the text between the tag's markers, or append it; everything else is kept."""
    begin, end = f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"
    text = open(path).read() if os.path.exists(path) else "# torch_tp benchmark results\n"
    block, i = "\n".join([begin, *lines, end]), text.find(begin)
    j = text.find(end, i) if i >= 0 else -1
    if i >= 0 and j < 0:  # a begin marker with no end: refuse to guess what to cut
        raise RuntimeError(f"{path}: {begin} without {end}; fix the file by hand")
    text = text[:i] + block + text[j + len(end):] if i >= 0 else text.rstrip("\n") + "\n\n" + block + "\n"
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write(json_path: str, results_md: str = None) -> None:
    """Print the tables, write the plot beside the JSON and, given ``results_md``, its section there."""
    with open(json_path) as f:
        data = json.load(f)
    print("\n".join(["", *tables_text(data), *data.get("notes", [])]))
    png = plot(data, os.path.splitext(json_path)[0] + ".png")
    if results_md:
        update_results_md(results_md, data["tag"], section(data, png))
    print(f"[{data['benchmark']}] {data['elapsed_s']:.1f} s; wrote {json_path}" + (f", {results_md}" if results_md
                                                                                   else ""), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Print a benchmark JSON's tables, redo its plot and, with "
                                "--results-md, its RESULTS.md section.")
    p.add_argument("json", help="a JSON written by a benchmarks/bench_*.py script")
    p.add_argument("--results-md", help="the RESULTS.md whose section to rewrite")
    a = p.parse_args()
    write(a.json, a.results_md)
