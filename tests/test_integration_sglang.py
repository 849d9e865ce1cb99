"""The SGLang drop-in (kdtree_lib.integrations.sglang) against SGLang's own functions, and its patching.

With KDTREE_SGLANG_DDTREE_UTILS naming a local copy of sgl-project/sglang's
python/sglang/srt/speculative/ddtree_utils.py (never committed), build_ddtree_tree and
build_eagle_tree_format must equal SGLang's element for element on the same logits, under its defaults
and its environment knobs. Without it: the EAGLE conversion against the Tree contract's own children
lists, the lazy child maps, the policy's invariants, and install() on stand-in modules.
"""
import importlib
import os
import sys
import types

import numpy as np
import pytest
import torch

from kdtree_lib.contracts import tree_from_parents
from kdtree_lib.integrations import sglang as dropin

SGLANG_FILE = os.environ.get("KDTREE_SGLANG_DDTREE_UTILS")
needs_sglang = pytest.mark.skipif(not SGLANG_FILE, reason="KDTREE_SGLANG_DDTREE_UTILS (a local copy of SGLang's "
                                                          "ddtree_utils.py) not set")
OUTPUTS = ("node_token_ids", "node_depths", "parents", "child_maps", "visibility", "actual_tree_sizes")


@pytest.fixture(scope="module")
def sglang_utils():
    return dropin.load_sglang_module(SGLANG_FILE)


