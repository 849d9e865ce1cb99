"""kdtree_lib.model on the GPU (`-m gpu`): bf16 parity with transformers, TP=2 over NCCL.

bf16 results are judged against an fp32 run of the same weights, with the error of transformers'
own bf16 run as the yardstick (flash-attention's "at most twice the error of PyTorch" rule).
"""
import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs torch with CUDA", allow_module_level=True)

from kdtree_lib.model import load_target
from kdtree_lib.pairs import tiny_config
from kdtree_lib.model.reference import prefill_logits, random_model, to_bfloat16, tree_logits
from kdtree_lib.model.sharded import tp_logits
from kdtree_lib.contracts import tree_from_parents
from tolerances import assert_within_baseline

PARENTS = np.array([[-1, 0, 0, 1, 1, 2, 3, 6, -1], [-1, 0, 1, 2, 0, 4, -1, -1, -1]])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    config = tiny_config()
    model = random_model(config, seed=21)
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path)
    prompt = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(22))
    tree = tree_from_parents(PARENTS, np.random.default_rng(23).integers(0, 256, PARENTS.shape))
    return model, path, prompt, tree


def hf_logits(model, prompt, tree):
    prefill = prefill_logits(model, prompt).cpu()
    verify = torch.stack([tree_logits(model, prompt[b], tree, b).cpu() for b in range(len(prompt))])
    return {"prefill": prefill, "verify": verify}


def live(logits, tree):
    return torch.cat([logits[b, :int(tree.n_nodes[b])] for b in range(tree.batch)])


# absorbed/auto runs the CuPy verify-attention kernel where it exists, absorbed/torch its reference
PATHS = [("naive", "auto"), ("absorbed", "torch"), ("absorbed", "auto")]


@pytest.mark.parametrize("attention, backend", PATHS)
def test_bf16_logits_match_transformers_on_gpu(reference, attention, backend):
    hf, path, prompt, tree = reference
    exact = hf_logits(hf.cuda(), prompt, tree)
    yardstick = hf_logits(to_bfloat16(hf.cuda()), prompt, tree)
    hf.float().cpu()
    model = load_target(path, device="cuda", dtype=torch.bfloat16, attention=attention, attention_backend=backend)
    cache = model.new_cache(2, 11 + tree.capacity)
    ours = {"prefill": model.prefill(prompt.cuda(), cache).logits.cpu(), "verify": model.verify(tree, cache).logits.cpu()}
    for phase in ("prefill", "verify"):
        pick = (lambda x: x) if phase == "prefill" else (lambda x: live(x, tree))
        ours_error = (pick(ours[phase]) - pick(exact[phase])).abs().max().item()
        hf_error = (pick(yardstick[phase]) - pick(exact[phase])).abs().max().item()
        print(f"{attention}/{backend} {phase}: ours {ours_error:.4f}, transformers bf16 {hf_error:.4f}")
        assert_within_baseline(pick(ours[phase]), pick(exact[phase]), pick(yardstick[phase]), factor=2, what=phase)


@pytest.mark.parametrize("attention, backend", PATHS)
def test_tp2_over_nccl_equals_tp1_within_bf16_tolerance(reference, attention, backend):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _, path, prompt, tree = reference
    exact = tp_logits(path, prompt, tree, world_size=1, dtype=torch.float32, device="cuda", attention="naive")
    options = dict(device="cuda", attention=attention, attention_backend=backend)
    one = tp_logits(path, prompt, tree, world_size=1, dtype=torch.bfloat16, **options)
    two = tp_logits(path, prompt, tree, world_size=2, dtype=torch.bfloat16, **options)
    for phase in ("prefill", "verify"):
        pick = (lambda x: x) if phase == "prefill" else (lambda x: live(x, tree))
        tp1_error = (pick(one[phase]) - pick(exact[phase])).abs().max().item()
        tp2_error = (pick(two[phase]) - pick(exact[phase])).abs().max().item()
        print(f"{attention}/{backend} {phase}: TP=1 bf16 error {tp1_error:.4f}, TP=2 bf16 error {tp2_error:.4f}")
        assert_within_baseline(pick(two[phase]), pick(exact[phase]), pick(one[phase]), factor=2, what=phase)
