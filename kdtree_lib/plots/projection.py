"""Figures of the CT200 projection (notebook 13): the calibration, the router's overlap, a round's
components, the acceptance sources side by side, the speedup band over sources × overlaps, and the explorer."""
from __future__ import annotations

import numpy as np

from ..projection import expected_distinct_experts, layer_costs, speedup_band
from ..results import matches
from .tp_step import COMPONENT_COLORS


def plot_calibration(axes, used: list[dict], config, hardware, efficiency) -> None:
    """Calibrated model against the measured layer times, for attention and the MoE."""
    for ax, component in zip(axes, ("attention", "moe")):
        measured = np.array([float(r[f"{component}_seconds"]) for r in used])
        modelled = np.array([layer_costs(config, hardware, batch=int(r["batch"]), nodes=int(r["nodes"]),
                                         context=int(r["context"]), moe_layer=matches(r["moe_layer"], True),
                                         efficiency=efficiency)[component] for r in used])
        ax.loglog(measured * 1e3, modelled * 1e3, "o", alpha=0.6)
        span = [min(measured.min(), modelled.min()) * 1e3, max(measured.max(), modelled.max()) * 1e3]
        ax.plot(span, span, "k--", label="model = measured")
        ax.set_xlabel(f"measured ms per layer ({hardware.name})")
        ax.set_ylabel("calibrated model, ms per layer")
        ax.set_title(f"{component}: efficiency {getattr(efficiency, component):.2f}")
        ax.grid(alpha=0.3)
        ax.legend()