def draft_logits(style: str, batch: int, depth: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if style == "peaked":
        return torch.randn(batch, depth, vocab, generator=generator) * 5
    if style == "repeated":  # one distribution at every position: ties between depths
        return (torch.randn(vocab, generator=generator) * 3).expand(batch, depth, vocab).clone()
    if style == "flat":  # weak drafts: the early stop and the spine rule decide
        return torch.randn(batch, depth, vocab, generator=generator) * 0.3
    raise ValueError(style)


def assert_same_outputs(ours, theirs, context: str) -> None:
    for name, a, b in zip(OUTPUTS, ours, theirs):
        if name == "child_maps":
            assert list(a) == list(b), f"{name} ({context})"
        else:
            assert a.dtype == b.dtype and a.shape == b.shape, f"{name}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)} ({context})"
            assert torch.equal(a, b), f"{name} differs ({context})"


# ----------------------------------------------------------------------------------------------
# against SGLang's own functions

@needs_sglang
@pytest.mark.parametrize("style", ["peaked", "repeated", "flat"])
@pytest.mark.parametrize("batch, depth, vocab, budget", [
    (3, 7, 3000, 8), (3, 7, 3000, 7), (2, 7, 3000, 3), (4, 7, 3000, 32), (2, 15, 2000, 64), (2, 15, 2000, 128),
    (1, 7, 50, 128), (2, 3, 5, 16)])
@pytest.mark.parametrize("knobs", [{}, {"SGLANG_DDTREE_MAX_TOPK": "3"}, {"SGLANG_DDTREE_DEPTH_BONUS": "0"},
                                   {"SGLANG_DDTREE_DEPTH_BONUS": "-0.5", "SGLANG_DDTREE_MAX_TOPK": "16"}])
def test_build_ddtree_tree_equals_sglangs(style, batch, depth, vocab, budget, knobs, sglang_utils, monkeypatch):
    for name, value in knobs.items():
        monkeypatch.setenv(name, value)
    logits = draft_logits(style, batch, depth, vocab, seed=batch * budget + depth)
    ours = dropin.build_ddtree_tree(logits, budget, torch.device("cpu"))
    theirs = sglang_utils.build_ddtree_tree(logits, budget, torch.device("cpu"))
    context = f"{style} B={batch} L={depth} V={vocab} budget={budget} {knobs}"
    assert_same_outputs(ours, theirs, context)
    eagle_ours = dropin.build_eagle_tree_format(ours[2], ours[5], budget + 1, torch.device("cpu"))
    eagle_theirs = sglang_utils.build_eagle_tree_format(theirs[2], theirs[5], budget + 1, torch.device("cpu"))
    for a, b in zip(eagle_ours, eagle_theirs):
        assert a.dtype == b.dtype and torch.equal(a, b), context


@needs_sglang
def test_reused_output_buffers_equal_sglangs(sglang_utils):
    logits = draft_logits("peaked", 3, 7, 3000, seed=5)
    buffers = lambda: (torch.full((4, 32), 9), torch.full((4, 32), 9), torch.full((4, 33), 9),  # noqa: E731
                       torch.ones(4, 33, 33, dtype=torch.bool))
    ours = dropin.build_ddtree_tree(logits, 32, torch.device("cpu"), *buffers())
    theirs = sglang_utils.build_ddtree_tree(logits, 32, torch.device("cpu"), *buffers())
    assert_same_outputs(ours, theirs, "reused buffers")


@needs_sglang
@pytest.mark.gpu
def test_build_ddtree_tree_equals_sglangs_on_the_gpu(sglang_utils):
    logits = draft_logits("peaked", 8, 7, 163_840, seed=1).cuda()
    for budget in (7, 16, 64):
        ours = dropin.build_ddtree_tree(logits, budget, logits.device)
        theirs = sglang_utils.build_ddtree_tree(logits, budget, logits.device)
        assert_same_outputs(ours, theirs, f"cuda budget={budget}")


# ----------------------------------------------------------------------------------------------
# without SGLang

def random_parents(rng, batch: int, nodes: int) -> np.ndarray:
    parents = np.full((batch, nodes), -1, np.int64)
    for b in range(batch):
        for i in range(1, int(rng.integers(1, nodes + 1))):
            parents[b, i] = rng.integers(0, i)
    return parents


def test_eagle_format_is_the_trees_children_lists():
    rng = np.random.default_rng(0)
    parents = random_parents(rng, 6, 40)
    tree = tree_from_parents(parents, np.zeros(parents.shape, np.int32))
    index, next_token, next_sibling = dropin.build_eagle_tree_format(
        torch.from_numpy(parents), torch.from_numpy(tree.n_nodes.astype(np.int64)), 40, torch.device("cpu"))
    assert index.dtype == next_token.dtype == next_sibling.dtype == torch.int64
    assert torch.equal(index, torch.arange(6 * 40).reshape(6, 40))
    assert np.array_equal(next_token.numpy(), tree.first_child) and np.array_equal(next_sibling.numpy(), tree.next_sibling)


def test_eagle_format_ignores_nodes_past_the_size():
    parents = torch.tensor([[-1, 0, 0, 1, 1]])
    _, next_token, next_sibling = dropin.build_eagle_tree_format(parents, torch.tensor([3]), 5, torch.device("cpu"))
    assert next_token.tolist() == [[1, -1, -1, -1, -1]] and next_sibling.tolist() == [[-1, 2, -1, -1, -1]]


def test_outputs_follow_the_policy():
    logits = draft_logits("flat", 3, 7, 3000, seed=2)
    tokens, depths, parents, child_maps, visibility, sizes = dropin.build_ddtree_tree(logits, 32, "cpu")
    assert (sizes < 33).any(), "flat drafts stop early"
    assert tokens.shape == depths.shape == (3, 32) and parents.shape == (3, 33) and visibility.shape == (3, 33, 33)
    width = dropin.policy_from_environment().width(32, 7)
    for b in range(3):
        n = int(sizes[b])
        assert (depths[b, : n - 1].diff() >= 0).all(), "breadth-first: depth-major"
        assert (parents[b, 1:n].diff() >= 0).all(), "children grouped by their parent's new index"
        if n - 1 < 32:  # the heap emptied: the spine is never dropped, so it reached depth L
            assert set(range(1, 8)) <= set(depths[b, : n - 1].tolist())
        assert all(len(children) <= width for children in child_maps[b].values())
        assert visibility[b, n:].sum() == 0 and bool(visibility[b, :n, :n].diagonal().all())
        for node in range(1, n):
            assert child_maps[b][int(parents[b, node])][int(tokens[b, node - 1])] == node


@pytest.mark.parametrize("logits, budget, match", [
    (torch.full((1, 7, 50), float("nan")), 8, "draft_logits: a row holds NaN"),
    (torch.full((1, 7, 50), float("inf")), 8, "draft_logits: a row holds NaN"),
    (torch.full((1, 7, 50), float("-inf")), 8, "draft_logits: a row holds NaN"),
    (torch.zeros(1, 7, 50, dtype=torch.int64), 8, "draft_logits: expected dtype"),
    (torch.zeros(7, 50), 8, "draft_logits: expected 3 dimensions"),
    (torch.zeros(1, 7, 50), 0, "tree_budget: expected a positive integer"),
    (torch.zeros(1, 7, 50), 1025, "tree_budget: at most 1024"),
])
def test_bad_input_names_sglangs_argument(logits, budget, match):
    with pytest.raises(ValueError, match=match):
        dropin.build_ddtree_tree(logits, budget, "cpu")


def test_child_maps_are_built_when_read():
    maps = dropin.build_ddtree_tree(draft_logits("peaked", 2, 7, 300, seed=3), 16, "cpu")[3]
    assert len(maps) == 2 and not maps._maps
    assert maps[-1] is maps[1] and list(maps._maps) == [1]


def test_install_patches_the_module_and_its_importers(monkeypatch):
    original = lambda *args: "sglang"  # noqa: E731
    utils = types.ModuleType(dropin.SGLANG_MODULE)
    utils.build_ddtree_tree = utils.build_eagle_tree_format = original
    worker = types.ModuleType("sglang.srt.speculative.ddtree_worker")
    worker.build_ddtree_tree = original  # `from ...ddtree_utils import build_ddtree_tree`
    bystander = types.ModuleType("sglang.srt.other")
    bystander.build_ddtree_tree = lambda *args: "someone else's"
    for module in (utils, worker, bystander):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    replaced = dropin.install(utils)
    assert dropin.is_installed(utils) and worker.build_ddtree_tree is dropin.build_ddtree_tree
    assert bystander.build_ddtree_tree(None) == "someone else's"
    assert dropin.install(utils) == [], "installing twice replaces nothing"
    dropin.uninstall(replaced)
    assert utils.build_ddtree_tree is original and worker.build_ddtree_tree is original
    with pytest.raises(ValueError, match="modules: .* holds none of"):
        dropin.install(types.ModuleType("empty"))


def test_load_sglang_module_refuses_other_files(tmp_path):
    other = tmp_path / "other.py"
    other.write_text("def build_ddtree_tree(*a):\n    return 1\n")
    with pytest.raises(ValueError, match="path: .* defines none or only some of"):
        dropin.load_sglang_module(other)


def test_patch_on_import_patches_sglangs_module_when_it_loads(tmp_path, monkeypatch):
    package = tmp_path / "sglang" / "srt" / "speculative"
    package.mkdir(parents=True)
    for folder in (tmp_path / "sglang", tmp_path / "sglang" / "srt", package):
        (folder / "__init__.py").write_text("")
    (package / "ddtree_utils.py").write_text("def build_ddtree_tree(*a):\n    return 1\n\n"
                                             "def build_eagle_tree_format(*a):\n    return 2\n")
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    dropin.patch_on_import()
    module = importlib.import_module(dropin.SGLANG_MODULE)
    assert dropin.is_installed(module)


def test_the_benchmarks_tree_stage_runs_on_the_cpu():
    """bench.tree_build's tree_stage rows at a small vocabulary (with SGLang's copy when it is given)."""
    from kdtree_lib.bench.tree_build import bench_tree_stage
    utils = dropin.load_sglang_module(SGLANG_FILE) if SGLANG_FILE else None
    rows = bench_tree_stage(utils, batches=(2,), depths=(7,), budgets=(7, 16), vocab=500, device="cpu")
    methods = {r["method"] for r in rows}
    parts = {"dropin_topk", "dropin_copy", "dropin_host_build"}
    assert methods == ({"dropin", "kdtree", "sglang"} if utils else {"dropin", "kdtree"}) | parts
    assert all(r["stage"] == "tree_stage" and r["time_us"] > 0 for r in rows)
    if utils:
        assert all(r["matches_sglang"] is True for r in rows)
