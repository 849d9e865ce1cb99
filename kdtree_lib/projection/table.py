"""The projection table: per acceptance source x overlap x context x batch x budget, a round's time and its speedups."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..contracts import tree_nodes
from .acceptance import AcceptanceSource
from .inputs import Input
from .roofline import CT200, Efficiency, Hardware, step_costs

if TYPE_CHECKING:
    from ..model import ModelConfig


OVERLAPS = (0.0, 0.25, 0.5, 0.75, 0.9)  # routing correlation swept: uniform to strongly correlated


def round_rows(config: ModelConfig, hardware: Hardware, source: AcceptanceSource, *, batch: int, context: int,
               correlation: float, efficiency: Efficiency, expert_bits: float, chain_budget: int,
               drafter: Callable[[int, int], float], tree_stage: Callable[[int, int], Input]) -> list[dict]:
    """Per budget of `source`: the round's time (verify step + drafter + tree stage), tokens/s and the
    speedups over AR and over the DFlash chain (chain_budget drafts, the same drafter and stage)."""
    options = dict(expert_bits=expert_bits, correlation=correlation, efficiency=efficiency)
    ar = step_costs(config, hardware, batch=batch, nodes=1, context=context, **options)["total"]

    def round_seconds(budget: int) -> dict:
        extra = drafter(batch, context) + tree_stage(batch, budget).value
        return step_costs(config, hardware, batch=batch, nodes=tree_nodes(budget), context=context,
                          fixed_seconds=extra, **options)
    chain_rate = source.chain.value / round_seconds(chain_budget)["total"]
    rows = []
    for budget, accepted in sorted(source.curve.items()):
        step = round_seconds(budget)
        rate = accepted / step["total"]
        rows.append({"source": source.name, "correlation": correlation, "context": context, "batch": batch,
                     "budget": budget, "acceptance": accepted, "round_seconds": step["total"],
                     "tokens_per_second": batch * rate, "ar_tokens_per_second": batch / ar,
                     "chain_tokens_per_second": batch * chain_rate, "speedup_vs_ar": rate * ar,
                     "speedup_vs_chain": rate / chain_rate,
                     **{f"{k}_seconds": v for k, v in step.items() if k != "total"}})
    return rows


def projection_table(config: ModelConfig, sources: list[AcceptanceSource], overlaps, *, hardware: Hardware = CT200,
                     batches=(1, 8), contexts=(4096, 32768), **round_options) -> list[dict]:
    """round_rows for every acceptance source × overlap × context × batch (round_options: round_rows')."""
    return [row for source in sources for correlation in overlaps for context in contexts for batch in batches
            for row in round_rows(config, hardware, source, batch=batch, context=context, correlation=correlation,
                                  **round_options)]


def best_table(rows: list[dict]) -> list[dict]:
    """Per (source, correlation, context, batch): the row of the budget with the most tokens/s."""
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["source"], row["correlation"], row["context"], row["batch"])
        if key not in best or row["tokens_per_second"] > best[key]["tokens_per_second"]:
            best[key] = row
    return list(best.values())


def speedup_band(rows: list[dict], key: str = "speedup_vs_ar") -> dict[tuple[int, int], dict]:
    """(context, batch) -> {budget: (lowest, highest) `key` over every source × overlap with that budget}."""
    band: dict[tuple[int, int], dict[int, list[float]]] = {}
    for row in rows:
        band.setdefault((row["context"], row["batch"]), {}).setdefault(row["budget"], []).append(row[key])
    return {where: {b: (min(v), max(v)) for b, v in sorted(budgets.items())} for where, budgets in band.items()}


def nearest_overlap(overlaps, marked: float) -> float:
    """The overlap of `overlaps` nearest `marked` (the stand-in's fitted correlation); the first of equals."""
    overlaps = list(overlaps)
    if not overlaps:
        raise ValueError("overlaps: expected at least one")
    return overlaps[int(np.argmin([abs(c - marked) for c in overlaps]))]



# ----------------------------------------------------------------------------------------------
# external reference lines, the headline and the takeaway, all printed from the table

EXTERNAL_SOURCE = "external public report on 8x RTX PRO 6000 Blackwell, K2.6 at TP=8 (not measured here)"
SHORT_CONTEXT = 8192  # the reports' "short context": the table's contexts up to this compare with them


@dataclass(frozen=True)
class Reference:
    """A tokens/s another stack reaches on the box, from a public report: a line to beat, not a measurement."""
    name: str
    context: str      # "short", or the context in tokens as text
    batch: int
    tokens_per_second: float

    @property
    def kind(self) -> str:
        """What of the model's own the reference also checks: "ar" (no speculation), "chain" (a DFlash chain), or ""."""
        name = self.name.lower()
        return "ar" if name.startswith("no speculation") else "chain" if "chain" in name else ""

    def applies(self, context: int, batch: int) -> bool:
        short = self.context == "short" and context <= SHORT_CONTEXT
        return batch == self.batch and (short or (self.context != "short" and int(self.context) == context))

    def line(self) -> str:
        return (f"{self.name}, {self.context} context, B={self.batch}: {self.tokens_per_second:g} tokens/s "
                f"[EXTERNAL: {EXTERNAL_SOURCE}]")


EXTERNAL_REFERENCES = (Reference("no speculation (AR)", "short", 1, 92.0), Reference("no speculation (AR)", "32768", 1, 73.0),
                       Reference("DFlash chain", "short", 1, 210.0), Reference("Eagle3", "short", 1, 122.0),
                       Reference("Eagle3", "32768", 1, 93.0))


