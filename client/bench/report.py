"""Rendering a benchmark result for a person: a table that fits any terminal width (columns
fold, never cut), a legend, the machine as plain lines, a warning when other processes loaded
the machine, a one-line headline; and a PNG plot."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from client.bench.runner import reference_of

LEGEND = (
    "tok/s: new tokens per second over the whole run, prefill included",
    "× ar, × hf-ar, × hf-pld: tok/s over that baseline's: ar is our plain decoding; hf-ar and "
    "hf-pld are transformers' generate on the same weights, plain and with prompt lookup",
    "τ: tokens per target forward, the bonus token included (ar: 1.00); accept: accepted ÷ drafted "
    "draft tokens",
    "draft c: what one draft token costs, in target forwards (drafting seconds per draft token ÷ "
    "ar's seconds per token); c/step: what drafting adds to a step, in target forwards (drafting "
    "seconds per target forward ÷ ar's seconds per token)",
    "= ar: outputs token-identical to ar's (MODE@DTYPE: to ar@DTYPE's) of all outputs, NO when one "
    "differs; every mode must have all under greedy decoding; hf-pld may differ in a near-tie",
)
"""What the columns of the main table mean, printed under it."""


def _fmt(value: Any, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return f"{value:.{digits}f}{suffix}"


def _table(title: str, columns: list[str]) -> Table:
    """A table that fits the terminal without cutting a cell: no outer edges, the first column
    (mode names) never wrapped, the other cells wrapped, or a word longer than its column folded,
    instead of being cut with "…" (at 80 columns a header may take two lines)."""
    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    for i, col in enumerate(columns):
        if i == 0:
            table.add_column(col, no_wrap=True)
        else:
            table.add_column(col, justify="right", overflow="fold")
    return table


def stacked(name: str) -> str:
    """A hyphenated name one part a line, for a narrow header: "short-text-editing" →
    "short-\\ntext-\\nediting"."""
    return name.replace("-", "-\n")


def headline(report: Mapping[str, Any]) -> str:
    """The run in one line: the fastest engine mode against ``ar``, and whether every output was
    ``ar``'s. Examples: "best: pld 1.14× ar on 5 prompts; all 6/6 outputs of every mode identical
    to ar"; "best: pld+h 1.31× ar on 5 prompts; OUTPUTS DIFFER from ar: rest 5/6 identical".
    ``hf-*`` baselines never count as best; their differences are noted apart (transformers' own
    decoding)."""
    modes = report["modes"]
    prompts = report["config"]["questions"]
    engine = {n: m for n, m in modes.items() if not n.startswith("hf-")}
    drafting = {n: m for n, m in engine.items() if reference_of(n) != n and m["speedup_vs_ar"] is not None}
    if drafting:
        best = max(drafting, key=lambda n: drafting[n]["speedup_vs_ar"])
        line = (
            f"best: {best} {drafting[best]['speedup_vs_ar']:.2f}× {reference_of(best)} on {prompts} prompts"
        )
    else:
        line = f"ar alone: {modes['ar']['tokens_per_second']:.1f} tok/s on {prompts} prompts"
    differ = [n for n, m in engine.items() if not m["identical_to_ar"]]
    if differ:
        parts = [
            f"{n} {engine[n]['outputs_identical_to_ar']}/{engine[n]['outputs']} identical" for n in differ
        ]
        line += "; OUTPUTS DIFFER from ar: " + ", ".join(parts)
    else:
        outputs = modes["ar"]["outputs"]
        line += f"; all {outputs}/{outputs} outputs of every mode identical to ar"
    baselines = [n for n, m in modes.items() if n.startswith("hf-") and not m["identical_to_ar"]]
    if baselines:
        parts = [f"{n} {modes[n]['outputs_identical_to_ar']}/{modes[n]['outputs']}" for n in baselines]
        line += f" ({', '.join(parts)} identical: transformers' own decoding)"
    return line


def load_warning(report: Mapping[str, Any]) -> str | None:
    """A warning when the 1-minute load average passed the core count while the bench ran
    (``machine.load_average``: sampled at the start, between modes and at the end), else None.

    Example: max 3.4 on 2 cores → "warning: the 1-minute load average reached 3.40 on 2 cores
    during the run: other processes wanted these CPUs too, so tokens/s and the ratios between
    modes may be unreliable; rerun on a quiet machine".
    """
    load = report["machine"].get("load_average")
    if not load or load["max"] is None or load["max"] <= load["cores"]:
        return None
    return (
        f"warning: the 1-minute load average reached {load['max']:.2f} on {load['cores']} cores during "
        "the run: other processes wanted these CPUs too, so tokens/s and the ratios between modes may "
        "be unreliable; rerun on a quiet machine"
    )


def cost_curve_line(curve_ms: Mapping[str, float]) -> str:
    """The verify cost curve as one short line. Example: {"1": 50.1, "2": 52.0} → "verify cost at
    512 tokens of context, ms per forward of n rows: n=1 50.1 · 2 52.0"."""
    points = [f"{n} {ms:.1f}" for n, ms in curve_ms.items()]
    if points:
        points[0] = "n=" + points[0]
    return "verify cost at 512 tokens of context, ms per forward of n rows: " + " · ".join(points)