def plot_router_overlap(axes, curves: dict[int, list[dict]], correlation: dict[int, float], config) -> None:
    """Distinct experts of windows of real text against tokens, with the uniform and fitted models."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    for ax, (batch, rows) in zip(axes, curves.items()):
        tokens = np.array(sorted({r["tokens"] for r in rows}))
        mean = [np.mean([r["distinct_mean"] for r in rows if r["tokens"] == t]) for t in tokens]
        ax.plot(tokens, mean, "o", label="measured on text (mean over MoE layers)")
        for c, style, label in ((0.0, "k--", "uniform, independent"),
                                (correlation[batch], "C1-", f"fitted c = {correlation[batch]:.2f}")):
            ax.plot(tokens, [expected_distinct_experts(int(t), config.n_routed_experts, config.num_experts_per_tok, c)
                             for t in tokens], style, label=label)
        # powers of two, labelled as plain integers and no minor labels: base-10 minor labels overlapped
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(LogLocator(base=2))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("tokens in the step (B x N)")
        ax.set_ylabel("distinct experts per layer")
        ax.set_title(f"stand-in target, batch {batch}")
        ax.grid(alpha=0.3)
        ax.legend()


def plot_round_components(axes, projected: list[dict], *, context: int, batches) -> None:
    """Stacked ms per projected round by component against budget, an axis per batch."""
    for ax, batch in zip(axes, batches):
        rows = [r for r in projected if (r["context"], r["batch"]) == (context, batch)]
        labels = [str(r["budget"]) for r in rows]
        bottom = np.zeros(len(rows))
        for name, color in COMPONENT_COLORS.items():
            values = np.array([r[f"{name}_seconds"] for r in rows]) * 1e3
            ax.bar(labels, values, bottom=bottom, color=color,
                   label=name + (" (head, drafter, tree kernels)" if name == "rest" else ""))
            bottom += values
        ax.set_xlabel("budget")
        ax.set_ylabel("ms per round, all layers")
        ax.set_title(f"CT200 round, batch {batch}, context {context}")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)


def plot_acceptance_sources(ax, sources) -> None:
    """Tokens per round against budget of each acceptance source (dashed: not measured here), chains as crosses
    at their number of drafts (a chain of 7 drafts has as many nodes as a tree of budget 7)."""
    for color, source in zip(("C2", "C1", "C0", "C4"), sources):
        style = "o-" if source.measured else "o--"
        ax.plot(list(source.curve), list(source.curve.values()), style, color=color,
                label=source.name + ("" if source.measured else " (ASSUMED)"))
        ax.plot([source.chain_drafts], [source.chain.value], "x", color=color, markersize=10,
                label=f"{source.name} chain of {source.chain_drafts} drafts" + ("" if source.chain.measured else " (ASSUMED)"))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (draft nodes per tree)")
    ax.set_ylabel("tokens per round")
    ax.set_title("acceptance sources")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_speedup_band(axes, table: list[dict], *, contexts, batches, marked: float, key: str = "speedup_vs_ar") -> None:
    """Per context an axis: per batch the band of `key` over every acceptance source × overlap against
    budget, and each source's line at the overlap nearest `marked` (the stand-in's fitted value)."""
    band = speedup_band(table, key)
    overlaps = sorted({row["correlation"] for row in table})
    nearest = min(overlaps, key=lambda c: abs(c - marked))
    sources = list(dict.fromkeys(row["source"] for row in table))
    for ax, context in zip(axes, contexts):
        for batch, color in zip(batches, ("C0", "C3", "C2", "C4")):
            budgets = list(band[context, batch])
            low, high = zip(*band[context, batch].values())
            ax.fill_between(budgets, low, high, color=color, alpha=0.15, label=f"batch {batch}: all sources x overlaps")
            for source, style in zip(sources, ("o-", "s--", "^:", "d-.")):
                rows = sorted((r for r in table if (r["source"], r["correlation"], r["context"], r["batch"])
                               == (source, nearest, context, batch)), key=lambda r: r["budget"])
                ax.plot([r["budget"] for r in rows], [r[key] for r in rows], style, color=color,
                        label=f"batch {batch}, {source}, overlap {nearest:g}")
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (draft nodes per tree)")
        ax.set_ylabel(key.replace("_", " "))
        ax.set_title(f"CT200, context {context}: band over sources x overlaps\n"
                     f"lines at overlap {nearest:g} (the stand-in's fit: {marked:.2f})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


def projection_explorer(config, sources: list, *, drafters: dict, overlaps, batches, contexts, start: dict | None = None,
                        **round_options):
    """An ipywidgets panel (notebook 13's explorer): pick the acceptance source, the routing overlap,
    batch, context and drafter placement (drafters: placement -> seconds(batch, context)); it redraws
    the speedups over AR and over the chain against budget and prints the best budget. It opens on
    `start` (source, overlap, batch, context, placement: the headline's settings), else on the first of each."""
    import ipywidgets
    import matplotlib.pyplot as plt

    from ..projection import CT200, round_rows
    by_name = {source.name: source for source in sources}
    hardware = round_options.pop("hardware", CT200)

    def redraw(source, overlap, batch, context, placement):
        rows = round_rows(config, hardware, by_name[source], batch=batch, context=context, correlation=overlap,
                          drafter=drafters[placement], **round_options)
        best = max(rows, key=lambda r: r["tokens_per_second"])
        fig, ax = plt.subplots(figsize=(7.5, 3.8))
        for key, style in (("speedup_vs_ar", "o-"), ("speedup_vs_chain", "s--")):
            ax.plot([r["budget"] for r in rows], [r[key] for r in rows], style, label=key.replace("_", " "))
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (draft nodes per tree)")
        ax.set_ylabel("speedup")
        ax.set_title(f"{source}, overlap {overlap:g}, B={batch}, L={context}, drafter {placement}: best budget "
                     f"{best['budget']} ({best['speedup_vs_ar']:.2f}x AR, {best['speedup_vs_chain']:.2f}x chain)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        plt.show()
        return best

    choices = {"source": list(by_name), "overlap": list(overlaps), "batch": list(batches), "context": list(contexts),
               "placement": list(drafters)}
    start = {key: options[0] for key, options in choices.items()} | dict(start or {})
    for key, value in start.items():
        if key not in choices or value not in choices[key]:
            raise ValueError(f"start: {key}={value!r} is not one of {choices.get(key)}")
    return ipywidgets.interactive(
        redraw, source=ipywidgets.Dropdown(options=choices["source"], value=start["source"], description="acceptance"),
        overlap=ipywidgets.SelectionSlider(options=choices["overlap"], value=start["overlap"], description="overlap"),
        batch=ipywidgets.Dropdown(options=choices["batch"], value=start["batch"], description="batch"),
        context=ipywidgets.Dropdown(options=choices["context"], value=start["context"], description="context"),
        placement=ipywidgets.Dropdown(options=choices["placement"], value=start["placement"], description="drafter"))
