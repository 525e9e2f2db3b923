"""The PNG plots of a bench (matplotlib, imported when drawing) and the short method labels they use. A new
plot is a figure function here, named in :data:`PLOTS` and drawn by :func:`write_plots`."""

from __future__ import annotations

import io
import pathlib
from typing import Sequence

from selfdraft.inference.bench.common import BASELINE, _groups, _write_atomic

PLOTS = ("speedup.png", "acceptance_histograms.png", "per_depth_acceptance.png")


def write_plots(results: dict, out: pathlib.Path) -> list[pathlib.Path]:
    """Write the :data:`PLOTS` of ``results`` into the folder ``out``, each atomically; return their paths."""
    written = []
    for name, figure in zip(PLOTS, (_speedup_figure, _histogram_figure, _depth_figure)):
        _write_atomic(out / name, _png(figure(results)))
        written.append(out / name)
    return written


def _png(figure) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buffer = io.BytesIO()
    FigureCanvasAgg(figure).print_png(buffer)
    return buffer.getvalue()


def _figure(n: int, width: float = 6.0, height: float = 3.6):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height * n), layout="constrained")
    return figure, [figure.add_subplot(n, 1, i + 1) for i in range(n)]


def _colors(results: dict) -> dict[str, str]:
    """One colour per method, the same in every plot."""
    return {label: f"C{i % 10}" for i, label in enumerate(results["meta"]["methods"])}


def _short(label: str, width: int = 28) -> str:
    return label if len(label) <= width else "..." + label[-(width - 3):]


def _cut_path(label: str, parts: int) -> str:
    """``label`` with the path in its spec cut to the last ``parts`` parts; prefix and options kept."""
    spec, at, options = label.partition("@")
    prefix, colon, path = spec.partition(":") if ":" in spec and "/" not in spec.split(":")[0] else ("", "", spec)
    if "/" in path:
        path = "/".join(pathlib.PurePath(path).parts[-parts:])
    return prefix + colon + path + at + options


def method_labels(methods: Sequence[str]) -> dict[str, str]:
    """Short, distinct legend labels: a drafter folder's path cut to its last two parts, more where
    that is needed to tell two methods apart, options kept (``runs/eagle3-smollm2/drafter@depth=3``
    -> ``eagle3-smollm2/drafter@depth=3``)."""
    parts: dict[str, int | None] = dict.fromkeys(methods, 2)  # None: the label in full
    while True:
        labels = {m: m if n is None else _cut_path(m, n) for m, n in parts.items()}
        clashing = [m for m, n in parts.items() if n is not None and list(labels.values()).count(labels[m]) > 1]
        if not clashing:
            return labels
        for m in clashing:
            longer = _cut_path(m, parts[m] + 1)
            parts[m] = None if longer == labels[m] else parts[m] + 1


def _speedup_figure(results: dict):
    temps = results["meta"]["temperatures"]
    tasks = results["meta"]["tasks"]
    labels = method_labels(results["meta"]["methods"])
    figure, axes = _figure(len(temps), width=max(6.0, 1.6 * len(tasks) + 3) + 0.09 * max(map(len, labels.values())))
    for ax, t in zip(axes, temps):
        rows = [r for r in results["rows"] if r["temperature"] == t and not r["baseline"]]
        methods = list(dict.fromkeys(r["method"] for r in rows))
        width = 0.8 / max(len(methods), 1)
        for j, method in enumerate(methods):
            xs, ys = [], []
            for i, task in enumerate(tasks):
                hit = [r for r in rows if r["task"] == task and r["method"] == method]
                if hit:
                    xs.append(i - 0.4 + width * (j + 0.5))
                    ys.append(hit[0]["speedup"])
            ax.bar(xs, ys, width, label=labels[method], color=_colors(results)[method])
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(tasks)), [_short(task, 20) for task in tasks])
        ax.set_ylabel(f"speedup vs {BASELINE}")
        ax.set_title(f"temperature {t:g}")
        _legend_or_note(ax, bool(methods), "only the baseline ran")
    return figure


def _histogram_figure(results: dict):
    drafting = {r["method"] for r in results["rows"]
                if r["per_depth_acceptance"] or set(r["acceptance_histogram"] or {}) - {"1"}}
    rows = [r for r in results["rows"] if r["method"] in drafting and r["acceptance_histogram"]]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    labels = method_labels(results["meta"]["methods"])
    figure, axes = _figure(max(len(methods), 1), height=3.0)
    for ax, method in zip(axes, methods):
        series = [r for r in rows if r["method"] == method]
        top = max(int(k) for r in series for k in r["acceptance_histogram"])
        width = 0.8 / len(series)
        for j, r in enumerate(series):
            counts = r["acceptance_histogram"]
            total = sum(counts.values())
            ax.bar([k - 0.4 + width * (j + 0.5) for k in range(1, top + 1)],
                   [counts.get(str(k), 0) / total for k in range(1, top + 1)], width,
                   label=f"{_short(r['task'], 20)}, T={r['temperature']:g}")
        ax.set_xticks(range(1, top + 1))
        ax.set_xlabel("tokens emitted per target forward")
        ax.set_ylabel("share of forwards")
        ax.set_title(labels[method])
        ax.legend(fontsize="small")
    if not methods:
        axes[0].text(0.5, 0.5, "no drafting method reported a histogram", ha="center", transform=axes[0].transAxes)
    return figure


def _depth_figure(results: dict):
    from matplotlib.ticker import MaxNLocator

    groups = _groups(results)
    labels = method_labels(results["meta"]["methods"])
    figure, axes = _figure(len(groups), width=6.0 + 0.09 * max(map(len, labels.values())), height=3.0)
    for ax, (task, t, rows) in zip(axes, groups):
        drew = False
        for r in rows:
            depth = r["per_depth_acceptance"]
            if depth:
                ax.plot([int(d) for d in depth], list(depth.values()), marker="o", label=labels[r["method"]],
                        color=_colors(results)[r["method"]])
                drew = True
        ax.set_ylim(-0.03, 1.03)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft depth d")
        ax.set_ylabel("accepted at d")
        ax.set_title(f"{_short(task, 30)}, temperature {t:g}")
        _legend_or_note(ax, drew, "no drafting method")
    return figure


def _legend_or_note(ax, drew: bool, note: str) -> None:
    """A legend beside the axes, or ``note`` in them where nothing was drawn."""
    if drew:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.text(0.5, 0.5, note, ha="center", transform=ax.transAxes)
