#!/usr/bin/env python3
"""Plots of a `sparse-mla bench` result file (JSON).

  python3 bench/plot.py bench/results/<run>.json [--out-dir DIR] [--markdown]

Writes, next to the JSON (or into DIR), PNG files named after it:
  <run>_roofline.png       achieved TFLOP/s against arithmetic intensity, one panel per device,
                           with the device's roofline (ceilings recorded in the JSON) and
                           FlashMLA's published times placed on the same axes
  <run>_<suite>_time.png   time per call against batch size (or context length for dense decode),
                           one panel per configuration, every backend against FlashMLA
Only results that passed the reference check are drawn. --markdown also prints Markdown tables
of the run (what docs/performance.md quotes) to stdout.
"""

import argparse
import json
import math
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BACKEND_STYLE = {
    "sm90": ("tab:red", "o"),
    "cuda": ("tab:blue", "s"),
    "cpu": ("tab:green", "^"),
    "torch": ("tab:purple", "D"),
    "FlashMLA": ("black", "x"),
}
# Which x axis a suite's time plot uses.
SUITE_X = {"model1": "b", "tp": "b", "v32": "b", "dense": "context", "dense_tp": "h_q"}


def style(backend):
    return BACKEND_STYLE.get(backend, ("tab:gray", "."))


def device_of(run, backend):
    """The device entry a backend ran on: the GPU for GPU backends (and torch when a GPU is
    listed), the CPU for the CPU backend."""
    devices = run["devices"]
    gpu = [d for d in devices if d["kind"] == "cuda"]
    cpu = [d for d in devices if d["kind"] == "cpu"]
    if backend == "cpu" or (backend == "torch" and not gpu):
        return cpu[0] if cpu else None
    return gpu[0] if gpu else None


def passed(results):
    return [r for r in results if r["status"] == "ok" and r.get("median_us")]