def kernels_line(dtype: str, d: Mapping[str, Any]) -> str:
    """One dtype's forward: GEMM kernels grouped by kernel, fused kernels, weight bytes. Example:
    "float32: GEMM kernels quant:1 (qkv, o, gate_up, down), native (lm_head); fused CPU kernels on;
    weights 538 MB, 112 MB read per forward"."""
    by_kernel: dict[str, list[str]] = {}
    for role, kernel in (d.get("gemm_kernels") or {}).items():
        by_kernel.setdefault(kernel, []).append(role)
    parts = [
        "GEMM kernels " + ", ".join(f"{k} ({', '.join(roles)})" for k, roles in by_kernel.items())
        if by_kernel
        else "torch's own GEMMs"
    ]
    if "fused_kernels" in d:
        parts.append(f"fused CPU kernels {'on' if d['fused_kernels'] else 'off'}")
    if d.get("weight_bytes"):
        weights = f"weights {d['weight_bytes'] / 1e6:.0f} MB"
        if d.get("weight_bytes_read"):
            weights += f", {d['weight_bytes_read'] / 1e6:.0f} MB read per forward"
        parts.append(weights)
    return f"{dtype}: " + "; ".join(parts)


def limit_line(dtype: str, d: Mapping[str, Any]) -> str | None:
    """How close ``ar`` came to the memory-bandwidth limit of one dtype, or None if unknown."""
    limit = d.get("bandwidth_limit_tokens_per_second")
    if limit is None:
        return None
    line = f"{dtype}: bandwidth limit {limit:.1f} tok/s"
    if d.get("read_bandwidth_limit_tokens_per_second"):
        line += f" ({d['read_bandwidth_limit_tokens_per_second']:.1f} for the bytes a forward reads)"
    if d.get("ar_tokens_per_second") is not None:
        fraction = _fmt(d.get("ar_fraction_of_bandwidth_limit"))
        line += f"; ar {d['ar_tokens_per_second']:.1f} tok/s = {fraction} of it"
    if d.get("ar_decode_tokens_per_second") is not None:
        line += (
            f" (decoding alone {d['ar_decode_tokens_per_second']:.1f} tok/s = "
            f"{_fmt(d.get('ar_decode_fraction_of_bandwidth_limit'))})"
        )
    return line


def machine_lines(report: Mapping[str, Any]) -> list[str]:
    """The machine section as plain lines: the CPU, the software, the model, the kernels, the
    bandwidth limits and the cost curve."""
    mach = report["machine"]
    lines = [
        f"machine: {mach['cpu']}, {mach['cores']} cores; torch {mach['torch']} "
        f"({mach['torch_threads']} threads)"
        + (f", transformers {mach['transformers']}" if "transformers" in mach else "")
        + (f", Python {mach['python']}" if "python" in mach else ""),
        f"model: {mach.get('model', '?')}, {mach['dtype']} on {mach['device']}, backend {mach['backend']}",
    ]
    lines += [kernels_line(dtype, d) for dtype, d in mach.get("dtypes", {}).items()]
    if "memory_read_gb_per_s" in mach:
        lines.append(f"memory read bandwidth: {mach['memory_read_gb_per_s']} GB/s")
    lines += [line for dtype, d in mach.get("dtypes", {}).items() if (line := limit_line(dtype, d))]
    if mach.get("verify_cost_ms_at_512"):
        lines.append(cost_curve_line(mach["verify_cost_ms_at_512"]))
    for dtype, c in mach.get("dtype_comparison", {}).items():
        same = next(v for k, v in c.items() if k.startswith("ar_outputs_identical"))
        lines.append(f"{dtype} ar identical to {mach['dtype']} ar: {same}/{c['outputs']} outputs")
    load = mach.get("load_average")
    if load and load["max"] is not None:
        lines.append(
            f"1-minute load average during the run: at most {load['max']:.2f} on {load['cores']} cores"
        )
    return lines


