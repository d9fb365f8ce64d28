"""Tables and figures of ``specdec eval``: report.md, speedup.png, latency.png and acceptance_per_depth.png."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from orchestrator.measure import md_table  # noqa: E402

WORST_SLICES = 3  # report.md lists this many slices with the lowest speedup


def _label(report) -> str:
    return "overall" if report.slice_dimension == "overall" else f"{report.slice_dimension}={report.slice_value}"


def speedup_figure(reports) -> plt.Figure:
    """Horizontal bars of each slice's end-to-end speedup; the dashed line is 1.0 (no gain)."""
    labels = [_label(r) for r in reports]
    fig, ax = plt.subplots(figsize=(7, 0.3 * len(reports) + 1.5))
    ax.barh(labels, [r.speedup for r in reports], color=["tab:green" if r.speedup >= 1 else "tab:red" for r in reports])
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over target-only (end-to-end tokens/s)")
    return fig


def latency_figure(reports) -> plt.Figure:
    """Two panels: TTFT (mean, ms) and p95 end-to-end latency (ms) per slice, target-only vs speculative."""
    labels = [_label(r) for r in reports]
    ys = range(len(reports))
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.3 * len(reports) + 1.5), sharey=True)
    panels = ((axes[0], "TTFT ms", "target_only_first_token_ms", "first_token_ms"),
              (axes[1], "p95 latency ms", "target_only_p95_latency_ms", "p95_latency_ms"))
    for ax, title, target_key, spec_key in panels:
        ax.barh([y - 0.2 for y in ys], [getattr(r, target_key) for r in reports], height=0.4, label="target-only")
        ax.barh([y + 0.2 for y in ys], [getattr(r, spec_key) for r in reports], height=0.4, label="speculative")
        ax.set_title(title)
        ax.set_xlabel("ms")
    axes[0].set_yticks(list(ys), labels)
    axes[0].invert_yaxis()
    axes[1].legend(loc="lower right")
    return fig


def acceptance_figure(reports) -> plt.Figure:
    """Acceptance at tree depth d (accepted at d / rounds that reached d): overall bold, categories thin."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in reports:
        if r.slice_dimension not in ("overall", "category") or not r.acceptance_per_depth:
            continue
        depths = range(1, len(r.acceptance_per_depth) + 1)
        overall = r.slice_dimension == "overall"
        ax.plot(depths, r.acceptance_per_depth, marker="o", linewidth=2.5 if overall else 0.8,
                color="black" if overall else None, label=_label(r))
    ax.set_xlabel("tree depth")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=6, ncol=2)
    return fig


def write_figures(reports, out_dir: Path) -> list[str]:
    """The three PNGs under out_dir; returns their file names."""
    figures = {"speedup.png": speedup_figure, "latency.png": latency_figure,
               "acceptance_per_depth.png": acceptance_figure}
    for name, draw in figures.items():
        fig = draw(reports)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
    return list(figures)


def report_table(reports) -> str:
    """One row per report: slice, speedups, TTFT and p95 (both modes), acceptance, equivalence, memory."""
    head = ["slice", "n", "speedup", "decode speedup", "TTFT ms (target / spec)", "p95 ms (target / spec)",
            "decode tok/s (target / spec)", "acc rate", "mean acc len", "spec length", "= target", "peak MB"]
    rows = [[_label(r), str(r.questions), f"{r.speedup:.2f}x", f"{r.decode_speedup:.2f}x",
             f"{r.target_only_first_token_ms:.0f} / {r.first_token_ms:.0f}",
             f"{r.target_only_p95_latency_ms:.0f} / {r.p95_latency_ms:.0f}",
             f"{r.target_only_decode_tokens_per_second:.2f} / {r.decode_tokens_per_second:.2f}",
             f"{r.acceptance_rate:.3f}", f"{r.mean_accepted_length:.2f}", "n/a" if r.speculation_length is None else f"{r.speculation_length:.2f}",
             f"{r.output_equivalent_fraction:.0%}", "n/a" if r.peak_memory_mb is None else f"{r.peak_memory_mb:.0f}"]
            for r in reports]
    return md_table(head, rows)


def markdown_report(reports, meta: dict, figures: list[str]) -> str:
    """report.md: the setting, the overall row, the worst slices by speedup, a table per dimension, figures."""
    overall, slices = reports[0], reports[1:]
    worst = sorted(slices, key=lambda r: r.speedup)[:WORST_SLICES]
    parts = [f"# specdec eval ({meta['task_set']}, {meta['per_category']} per category, "
             f"{meta['max_new_tokens']} new tokens, greedy)\n",
             f"Draft: {overall.draft_model}. Compared: {overall.compared_outputs}. Speedups are end-to-end tokens/s "
             "against target-only in the same run; latency figures are ms from the call.\n",
             "## Overall\n", report_table([overall]), f"## Worst {len(worst)} slices by speedup\n", report_table(worst)]
    for dimension in dict.fromkeys(r.slice_dimension for r in slices):
        parts += [f"## By {dimension}\n", report_table([r for r in slices if r.slice_dimension == dimension])]
    parts += ["## Figures\n"] + [f"![{name}]({name})\n" for name in figures]
    if overall.peak_memory_by_process_mb:
        parts.append("Peak resident memory by process (MB): " + ", ".join(
            f"{name}: {mb:.0f}" for name, mb in overall.peak_memory_by_process_mb.items()) + "\n")
    else:
        parts.append("Peak memory: not measured (a remote front; pass --service-pid for local services).\n")
    return "\n".join(parts)
