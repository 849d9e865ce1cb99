"""The CPU op counter (kdtree_lib.bench.op_counts): what it counts on known calls, that a step's counts
are stable, that its host stand-ins for the prepared launches decode as the host backend does, and the
pinned upper bounds on the torch ops of one eager step (a rewrite that adds ops to the step fails here)."""
import numpy as np
import pytest
import torch

from kdtree_lib.bench import op_counts
from kdtree_lib.bench.op_counts import OpCounter, count_ops, host_decoder, step_counts
from kdtree_lib.decode import shape_decoder
from kdtree_lib.pairs import pair_with_prompts, random_pair

# torch ops of one eager step of the stand-in pair (k26-mini, batch 1, bf16), reached by the rewrites of
# issue 30 (before them: AR 625, chain and DDTree 1,088). A change that adds ops fails here; one that
# removes some lowers the bound. The float experts' combine in slot order (model.combine_slots, one op more
# per MoE layer than index_add_) bought a step that repeats itself on a GPU: 5 ops. In bf16 each RMSNorm
# counts as its kernel's one prepared launch (AR 25, chain/DDTree 52 of them), not its ~8 torch ops.
MAX_OPS = {"ar": 291, "chain": 445, "ddtree-8": 445, "ddtree-32": 445}


def test_views_metadata_and_bare_allocations_are_not_counted():
    x = torch.randn(4, 6)

    def known(x):
        y = x.view(24).unsqueeze(0).t().detach()          # views: nothing
        z = x.t().reshape(-1)                               # a non-contiguous reshape copies: 1
        torch.empty(3), torch.empty_like(x)                 # bare allocations: nothing
        w = torch.zeros(2)                                  # an allocation filled on the device: 1
        return (y * 2 + 1).sum() + z[0] + w[0]              # mul, add, sum, add, add: 5 (z[0], w[0] views)
    count, _ = count_ops(known, x)
    assert count == 7
    with OpCounter() as counter:
        x.sum().item()
    assert counter.total == 1 and sum(counter.host_reads.values()) == 1


def test_out_and_in_place_ops_count_once():
    x, out = torch.randn(3, 5), torch.empty(3, dtype=torch.long)
    count, _ = count_ops(lambda: (torch.argmax(x, dim=-1, out=out), x.add_(1), x.copy_(x)))
    assert count == 3


def test_a_prepared_stand_in_counts_once_and_hides_its_ops():
    with OpCounter() as counter:
        with counter.prepared("kernel"):
            torch.randn(4).exp().sum()
        torch.ones(2).neg()
    assert counter.total == 2 and counter.prepared_calls == {"kernel": 1}


@pytest.fixture(scope="module")
def stand_in():
    chosen = pair_with_prompts(8, prompts_per_package=2, prompt_tokens=24, dtype=torch.bfloat16)
    if not chosen.stand_in:
        pytest.skip("no stand-in checkpoint under data/models")
    return chosen


@pytest.mark.parametrize("method, budget", [("ar", 1), ("chain", 7), ("ddtree", 8), ("ddtree", 32)])
def test_a_step_counts_the_same_on_every_step_and_prompt(stand_in, method, budget):
    first = step_counts(stand_in.target, stand_in.drafter, stand_in.prompts[:1], method=method, budget=budget)
    later = step_counts(stand_in.target, stand_in.drafter, stand_in.prompts[:1], method=method, budget=budget,
                        warmup=3)
    other = step_counts(stand_in.target, stand_in.drafter, stand_in.prompts[1:2], method=method, budget=budget)
    assert first.counts == later.counts == other.counts
    assert first.by_op == later.by_op == other.by_op
    assert not first.host_reads, f"an eager step reads the device back: {dict(first.host_reads)}"
    layers = len(stand_in.target.layers)
    kernels = {"verify attention": layers} | ({} if method == "ar" else
                                              {"draft top-k": 1, "tree build": 1, "accept": 1, "compaction": 1})
    # the norms run as kernels (bf16): per target layer input, q_a, kv_a and post-attention, plus the final
    # norm; per drafter layer input, q, k for the block, k for the context it extends and post-attention,
    # plus its hidden and final norms
    norms = 4 * layers + 1 + (0 if method == "ar" else 5 * len(stand_in.drafter.layers) + 2)
    assert first.prepared_calls == kernels | {"rms norm": norms}


def test_the_step_stays_within_its_pinned_op_counts(stand_in):
    depth = stand_in.drafter.config.draft_depth
    steps = [step_counts(stand_in.target, stand_in.drafter, stand_in.prompts[:1], method=method, budget=budget)
             for method, budget in op_counts.shapes((8, 32), depth)]
    print(op_counts.table(steps))
    found = {step.shape: step.total for step in steps}
    assert found.keys() == MAX_OPS.keys()
    over = {shape: (found[shape], limit) for shape, limit in MAX_OPS.items() if found[shape] > limit}
    assert not over, f"torch ops per eager step above the pinned bound (found, bound): {over}"


@pytest.mark.parametrize("method, budget", [("ar", 1), ("chain", 7), ("ddtree", 6)])
def test_the_host_stand_ins_decode_as_the_host_backend(method, budget):
    """HostLaunches runs PreparedStep.step, the GPU's step: its tokens, acceptance and caches equal those
    of the host backend's own step (so the counted step is a real step, not a stub)."""
    target, drafter = random_pair(vocab=48, draft_sharpness=0.05)
    prompts = [np.array([3, 9, 4, 17, 5]), np.array([8, 1, 30, 2, 7, 11, 6])]
    counted = host_decoder(target, drafter, prompts, method=method, budget=budget, new_tokens=12, counter=OpCounter())
    plain = shape_decoder(target, drafter, prompts, method=method, budget=budget, new_tokens=12, backend="numpy")
    for _ in range(4):
        counted.step()
        plain.step()
    for name in ("out", "out_len", "accepted", "root"):
        assert torch.equal(getattr(counted, name), getattr(plain, name)), name
    assert torch.equal(counted.cache.lengths, plain.cache.lengths)
    for mine, theirs in zip(counted.cache.kv, plain.cache.kv):
        assert torch.equal(mine, theirs)


def test_the_command_prints_the_table(capsys):
    assert op_counts.main(["--budgets", "8"]) == 0
    out = capsys.readouterr().out
    assert "torch ops" in out and "ddtree-8" in out and "verify / attention" in out