def render_table(report: dict[str, Any], console: Console) -> None:
    """The whole report on ``console``: the main table and its legend, per category, sources,
    retrieval latency, the machine, a load warning if any, and the headline last."""
    modes = report["modes"]
    table = _table(
        "specdraft bench — all modes in one process, interleaved",
        ["mode", "tok/s", "× ar", "× hf-ar", "× hf-pld", "τ", "accept", "draft c", "c/step", "= ar"],
    )
    for mode, m in modes.items():
        table.add_row(
            mode,
            _fmt(m["tokens_per_second"], 1),
            _fmt(m["speedup_vs_ar"], 2, "×"),
            _fmt(m.get("speedup_vs_hf-ar"), 2, "×"),
            _fmt(m.get("speedup_vs_hf-pld"), 2, "×"),
            _fmt(m["tau"], 2),
            _fmt(m["acceptance_rate"], 2),
            _fmt(m.get("draft_cost"), 3),
            _fmt(m.get("draft_cost_per_step"), 3),
            ("" if m["identical_to_ar"] else "NO ") + f"{m['outputs_identical_to_ar']}/{m['outputs']}",
        )
    console.print(table)
    for line in LEGEND:
        console.print(line, style="dim", highlight=False)

    counts = report["config"].get("questions_per_category", {})
    categories = sorted({c for m in modes.values() for c in m["per_category"]})
    per_cat = _table(
        "per category: speed-up vs ar, τ",
        ["mode", *[stacked(cat) + (f"\n({counts[cat]})" if cat in counts else "") for cat in categories]],
    )
    for mode, m in modes.items():
        cells = []
        for cat in categories:
            c = m["per_category"].get(cat)
            cells.append("–" if c is None else f"{_fmt(c['speedup_vs_ar'])}×\nτ {_fmt(c['tau'])}")
        per_cat.add_row(mode, *cells)
    console.print(per_cat)
    if counts:
        console.print("(n): prompts in the category", style="dim", highlight=False)
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
    for line in machine_lines(report):
        console.print(line, highlight=False)
    render_concurrency(report, console)
    warning = load_warning(report)
    if warning:
        console.print(warning, style="bold yellow", highlight=False)
    console.print(headline(report), style="bold", highlight=False)


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
    table = _table(
        "under load: one batch scheduler, c closed-loop users",
        ["mode", "c", "agg tok/s", "× c=lowest", "p50 s", "p95 s", "ttft p50", "batch", "draft/step", "= ar"],
    )
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
    """A PNG of the run: tokens/s per mode (absolute, with a mark for outputs identical to their
    ``ar``), speed-up vs ``ar`` and τ per mode and category (the prompts in each category in its
    label), the headline as the title. matplotlib's Agg backend: no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    modes = report["modes"]
    names = list(modes)
    drafting = [m for m in names if reference_of(m) != m]
    counts = report["config"].get("questions_per_category", {})
    cats = sorted({c for m in modes.values() for c in m["per_category"]})

    def prompts(n: int) -> str:
        return f"({n} prompt{'' if n == 1 else 's'})"

    labels = [f"{c}\n{prompts(counts[c])}" if c in counts else c for c in cats]
    labels.append(f"all\n{prompts(report['config']['questions'])}")

    def value(mode: str, cat: str | None, key: str) -> float:
        entry = modes[mode] if cat is None else modes[mode]["per_category"].get(cat, {})
        v = entry.get(key)
        return float(v) if v is not None else 0.0

    width_in = max(9.0, 0.9 * len(labels) * max(1, len(drafting)) / 2)
    fig, axes = plt.subplots(3, 1, figsize=(width_in, 12))
    tps = [value(m, None, "tokens_per_second") for m in names]
    bars = axes[0].bar(
        names, tps, color=["grey" if m.startswith(("ar", "hf-")) else "tab:blue" for m in names]
    )
    for bar, mode in zip(bars, names, strict=True):
        same = modes[mode]["identical_to_ar"]
        mark = "= ar" if same else f"≠ ar ({modes[mode]['outputs_identical_to_ar']}/{modes[mode]['outputs']})"
        axes[0].annotate(
            mark,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
            color="green" if same else "red",
        )
    axes[0].set_ylabel("tokens/s (absolute)")
    axes[0].tick_params(axis="x", labelrotation=20)
    width = 0.8 / max(1, len(drafting))
    x = np.arange(len(labels))
    for ax, key, label in (
        (axes[1], "speedup_vs_ar", "speed-up vs ar (×)"),
        (axes[2], "tau", "τ (tokens / forward)"),
    ):
        for i, mode in enumerate(drafting):
            heights = [value(mode, c, key) for c in cats] + [value(mode, None, key)]
            ax.bar(x + i * width, heights, width, label=mode)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.margins(y=0.3)  # room for the legend above the bars
        ax.set_xticks(x + width * (len(drafting) - 1) / 2, labels, fontsize=8)
        ax.set_ylabel(label)
        if drafting:
            ax.legend(fontsize=8, ncols=min(len(drafting), 4))
    mach = report["machine"]
    fig.suptitle(
        f"{headline(report)}\n"
        f"{mach.get('model', '')} ({mach['dtype']}, {mach['device']}, {mach['cores']} cores)",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