def references(entries) -> list[Reference]:
    """Reference lines from [name, context ("short" or tokens), batch, tokens/s] entries (a notebook parameter)."""
    out = []
    for entry in entries:
        if len(entry) != 4:
            raise ValueError(f"external_references: expected [name, context, batch, tokens/s] entries, got {entry!r}")
        name, context, batch, rate = entry
        if str(context) != "short" and not str(context).isdigit():
            raise ValueError(f"external_references: context of {name!r} must be 'short' or a number of tokens, got {context!r}")
        out.append(Reference(str(name), str(context), int(batch), float(rate)))
    return out


def headline(best_rows: list[dict], *, source: str, correlation: float) -> dict[tuple[int, int], dict]:
    """(context, batch) -> the best-budget row of `source` at overlap `correlation`."""
    picked = {(r["context"], r["batch"]): r for r in best_rows if r["source"] == source and r["correlation"] == correlation}
    if not picked:
        raise ValueError(f"source/correlation: no best rows of {source!r} at overlap {correlation}")
    return dict(sorted(picked.items()))


def reference_lines(best: dict[tuple[int, int], dict], refs: list[Reference]) -> list[str]:
    """Per headline row and reference that applies to its context and batch: whether projected DDTree beats it;
    for the no-speculation and chain references also the model's own AR or chain against the reported one (a
    check of the model itself)."""
    lines = []
    for (context, batch), row in best.items():
        for ref in (r for r in refs if r.applies(context, batch)):
            rate = row["tokens_per_second"]
            verdict = "beats" if rate > ref.tokens_per_second else "does not beat"
            lines.append(f"L={context}, B={batch}: projected DDTree (budget {row['budget']}) {rate:.0f} tokens/s {verdict} "
                         f"{ref.name} at {ref.tokens_per_second:g} tokens/s [external] ({rate / ref.tokens_per_second:.2f}x)")
            own = {"ar": ("AR", row["ar_tokens_per_second"]),
                   "chain": ("DFlash chain", row["chain_tokens_per_second"])}.get(ref.kind)
            if own is not None:
                what, modelled = own
                lines.append(f"L={context}, B={batch}: the model's own {what} is {modelled:.0f} tokens/s, "
                             f"{modelled / ref.tokens_per_second:.2f}x the reported {ref.tokens_per_second:g}: the model is "
                             f"{'pessimistic' if modelled < ref.tokens_per_second else 'optimistic'} about it by "
                             f"{abs(1 - modelled / ref.tokens_per_second):.0%} there")
    return lines


def takeaway_lines(table: list[dict], *, source: str, correlation: float, refs: list[Reference] = (),
                   alternatives: dict[str, list[dict]] | None = None, depth=None) -> list[str]:
    """The takeaway, from the table: per context and batch the headline (best budget, tokens/s, speedups over
    AR and over the chain), the band over sources x overlaps, where the biggest budget stands, what would change
    it (alternatives: label -> best rows of another setting), how much of the gain over the chain the siblings
    give at the best budget (depth: an acceptance.DepthSource, read from depth rows), and the external
    references it beats or not."""
    best_rows = best_table(table)
    best = headline(best_rows, source=source, correlation=correlation)
    lines = []
    for (context, batch), row in best.items():
        same = [r for r in best_rows if (r["context"], r["batch"]) == (context, batch)]
        low = min(same, key=lambda r: r["speedup_vs_ar"])
        high = max(same, key=lambda r: r["speedup_vs_ar"])
        biggest = max((r for r in table if (r["source"], r["correlation"], r["context"], r["batch"])
                       == (source, correlation, context, batch)), key=lambda r: r["budget"])
        lines.append(f"L={context}, B={batch}: best budget {row['budget']}: {row['tokens_per_second']:.0f} tokens/s, "
                     f"{row['speedup_vs_ar']:.2f}x AR ({row['ar_tokens_per_second']:.0f} tokens/s), "
                     f"{row['speedup_vs_chain']:.2f}x the chain ({row['chain_tokens_per_second']:.0f} tokens/s): DDTree "
                     f"{'beats' if row['speedup_vs_chain'] > 1 else 'does not beat'} the chain "
                     f"({source}, overlap {correlation:g}); its largest budget {biggest['budget']} gives "
                     f"{biggest['speedup_vs_ar']:.2f}x AR")
        lines.append(f"    band over sources x overlaps: {low['speedup_vs_ar']:.2f}x ({low['source']}, overlap "
                     f"{low['correlation']:g}, budget {low['budget']}) to {high['speedup_vs_ar']:.2f}x ({high['source']}, "
                     f"overlap {high['correlation']:g}, budget {high['budget']}); best budgets "
                     f"{sorted({r['budget'] for r in same})}")
        for label, rows in (alternatives or {}).items():
            other = next((r for r in rows if (r["context"], r["batch"]) == (context, batch)), None)
            if other is not None:
                lines.append(f"    would change it: {label}: {row['speedup_vs_ar']:.2f}x -> {other['speedup_vs_ar']:.2f}x AR, "
                             f"best budget {row['budget']} -> {other['budget']}")
        if depth is not None:
            lines.append(f"    where the gain over the chain comes from: {depth.gain_line(row['budget'])}")
    return lines + reference_lines(best, list(refs))
