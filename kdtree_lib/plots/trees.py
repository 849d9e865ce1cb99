"""Drawing draft trees, their ancestor masks and the accept step's cache compaction."""
from __future__ import annotations

import numpy as np

def tree_layout(parents, n_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of each of the first n_nodes nodes: depth downwards, leaves side by side in
    depth-first order (children in pop order), a parent centred over its children."""
    parents = np.asarray(parents)[:n_nodes]
    children: list[list[int]] = [[] for _ in range(n_nodes)]
    for node in range(1, n_nodes):
        children[parents[node]].append(node)
    x = np.zeros(n_nodes)
    y = np.zeros(n_nodes)
    next_leaf = 0

    def place(node: int, depth: int) -> None:
        nonlocal next_leaf
        y[node] = -depth
        for child in children[node]:
            place(child, depth + 1)
        if children[node]:
            x[node] = (x[children[node][0]] + x[children[node][-1]]) / 2
        else:
            x[node], next_leaf = next_leaf, next_leaf + 1

    place(0, 0)
    return x, y


def draw_tree(ax, tree, b: int = 0, *, highlight=(), labels=None, max_labels: int = 48, node_size: float = 220,
              colorbar: bool = True):
    """Request b's tree: nodes coloured by path probability exp(log w), labelled with their tokens.

    `highlight` (node indices, e.g. an accepted path) is drawn in red; `labels` (one string per
    node) replaces the token labels; trees larger than `max_labels` nodes go unlabelled (and small).
    """
    import matplotlib.pyplot as plt

    tree = tree.to_numpy()
    n = int(tree.n_nodes[b])
    parents, tokens = tree.parents[b], tree.tokens[b]
    x, y = tree_layout(parents, n)
    marked = set(int(i) for i in highlight)
    for node in range(1, n):
        on_path = node in marked and int(parents[node]) in marked
        ax.plot([x[parents[node]], x[node]], [y[parents[node]], y[node]], color="#d1495b" if on_path else "#999999",
                lw=2.5 if on_path else 0.8, zorder=1)
    probability = np.exp(tree.log_weights[b, :n])  # root: exp(0) = 1; NaN (no weights) draws grey
    points = ax.scatter(x, y, c=probability, cmap="viridis", vmin=0, vmax=1, s=node_size if n <= max_labels else 30,
                        edgecolors=["#d1495b" if i in marked else "black" for i in range(n)],
                        linewidths=[2.5 if i in marked else 0.5 for i in range(n)], zorder=2, plotnonfinite=True)
    if n <= max_labels:
        text = labels if labels is not None else [str(t) for t in tokens[:n]]
        for node in range(n):
            ax.text(x[node], y[node], text[node], ha="center", va="center", fontsize=7 if node_size < 400 else 9, zorder=3,
                    color="white" if probability[node] < 0.5 else "black")
    ax.set_yticks(-np.arange(int(tree.depths[b, :n].max()) + 1))
    ax.set_yticklabels([str(d) for d in range(int(tree.depths[b, :n].max()) + 1)])
    ax.set_ylabel("depth")
    ax.set_xticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    if colorbar:
        plt.colorbar(points, ax=ax, label="path probability exp(log w)", fraction=0.04)
    return points


def draw_mask(ax, tree, b: int = 0, *, title: str = "ancestor mask"):
    """Request b's ancestor mask as an image: row i (query node), column j (key node) dark iff j ≤ i on i's path."""
    from ..contracts import unpack_mask

    tree = tree.to_numpy()
    n = int(tree.n_nodes[b])
    bits = unpack_mask(tree.mask[b], tree.capacity)[:n, :n]
    ax.imshow(bits, cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xlabel("key node j (pop order)")
    ax.set_ylabel("query node i (pop order)")
    ax.set_title(title)
    return bits


def draw_compaction(ax, length: int, n_nodes: int, path):
    """One request's cache during verify (committed slots, then tree node i at slot length + i) and after
    compaction (accepted node k moved to slot length + k), with an arrow per move."""
    from matplotlib.patches import Rectangle

    path = [int(p) for p in path if p >= 0]
    shown_committed = min(length, 4)  # only the last few committed slots: they do not move
    first = length - shown_committed

    def box(slot, row, color, text):
        ax.add_patch(Rectangle((slot - first, row), 0.92, 0.6, color=color))
        ax.text(slot - first + 0.46, row + 0.3, text, ha="center", va="center", fontsize=7)

    for slot in range(first, length):
        box(slot, 1.2, "#bbbbbb", "c")
        box(slot, 0, "#bbbbbb", "c")
    for node in range(n_nodes):
        box(length + node, 1.2, "#4c9a2a" if node in path else "#e8e8e8", str(node))
    for k, node in enumerate(path):
        box(length + k, 0, "#4c9a2a", str(node))
        if node != k:
            ax.annotate("", xy=(length + k - first + 0.46, 0.62), xytext=(length + node - first + 0.46, 1.18),
                        arrowprops=dict(arrowstyle="->", color="#d1495b", lw=1.2))
    ax.set_xlim(-0.2, shown_committed + n_nodes + 0.2)
    ax.set_ylim(-0.3, 2.1)
    ax.set_yticks([0.3, 1.5])
    ax.set_yticklabels(["after compaction", "during verify"])
    ticks = np.arange(0, shown_committed + n_nodes, max(1, (shown_committed + n_nodes) // 12))
    ax.set_xticks(ticks + 0.46)
    ax.set_xticklabels([str(first + t) for t in ticks])
    ax.set_xlabel("cache slot (c = committed token; numbers = tree node index; green = accepted)")
    for side in ax.spines.values():
        side.set_visible(False)


def tree_explorer(logits, *, budget: int = 16, top_k: int = 4, max_budget: int = 128):
    """An ipywidgets panel: sliders for budget, depth and top-k redraw the tree built from `logits` [1, D, V]."""
    import ipywidgets
    import matplotlib.pyplot as plt

    from ..draft_topk import draft_topk
    from ..tree_build import build_tree
    from ..synthetic import expected_acceptance_length

    depth_limit, vocab = logits.shape[1], logits.shape[2]

    def redraw(budget, depth, top_k):
        tree = build_tree(draft_topk(logits[:, :depth], top_k, backend="numpy"), budget, backend="numpy")
        fig, ax = plt.subplots(figsize=(10, 4))
        draw_tree(ax, tree, max_labels=40)
        ax.set_title(f"budget {budget}, depth {depth}, top-k {top_k}: {int(tree.n_nodes[0]) - 1} draft nodes, "
                     f"expected acceptance length {expected_acceptance_length(tree)[0]:.2f}")
        plt.show()

    return ipywidgets.interactive(
        redraw,
        budget=ipywidgets.IntSlider(value=budget, min=1, max=max_budget, description="budget"),
        depth=ipywidgets.IntSlider(value=depth_limit, min=1, max=depth_limit, description="depth"),
        top_k=ipywidgets.IntSlider(value=min(top_k, vocab), min=1, max=min(32, vocab), description="top-k"))
