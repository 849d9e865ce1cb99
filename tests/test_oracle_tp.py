"""The T = 0 oracle recorded on tensor-parallel ranks (every rank in lockstep, rank 0's records returned):
on the made-to-format real pair at TP=2 over gloo it is the single-process recording, and its replayed
rounds are the live TP decode's."""
import pytest

from kdtree_lib.acceptance import accepted_at_every_position, record_oracle_tp, round_lengths
from kdtree_lib.decode_tp import generate_tp
from kdtree_lib.pair_reference import save_kimi_pair

PROMPTS = [[257, 32, 102, 40, 120, 41, 58, 10, 258, 262, 114], [101, 414, 420, 557, 473]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_kimi_pair(tmp_path_factory.mktemp("kimi-pair"))


def test_the_oracle_on_tp2_ranks_is_the_single_process_one_and_the_live_decode(pair):
    target, drafter = pair
    one = record_oracle_tp(target, drafter, PROMPTS, NEW_TOKENS, 16, tp=1)
    two = record_oracle_tp(target, drafter, PROMPTS, NEW_TOKENS, 16, tp=2)
    assert [r.tokens.tolist() for r in two] == [r.tokens.tolist() for r in one]
    assert all(len(set(r.tokens.tolist())) > 3 for r in two)  # a real continuation, not one repeated token
    rounds = {}
    for budget, mode in ((1, "tree"), (4, "tree"), (16, "tree"), (16, "chain")):
        rounds[budget, mode] = [round_lengths(accepted_at_every_position(r, budget, mode=mode), NEW_TOKENS) for r in two]
        assert rounds[budget, mode] == [round_lengths(accepted_at_every_position(r, budget, mode=mode), NEW_TOKENS)
                                        for r in one], (budget, mode)
    live = generate_tp(target, drafter, PROMPTS, tp=2, method="ddtree", budget=4, max_new_tokens=NEW_TOKENS)
    assert rounds[4, "tree"] == [a.tolist() for a in live.acceptance]


def test_the_tp_oracle_refuses_bad_arguments_naming_them(pair, tmp_path):
    target, drafter = pair
    with pytest.raises(ValueError, match="target_path"):
        record_oracle_tp(tmp_path, drafter, PROMPTS, NEW_TOKENS, 4, tp=2)
    with pytest.raises(ValueError, match="drafter_path"):
        record_oracle_tp(target, None, PROMPTS, NEW_TOKENS, 4, tp=2)
    with pytest.raises(ValueError, match="tp"):
        record_oracle_tp(target, drafter, PROMPTS, NEW_TOKENS, 4, tp=0)
    with pytest.raises(ValueError, match="device"):
        record_oracle_tp(target, drafter, PROMPTS, NEW_TOKENS, 4, device="tpu")
