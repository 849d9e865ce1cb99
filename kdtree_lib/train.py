"""Training the stand-in pair: a small K2.6-architecture target and its DFlash drafter.

    target   transformers' DeepseekV3ForCausalLM at K2.6's architecture, small: MLA, the first layer
             dense, then MoE layers with one shared expert and sigmoid noaux_tc routing whose
             correction bias is updated for balance as DeepSeek-V3 does (no auxiliary loss: after
             each step, bias_i += rate * sign(mean load - load_i), the bias kept in float32).
             Next-token cross-entropy on the corpus's train split, bf16 autocast on a GPU.
    drafter  the DFlash draft model (kdtree_lib.dflash) on the frozen target's features, trained as
             DFlash is: random anchor positions, the block after each anchor sees only the context
             before it, cross-entropy at block position k weighted exp(-(k-1)/gamma).

Each stage writes a Hugging Face-format folder (config.json + safetensors shards of at most 16 MB)
with train_log.csv (one row per logged step) and eval.json (held-out metrics, the run's settings):

    data/models/k26-mini/           the target (and the committed tokenizer)
    data/models/k26-mini-dflash/    the drafter, block size 8 (as Kimi's DFlash drafter)
    data/models/k26-mini-dflash-b16 the drafter, block size 16 (with --block-sizes 8 16)

    python -m kdtree_lib.train all --out data/models --corpus data/corpus/build      # on a GPU
    python -m kdtree_lib.train all --tiny --steps 5 --out /tmp/models --corpus ...   # CPU smoke run
    python -m kdtree_lib.train acceptance --prompts 64 --new-tokens 256              # the quality bar

`acceptance` measures the pair as DDTree decodes it: the T = 0 oracle of kdtree_lib.acceptance (exactly a
live decode's rounds) of the DFlash chain and of DDTree trees at budgets 8, 32 and 128, on the
committed held-out prompts (data/corpus/heldout_prompts.jsonl); rows go to data/results/acceptance.csv.

Drafter labels: greedy decoding accepts a draft token iff it equals the target's argmax, so by
default (--labels target) block position k learns the target's argmax for token anchor + k given
the real text before it. DFlash trains on text the target itself generated, where data and target
agree; our corpus is human-written code, so --labels data (the corpus token) is the other choice.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import cli
from .dflash import DFlashConfig, DFlashDrafter, build_target_layer_ids, hf_features, save_drafter
from .pairs import TARGET_DIR, TINY_DRAFTER, load_pair, load_prompts, pair_name, stand_in_paths, tiny_config
from .paths import CORPUS_DIR, MODELS_DIR
from .tokenizer import TOKENIZER_PATH, corpus_tokens, load_tokenizer, special_ids

SHARD_SIZE = "16MB"
LOSS_GAMMA = {8: 4.0, 16: 7.0}  # DFlash's position-weight decay per block size
ACCEPTANCE_BUDGETS = (8, 32, 128)
PROMPTS_PACKAGE = "heldout"     # the `package` of acceptance rows measured on the committed prompts

# K2.6's architecture (data/configs/kimi-k2.6.json) at ~19M parameters. Its attention geometry is
# K2.6's own: the 576-wide absorbed cache entry (kv_lora_rank 512 + rope 64) that the verify kernels
# are built for, 128/64/128 per-head dims and the same YaRN, hence the same softmax scale; fewer heads
# (4), a small q_lora_rank, hidden 256. One dense layer, then MoE: 16 routed experts (top 4) and one
# shared expert, sigmoid noaux_tc routing.
K26_MINI = dict(
    vocab_size=8192, hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
    n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.827, norm_topk_prob=True,
    rms_norm_eps=1e-5, max_position_embeddings=262144, num_nextn_predict_layers=0, tie_word_embeddings=False,
    rope_interleave=True, attention_bias=False, scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1,
    rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0})
# Qwen3-style layers, five as z-lab's released drafters (~4M parameters); hidden size and
# vocabulary are the target's; features from target layers 1-4 (all but the dense first and the last)
DRAFTER = dict(intermediate_size=768, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
               head_dim=64, feature_layers=4, rope_theta=50000.0, rms_norm_eps=1e-6)


@dataclass
class Settings:
    """One run's settings (the CLI's flags; eval.json records them)."""
    out: Path
    corpus: Path
    tokenizer: Path = TOKENIZER_PATH
    tiny: bool = False
    device: str = "auto"
    seed: int = 0
    seq_len: int = 512
    batch_size: int = 64
    steps: int = 2400
    lr: float = 3e-3
    max_minutes: float = 4.5
    drafter_steps: int = 2400
    drafter_lr: float = 2e-3
    drafter_minutes: float = 4.0
    block_sizes: tuple[int, ...] = (8,)
    anchor_tokens: int = 512           # block positions per sequence: anchors = anchor_tokens // block_size
    labels: str = "target"
    experts: str = "grouped_mm"        # transformers' MoE expert kernel: grouped_mm, or eager (a loop)
    bias_rate: float = 1e-3            # DeepSeek-V3's bias update speed
    warmup: int = 100
    weight_decay: float = 0.1
    log_every: int = 25
    eval_every: int = 500
    eval_windows: int = 64
    command: list[str] = field(default_factory=list)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


# ----------------------------------------------------------------------------------------------
# data, schedule, logging

class Batches:
    """Random windows of seq_len + 1 tokens from one split (seeded)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int):
        if tokens.size < seq_len + 2:
            raise ValueError(f"tokens: {tokens.size} tokens cannot fill a window of {seq_len + 1}")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rng = np.random.default_rng(seed)

    def next(self, device) -> torch.Tensor:
        starts = self.rng.integers(0, self.tokens.size - self.seq_len - 1, self.batch_size)
        rows = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts]).astype(np.int64)
        return torch.from_numpy(rows).to(device)                                   # (B, S + 1)


