"""Rendering a benchmark result: a terminal table and a PNG plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def _fmt(value: Any, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return f"{value:.{digits}f}{suffix}"


def render_table(report: dict[str, Any], console: Console) -> None:
    modes = report["modes"]
    table = Table(title="specdraft bench — all modes in one process, interleaved", title_justify="left")
    columns = ("mode", "tok/s", "vs ar", "vs hf-ar", "vs hf-pld", "τ", "accept", "draft c", "identical to ar")
    for col in columns:
        table.add_column(col, justify="left" if col == "mode" else "right")
    for mode, m in modes.items():
        same = f"{m['outputs_identical_to_ar']}/{m['outputs']}"
        table.add_row(
            mode,
            _fmt(m["tokens_per_second"], 1),
            _fmt(m["speedup_vs_ar"], 2, "×"),
            _fmt(m.get("speedup_vs_hf-ar"), 2, "×"),
            _fmt(m.get("speedup_vs_hf-pld"), 2, "×"),
            _fmt(m["tau"], 2),
            _fmt(m["acceptance_rate"], 2),
            _fmt(m.get("draft_cost"), 3),
            ("yes " if m["identical_to_ar"] else "NO ") + same,
        )
    console.print(table)

    categories = sorted({c for m in modes.values() for c in m["per_category"]})
    per_cat = Table(title="per category: tok/s (speed-up vs ar, τ)", title_justify="left")
    per_cat.add_column("mode")
    for cat in categories:
        per_cat.add_column(cat, justify="right")
    for mode, m in modes.items():
        cells = []
        for cat in categories:
            c = m["per_category"].get(cat)
            cells.append(
                "–"
                if c is None
                else f"{c['tokens_per_second']:.1f} ({_fmt(c['speedup_vs_ar'])}×, {_fmt(c['tau'])})"
            )
        per_cat.add_row(mode, *cells)
    console.print(per_cat)
    for mode, m in modes.items():
        by_source = m.get("accepted_by_source")
        if by_source:
            parts = [
                f"{source} {v['tokens']} ({_fmt(v['share'], 2)} of accepted,"
                f" {_fmt(v['per_forward'], 2)} a forward)"
                for source, v in by_source.items()
            ]
            console.print(f"{mode}: accepted draft tokens by source: " + "; ".join(parts))
    latency = report.get("datastore_latency_ms")
    if latency:
        parts = [
            f"{kind} {v['calls']} calls, p50 {v['p50_ms']:.2f} / p90 {v['p90_ms']:.2f}"
            f" / p99 {v['p99_ms']:.2f} ms"
            for kind, v in latency.items()
            if kind != "where"
        ]
        console.print(f"datastore retrieval ({latency['where']}): " + ("; ".join(parts) or "no calls"))
    mach = report["machine"]
    console.print(
        f"machine: {mach['cpu']}, {mach['cores']} cores, "
        f"torch {mach['torch']} ({mach['torch_threads']} threads), "
        f"{mach['dtype']} on {mach['device']}, backend {mach['backend']}; "
        f"verify cost t(n) ms at 512 ctx: {mach['verify_cost_ms_at_512']}"
    )
    if "memory_read_gb_per_s" in mach:
        console.print(f"memory read bandwidth: {mach['memory_read_gb_per_s']} GB/s")
    for dtype, d in mach.get("dtypes", {}).items():
        console.print(
            f"{dtype}: GEMM kernels {d.get('gemm_kernels', '–')}, "
            f"weights {d.get('weight_bytes', 0) / 1e6:.0f} MB "
            f"(read per forward {d.get('weight_bytes_read', d.get('weight_bytes', 0)) / 1e6:.0f} MB: "
            f"limit {_fmt(d.get('read_bandwidth_limit_tokens_per_second'), 1)} tok/s), "
            f"bandwidth limit {_fmt(d.get('bandwidth_limit_tokens_per_second'), 1)} tok/s; ar "
            f"{_fmt(d.get('ar_tokens_per_second'), 1)} tok/s = "
            f"{_fmt(d.get('ar_fraction_of_bandwidth_limit'))} of it "
            f"(decode alone {_fmt(d.get('ar_decode_tokens_per_second'), 1)} tok/s = "
            f"{_fmt(d.get('ar_decode_fraction_of_bandwidth_limit'))})"
        )
    for dtype, c in mach.get("dtype_comparison", {}).items():
        same = next(v for k, v in c.items() if k.startswith("ar_outputs_identical"))
        console.print(f"{dtype} ar identical to {mach['dtype']} ar: {same}/{c['outputs']} outputs")
    render_concurrency(report, console)


def render_concurrency(report: dict[str, Any], console: Console) -> None:
    """The ``--concurrency`` runs: per mode and level, aggregate tokens/s (and × the same mode at
    the lowest level), latency, requests per forward, draft tokens per request step."""
    rows = [
        (mode + label, m[key])
        for mode, m in report["modes"].items()
        for key, label in (("concurrency", ""), ("concurrency_no_prefix_cache", " (no prefix cache)"))
        if key in m
    ]
    if not rows:
        return
    table = Table(title="under load: one batch scheduler, c closed-loop users", title_justify="left")
    columns = (
        "mode",
        "c",
        "agg tok/s",
        "× c=lowest",
        "p50 s",
        "p95 s",
        "ttft p50",
        "batch",
        "draft/step",
        "= ar",
    )
    for col in columns:
        table.add_column(col, justify="left" if col == "mode" else "right")
    for mode, levels in rows:
        first = next(iter(levels.values()))["aggregate_tokens_per_second"]
        for c, f in levels.items():
            agg = f["aggregate_tokens_per_second"]
            table.add_row(
                mode,
                c,
                _fmt(agg, 1),
                _fmt(agg / first if first else None, 2, "×"),
                _fmt(f["latency_p50_seconds"], 2),
                _fmt(f["latency_p95_seconds"], 2),
                _fmt(f["ttft_p50_seconds"], 2),
                _fmt(f["mean_batch_size"], 2),
                _fmt(f["draft_tokens_per_request_step"], 2),
                f"{f['identical_outputs']}/{f['outputs']}",
            )
    console.print(table)


def plot(report: dict[str, Any], path: Path) -> Path:
    """Bar charts of speed-up vs ar and of τ, per mode and category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    modes = [m for m in report["modes"] if m != "ar"]
    categories = [*sorted({c for m in report["modes"].values() for c in m["per_category"]}), "all"]

    def value(mode: str, cat: str, key: str) -> float:
        entry = report["modes"][mode] if cat == "all" else report["modes"][mode]["per_category"].get(cat, {})
        v = entry.get(key)
        return float(v) if v is not None else 0.0

    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.4 * len(categories) * max(1, len(modes)) / 3), 8))
    width = 0.8 / max(1, len(modes))
    x = np.arange(len(categories))
    for ax, key, label in (
        (axes[0], "speedup_vs_ar", "speed-up vs ar"),
        (axes[1], "tau", "τ (tokens / forward)"),
    ):
        for i, mode in enumerate(modes):
            ax.bar(x + i * width, [value(mode, c, key) for c in categories], width, label=mode)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(x + width * (len(modes) - 1) / 2, categories, rotation=15)
        ax.set_ylabel(label)
        ax.legend(fontsize=8, ncols=min(len(modes), 4))
    mach = report["machine"]
    fig.suptitle(
        f"specdraft bench — {mach['model']} ({mach['dtype']}, {mach['device']}, {mach['cores']} cores)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
