"""Parity with the paper's official code (github.com/liranringel/ddtree), from a local copy that is never
committed: set KDTREE_OFFICIAL_DIR to it (skipped otherwise). On the stand-in pair, in fp32 on the CPU, the
official ddtree_generate must accept exactly what our decode accepts round by round (our first round is the
official prefill's token: we prefill prompt[:-1] and verify the last prompt token as a root), and emit the
greedy autoregressive tokens."""
import os

import numpy as np
import pytest
import torch

from kdtree_lib.bench.decode import load_official
from kdtree_lib.pairs import pair_with_prompts, stand_in_paths
from kdtree_lib.decode import generate

OFFICIAL_DIR = os.environ.get("KDTREE_OFFICIAL_DIR")
pytestmark = pytest.mark.skipif(not OFFICIAL_DIR, reason="KDTREE_OFFICIAL_DIR (a local copy of the official code) not set")


@pytest.mark.parametrize("budget", [8, 32])
def test_official_code_accepts_what_we_accept(budget, monkeypatch):
    transformers = pytest.importorskip("transformers")
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)  # its clock, on a CPU
    ddtree, official_model = load_official(OFFICIAL_DIR)
    target_path, drafter_path = stand_in_paths(8)
    target = transformers.AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32,
                                                               attn_implementation="sdpa").eval()
    drafter = official_model.DFlashDraftModel.from_pretrained(drafter_path, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    chosen = pair_with_prompts(8, prompts_per_package=1, prompt_tokens=64)
    prompt = chosen.prompts[0]
    out = ddtree.ddtree_generate(model=drafter, target=target, input_ids=torch.as_tensor(np.asarray(prompt)).long()[None],
                                 mask_token_id=drafter.mask_token_id, max_new_tokens=40,
                                 block_size=drafter.block_size, stop_token_ids=None, temperature=0.0,
                                 tree_budget=budget)
    ours = generate(chosen.target, chosen.drafter, [prompt], budget=budget, max_new_tokens=40, backend="numpy")
    ar = generate(chosen.target, chosen.drafter, [prompt], method="ar", max_new_tokens=40, backend="numpy")
    assert ours.acceptance[0][0] == 1
    ours_after_first = ours.acceptance[0][1:].tolist()  # the official loop may run one more round past the limit
    assert list(out.acceptance_lengths)[:len(ours_after_first)] == ours_after_first
    assert out.output_ids[0, len(prompt):].tolist() == ar.tokens[0].tolist()
