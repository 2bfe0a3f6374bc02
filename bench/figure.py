"""The README's figure, from the benchmarks' JSON: stored size and save/load seconds of S4 against
torch.save, ZipNN, nvCOMP and DCP's FileSystemWriter.

    python bench/figure.py OUT/gpu.json OUT/dcp.json OUT/cpu_speed.json [-o docs/results.svg]

Takes the JSON that ``bench/gpu.py``, ``bench/dcp.py`` (on CUDA) and ``bench/cpu_speed.py``
write to $OUT; a file that is missing leaves its bars out. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

Bars = list[tuple[str, dict[str, float]]]  # (group label, {series: value})
S4, PEER = "S4", "peer"


def by_benchmark(paths: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for p in paths:
        doc = json.loads(Path(p).read_text())
        out[doc["benchmark"]] = doc
    return out


def gpu_rows(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["case"], r["codec"]): r for r in doc["results"]}


def sizes(docs: dict[str, dict[str, Any]]) -> Bars:
    """Stored / raw per data set: S4 against the peer measured beside it."""
    bars: Bars = []
    if "cpu_speed" in docs:
        for name, label in (("fp32", "MiniLM fp32"), ("bf16", "MiniLM bf16"),
                            ("trained", "training state")):
            r = docs["cpu_speed"]["results"].get(name)
            if r and "ZipNN" in r["stored_bytes"]:
                raw = r["raw_bytes"]
                bars.append((f"{label}\nvs ZipNN (CPU)", {
                    S4: r["stored_bytes"]["s4"] / raw, PEER: r["stored_bytes"]["ZipNN"] / raw}))
    if "gpu" in docs:
        rows = gpu_rows(docs["gpu"])
        for case, label in (("(a) 1 GiB bf16", "1 GiB bf16"), ("(b) training state",
                                                               "training state")):
            s4, ans = rows.get((case, "s4 d2d")), rows.get((case, "nvcomp ANS"))
            if s4 and ans:
                bars.append((f"{label}\nvs nvCOMP ANS (H200)",
                             {S4: s4["ratio"], PEER: ans["ratio"]}))
    if "dcp" in docs:
        for case in ("fp32", "bf16"):
            rows = {r["writer"]: r for r in docs["dcp"]["results"]["rows"] if r["case"] == case}
            if "S4StorageWriter" in rows and "FileSystemWriter" in rows:
                raw = sum(rows["S4StorageWriter"]["raw"].values())
                bars.append((f"DCP {case} + AdamW\nvs FileSystemWriter", {
                    S4: rows["S4StorageWriter"]["total"] / raw,
                    PEER: rows["FileSystemWriter"]["total"] / raw}))
    return bars


def seconds(docs: dict[str, dict[str, Any]]) -> Bars:
    """Save and load seconds: S4 against torch or DCP's FileSystemWriter in the same run."""
    bars: Bars = []
    if "gpu" in docs:
        rows = gpu_rows(docs["gpu"])
        s4, pt = rows.get(("(c) end to end", "s4weights disk")), \
            rows.get(("(c) end to end", "torch disk"))
        if s4 and pt:
            for k in ("save", "load"):
                bars.append((f"H200 1.88 GB {k}\nvs torch (disk)",
                             {S4: s4[f"{k}_s"], PEER: pt[f"{k}_s"]}))
    if "dcp" in docs and docs["dcp"]["results"]["device"] == "cuda":
        rows = {r["writer"]: r for r in docs["dcp"]["results"]["rows"] if r["case"] == "fp32"}
        if "S4StorageWriter" in rows and "FileSystemWriter" in rows:
            for k in ("save", "load"):
                bars.append((f"H200 DCP {k}\nvs FileSystemWriter", {
                    S4: rows["S4StorageWriter"][k], PEER: rows["FileSystemWriter"][k]}))
    if "cpu_speed" in docs:
        r = docs["cpu_speed"]["results"].get("trained")
        if r:
            for k, peer in (("save", "torch.save"), ("load", "torch.load")):
                bars.append((f"CPU training state {k}\nvs torch (memory)", {
                    S4: r["rows"][f"s4 {k}, memory"]["wall"],
                    PEER: r["rows"][f"{peer}, memory"]["wall"]}))
    return bars


def panel(ax, bars: Bars, xlabel: str) -> None:
    labels = [label for label, _ in bars]
    ys = range(len(bars))
    h = 0.38
    ax.barh([y - h / 2 for y in ys], [v[S4] for _, v in bars], h, label="S4", color="#2a6f97")
    ax.barh([y + h / 2 for y in ys], [v[PEER] for _, v in bars], h, label="peer (named)",
            color="#bbbbbb")
    for y, (_, v) in zip(ys, bars):
        for dy, key in ((-h / 2, S4), (h / 2, PEER)):
            ax.text(v[key], y + dy, f" {v[key]:.2f}", va="center", fontsize=7)
    ax.set_yticks(list(ys), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlim(0, 1.15 * max(max(v.values()) for _, v in bars))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="benchmark JSON files ($OUT/<name>.json)")
    ap.add_argument("-o", "--output", default="docs/results.svg")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = by_benchmark(args.json)
    size_bars, time_bars = sizes(docs), seconds(docs)
    if not size_bars or not time_bars:
        raise SystemExit("no bars: pass gpu.json, dcp.json or cpu_speed.json")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 0.45 * max(len(size_bars),
                                                                  len(time_bars)) + 1.2))
    panel(left, size_bars, "stored / raw (lower is better)")
    panel(right, time_bars, "seconds (lower is better)")
    dates = sorted({d["date"] for d in docs.values()})
    fig.suptitle("S4 against its peers, measured " + ", ".join(dates), fontsize=9)
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    # A fixed hash salt and no date in the file keep the SVG the same for the same figures.
    matplotlib.rcParams["svg.hashsalt"] = "s4weights"
    fig.savefig(args.output, metadata={"Date": None})
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
