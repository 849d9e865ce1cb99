"""The SGLang drop-in (kdtree_lib.integrations.sglang) against SGLang's own functions, and its patching.

With KDTREE_SGLANG_DDTREE_UTILS naming a local copy of sgl-project/sglang's
python/sglang/srt/speculative/ddtree_utils.py, and KDTREE_SGLANG_PR29907_DDTREE_UTILS one of SGLang PR
#29907's version (with build_ddtree_tree_from_topk), both never committed, the drop-in's functions must
equal SGLang's element for element on the same inputs, under its defaults and its environment knobs.
Always (CPU): the host path against kdtree's own references (the Tree contract's children lists and
masks, the paper's heap), the lazy child maps, the policy's invariants, the refusals, install() on
stand-in modules and the .pth install on a fake site-packages. With a GPU: the kernel path against
the host path and SGLang's copies, poisoned outputs, CUDA-graph capture, and no host synchronisation.
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
PR_FILE = os.environ.get("KDTREE_SGLANG_PR29907_DDTREE_UTILS")
needs_pr = pytest.mark.skipif(not PR_FILE, reason="KDTREE_SGLANG_PR29907_DDTREE_UTILS (a local copy of SGLang PR "
                                                  "#29907's ddtree_utils.py) not set")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOPK_PATHS = {"fused": "fused_v3", "exact": "exact"}  # the knob's value -> the path that runs (width <= 128)
OUTPUTS = ("node_token_ids", "node_depths", "parents", "child_maps", "visibility", "actual_tree_sizes")


@pytest.fixture(scope="module")
def sglang_utils():
    return dropin.load_sglang_module(SGLANG_FILE)


@pytest.fixture(scope="module")
def pr_utils():
    return dropin.load_sglang_module(PR_FILE)


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
@cuda
@pytest.mark.parametrize("topk", dropin.TOPK_CHOICES)
def test_build_ddtree_tree_equals_sglangs_on_the_gpu(topk, sglang_utils, monkeypatch):
    monkeypatch.setenv(dropin.TOPK_ENV, topk)
    logits = draft_logits("peaked", 8, 7, 163_840, seed=1).cuda()
    for budget in (7, 16, 64):
        assert dropin.prepared_build(logits, budget).topk_path == TOPK_PATHS[topk]
        ours = dropin.build_ddtree_tree(logits, budget, logits.device)
        theirs = sglang_utils.build_ddtree_tree(logits, budget, logits.device)
        assert_same_outputs(ours, theirs, f"cuda budget={budget}")
        eagle_ours = dropin.build_eagle_tree_format(ours[2], ours[5], budget + 1, logits.device)
        eagle_theirs = sglang_utils.build_eagle_tree_format(theirs[2], theirs[5], budget + 1, logits.device)
        for a, b in zip(eagle_ours, eagle_theirs):
            assert a.dtype == b.dtype and torch.equal(a, b), f"cuda budget={budget}"


@needs_pr
@pytest.mark.parametrize("style", ["peaked", "repeated", "flat"])
@pytest.mark.parametrize("depth, vocab, budget", [(7, 3000, 8), (7, 3000, 7), (7, 3000, 1), (15, 2000, 64),
                                                  (3, 5, 16), (7, 50, 128), (1, 40, 20)])
def test_from_topk_equals_pr29907s(style, depth, vocab, budget, pr_utils):
    logits = draft_logits(style, 1, depth, vocab, seed=depth * budget)[0]
    ours = dropin.pr29907_build_ddtree_tree(logits, budget)
    theirs = pr_utils.build_ddtree_tree(logits, budget)
    assert_same_pr_outputs(ours, theirs, f"{style} D={depth} V={vocab} budget={budget}")
    k = min(vocab, budget + 3)  # more ranks than the budget can reach
    logp, ids = torch_topk(logits, k)
    assert_same_pr_outputs(dropin.build_ddtree_tree_from_topk(logp, ids, budget),
                           pr_utils.build_ddtree_tree_from_topk(logp, ids, budget), "from_topk")


@needs_pr
def test_from_topk_degenerate_inputs_equal_pr29907s(pr_utils):
    logp, ids = torch_topk(draft_logits("peaked", 1, 4, 100, seed=0)[0], 8)
    for args in ((logp, ids, 0), (logp, ids, -3), (logp[:0], ids[:0], 8)):
        assert_same_pr_outputs(dropin.build_ddtree_tree_from_topk(*args), pr_utils.build_ddtree_tree_from_topk(*args),
                               f"budget={args[2]} D={args[0].shape[0]}")


@needs_pr
@pytest.mark.gpu
@cuda
def test_from_topk_equals_pr29907s_on_the_gpu(pr_utils):
    logits = draft_logits("peaked", 1, 7, 163_840, seed=2)[0].cuda()
    for budget in (7, 16, 64):
        logp, ids = torch_topk(logits, budget)
        theirs = pr_utils.build_ddtree_tree_from_topk(logp, ids, budget)
        assert_same_pr_outputs(dropin.build_ddtree_tree_from_topk(logp, ids, budget), theirs, f"cuda {budget}")
        batched = dropin.build_ddtree_tree_from_topk_batched(logp[None], ids[None], budget)
        assert_batched_row_equals(batched, 0, theirs, f"batched cuda {budget}")


def torch_topk(logits, k):
    x = logits.float()
    values, ids = torch.topk(x, k, dim=-1)
    return values - torch.logsumexp(x, dim=-1, keepdim=True), ids


PR_OUTPUTS = ("node_token_ids", "node_depths", "parents", "child_maps", "visibility", "retrieve_next_token",
              "retrieve_next_sibling")


def assert_same_pr_outputs(ours, theirs, context: str) -> None:
    assert len(ours) == len(theirs) == 7, context
    for name, a, b in zip(PR_OUTPUTS, ours, theirs):
        if name in ("parents", "child_maps"):
            assert type(a) is list and a == b, f"{name} ({context})"
        else:
            assert a.device.type == "cpu" and a.dtype == b.dtype and a.shape == b.shape, \
                f"{name}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)} ({context})"
            assert torch.equal(a, b), f"{name} differs ({context})"


def assert_batched_row_equals(batched, b: int, single, context: str) -> None:
    """Row b of the batched form is the single-request answer, padded."""
    tokens, depths, parents, child_maps, visibility, next_token, next_sibling, sizes = batched
    n = len(single[2])
    assert int(sizes[b]) == n, context
    assert torch.equal(tokens[b, : n - 1].cpu(), single[0]) and (tokens[b, n - 1:] == 0).all(), context
    assert torch.equal(depths[b, : n - 1].cpu(), single[1]) and (depths[b, n - 1:] == 0).all(), context
    assert parents[b, :n].tolist() == single[2] and (parents[b, n:] == -1).all(), context
    assert child_maps[b] == single[3], context
    assert torch.equal(visibility[b, :n, :n].cpu(), single[4]) and visibility[b, n:].sum() == 0 \
        and visibility[b, :, n:].sum() == 0, context
    assert torch.equal(next_token[b, :n].cpu(), single[5]) and (next_token[b, n:] == -1).all(), context
    assert torch.equal(next_sibling[b, :n].cpu(), single[6]) and (next_sibling[b, n:] == -1).all(), context


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
    with pytest.raises(ValueError, match="path: .* defines neither"):
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
    parts = {"dropin_topk", "dropin_host_build"}
    assert methods == ({"dropin", "kdtree", "sglang"} if utils else {"dropin", "kdtree"}) | parts
    assert all(r["stage"] == "tree_stage" and r["time_us"] > 0 for r in rows)
    paths = {r["method"]: r["topk_path"] for r in rows}
    assert paths["dropin"] == paths["dropin_topk"] == "exact" and paths["dropin_host_build"] == "none"
    if utils:
        assert all(r["matches_sglang"] is True for r in rows)


def test_the_stage_takeaway_states_each_target_and_where_the_time_goes():
    """bench.tree_build.stage_targets / stage_takeaway on a hand-made run: issue 29's targets at D=7
    (30x at B=1, 100x at B=64 budget 8, 300x at B=64 budgets >= 32, kdtree's graph <= 20 us at B=1)."""
    from kdtree_lib.bench.tree_build import stage_takeaway, stage_targets
    times = {(1, 8): {"sglang": 900.0, "dropin": 30.0, "dropin_call": 25.0, "dropin_graph": 12.0,
                      "kdtree_graph_fused": 19.5},
             (1, 64): {"sglang": 1000.0, "dropin": 100.0, "dropin_call": 85.0, "dropin_graph": 60.0,
                       "kdtree_graph_fused": 38.0},
             (64, 8): {"sglang": 20_000.0, "dropin": 190.0, "dropin_topk": 150.0, "dropin_kernel": 11.0},
             (64, 32): {"sglang": 45_000.0, "dropin": 225.0, "dropin_topk": 160.0, "dropin_kernel": 34.0},
             (8, 32): {"sglang": 4000.0, "dropin": 100.0}}  # no target at B=8
    rows = [dict(stage="tree_stage", depth=7, batch=batch, budget=budget, method=method, time_us=time)
            for (batch, budget), methods in times.items() for method, time in methods.items()]
    rows.append(dict(stage="tree_stage", depth=15, batch=1, budget=8, method="dropin", time_us=1.0))  # not D=7
    lines = {(line["what"], line["batch"], line["budget"]): line for line in stage_targets(rows)}
    assert set(lines) == {("dropin", 1, 8), ("dropin", 1, 64), ("dropin", 64, 8), ("dropin", 64, 32),
                          ("kdtree_graph_fused", 1, 8), ("kdtree_graph_fused", 1, 64)}
    assert lines["dropin", 1, 8]["met"] and lines["dropin", 1, 8]["ratio"] == 30.0
    assert not lines["dropin", 1, 64]["met"] and lines["dropin", 64, 8]["met"] and not lines["dropin", 64, 32]["met"]
    assert lines["kdtree_graph_fused", 1, 8]["met"] and not lines["kdtree_graph_fused", 1, 64]["met"]
    text = stage_takeaway(rows)
    assert "2 of 4 targets met" in text and "MISSED by 3.0x" in text and "MISSED by 1.5x" in text
    assert "host time per call 85.0 us, its calls in a CUDA graph 60.0 us" in text
    assert "its top-k 160.0 us, its build kernel 34.0 us" in text
    assert "1 of 2 budgets <= 64 within 20 us" in text and "budget 64 38.0 us (over by 18.0 us)" in text
    assert "KDTREE_SGLANG_GRAPH" not in text  # no graphed rows in this run
    rows += [dict(stage="tree_stage", depth=7, batch=1, budget=8, method="dropin_graphed", time_us=29.0),
             dict(stage="tree_stage", depth=7, batch=1, budget=8, method="dropin_graphed_call", time_us=9.5)]
    graphed = [line for line in stage_targets(rows) if line["what"] == "dropin_graphed"]
    assert len(graphed) == 1 and graphed[0]["met"] and graphed[0]["host_us"] == 9.5
    assert "KDTREE_SGLANG_GRAPH=1, same call, D=7): 1 of 1 targets met" in stage_takeaway(rows)
    assert "host time per call 9.5 us" in stage_takeaway(rows)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("topk", dropin.TOPK_CHOICES)
def test_the_benchmarks_drop_in_rows_name_the_top_k_it_ran(topk, monkeypatch):
    from kdtree_lib.bench.tree_build import DROPIN_TOPK_METHODS, bench_tree_stage
    monkeypatch.setenv(dropin.TOPK_ENV, topk)
    rows = bench_tree_stage(None, batches=(2,), depths=(7,), budgets=(16,), vocab=5000, device="cuda")
    paths = {r["method"]: r["topk_path"] for r in rows}
    assert set(DROPIN_TOPK_METHODS) | {"dropin_kernel"} <= set(paths)
    assert all(paths[name] == TOPK_PATHS[topk] for name in DROPIN_TOPK_METHODS) and paths["dropin_kernel"] == "none"
    assert all(r["time_us"] > 0 for r in rows)
    how = {r["method"]: r["dropin_path"] for r in rows}
    assert how["dropin"] == how["dropin_call"] == "eager"
    assert how["dropin_graphed"] == how["dropin_graphed_call"] == "graph"
    assert how["kdtree"] == ""


# ----------------------------------------------------------------------------------------------
# refusals (issue 28: knobs, numpy logits, depths, sizes of another batch)

@pytest.mark.parametrize("knob, value", [("SGLANG_DDTREE_MAX_TOPK", "abc"), ("SGLANG_DDTREE_MAX_TOPK", "0"),
                                         ("SGLANG_DDTREE_MAX_TOPK", "-2"), ("SGLANG_DDTREE_DEPTH_BONUS", "abc"),
                                         ("SGLANG_DDTREE_DEPTH_BONUS", "nan"), ("SGLANG_DDTREE_DEPTH_BONUS", "inf"),
                                         ("KDTREE_SGLANG_CHECK_VALUES", "yes"), ("KDTREE_SGLANG_TOPK", "fast"),
                                         ("KDTREE_SGLANG_TOPK", "")])
def test_unusable_knobs_are_refused_by_name(knob, value, monkeypatch):
    monkeypatch.setenv(knob, value)
    with pytest.raises(ValueError, match=f"^{knob}: expected"):
        dropin.build_ddtree_tree(torch.zeros(1, 7, 50), 16, "cpu")


@pytest.mark.parametrize("logits, match", [
    (np.zeros((1, 7, 50), np.float32), "draft_logits: expected a torch.Tensor, got ndarray"),
    (torch.zeros(1, 33, 50), "draft_logits: depth .* 1..32, got 33"),
    (torch.zeros(1, 0, 50), "draft_logits: depth .* got 0"),
    (torch.zeros(1, 7, 0), "draft_logits: expected a vocabulary"),
])
def test_bad_logits_are_refused_by_name(logits, match):
    with pytest.raises(ValueError, match=match):
        dropin.build_ddtree_tree(logits, 16, "cpu")


def test_eagle_format_refuses_sizes_of_another_batch():
    parents = torch.tensor([[-1, 0, 0], [-1, 0, 1]])
    with pytest.raises(ValueError, match=r"actual_tree_sizes: expected shape \(2,\)"):
        dropin.build_eagle_tree_format(parents, torch.tensor([3]), 3, "cpu")
    with pytest.raises(ValueError, match="parents: expected dtype"):
        dropin.build_eagle_tree_format(parents.float(), torch.tensor([3, 3]), 3, "cpu")
    with pytest.raises(ValueError, match="draft_token_num: expected a positive integer"):
        dropin.build_eagle_tree_format(parents, torch.tensor([3, 3]), 0, "cpu")


@pytest.mark.parametrize("change, match", [
    (lambda lp, ids, b: (lp.numpy(), ids, b), "top_log_probs: expected a torch.Tensor"),
    (lambda lp, ids, b: (lp, ids.float(), b), "top_token_ids: expected dtype"),
    (lambda lp, ids, b: (lp, ids[:, :2], b), "top_token_ids: expected top_log_probs' shape"),
    (lambda lp, ids, b: (lp[None], ids[None], b), "top_log_probs: expected 2 dimensions"),
    (lambda lp, ids, b: (lp, ids, 1025), "budget: at most 1024"),
    (lambda lp, ids, b: (lp, ids, 2.5), "budget: expected an integer"),
    (lambda lp, ids, b: (torch.full_like(lp, float("nan")), ids, b), "top_log_probs: holds NaN"),
    (lambda lp, ids, b: (lp.expand(40, -1), ids.expand(40, -1), b), "top_log_probs: depth .* got 40"),
])
def test_from_topk_refuses_bad_input_by_name(change, match):
    logp, ids = torch_topk(draft_logits("peaked", 1, 1, 100, seed=0)[0], 4)
    with pytest.raises(ValueError, match=match):
        dropin.build_ddtree_tree_from_topk(*change(logp, ids, 8))


# ----------------------------------------------------------------------------------------------
# PR #29907's format against kdtree's own references (the paper's heap, the Tree contract)

@pytest.mark.parametrize("style", ["peaked", "repeated", "flat"])
@pytest.mark.parametrize("depth, k, budget", [(7, 16, 8), (7, 40, 32), (15, 6, 64), (3, 5, 100), (5, 1, 3)])
def test_from_topk_is_the_paper_tree(style, depth, k, budget):
    from kdtree_lib.contracts import DraftTopK
    from kdtree_lib.tree_build import build_tree
    logp, ids = torch_topk(draft_logits(style, 1, depth, 300, seed=k + budget)[0], k)
    tokens, depths, parents, child_maps, visibility, next_token, next_sibling = \
        dropin.build_ddtree_tree_from_topk(logp, ids, budget)
    width = min(budget, k)
    tree = build_tree(DraftTopK(logp=logp[None, :, :width].numpy(), ids=ids[None, :, :width].to(torch.int32).numpy()),
                      budget, policy="paper", backend="numpy")
    n = int(tree.n_nodes[0])
    assert len(parents) == n and parents == tree.parents[0, :n].tolist()
    assert tokens.tolist() == tree.tokens[0, 1:n].tolist() and depths.tolist() == tree.depths[0, 1:n].tolist()
    assert np.array_equal(visibility.numpy(), tree_visibility(tree, n))
    assert next_token.tolist() == tree.first_child[0, :n].tolist()
    assert next_sibling.tolist() == tree.next_sibling[0, :n].tolist()
    assert all(child_maps[int(p)][int(t)] == c for c, (p, t) in enumerate(zip(parents[1:], tokens.tolist()), start=1))


def tree_visibility(tree, n: int) -> np.ndarray:
    from kdtree_lib.contracts import unpack_mask
    return unpack_mask(tree.mask, tree.capacity)[0, :n, :n]


# ----------------------------------------------------------------------------------------------
# patching: PR #29907's flavour, and the .pth file in an environment

def test_install_picks_pr29907s_flavour(monkeypatch):
    utils = types.ModuleType(dropin.SGLANG_MODULE)
    utils.build_ddtree_tree = utils.build_ddtree_tree_from_topk = lambda *args: "sglang"
    monkeypatch.setitem(sys.modules, utils.__name__, utils)
    replaced = dropin.install(utils)
    assert utils.build_ddtree_tree is dropin.pr29907_build_ddtree_tree
    assert utils.build_ddtree_tree_from_topk is dropin.build_ddtree_tree_from_topk and dropin.is_installed(utils)
    dropin.uninstall(replaced)
    assert not dropin.is_installed(utils)


def fake_site_packages(root, flavour: str = "main"):
    folder = root / "lib" / "site-packages"
    package = folder / "sglang" / "srt" / "speculative"
    package.mkdir(parents=True)
    for part in (folder / "sglang", folder / "sglang" / "srt", package):
        (part / "__init__.py").write_text("")
    names = ("build_ddtree_tree", "build_eagle_tree_format") if flavour == "main" else \
        ("build_ddtree_tree", "build_ddtree_tree_from_topk")
    (package / "ddtree_utils.py").write_text("".join(f"def {name}(*a):\n    return 'sglang'\n\n" for name in names))
    return folder


def test_pth_install_status_uninstall(tmp_path, capsys):
    folder = fake_site_packages(tmp_path)
    run = lambda *args: dropin.main([*args, "--site-packages", str(folder)])  # noqa: E731
    assert run("status") == 3 and "not installed" in capsys.readouterr().out
    assert run("install") == 0 and "installed:" in capsys.readouterr().out
    assert run("install") == 0 and "already installed" in capsys.readouterr().out
    assert [p.name for p in folder.glob("*.pth")] == [dropin.PTH_NAME]
    assert run("status") == 0 and "main's" in capsys.readouterr().out
    assert run("uninstall") == 0 and "uninstalled" in capsys.readouterr().out
    assert run("uninstall") == 0 and "not installed" in capsys.readouterr().out
    assert not list(folder.glob("*.pth")) and not list(folder.glob("*.tmp"))


def test_pth_refuses_other_folders_in_one_line(tmp_path, capsys):
    no_sglang = tmp_path / "site-packages"
    no_sglang.mkdir()
    other_name = fake_site_packages(tmp_path / "x").parent / "other"
    other_name.mkdir()
    for folder, match in ((no_sglang, "holds no SGLang DDTree module"), (tmp_path / "missing", "not a folder"),
                          (other_name, "expected a site-packages")):
        assert dropin.main(["install", "--site-packages", str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and match in err and "Traceback" not in err
    folder = fake_site_packages(tmp_path / "y")
    (folder / dropin.PTH_NAME).write_text("someone else's\n")
    assert dropin.main(["uninstall", "--site-packages", str(folder)]) == 2
    assert "not written by this tool" in capsys.readouterr().err and (folder / dropin.PTH_NAME).exists()


@pytest.mark.parametrize("flavour", ["main", "pr"])
def test_pth_patches_a_new_process_of_that_environment(tmp_path, flavour):
    import subprocess
    folder = fake_site_packages(tmp_path, flavour)
    assert dropin.main(["install", "--site-packages", str(folder)]) == 0
    probe = ("import site, sys; site.addsitedir(sys.argv[1]); import sglang.srt.speculative.ddtree_utils as m; "
             "from kdtree_lib.integrations import sglang as d; print(d.is_installed(m))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", dropin.INSTALL_ENV)}
    done = subprocess.run([sys.executable, "-c", probe, str(folder)], capture_output=True, text=True, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
    assert "SGLang's DDTree build is kdtree_lib's in process" in done.stderr
    off = subprocess.run([sys.executable, "-c", probe, str(folder)], capture_output=True, text=True,
                         env={**env, dropin.INSTALL_ENV: "0"}, cwd=tmp_path)
    assert off.stdout.strip() == "False", off.stderr
    assert dropin.main(["uninstall", "--site-packages", str(folder)]) == 0
    after = subprocess.run([sys.executable, "-c", probe, str(folder)], capture_output=True, text=True, env=env,
                           cwd=tmp_path)
    assert after.returncode != 0 or after.stdout.strip() == "False"


# ----------------------------------------------------------------------------------------------
# the prepared call's per-call path (CPU: the module's GPU path on CPU tensors, the driver stubbed and
# every launch's parameters recorded, as bench.dropin_host measures it)

@pytest.fixture
def proxy():
    """(the drop-in's module with its GPU path taking CPU tensors, the launches recorded: (kernel, slots))."""
    from kdtree_lib.bench import dropin_host
    launches = []
    with dropin_host.stubbed_driver(launches):
        yield dropin_host.proxy_module(dropin_host.module_source(None)), launches


def recorded(launches, kernel: str) -> list:
    return [slots for name, slots in launches if name == kernel]


def build_outputs(slots) -> dict:
    """The build launch's output addresses by name (SGLANG_OUTPUTS order, after its other parameters)."""
    from kdtree_lib.tree_build import SGLANG_OUTPUTS
    return dict(zip(SGLANG_OUTPUTS, slots[len(slots) - len(SGLANG_OUTPUTS):]))


def memory_range(tensor) -> range:
    return range(tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size())


def test_a_warm_call_points_its_launches_at_this_calls_logits_and_outputs(proxy):
    module, launches = proxy
    first, second = torch.randn(1, 7, 5000), torch.randn(1, 7, 5000)  # another address, as the worker's next step
    kept = module.build_ddtree_tree(first, 32, first.device)
    module.build_ddtree_tree(second, 32, first.device)
    again = module.build_ddtree_tree(first, 32, first.device)
    topk = recorded(launches, "draft_topk_fused_vec4")
    assert [slots[0] for slots in topk] == [first.data_ptr(), second.data_ptr(), first.data_ptr()]
    builds = recorded(launches, "build_tree_sglang")
    assert len(builds) == 3 and len(module._CALLS) == 1
    logp = builds[0][0]
    for slots, returned in ((builds[0], kept), (builds[2], again)):
        written = build_outputs(slots)
        assert slots[0] == logp  # the prepared top-k's own buffers: never moved
        for name, tensor in zip(("node_tokens", "node_depths", "parents", "visibility", "sizes"),
                                returned[:3] + returned[4:]):
            assert written[name] == tensor.data_ptr(), name
    # the first call's outputs, still held, are no later call's outputs
    held = [memory_range(t) for t in kept[:3] + kept[4:]]
    for slots in builds[1:]:
        for name, address in build_outputs(slots).items():
            assert name == "bad" or not any(address in r for r in held), name


def test_a_changed_knob_between_calls_takes_effect_and_is_checked_first(proxy, monkeypatch):
    module, launches = proxy
    logits = torch.randn(2, 7, 3000)
    module.build_ddtree_tree(logits, 32, logits.device)
    monkeypatch.setenv("SGLANG_DDTREE_MAX_TOPK", "3")
    module.build_ddtree_tree(logits, 32, logits.device)
    widths = [slots[2] for slots in recorded(launches, "draft_topk_fused_vec4")]  # the top-k's k
    assert widths == [5, 3] and len(module._CALLS) == 2  # min(SGLANG_DDTREE_MAX_TOPK, 32 // 7 + 1)
    for knob, value in (("SGLANG_DDTREE_MAX_TOPK", "abc"), ("KDTREE_SGLANG_TOPK", "fast"), (module.GRAPH_ENV, "2")):
        monkeypatch.setenv(knob, value)
        count = len(launches)
        with pytest.raises(ValueError, match=f"^{knob}: expected"):
            module.build_ddtree_tree(logits, 32, logits.device)
        assert len(launches) == count, "refused before any launch"
        monkeypatch.delenv(knob)
    module.build_ddtree_tree(logits, 32, logits.device)  # the defaults again: the first call's key
    assert recorded(launches, "draft_topk_fused_vec4")[-1][2] == 5 and len(module._CALLS) == 2


def test_a_warm_key_still_refuses_bad_input_before_any_launch(proxy):
    module, launches = proxy
    logits = torch.randn(1, 7, 3000)
    module.build_ddtree_tree(logits, 16, logits.device)
    count = len(launches)
    for args, match in (((logits.long(), 16), "draft_logits: expected dtype"), ((logits, True), "tree_budget"),
                        ((logits, 1025), "tree_budget: at most"), ((logits[0], 16), "draft_logits: expected 3"),
                        ((logits.numpy(), 16), "draft_logits: expected a torch.Tensor")):
        with pytest.raises(ValueError, match=match):
            module.build_ddtree_tree(*args, logits.device)
    with pytest.raises(ValueError, match="device: expected a torch device"):
        module.build_ddtree_tree(logits, 16, "nonsense")
    assert len(launches) == count


def test_the_workers_buffers_are_written_in_place_call_after_call(proxy):
    module, launches = proxy
    logits = torch.randn(3, 7, 3000)
    buffers = (torch.zeros(8, 32, dtype=torch.long), torch.zeros(8, 32, dtype=torch.long),
               torch.zeros(8, 33, dtype=torch.long), torch.zeros(8, 33, 33, dtype=torch.bool))
    trees = [module.build_ddtree_tree(logits, 32, logits.device, *buffers) for _ in range(2)]
    other = tuple(b.clone() for b in buffers)  # the worker's buffers replaced
    trees.append(module.build_ddtree_tree(logits, 32, logits.device, *other))
    for tree, given, slots in zip(trees, (buffers, buffers, other), recorded(launches, "build_tree_sglang")):
        written = build_outputs(slots)
        for name, returned, buffer in zip(module.OUT_NAMES, tree[:3] + tree[4:5], given):
            assert returned.data_ptr() == buffer.data_ptr() == written[name] and returned.shape[0] == 3, name
    assert trees[1][2] is trees[0][2]  # the same rows of the same buffers
    eagle = module.build_eagle_tree_format(trees[2][2], trees[2][5], 33, logits.device)
    assert [t.data_ptr() for t in eagle] == [build_outputs(recorded(launches, "build_tree_sglang")[-1])[name]
                                             for name in ("retrive_index", "next_token", "next_sibling")]
    assert not recorded(launches, "eagle_tree_format"), "handed over: no launch"


def test_the_host_proxy_runs_and_refuses_by_flag(capsys):
    from kdtree_lib.bench import dropin_host
    assert dropin_host.main(["--budgets", "8", "--number", "2", "--out-buffers"]) == 0
    assert "CPU proxy, checkout: B=1 D=7 budget=   8 _out_* buffers:" in capsys.readouterr().out
    assert dropin_host.main(["--budgets", "8,0"]) == 2
    assert "argument --budgets: expected a positive integer, got '0'" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# the kernel path (GPU): against the host path, poisoned, in a CUDA graph, without host syncs

KERNEL_CASES = [(3, 7, 3000, 8), (3, 7, 3000, 7), (2, 7, 3000, 3), (4, 7, 3000, 32), (2, 15, 2000, 64),
                (2, 15, 2000, 128), (1, 7, 50, 128), (2, 3, 5, 16), (2, 2, 40, 1024), (64, 7, 3000, 32)]


# the fused top-k on "repeated" logits: every depth holds the same values, so candidates at different
# depths tie exactly and the last-bit rounding of their weights decides (the module's docstring)
STYLE_TOPK = [("peaked", "exact"), ("repeated", "exact"), ("flat", "exact"), ("peaked", "fused"), ("flat", "fused")]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("style, topk", STYLE_TOPK)
@pytest.mark.parametrize("batch, depth, vocab, budget", KERNEL_CASES)
@pytest.mark.parametrize("knobs", [{}, {"SGLANG_DDTREE_MAX_TOPK": "3"},
                                   {"SGLANG_DDTREE_DEPTH_BONUS": "-0.5", "SGLANG_DDTREE_MAX_TOPK": "16"}])
def test_kernel_path_equals_the_host_reference(style, topk, batch, depth, vocab, budget, knobs, monkeypatch):
    monkeypatch.setenv(dropin.TOPK_ENV, topk)
    for name, value in knobs.items():
        monkeypatch.setenv(name, value)
    logits = draft_logits(style, batch, depth, vocab, seed=batch * budget + depth)
    context = f"{style} B={batch} L={depth} V={vocab} budget={budget} {knobs}"
    want = dropin.build_ddtree_tree(logits, budget, "cpu")
    got = dropin.build_ddtree_tree(logits.cuda(), budget, "cpu")
    assert_same_outputs(got, want, context)
    got_gpu = dropin.build_ddtree_tree(logits.cuda(), budget, logits.cuda().device)
    eagle_want = dropin.build_eagle_tree_format(want[2], want[5], budget + 1, "cpu")
    eagle_got = dropin.build_eagle_tree_format(got_gpu[2], got_gpu[5], budget + 1, "cpu")
    for a, b in zip(eagle_got, eagle_want):
        assert a.dtype == b.dtype and torch.equal(a, b), context


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("width", [1, 7, 40, 129, 1025])
def test_eagle_kernel_equals_the_torch_path(width):
    rng = np.random.default_rng(width)
    parents = torch.from_numpy(random_parents(rng, 9, width))
    if width > 2:
        parents[3, 2] = width + 5  # a parent outside the tree (and below: sizes past the columns, negative)
    sizes = torch.from_numpy(rng.integers(-2, width + 3, 9))
    for columns in (width, max(1, width - 3)):
        want = dropin.build_eagle_tree_format(parents[:, :columns], sizes, width, "cpu")
        got = dropin.build_eagle_tree_format(parents[:, :columns].cuda(), sizes.cuda().int(), width, "cpu")
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), (width, columns)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("policy", ["sglang", "paper"])
def test_kernel_writes_every_output_element(policy):
    from kdtree_lib.tree_build import SGLangBuildLaunch
    logits = draft_logits("flat", 5, 7, 3000, seed=9).cuda()
    logp, ids = torch_topk(logits, 6)
    launch = SGLangBuildLaunch(5, 7, 6, 32, 0, policy=policy, ids_int64=True, links=True)
    clean = launch(logp, ids, launch.allocate(logits))
    poisoned = launch.allocate(logits)
    for tensor in poisoned.values():
        tensor.view(torch.uint8).fill_(0xA5)
    poisoned = launch(logp, ids, poisoned)
    torch.cuda.synchronize()
    for name in clean:
        assert torch.equal(clean[name], poisoned[name]), name
    assert (poisoned["bad"] == 0).all() and ((poisoned["visibility"].view(torch.uint8) <= 1).all())


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("depth, k, budget", [(7, 20, 48), (32, 400, 400)])  # the second reads past the staged ranks
def test_batched_from_topk_equals_each_request(depth, k, budget):
    logits = draft_logits("repeated", 6, depth, 3000, seed=4).cuda()
    logits[2] = draft_logits("flat", 1, depth, 3000, seed=5)[0].cuda()
    logp, ids = torch_topk(logits, k)
    batched = dropin.build_ddtree_tree_from_topk_batched(logp, ids.int(), budget)
    for b in range(6):
        single = dropin.build_ddtree_tree_from_topk(logp[b].cpu(), ids[b].cpu(), budget)
        assert_batched_row_equals(batched, b, single, f"request {b}")
        assert_same_pr_outputs(dropin.build_ddtree_tree_from_topk(logp[b], ids[b], budget), single, f"cuda {b}")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("topk", dropin.TOPK_CHOICES)
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf row"])
def test_non_finite_logits_raise_or_give_the_root_alone(topk, bad, monkeypatch):
    """A request whose logits hold NaN or +inf, or a position entirely -inf: flagged by the fused
    top-k (its row written as NaN) or NaN by torch's arithmetic, then rooted alone by the build."""
    monkeypatch.setenv(dropin.TOPK_ENV, topk)
    logits = draft_logits("peaked", 3, 7, 3000, seed=6).cuda()
    if bad == "-inf row":
        logits[1, 4] = float("-inf")
    else:
        logits[1, 4, 17] = float(bad)
    assert dropin.prepared_build(logits, 32).topk_path == TOPK_PATHS[topk]
    monkeypatch.setenv(dropin.CHECK_ENV, "1")
    with pytest.raises(ValueError, match=r"draft_logits: request\(s\) \[1\] hold NaN"):
        dropin.build_ddtree_tree(logits, 32, logits.device)
    monkeypatch.setenv(dropin.CHECK_ENV, "0")
    tokens, depths, parents, _, visibility, sizes = dropin.build_ddtree_tree(logits, 32, logits.device)
    want = dropin.build_ddtree_tree(logits[[0, 2]].cpu(), 32, "cpu")
    assert sizes.tolist()[1] == 1 and (tokens[1] == 0).all() and (parents[1] == -1).all()
    assert (depths[1] == 0).all() and visibility[1].sum() == 1 and bool(visibility[1, 0, 0])
    assert torch.equal(tokens[[0, 2]].cpu(), want[0]) and torch.equal(sizes[[0, 2]].cpu(), want[5])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("topk", dropin.TOPK_CHOICES)
@pytest.mark.parametrize("budget", [7, 32])
def test_the_drop_in_captures_in_a_cuda_graph(budget, topk, monkeypatch):
    monkeypatch.setenv(dropin.TOPK_ENV, topk)
    logits = draft_logits("peaked", 4, 7, 5000, seed=7).cuda()

    def step():
        tree = dropin.build_ddtree_tree(logits, budget, logits.device)
        return tree, dropin.build_eagle_tree_format(tree[2], tree[5], budget + 1, logits.device)

    eager_tree, eager_eagle = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_tree, captured_eagle = step()
    logits.copy_(draft_logits("flat", 4, 7, 5000, seed=8).cuda())
    graph.replay()
    torch.cuda.synchronize()
    fresh_tree, fresh_eagle = step()
    for name, a, b in zip(OUTPUTS, captured_tree, fresh_tree):
        if name != "child_maps":
            assert torch.equal(a, b), f"{name}: replay on new logits differs from eager"
    assert list(captured_tree[3]) == list(fresh_tree[3])
    for a, b in zip(captured_eagle, fresh_eagle):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(eager_tree[:3], fresh_tree[:3])), "the new logits change the tree"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("topk", dropin.TOPK_CHOICES)
def test_the_drop_in_never_synchronizes_by_default(topk, monkeypatch):
    monkeypatch.delenv(dropin.CHECK_ENV, raising=False)
    monkeypatch.setenv(dropin.TOPK_ENV, topk)
    logits = draft_logits("peaked", 8, 7, 5000, seed=3).cuda()
    dropin.build_ddtree_tree(logits, 32, logits.device)  # prepared and compiled
    assert dropin.prepared_build(logits, 32).topk_path == TOPK_PATHS[topk]
    buffers = dict(_out_node_token_ids=torch.zeros(16, 32, dtype=torch.long, device=logits.device),
                   _out_node_depths=torch.zeros(16, 32, dtype=torch.long, device=logits.device),
                   _out_parents=torch.zeros(16, 33, dtype=torch.long, device=logits.device),
                   _out_visibility=torch.zeros(16, 33, 33, dtype=torch.bool, device=logits.device))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        new_logits = logits * 0.5  # another tensor, as the worker's next step hands over
        tree = dropin.build_ddtree_tree(new_logits, 32, logits.device, **buffers)
        dropin.build_eagle_tree_format(tree[2], tree[5], 33, logits.device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tree[0].data_ptr() == buffers["_out_node_token_ids"].data_ptr()  # written in place, as SGLang does
    assert tree[4].data_ptr() == buffers["_out_visibility"].data_ptr() and tuple(tree[4].shape) == (8, 33, 33)
    again = dropin.build_ddtree_tree(new_logits, 32, logits.device)  # fresh outputs
    for name, a, b in zip(OUTPUTS, tree, again):
        assert name == "child_maps" or torch.equal(a, b), name


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("topk", dropin.TOPK_CHOICES)
def test_an_earlier_calls_outputs_survive_later_calls(topk, monkeypatch):
    """The caller may keep what a call returned: later calls of the same key (other logits, another
    address) never write into it."""
    monkeypatch.setenv(dropin.TOPK_ENV, topk)
    styles = ("peaked", "flat", "repeated")
    logits = [draft_logits(style, 3, 7, 5000, seed=20 + i).cuda() for i, style in enumerate(styles)]
    kept = []
    for x in logits:
        tree = dropin.build_ddtree_tree(x, 32, x.device)
        kept.append((tree, dropin.build_eagle_tree_format(tree[2], tree[5], 33, x.device)))
    torch.cuda.synchronize()
    for x, (tree, eagle), style in zip(logits, kept, styles):
        want = dropin.build_ddtree_tree(x.cpu(), 32, "cpu")
        assert_same_outputs([t.cpu() if isinstance(t, torch.Tensor) else t for t in tree], want, style)
        for a, b in zip(eagle, dropin.build_eagle_tree_format(want[2], want[5], 33, "cpu")):
            assert torch.equal(a.cpu(), b), style


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("topk", dropin.TOPK_CHOICES)
@pytest.mark.parametrize("budget", [7, 32, 128])
@pytest.mark.parametrize("given", [False, True])
def test_graph_replay_equals_the_eager_call(topk, budget, given, monkeypatch):
    """KDTREE_SGLANG_GRAPH=1: the call copies the logits into the graph's static buffer and replays;
    every output (and the EAGLE arrays handed over) equals the eager call's, on several logits in a
    row (bf16 and non-contiguous ones too), and what an earlier call returned is not rewritten."""
    monkeypatch.setenv(dropin.TOPK_ENV, topk)
    nodes = budget + 1
    buffers = (torch.zeros(6, budget, dtype=torch.long, device="cuda"),
               torch.zeros(6, budget, dtype=torch.long, device="cuda"),
               torch.zeros(6, nodes, dtype=torch.long, device="cuda"),
               torch.zeros(6, nodes, nodes, dtype=torch.bool, device="cuda")) if given else ()
    wide = draft_logits("peaked", 4, 7, 5001, seed=31).cuda()
    inputs = [draft_logits("peaked", 4, 7, 5000, seed=30).cuda(), draft_logits("flat", 4, 7, 5000, seed=32).cuda(),
              wide[..., 1:], draft_logits("peaked", 4, 7, 5000, seed=33).cuda().bfloat16()]

    def step(x):
        tree = dropin.build_ddtree_tree(x, budget, x.device, *buffers)
        return tree, dropin.build_eagle_tree_format(tree[2], tree[5], nodes, x.device)

    def copied(tree, eagle):  # the buffers are rewritten by the next call
        return [t.clone() if isinstance(t, torch.Tensor) else list(t) for t in tree], [t.clone() for t in eagle]

    eager = [copied(*step(x)) for x in inputs]
    monkeypatch.setenv(dropin.GRAPH_ENV, "1")
    returned, graphed = [], []
    for x in inputs:
        returned.append(step(x))
        graphed.append(copied(*returned[-1]))
    build = dropin.prepared_build(inputs[0], budget)
    assert build.graph is not None, "the float32 shape was captured"
    for (want_tree, want_eagle), (tree, eagle), x in zip(eager, graphed, inputs):
        assert_same_outputs(tree, want_tree, f"graph {x.dtype} contiguous={x.is_contiguous()}")
        for a, b in zip(eagle, want_eagle):
            assert torch.equal(a, b)
    if not given:  # fresh outputs: the first call's are still its own
        assert_same_outputs(returned[0][0], eager[0][0], "kept")
        assert all(torch.equal(a, b) for a, b in zip(returned[0][1], eager[0][1]))


@pytest.mark.gpu
@cuda
def test_graphs_are_bounded(monkeypatch):
    """At most GRAPH_LIMIT graphs (the least recently used dropped), and logits above
    GRAPH_LOGITS_BYTES run eagerly; both still equal the eager call."""
    monkeypatch.setenv(dropin.GRAPH_ENV, "1")
    monkeypatch.setattr(dropin, "GRAPH_LIMIT", 2)
    logits = draft_logits("peaked", 2, 7, 3000, seed=40).cuda()
    builds = []
    for budget in (16, 24, 32):
        dropin.build_ddtree_tree(logits, budget, logits.device)
        builds.append(dropin.prepared_build(logits, budget))
    assert builds[0].graph is None and builds[1].graph is not None and builds[2].graph is not None
    assert len(dropin._GRAPHED) <= 2
    monkeypatch.setattr(dropin, "GRAPH_LOGITS_BYTES", logits.numel() * 4 - 1)
    big = dropin.build_ddtree_tree(logits, 40, logits.device)
    assert dropin.prepared_build(logits, 40).graph is None
    monkeypatch.setenv(dropin.GRAPH_ENV, "0")
    assert_same_outputs(big, dropin.build_ddtree_tree(logits, 40, logits.device), "eager above the bound")


def recording_torch_ops():
    """A torch dispatch mode that records the name of every torch operation run under it (`.ops`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recording(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    return Recording()


@pytest.mark.gpu
@cuda
def test_a_warm_fused_call_runs_no_torch_operation_but_its_sizes(monkeypatch):
    """The worker's call (fused top-k, its four _out_* buffers), warm: the torch operations it
    dispatches are the allocation of the sizes and the EAGLE arrays; the work is the two launches."""
    monkeypatch.setenv(dropin.TOPK_ENV, "fused")
    logits = draft_logits("peaked", 8, 7, 5000, seed=3).cuda()
    buffers = (torch.zeros(16, 32, dtype=torch.long, device="cuda"), torch.zeros(16, 32, dtype=torch.long, device="cuda"),
               torch.zeros(16, 33, dtype=torch.long, device="cuda"), torch.zeros(16, 33, 33, dtype=torch.bool, device="cuda"))
    want = dropin.build_ddtree_tree(logits, 32, logits.device)
    dropin.build_ddtree_tree(logits, 32, logits.device, *buffers)  # prepared
    with recording_torch_ops() as recording:
        got = dropin.build_ddtree_tree(logits, 32, logits.device, *buffers)
    print("torch operations of a warm fused call:", recording.ops)
    # the sizes' empty, and one empty for the three EAGLE arrays ([3, B, N], unbound); the buffers' rows
    # are the last call's views (same buffers)
    assert sorted(recording.ops) == ["empty", "empty", "unbind"], recording.ops
    for name, a, b in zip(OUTPUTS, got, want):
        assert name == "child_maps" or torch.equal(a, b), name


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("topk", dropin.TOPK_CHOICES)
def test_eagle_format_of_the_builds_own_outputs_costs_no_launch(topk, monkeypatch):
    """build_eagle_tree_format handed the parents and sizes the last build returned, unchanged, returns
    the arrays the build kernel wrote (no launch, no torch operation); parents changed in place, a
    copy, sizes of another call, another width, a second call for the same tensors, or a later build
    in between: the kernel runs, and every answer equals the torch path's on the tensors passed."""
    launches = []
    original = dropin.EagleFormatLaunch.__call__
    monkeypatch.setattr(dropin.EagleFormatLaunch, "__call__",
                        lambda self, *args: launches.append(1) or original(self, *args))
    monkeypatch.setenv(dropin.TOPK_ENV, topk)
    logits = draft_logits("peaked", 5, 7, 5000, seed=11).cuda()
    buffers = (torch.zeros(8, 32, dtype=torch.long, device="cuda"), torch.zeros(8, 32, dtype=torch.long, device="cuda"),
               torch.zeros(8, 33, dtype=torch.long, device="cuda"), torch.zeros(8, 33, 33, dtype=torch.bool, device="cuda"))

    def want(parents, sizes, width=33):
        return dropin._eagle_format_torch(parents.cpu(), sizes.cpu(), width)

    def check(got, parents, sizes, width=33):
        for a, b in zip(got, want(parents, sizes, width)):
            assert a.device == logits.device and torch.equal(a.cpu(), b)

    for given in ((), buffers):  # fresh outputs, and the worker's buffers written in place
        tree = dropin.build_ddtree_tree(logits, 32, logits.device, *given)
        with recording_torch_ops() as recording:
            handed = dropin.build_eagle_tree_format(tree[2], tree[5], 33, logits.device)
        assert not launches and recording.ops == [], recording.ops
        check(handed, tree[2], tree[5])
        again = dropin.build_eagle_tree_format(tree[2], tree[5], 33, logits.device)  # once only
        assert len(launches) == 1 and all(a.data_ptr() != b.data_ptr() for a, b in zip(again, handed))
        check(again, tree[2], tree[5])
        launches.clear()

    cases = {"parents changed in place": lambda t: (t[2].index_fill_(1, torch.tensor([5], device="cuda"), 0), t[5]),
             "sizes changed in place": lambda t: (t[2], t[5].sub_(1)),
             "a copy of parents": lambda t: (t[2].clone(), t[5]),
             "sizes of another call": lambda t: (t[2], t[5].clone())}
    for name, change in cases.items():
        tree = dropin.build_ddtree_tree(logits, 32, logits.device, *buffers)
        parents, sizes = change(tree)
        check(dropin.build_eagle_tree_format(parents, sizes, 33, logits.device), parents, sizes)
        assert len(launches) == 1, name
        launches.clear()
    tree = dropin.build_ddtree_tree(logits, 32, logits.device)
    check(dropin.build_eagle_tree_format(tree[2], tree[5], 40, logits.device), tree[2], tree[5], 40)  # another width
    tree = dropin.build_ddtree_tree(logits, 32, logits.device, *buffers)
    dropin.build_ddtree_tree(logits * 0.25, 16, logits.device, *buffers[:2])  # a later build in between
    check(dropin.build_eagle_tree_format(tree[2], tree[5], 33, logits.device), tree[2], tree[5])
    assert len(launches) == 2


# ----------------------------------------------------------------------------------------------
# the fused top-k against the exact one: where each runs, and how many trees differ

def zipf_logits(batch: int, depth: int, vocab: int, seed: int, *, exponent: float = 1.1, noise: float = 0.5):
    """Zipf-like draft logits on the GPU: log-probability about -exponent * log(rank) (plus noise), each
    position's ranks over a random permutation of the vocabulary, its top token some nats ahead."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    ranks = torch.argsort(torch.rand(batch, depth, vocab, device="cuda", generator=generator), dim=-1) + 1
    logits = -exponent * torch.log(ranks.float())
    logits += noise * torch.randn(batch, depth, vocab, device="cuda", generator=generator)
    lead = 4 * torch.rand(batch, depth, 1, device="cuda", generator=generator)
    return torch.where(ranks == 1, logits + lead, logits)


def differing_trees(logits, budget: int, monkeypatch) -> int:
    """How many requests' outputs (tree tensors and EAGLE arrays) differ between the fused and the exact top-k."""
    outputs = {}
    for topk in ("fused", "exact"):
        monkeypatch.setenv(dropin.TOPK_ENV, topk)
        assert dropin.prepared_build(logits, budget).topk_path == TOPK_PATHS[topk], (topk, budget)
        tree = dropin.build_ddtree_tree(logits, budget, logits.device)
        eagle = dropin.build_eagle_tree_format(tree[2], tree[5], budget + 1, logits.device)
        outputs[topk] = [tree[0], tree[1], tree[2], tree[4], tree[5][:, None], eagle[1], eagle[2]]
    same = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    for a, b in zip(outputs["fused"], outputs["exact"]):
        same &= (a == b).flatten(1).all(dim=1)
    return int((~same).sum())


@pytest.mark.gpu
@cuda
def test_fused_and_exact_trees_agree_on_realistic_logits(drafter_logits, monkeypatch):
    """On Zipf-like, peaked and drafter-like logits, every budget, D = 7 and 15: the number of requests
    whose tree differs between KDTREE_SGLANG_TOPK=fused and =exact is 0 (a difference needs two
    compared numbers within a few ulps: the module's docstring)."""
    sets = {"zipf": [zipf_logits(16, depth, 163_840, seed=depth) for depth in (7, 15)],
            "zipf steep": [zipf_logits(16, 7, 163_840, seed=3, exponent=1.6, noise=0.2)],
            "peaked": [draft_logits("peaked", 16, depth, 163_840, seed=depth).cuda() for depth in (7, 15)],
            "drafter": drafter_logits}
    counts = {}
    for name, batches in sets.items():
        for budget in ("depth", 8, 16, 32, 64, 128, 512):  # "depth": SGLang's spine fast path (top-1 ids only)
            compared = differing = 0
            for logits in batches:
                differing += differing_trees(logits, logits.shape[1] if budget == "depth" else budget, monkeypatch)
                compared += logits.shape[0]
            counts[f"{name} budget={budget}"] = (differing, compared)
    print("trees differing (fused vs exact), (differing, compared):", counts)
    assert all(compared > 0 for _, compared in counts.values())
    assert sum(differing for differing, _ in counts.values()) == 0, counts


@pytest.mark.gpu
@cuda
def test_the_exact_top_k_runs_where_the_fused_one_does_not_apply(monkeypatch):
    """Widths above 128 (SGLANG_DDTREE_MAX_TOPK raised) take torch's exact top-k; bf16 logits take
    the fused one on their float32 values (SGLang's `.float()`), non-contiguous ones on a copy."""
    logits = draft_logits("peaked", 2, 2, 3000, seed=11).cuda()
    monkeypatch.setenv("SGLANG_DDTREE_MAX_TOPK", "200")
    prepared = dropin.prepared_build(logits, 512)
    assert prepared.topk == 200 and prepared.topk_path == "exact"
    assert_same_outputs(dropin.build_ddtree_tree(logits, 512, "cpu"), dropin.build_ddtree_tree(logits.cpu(), 512, "cpu"),
                        "width 200")
    monkeypatch.delenv("SGLANG_DDTREE_MAX_TOPK")
    half = draft_logits("peaked", 4, 7, 5000, seed=12).cuda().bfloat16()
    assert dropin.prepared_build(half, 32).topk_path == "fused_v3"
    assert_same_outputs(dropin.build_ddtree_tree(half, 32, "cpu"), dropin.build_ddtree_tree(half.float(), 32, "cpu"),
                        "bf16")
    wide = draft_logits("peaked", 4, 7, 5001, seed=13).cuda()
    strided = wide[..., 1:]  # 5000 logits a row, rows 5001 apart: not contiguous
    assert_same_outputs(dropin.build_ddtree_tree(strided, 32, "cpu"),
                        dropin.build_ddtree_tree(strided.contiguous(), 32, "cpu"), "non-contiguous")
    misaligned = wide.flatten()[1:1 + 4 * 7 * 5000].view(4, 7, 5000)  # contiguous, 4 bytes past 16-byte alignment
    assert misaligned.is_contiguous() and misaligned.data_ptr() % 16
    assert_same_outputs(dropin.build_ddtree_tree(misaligned, 32, "cpu"),
                        dropin.build_ddtree_tree(misaligned.clone(), 32, "cpu"), "misaligned")


def test_launch_passes_sglangs_own_options_on(monkeypatch):
    started = {}
    monkeypatch.setattr(dropin.runpy, "run_module", lambda name, **kw: started.update(name=name, argv=list(sys.argv)))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delenv(dropin.INSTALL_ENV, raising=False)
    assert dropin.main(["launch", "--model-path", "m", "--speculative-algorithm", "DDTREE"]) == 0
    assert started == {"name": "sglang.launch_server",
                       "argv": ["sglang.launch_server", "--model-path", "m", "--speculative-algorithm", "DDTREE"]}
    assert os.environ[dropin.INSTALL_ENV] == "1"


def test_a_device_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="device: expected a torch device, got 'nonsense'"):
        dropin.build_ddtree_tree(torch.zeros(1, 7, 50), 8, "nonsense")