def fixed_windows(tokens: np.ndarray, seq_len: int, count: int) -> torch.Tensor:
    """`count` windows of seq_len + 1 tokens spread evenly over a split (the same every run)."""
    starts = np.linspace(0, tokens.size - seq_len - 2, count).astype(np.int64)
    return torch.from_numpy(np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int64))


def learning_rate(peak: float, step: int, steps: int, warmup: int, elapsed: float, budget: float) -> float:
    """Linear warmup, then cosine to 10% of peak over whichever runs out first, steps or time."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, max((step - warmup) / max(steps - warmup, 1), elapsed / budget))
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


class CsvLog:
    def __init__(self, path: Path, columns: list[str]):
        self.path, self.columns = path, columns
        with open(path, "w", newline="") as f:
            csv.writer(f).writerow(columns)

    def row(self, **values) -> None:
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow([_fmt(values.get(c, "")) for c in self.columns])


def _fmt(value):
    return f"{value:.6g}" if isinstance(value, float) else value


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def make_optimizer(params, lr: float, weight_decay: float):
    params = [p for p in params if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


# ----------------------------------------------------------------------------------------------
# the target

class RouterBalancer:
    """DeepSeek-V3's auxiliary-loss-free load balancing of sigmoid noaux_tc routers.

    Counts, during training forwards, how many tokens each router sends to each expert; after the
    optimizer step moves every correction bias by rate * sign(mean load - load). The bias only
    chooses experts (the gate weights use the raw sigmoid scores), so it needs no gradient.
    """

    def __init__(self, model, rate: float):
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.rate = rate
        self.loads = [torch.zeros_like(r.e_score_correction_bias, dtype=torch.float32) for r in self.routers]
        for router, load in zip(self.routers, self.loads):
            router.register_forward_hook(self._counter(load))

    @staticmethod
    def _counter(load):
        def hook(module, inputs, outputs):
            if module.training:
                chosen = outputs[2].flatten()                                   # (tokens * top_k,)
                load.add_(torch.bincount(chosen, minlength=load.numel()).float())
        return hook

    @torch.no_grad()
    def update(self) -> torch.Tensor:
        """Apply one bias step; returns the mean over layers of max load / mean load - 1 (MaxVio),
        as a device scalar (reading it would wait for the step)."""
        violations = []
        for router, load in zip(self.routers, self.loads):
            mean = load.mean()
            router.e_score_correction_bias += self.rate * torch.sign(mean - load)
            violations.append(load.max() / mean.clamp_min(1) - 1)
            load.zero_()
        return torch.stack(violations).mean()


def target_config(settings: Settings, vocab_size: int, eot: int):
    from transformers import DeepseekV3Config
    tiny = {key: value for key, value in tiny_config().items() if key in K26_MINI}  # its sizes, K26_MINI's switches
    shape = K26_MINI | tiny if settings.tiny else K26_MINI
    return DeepseekV3Config(**(shape | dict(vocab_size=vocab_size, bos_token_id=eot, eos_token_id=eot)))


def next_token_loss(model, rows) -> torch.Tensor:
    """Mean next-token cross-entropy of rows (B, S + 1)."""
    logits = model(input_ids=rows[:, :-1], use_cache=False).logits                  # (B, S, V)
    return F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())


@torch.no_grad()
def mean_loss(model, windows, device, batch_size) -> float:
    model.eval()
    losses = []
    for rows in windows.split(batch_size):
        with autocast(device):
            losses.append(float(next_token_loss(model, rows.to(device))) * len(rows))
    model.train()
    return sum(losses) / len(windows)


def save_target(model, directory: Path) -> None:
    """bf16 weights (the routers' correction bias stays float32, as DeepSeek-V3 ships it), shards of at most 16 MB."""
    model.to(torch.bfloat16)
    for router in (m for m in model.modules() if hasattr(m, "e_score_correction_bias")):
        router.e_score_correction_bias.data = router.e_score_correction_bias.data.float()
    model.save_pretrained(directory, max_shard_size=SHARD_SIZE)


def train_target(settings: Settings) -> Path:
    from transformers import DeepseekV3ForCausalLM
    device = settings.torch_device
    torch.manual_seed(settings.seed)
    tokenizer = load_tokenizer(settings.tokenizer)
    eot, _ = special_ids(tokenizer)
    train_tokens = corpus_tokens(settings.corpus, "train", settings.tokenizer)
    heldout_tokens = corpus_tokens(settings.corpus, "heldout", settings.tokenizer)
    directory = settings.out / TARGET_DIR
    directory.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(settings.tokenizer, directory)

    model = DeepseekV3ForCausalLM(target_config(settings, tokenizer.get_vocab_size(), eot)).to(device).train()
    model.set_experts_implementation(settings.experts)
    balancer = RouterBalancer(model, settings.bias_rate)
    optimizer = make_optimizer(model.parameters(), settings.lr, settings.weight_decay)
    batches = Batches(train_tokens, settings.seq_len, settings.batch_size, settings.seed)
    heldout = fixed_windows(heldout_tokens, settings.seq_len, settings.eval_windows)
    train_sample = fixed_windows(train_tokens, settings.seq_len, settings.eval_windows)
    log = CsvLog(directory / "train_log.csv", ["step", "tokens", "elapsed_s", "lr", "loss", "max_violation",
                                                "heldout_loss"])
    budget, start, step = settings.max_minutes * 60, time.perf_counter(), 0
    while step < settings.steps and time.perf_counter() - start < budget:
        lr = learning_rate(settings.lr, step, settings.steps, settings.warmup, time.perf_counter() - start, budget)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with autocast(device):
            loss = next_token_loss(model, batches.next(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        violation = balancer.update()
        step += 1
        last = step == settings.steps
        if step % settings.log_every == 0 or step == 1 or last:
            evaluate = step % settings.eval_every == 0 or last
            log.row(step=step, tokens=step * settings.batch_size * settings.seq_len,
                    elapsed_s=time.perf_counter() - start, lr=lr, loss=loss.item(), max_violation=violation.item(),
                    heldout_loss=mean_loss(model, heldout, device, settings.batch_size) if evaluate else "")
    elapsed = time.perf_counter() - start
    heldout_loss = mean_loss(model, heldout, device, settings.batch_size)
    train_loss = mean_loss(model, train_sample, device, settings.batch_size)
    save_target(model, directory)
    write_eval(directory, settings, steps=step, seconds=elapsed, device=str(device),
               parameters=sum(p.numel() for p in model.parameters()),
               tokens_seen=step * settings.batch_size * settings.seq_len,
               corpus_tokens={"train": int(train_tokens.size), "heldout": int(heldout_tokens.size)},
               heldout_loss=heldout_loss, heldout_perplexity=math.exp(heldout_loss),
               train_loss=train_loss, train_perplexity=math.exp(train_loss))
    print(f"target: {step} steps in {elapsed:.0f} s, held-out loss {heldout_loss:.3f} "
          f"(perplexity {math.exp(heldout_loss):.2f}) -> {directory}")
    return directory


# ----------------------------------------------------------------------------------------------
# the drafter

def checkpoint_mb(folder) -> float:
    """Megabytes of a checkpoint folder's safetensors shards (what the size budget counts)."""
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / 1e6


def drafter_dir(block_size: int) -> str:
    return "k26-mini-dflash" if block_size == 8 else f"k26-mini-dflash-b{block_size}"


def sample_anchors(batch: int, seq_len: int, count: int, generator) -> torch.Tensor:
    """`count` distinct sorted anchors per row in 1..seq_len-2 (each has context and a label)."""
    if count > seq_len - 2:
        raise ValueError(f"anchor count: {count} anchors do not fit a sequence of {seq_len}")
    order = torch.rand(batch, seq_len - 2, generator=generator).argsort(dim=1)
    return (order[:, :count] + 1).sort(dim=1).values                                 # (B, N)


def block_labels(rows, greedy, anchors, block_size: int, labels: str):
    """Targets (B, N, Q) and validity (B, N, Q) of block position k = anchor + k (k = 0 is never scored)."""
    length = rows.shape[1]
    positions = anchors[:, :, None] + torch.arange(block_size, device=rows.device)     # (B, N, Q)
    valid = (positions < length) & (positions > anchors[:, :, None])
    safe = positions.clamp(max=length - 1)
    if labels == "target":  # the target's argmax at position p - 1 predicts token p
        target = greedy.gather(1, (safe - 1).flatten(1)).view_as(safe)
    else:
        target = rows.gather(1, safe.flatten(1)).view_as(safe)
    return target, valid


def position_weights(block_size: int, device) -> torch.Tensor:
    """exp(-(k-1)/gamma) for k = 1..Q-1, and 0 for the anchor itself: (Q,)."""
    gamma = LOSS_GAMMA.get(block_size, block_size / 2)
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(k > 0, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


def drafter_step_outputs(target, drafter, rows, anchors, settings: Settings):
    """Logits (B, N, Q, V), labels and validity for one batch of windows (B, S)."""
    layer_ids = drafter.config.target_layer_ids
    with torch.no_grad(), autocast(rows.device):
        out = target(input_ids=rows, use_cache=False, output_hidden_states=True)
        features = hf_features(out.hidden_states, layer_ids)                       # (B, S, F)
        greedy = out.logits.argmax(-1)                                             # (B, S)
    with autocast(rows.device):
        logits = drafter.logits(drafter.forward_blocks(features, rows, anchors))
    labels, valid = block_labels(rows, greedy, anchors, drafter.config.block_size, settings.labels)
    return logits, labels, valid


def block_metrics(logits, labels, valid) -> dict:
    """Top-1 accuracy per block position k = 1..Q-1 and the teacher-forced accepted length
    (1 + leading correct positions, a proxy for a DFlash chain round)."""
    correct = (logits.argmax(-1) == labels) & valid                                  # (B, N, Q)
    scored = valid.flatten(0, 1).float()
    accuracy = (correct.flatten(0, 1).float().sum(0) / scored.sum(0).clamp_min(1))[1:]
    complete = valid[..., 1:].all(-1)                                                  # whole blocks only
    run = correct[..., 1:].long().cumprod(-1).sum(-1)[complete].float()
    return {"accuracy": accuracy.tolist(), "accept_tf": float(1 + run.mean()) if run.numel() else float("nan")}


def drafter_config(settings: Settings, target_config, block_size: int, mask_id: int) -> DFlashConfig:
    shape = dict(TINY_DRAFTER, feature_layers=1) if settings.tiny else dict(DRAFTER)
    layers = build_target_layer_ids(target_config.num_hidden_layers, shape.pop("feature_layers"))
    return DFlashConfig(hidden_size=target_config.hidden_size, vocab_size=target_config.vocab_size,
                        block_size=block_size, mask_token_id=mask_id, target_layer_ids=layers,
                        num_target_layers=target_config.num_hidden_layers, **shape)


@torch.no_grad()
def evaluate_drafter(target, drafter, windows, settings: Settings) -> dict:
    generator = torch.Generator().manual_seed(settings.seed + 1)
    count = settings.anchor_tokens // drafter.config.block_size
    parts = []
    for rows in windows.split(settings.batch_size):
        rows = rows[:, :-1].to(settings.torch_device)
        anchors = sample_anchors(len(rows), rows.shape[1], count, generator).to(rows.device)
        parts.append(drafter_step_outputs(target, drafter, rows, anchors, settings))
    logits, labels, valid = (torch.cat(p) for p in zip(*parts))
    return block_metrics(logits, labels, valid)


def train_drafter(settings: Settings, block_size: int) -> Path:
    from transformers import DeepseekV3ForCausalLM
    if settings.labels not in ("target", "data"):
        raise ValueError(f"labels: expected 'target' or 'data', got {settings.labels!r}")
    device = settings.torch_device
    torch.manual_seed(settings.seed)
    tokenizer = load_tokenizer(settings.tokenizer)
    _, mask_id = special_ids(tokenizer)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = DeepseekV3ForCausalLM.from_pretrained(settings.out / TARGET_DIR, dtype=dtype,
                                                   experts_implementation=settings.experts).to(device).eval()
    target.requires_grad_(False)
    drafter = DFlashDrafter(drafter_config(settings, target.config, block_size, mask_id)).to(device)
    drafter.init_weights()
    drafter.bind(target).train()
    directory = settings.out / drafter_dir(block_size)
    directory.mkdir(parents=True, exist_ok=True)
    link_tokenizer(directory)

    train_tokens = corpus_tokens(settings.corpus, "train", settings.tokenizer)
    heldout = fixed_windows(corpus_tokens(settings.corpus, "heldout", settings.tokenizer), settings.seq_len,
                            settings.eval_windows)
    batches = Batches(train_tokens, settings.seq_len, settings.batch_size, settings.seed + 17)
    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = make_optimizer(drafter.parameters(), settings.drafter_lr, settings.weight_decay)
    weights = position_weights(block_size, device)
    count = settings.anchor_tokens // block_size
    depth = block_size - 1
    log = CsvLog(directory / "train_log.csv", ["step", "elapsed_s", "lr", "loss", "accept_tf",
                                                *[f"acc_{k}" for k in range(1, depth + 1)], "heldout_accept_tf"])
    budget, start, step = settings.drafter_minutes * 60, time.perf_counter(), 0
    while step < settings.drafter_steps and time.perf_counter() - start < budget:
        lr = learning_rate(settings.drafter_lr, step, settings.drafter_steps, settings.warmup,
                           time.perf_counter() - start, budget)
        for group in optimizer.param_groups:
            group["lr"] = lr
        rows = batches.next(device)[:, :-1]                                               # (B, S)
        anchors = sample_anchors(len(rows), rows.shape[1], count, generator).to(device)
        logits, labels, valid = drafter_step_outputs(target, drafter, rows, anchors, settings)
        per_token = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none")
        weight = (weights * valid).flatten()
        loss = (per_token * weight).sum() / weight.sum().clamp_min(1e-6)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        step += 1
        last = step == settings.drafter_steps
        if step % settings.log_every == 0 or step == 1 or last:
            metrics = block_metrics(logits.detach(), labels, valid)
            evaluate = step % settings.eval_every == 0 or last
            log.row(step=step, elapsed_s=time.perf_counter() - start, lr=lr, loss=loss.item(),
                    accept_tf=metrics["accept_tf"],
                    **{f"acc_{k + 1}": a for k, a in enumerate(metrics["accuracy"])},
                    heldout_accept_tf=(evaluate_drafter(target, drafter.eval(), heldout, settings)["accept_tf"]
                                       if evaluate else ""))
            drafter.train()
    elapsed = time.perf_counter() - start
    final = evaluate_drafter(target, drafter.eval(), heldout, settings)
    save_drafter(drafter, directory)
    write_eval(directory, settings, steps=step, seconds=elapsed, device=str(device), block_size=block_size,
               parameters=sum(p.numel() for p in drafter.parameters()),
               heldout_accuracy=final["accuracy"], heldout_accept_tf=final["accept_tf"])
    print(f"drafter (block {block_size}): {step} steps in {elapsed:.0f} s, held-out teacher-forced accepted "
          f"length {final['accept_tf']:.2f} -> {directory}")
    return directory


# ----------------------------------------------------------------------------------------------
# acceptance on held-out prompts

def acceptance_rows(models_dir, block_size: int, *, budgets=ACCEPTANCE_BUDGETS, n_prompts: int = 64,
                    prompt_tokens: int = 128, new_tokens: int = 256, device: str = "auto") -> list[dict]:
    """Mean acceptance length of the DFlash chain and of DDTree at each budget (T = 0), one row each.

    The target's greedy run from each prompt is recorded once with the drafter's top-k at every
    position (kdtree_lib.acceptance.record_oracle); chain and trees are then built from it, exactly the
    rounds a live decode makes.
    """
    from .acceptance import oracle_rows, record_oracle
    device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                          "cpu" if device == "auto" else device)
    target_path, drafter_path = stand_in_paths(block_size, models_dir)
    target, drafter = load_pair(target_path, drafter_path, device=device,
                                dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    prompts = load_prompts(n_prompts, prompt_tokens)
    records = record_oracle(target, drafter, prompts, new_tokens, min(max(budgets), target.config.vocab_size))
    if device.type == "cuda":
        records = [record.to_torch(device) for record in records]
    pair = pair_name(target_path, drafter_path)
    return [row | {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens}
            for mode in ("chain", "tree")
            for row in oracle_rows(records, budgets, package=PROMPTS_PACKAGE, block_size=block_size, mode=mode,
                                   n_new_tokens=new_tokens, pair=pair, progress=False)]


def measure_acceptance(settings: Settings, n_prompts: int, prompt_tokens: int, new_tokens: int) -> list[dict]:
    """acceptance_rows for every trained block size, appended to data/results/acceptance.csv."""
    from .results import append_rows
    from .acceptance import TOPIC
    rows = []
    for block_size in settings.block_sizes:
        if not (settings.out / drafter_dir(block_size) / "config.json").is_file():
            print(f"no drafter for block size {block_size} in {settings.out}: skipped")
            continue
        rows += acceptance_rows(settings.out, block_size, n_prompts=n_prompts, prompt_tokens=prompt_tokens,
                                new_tokens=new_tokens, device=settings.device)
    for row in rows:
        print(f"block {row['block_size']:2d} {row['mode']:5s} budget {row['budget']:3d}: "
              f"{row['mean_acceptance']:.3f} tokens per round over {row['rounds']} rounds")
    if rows:
        print(f"{len(rows)} rows -> {append_rows(TOPIC, rows)}")
    return rows


# ----------------------------------------------------------------------------------------------
# files

def copy_tokenizer(tokenizer: Path, directory: Path) -> None:
    """The tokenizer files beside the target's weights (already there when out is data/models)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        source = tokenizer.parent / name if name != "tokenizer.json" else tokenizer
        if source.is_file() and source.resolve() != (directory / name).resolve():
            shutil.copyfile(source, directory / name)


def link_tokenizer(directory: Path) -> None:
    """The drafter uses the target's tokenizer: a relative link to it."""
    link = directory / "tokenizer.json"
    if not link.exists() and not link.is_symlink():
        link.symlink_to(Path("..") / TARGET_DIR / "tokenizer.json")


def read_log(path) -> dict[str, np.ndarray]:
    """A train_log.csv as float columns (cells a row left empty are NaN)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    columns = rows[0].keys() if rows else []
    return {c: np.array([float(r[c]) if r[c] != "" else np.nan for r in rows]) for c in columns}


def read_stage(directory) -> tuple[dict, dict] | None:
    """(train_log columns, eval.json) of one trained folder, or None where it has not been trained."""
    directory = Path(directory)
    if not (directory / "train_log.csv").is_file() or not (directory / "eval.json").is_file():
        return None
    return read_log(directory / "train_log.csv"), json.loads((directory / "eval.json").read_text())


def write_eval(directory: Path, settings: Settings, **values) -> None:
    run = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()}
    (directory / "eval.json").write_text(json.dumps(values | {"settings": run}, indent=1) + "\n")


def parse_args(argv) -> tuple[str, Settings, dict]:
    parser = cli.ArgumentParser(prog="python -m kdtree_lib.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=("target", "drafter", "all", "acceptance"))
    parser.add_argument("--out", type=Path, default=MODELS_DIR)
    parser.add_argument("--corpus", type=Path, default=CORPUS_DIR / "build",
                        help="corpus build folder (corpus-*.jsonl, or cached tokens-*.npy)")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER_PATH)
    parser.add_argument("--tiny", action="store_true", help="tiny models and batches: a CPU smoke run")
    defaults = Settings(out=Path(), corpus=Path())
    for name in ("device", "seed", "seq_len", "batch_size", "steps", "lr", "max_minutes", "drafter_steps",
                 "drafter_lr", "drafter_minutes", "anchor_tokens", "labels", "experts", "bias_rate", "warmup",
                 "log_every", "eval_every", "eval_windows"):
        parser.add_argument("--" + name.replace("_", "-"), type=type(getattr(defaults, name)), default=None)
    parser.add_argument("--block-sizes", type=cli.positive_int, nargs="+", default=None)
    parser.add_argument("--prompts", type=cli.positive_int, default=64, help="acceptance: held-out prompts")
    parser.add_argument("--prompt-tokens", type=cli.positive_int, default=128, help="acceptance: tokens per prompt")
    parser.add_argument("--new-tokens", type=cli.positive_int, default=256, help="acceptance: greedy tokens per prompt")
    args = parser.parse_args(argv)
    acceptance = {"n_prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens}
    values = TINY_SETTINGS.copy() if args.tiny else {}
    values.update({k: v for k, v in vars(args).items()
                   if v is not None and k not in ("stage", "prompts", "prompt_tokens", "new_tokens")})
    if "block_sizes" in values:
        values["block_sizes"] = tuple(values["block_sizes"])
    return args.stage, Settings(**values, command=list(argv if argv is not None else sys.argv[1:])), acceptance


# a CPU smoke run: every code path, seconds not minutes
TINY_SETTINGS = dict(seq_len=64, batch_size=2, steps=5, drafter_steps=5, warmup=2, anchor_tokens=16,
                     log_every=1, eval_every=5, eval_windows=2)


@cli.command
def main(argv=None) -> int:
    stage, settings, acceptance = parse_args(argv)
    torch.set_float32_matmul_precision("high")  # TF32 for what autocast leaves in float32
    if stage in ("target", "all"):
        train_target(settings)
    if stage in ("drafter", "all"):
        for block_size in settings.block_sizes:
            train_drafter(settings, block_size)
    if stage == "acceptance":
        measure_acceptance(settings, **acceptance)
    return 0


if __name__ == "__main__":
    sys.exit(main())