def roofline(run, out_path):
    cases = [c for c in run["cases"] if c.get("flops")]
    groups = defaultdict(list)  # device name -> [(backend, ai, tflops, case)]
    for c in cases:
        ai = c["flops"] / c["bytes"]
        for r in passed(c["results"]):
            dev = device_of(run, r["backend"])
            if dev is None:
                continue
            groups[dev["name"]].append((r["backend"], ai, c["flops"] / r["median_us"] * 1e-6, c))
    if not groups:
        return None
    devices = {d["name"]: d for d in run["devices"]}
    fig, axes = plt.subplots(1, len(groups), figsize=(7 * len(groups), 5.2), squeeze=False)
    for ax, (name, points) in zip(axes[0], sorted(groups.items())):
        dev = devices[name]
        ceil = dev.get("ceilings") or {}
        ais = [p[1] for p in points]
        lo, hi = min(ais) / 2, max(ais) * 2
        if dev["kind"] == "cuda":  # FlashMLA's times only exist for the GPU
            for c in cases:
                if c.get("flashmla_us"):
                    points.append(("FlashMLA", c["flops"] / c["bytes"],
                                   c["flops"] / c["flashmla_us"] * 1e-6, c))
        if ceil.get("gbps") and ceil.get("bf16_tflops"):
            xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
            bw = ceil["gbps"] * 1e-3  # TB/s
            ax.plot(xs, [min(ceil["bf16_tflops"], x * bw) for x in xs], color="gray", lw=1.5,
                    label=f"roofline {ceil['bf16_tflops']:.3g} TFLOP/s, {ceil['gbps']:.3g} GB/s")
            if ceil.get("fp8_tflops"):
                ax.plot(xs, [min(ceil["fp8_tflops"], x * bw) for x in xs], color="gray", lw=1,
                        ls="--", label=f"fp8 tensor cores {ceil['fp8_tflops']:.3g} TFLOP/s")
        for backend in sorted({p[0] for p in points}):
            sel = [p for p in points if p[0] == backend]
            color, marker = style(backend)
            ax.scatter([p[1] for p in sel], [p[2] for p in sel], c=color, marker=marker, s=22,
                       label=f"{backend} ({len(sel)})", alpha=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP / byte, targets.md counting)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{name}\n{dev.get('detail', '')}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"sparse-mla bench {run['run']['commit']} {run['run']['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def time_plot(run, suite, out_path):
    key = SUITE_X.get(suite)
    cases = [c for c in run["cases"] if c["suite"] == suite]
    if not key or not cases:
        return None

    def x_of(c):
        return c["seqlens"][0] if key == "context" else c[key]

    configs = list(dict.fromkeys(c["config"] for c in cases))  # in the order of the suite
    n = len(configs)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(4.2 * cols, 7), 3.4 * rows + 0.6),
                             squeeze=False)
    drawn = 0
    for ax, config in zip(axes.flat, configs):
        sel = sorted((c for c in cases if c["config"] == config), key=x_of)
        series = defaultdict(list)
        for c in sel:
            for r in passed(c["results"]):
                series[r["backend"]].append((x_of(c), r["median_us"]))
            if c.get("flashmla_us"):
                series["FlashMLA"].append((x_of(c), c["flashmla_us"]))
        for backend, pts in sorted(series.items()):
            color, marker = style(backend)
            label = backend
            if backend == "FlashMLA" and any(c.get("flashmla_note") for c in sel):
                label += " (" + next(c["flashmla_note"] for c in sel if c.get("flashmla_note")) + ")"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, ms=4,
                    lw=1.2, ls="--" if backend == "FlashMLA" else "-", label=label)
            drawn += 1
        ax.set_title(config, fontsize=9)
        ax.set_xlabel({"b": "batch", "context": "s_k (tokens)", "h_q": "h_q"}[key])
        ax.set_ylabel("us per call")
        ax.set_yscale("log")
        if key == "context":
            ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if not drawn:
        plt.close(fig)
        return None
    gpu = [d["name"] for d in run["devices"] if d["kind"] == "cuda"]
    where = gpu[0] if gpu else run["devices"][0]["name"]
    fig.suptitle(f"{suite}: time per call on {where}, commit {run['run']['commit']}\n"
                 f"(FlashMLA: its H200 times quoted in targets.md)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def fmt(v, digits=3):
    if v is None:
        return "-"
    return f"{v:.{digits}g}" if abs(v) < 10 ** digits else f"{v:.0f}"


def compared_us(r):
    """Our time that the FlashMLA ratio used: the kernel span or the event-timed median."""
    return r["span_median_us"] if r.get("speedup_basis") == "kernel span" else r["median_us"]


def markdown(run, source):
    lines = [f"Source: `{source}` ({run['run']['date']}, commit {run['run']['commit']}, "
             f"`{run['run']['command']}`).", ""]
    for d in run["devices"]:
        c = d.get("ceilings") or {}
        lines.append(f"- {d['kind']}: {d['name']} ({d['detail']}); ceilings "
                     f"{fmt(c.get('bf16_tflops'))} TFLOP/s, {fmt(c.get('gbps'))} GB/s "
                     f"({c.get('source', '')})")
    lines.append("")
    # DeepSeek-V4 production grid: time and speedup per (config, batch), per backend.
    prod = [c for c in run["cases"] if c["suite"] == "model1"]
    backends = sorted({r["backend"] for c in prod for r in c["results"]})
    for backend in backends:
        for s_q in (2, 1):
            rows = [c for c in prod if c["s_q"] == s_q]
            if not rows:
                continue
            batches = sorted({c["b"] for c in rows})
            configs = list(dict.fromkeys(c["config"] for c in rows))
            lines.append(f"**{backend}, s_q = {s_q}**: us per call (FlashMLA us, speedup), timed as "
                         "FlashMLA's time was (kernel span or events: each result's speedup_basis)")
            lines.append("")
            lines.append("| config | " + " | ".join(f"b={b}" for b in batches) + " |")
            lines.append("|---|" + "---|" * len(batches))
            for config in configs:
                cells = []
                for b in batches:
                    c = next((c for c in rows if c["config"] == config and c["b"] == b), None)
                    r = next((r for r in (c or {}).get("results", []) if r["backend"] == backend),
                             None)
                    if r is None:
                        cells.append("")
                    elif r["status"] != "ok":
                        cells.append(r["status"].upper())
                    else:
                        extra = f" ({fmt(c['flashmla_us'])}, {r['speedup_vs_flashmla']:.2f}x)" \
                            if r.get("speedup_vs_flashmla") else f" ({fmt(c['flashmla_us'])})"
                        cells.append(fmt(compared_us(r), 4) + extra)
                lines.append(f"| {config.split()[0]} | " + " | ".join(cells) + " |")
            lines.append("")
    # Every result.
    lines.append("| case | backend | us | span us | TFLOP/s | GB/s | roof % | FlashMLA us | speedup "
                 "| check |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for c in run["cases"]:
        for r in c["results"]:
            ok = r["status"] == "ok"
            lines.append(" | ".join([
                f"| {c['name']}", r["backend"], fmt(r["median_us"], 4) if ok else "-",
                fmt(r.get("span_median_us"), 4) if ok else "-",
                fmt(r["tflops"]) if ok else "-", fmt(r["gbps"]) if ok else "-",
                fmt(r["roofline_pct"]) if ok else "-", fmt(c.get("flashmla_us")),
                f"{r['speedup_vs_flashmla']:.2f}x" if r.get("speedup_vs_flashmla") else "-",
                r.get("check", "PASS" if ok else r["status"].upper())]) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description="Plots of a sparse-mla bench JSON file")
    ap.add_argument("json")
    ap.add_argument("--out-dir", help="default: the JSON's directory")
    ap.add_argument("--markdown", action="store_true", help="also print Markdown tables")
    args = ap.parse_args()
    with open(args.json) as f:
        run = json.load(f)
    if run.get("schema") != "sparse-mla-bench/1":
        sys.exit(f"{args.json}: not a sparse-mla bench result (schema {run.get('schema')!r})")
    out_dir = args.out_dir or os.path.dirname(os.path.abspath(args.json))
    stem = os.path.join(out_dir, os.path.splitext(os.path.basename(args.json))[0])
    written = [roofline(run, stem + "_roofline.png")]
    for suite in SUITE_X:
        written.append(time_plot(run, suite, f"{stem}_{suite}_time.png"))
    written = [w for w in written if w]
    if args.markdown:
        print(markdown(run, os.path.relpath(args.json)))
    else:
        for w in written:
            print(w)
    if not written:
        print("nothing to plot: no case passed its check", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
