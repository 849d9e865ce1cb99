"""Training a stand-in pair: a small K2.6-architecture target and its DFlash drafter, in the real formats.

    target   transformers' DeepseekV3ForCausalLM at K2.6's architecture, small: MLA, the first layer
             dense, then MoE layers with one shared expert and sigmoid noaux_tc routing whose
             correction bias is updated for balance as DeepSeek-V3 does (no auxiliary loss: after
             each step, bias_i += rate * sign(mean load - load_i), the bias kept in float32).
             Next-token cross-entropy on the corpus's train split, bf16 autocast on a GPU. Trained
             in float; then rounded as stored (bf16, routed experts INT4 in K2.6's format), and the
             drafter trains on that target, the one decoding runs.
    drafter  the DFlash draft model (kdtree_lib.dflash) on the frozen target's features, trained as
             DFlash is: random anchor positions, the block after each anchor sees only the context
             before it, cross-entropy at block position k weighted exp(-(k-1)/gamma).

The pair's shape is kdtree_lib.standin's (--pair, k26-deep by default: K2.6's proportions). The
target is written in K2.6's checkpoint layout (a wrapper config.json with K2.6's text_config keys,
`language_model.` tensor names, INT4 pack-quantized routed experts, safetensors shards under 16 MB
with an index) beside the corpus tokenizer; each drafter in z-lab's format with the real drafter's
config keys. Each folder holds train_log.csv (one row per logged step) and eval.json (held-out
metrics, the run's settings):

    data/models/k26-deep/               the target (and the tokenizer)
    data/models/k26-deep-dflash/        the drafter, block size 8 (as Kimi's DFlash drafter)
    data/models/k26-deep-dflash-b16/    the drafter, block size 16 (with --block-sizes 8 16)

    python -m kdtree_lib.train all                    # on one H200: about 9 minutes (docs/stand-in-pair.md)
    python -m kdtree_lib.train all --tiny --out /tmp/models --corpus ...      # CPU smoke run
    python -m kdtree_lib.train acceptance --pair k26-deep --prompts 64 --new-tokens 256

Resumable: a run works in <out>/.<pair>.training/ (its settings, training states written atomically
every --checkpoint-every steps, at a stage's end and on SIGTERM, the finished folders staged there);
the same command again continues where a cut left it (--restart discards the work). On SIGTERM (as
`timeout` sends) the run saves its state at the next step and exits with status 3. Only when every
folder is complete are they moved into <out>, so a cut never leaves a half-written pair there; a
pair already in <out> is replaced only with --retrain. Time budgets (--max-minutes, --drafter-minutes)
count training time over all calls.

`acceptance` measures the pair as DDTree decodes it: the T = 0 oracle of kdtree_lib.acceptance (exactly a
live decode's rounds) of the DFlash chain and of DDTree trees at budgets 8, 32 and 128, on the
committed held-out prompts (data/corpus/heldout_prompts.jsonl); rows go to data/results/acceptance.csv
with the pair's name in their `pair` column.

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
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from . import cli
from .dflash import DFlashConfig, DFlashDrafter, hf_features, save_drafter
from .pairs import TARGET_DIR, drafter_dir, load_pair, load_prompts, pair_name, stand_in_paths  # noqa: F401
from .paths import CORPUS_DIR, MODELS_DIR
from .standin import CHECKPOINT_BUDGET_BYTES, DEEP, DRAFTER, K26_MINI, SHAPES, shape_of  # noqa: F401  (K26_MINI, DRAFTER: the committed pair's shape)
from .tokenizer import TOKENIZER_PATH, corpus_tokens, load_tokenizer, special_ids

SHARD_BYTES = 14_000_000  # tensor bytes per shard: with its header a shard stays under 16 MB
LOSS_GAMMA = {8: 4.0, 16: 7.0}  # DFlash's position-weight decay per block size
ACCEPTANCE_BUDGETS = (8, 32, 128)
PROMPTS_PACKAGE = "heldout"     # the `package` of acceptance rows measured on the committed prompts
STATE_KEYS_IGNORED = ("command", "retrain", "restart", "out")  # settings a resumed run may change (out holds it)
EXIT_STOPPED = 3  # `train` stopped on SIGTERM with its state saved: the same command continues


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
    pair: str = DEEP
    steps: int = 4000
    lr: float = 3e-3
    max_minutes: float = 5.5           # training time budgets, over all calls: with evaluation and writing
    drafter_steps: int = 5000          # a whole run fits one 10-minute command on an H200 (docs/stand-in-pair.md)
    drafter_lr: float = 2e-3
    drafter_minutes: float = 2.5
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
    checkpoint_every: int = 500        # steps between saved training states (also at a stage's end and on SIGTERM)
    retrain: bool = False              # replace a pair already in `out` (once the new one is complete)
    restart: bool = False              # discard a cut run's work instead of resuming it
    command: list[str] = field(default_factory=list)

    @property
    def work(self) -> Path:
        """The run's working folder: settings, training states, staged finished folders."""
        return self.out / f".{self.pair}.training"

    @property
    def folders(self) -> list[str]:
        """The pair's folders, target first."""
        return [self.pair] + [drafter_dir(b, self.pair) for b in self.block_sizes]

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
    """train_log.csv; through_step: a resumed stage's log keeps its rows up to that step (a cut may
    have logged rows past the saved state) and continues after them."""

    def __init__(self, path: Path, columns: list[str], through_step: int | None = None):
        self.path, self.columns = path, columns
        kept = []
        if through_step is not None and path.is_file():
            with open(path, newline="") as f:
                kept = [row for row in csv.reader(f)][1:]
            kept = [row for row in kept if int(row[0]) <= through_step]
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows([columns, *kept])

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


def text_config(settings: Settings, vocab_size: int, eot: int) -> dict:
    """The target's text_config (K2.6's keys at the pair's dims; --tiny: a smoke run's dims)."""
    return shape_of(settings.pair, tiny=settings.tiny).text_config(vocab_size, eot)


def hf_target(text: dict):
    """transformers' DeepseekV3ForCausalLM for a text_config (float32, fresh weights)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from .model.config import transformers_kwargs
    return DeepseekV3ForCausalLM(DeepseekV3Config(**transformers_kwargs(text)))


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


@torch.no_grad()
def round_as_stored(model) -> None:
    """Round the weights in place to what the checkpoint stores: routed experts to K2.6's INT4
    (symmetric, group 32, bf16 scales), every other parameter to bf16 (the routers' correction bias,
    a buffer, stays float32). The float model then computes exactly what the written target does,
    and the drafter trains on that."""
    from .model.checkpoint import dequantize_int4, quantize_int4
    from .moe import GROUP_SIZE
    for name, tensor in model.named_parameters():
        if ".mlp.experts." in name:                       # stacked (E, out, in); groups run along `in`
            for weight in tensor:                         # quantize_int4 works on the host
                weight.copy_(dequantize_int4(*quantize_int4(weight.float().cpu()), GROUP_SIZE))
        else:
            tensor.copy_(tensor.to(torch.bfloat16))


def write_target(model, text: dict, directory: Path) -> None:
    """The target in K2.6's checkpoint layout: a wrapper config.json (text_config with the INT4
    quantization config), `language_model.` names, routed experts pack-quantized, bf16 elsewhere,
    the routers' correction bias float32 (as K2.6 ships it), shards of at most SHARD_BYTES + index."""
    from .dflash import write_safetensors
    from .model.checkpoint import INT4_QUANTIZATION_CONFIG, KIMI_PREFIX, quantize_int4
    from .model.reference import kimi_tensors
    stored = {}
    for name, tensor in kimi_tensors(model).items():
        tensor = tensor.detach().float().cpu()
        if ".mlp.experts." in name:
            packed, scale = quantize_int4(tensor)
            stored |= {f"{name}_packed": packed, f"{name}_scale": scale,
                       f"{name}_shape": torch.tensor(list(tensor.shape), dtype=torch.int64)}
        else:
            stored[name] = tensor if name.endswith("e_score_correction_bias") else tensor.to(torch.bfloat16)
    directory.mkdir(parents=True)
    write_safetensors({KIMI_PREFIX + name: t.contiguous() for name, t in stored.items()}, directory, SHARD_BYTES)
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": text | {"quantization_config": INT4_QUANTIZATION_CONFIG}}
    (directory / "config.json").write_text(json.dumps(wrapper, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------
# resumable stages

def save_state(path: Path, **state) -> None:
    """A training state, written atomically (a cut leaves the previous one whole)."""
    part = path.with_name(path.name + ".part")
    torch.save(state, part)
    os.replace(part, path)


def rng_state(batches: "Batches", generator: torch.Generator | None = None) -> dict:
    state = {"batches": batches.rng.bit_generator.state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def restore_rng(state: dict, batches: "Batches", generator: torch.Generator | None = None) -> None:
    batches.rng.bit_generator.state = state["batches"]
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None:
        generator.set_state(state["generator"])


def load_state(path: Path) -> dict | None:
    """A saved training state on the host (RNG states must stay there; load_state_dict moves the rest)."""
    return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None


def publish(staging: Path, final: Path) -> None:
    """Rename a finished folder into place (atomic: a reader sees none of it or all of it)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)


class Stopped(Exception):
    """The run was asked to stop (SIGTERM); its state is saved."""


class StopRequest:
    """SIGTERM (what `timeout` sends first) asks the training loops to save their state and stop at
    the next step; the same command then continues (a hard kill resumes from the last saved state)."""

    def __init__(self):
        self.requested = False

    def __enter__(self):
        self.requested, self.previous = False, None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)

    def check(self, save, where: str) -> None:
        if self.requested:
            save()
            raise Stopped(where)


STOP = StopRequest()


def progress(total: int, initial: int, desc: str):
    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, mininterval=2.0)


def train_target(settings: Settings) -> Path:
    """The target stage of a run: trains (resuming a saved state), quantizes the routed experts and
    stages the K2.6-format folder in the run's work folder; returns it."""
    work = settings.work
    staged = work / settings.pair
    if (staged / "config.json").is_file():
        print(f"target: already trained in {work}")
        return staged
    device = settings.torch_device
    torch.manual_seed(settings.seed)
    tokenizer = load_tokenizer(settings.tokenizer)
    eot, _ = special_ids(tokenizer)
    train_tokens = corpus_tokens(settings.corpus, "train", settings.tokenizer)
    heldout_tokens = corpus_tokens(settings.corpus, "heldout", settings.tokenizer)
    text = text_config(settings, tokenizer.get_vocab_size(), eot)
    model = hf_target(text).to(device).train()
    model.set_experts_implementation(settings.experts)
    balancer = RouterBalancer(model, settings.bias_rate)
    optimizer = make_optimizer(model.parameters(), settings.lr, settings.weight_decay)
    batches = Batches(train_tokens, settings.seq_len, settings.batch_size, settings.seed)
    heldout = fixed_windows(heldout_tokens, settings.seq_len, settings.eval_windows)
    train_sample = fixed_windows(train_tokens, settings.seq_len, settings.eval_windows)

    state_path, step, trained = work / "target.state.pt", 0, 0.0
    state = load_state(state_path)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        restore_rng(state["rng"], batches)
        step, trained = state["step"], state["seconds"]
        print(f"target: resuming at step {step} ({trained:.0f} s trained)")
    log = CsvLog(work / "target.train_log.csv", ["step", "tokens", "elapsed_s", "lr", "loss", "max_violation",
                                                  "heldout_loss"], through_step=step if state else None)

    def save() -> None:
        save_state(state_path, model=model.state_dict(), optimizer=optimizer.state_dict(),
                   rng=rng_state(batches), step=step, seconds=time.perf_counter() - start)

    budget, start = settings.max_minutes * 60, time.perf_counter() - trained
    with progress(settings.steps, step, "target") as bar:
        while step < settings.steps and time.perf_counter() - start < budget:
            STOP.check(save, f"target at step {step}")
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
            bar.update(1)
            last = step == settings.steps
            if step % settings.log_every == 0 or step == 1 or last:
                evaluate = step % settings.eval_every == 0 or last
                bar.set_postfix(loss=f"{loss.item():.3f}")
                log.row(step=step, tokens=step * settings.batch_size * settings.seq_len,
                        elapsed_s=time.perf_counter() - start, lr=lr, loss=loss.item(), max_violation=violation.item(),
                        heldout_loss=mean_loss(model, heldout, device, settings.batch_size) if evaluate else "")
            if step % settings.checkpoint_every == 0:
                save()
    save()  # the loop's end: a cut in what follows resumes here, with nothing left to train
    elapsed = time.perf_counter() - start
    heldout_loss = mean_loss(model, heldout, device, settings.batch_size)
    train_loss = mean_loss(model, train_sample, device, settings.batch_size)
    model.float()
    round_as_stored(model)
    stored_loss = mean_loss(model, heldout, device, settings.batch_size)
    torch.save({"text_config": text, "model": {k: v.cpu() for k, v in model.state_dict().items()}},
               work / "target.final.pt.part")
    os.replace(work / "target.final.pt.part", work / "target.final.pt")
    part = work / f"{settings.pair}.part"
    shutil.rmtree(part, ignore_errors=True)
    write_target(model, text, part)
    copy_tokenizer(settings.tokenizer, part)
    shutil.copyfile(work / "target.train_log.csv", part / "train_log.csv")
    write_eval(part, settings, steps=step, seconds=elapsed, device=str(device),
               parameters=sum(p.numel() for p in model.parameters()),
               tokens_seen=step * settings.batch_size * settings.seq_len,
               corpus_tokens={"train": int(train_tokens.size), "heldout": int(heldout_tokens.size)},
               heldout_loss=heldout_loss, heldout_perplexity=math.exp(heldout_loss),
               train_loss=train_loss, train_perplexity=math.exp(train_loss),
               stored_heldout_loss=stored_loss, stored_heldout_perplexity=math.exp(stored_loss))
    os.replace(part, staged)
    print(f"target: {step} steps in {elapsed:.0f} s, held-out loss {heldout_loss:.3f} (perplexity "
          f"{math.exp(heldout_loss):.2f}; {stored_loss:.3f} as stored, bf16 with INT4 experts) -> {staged}")
    return staged


def trained_target(settings: Settings, device, dtype):
    """The staged target as the drafter trains on it: transformers' model with the weights as stored."""
    saved = torch.load(settings.work / "target.final.pt", map_location="cpu", weights_only=False)
    model = hf_target(saved["text_config"])
    model.load_state_dict(saved["model"])
    model.set_experts_implementation(settings.experts)
    if dtype == torch.bfloat16:
        from .model.reference import to_bfloat16
        model = to_bfloat16(model)
    return model.to(device).eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------
# the drafter

def checkpoint_mb(folder) -> float:
    """Megabytes of a checkpoint folder's safetensors shards and their index (what the size budget counts)."""
    files = [*Path(folder).glob("*.safetensors"), *Path(folder).glob("*.safetensors.index.json")]
    return sum(f.stat().st_size for f in files) / 1e6


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


def drafter_raw_config(settings: Settings, text: dict, block_size: int, mask_id: int) -> dict:
    """The drafter's config.json: the real drafter's keys at the pair's dims (kdtree_lib.standin)."""
    return shape_of(settings.pair, tiny=settings.tiny).drafter_config(text, block_size, mask_id)


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
    """One drafter stage of a run: trains on the staged INT4 target (resuming a saved state) and
    stages the drafter's folder in the run's work folder; returns it."""
    if settings.labels not in ("target", "data"):
        raise ValueError(f"labels: expected 'target' or 'data', got {settings.labels!r}")
    work, name = settings.work, drafter_dir(block_size, settings.pair)
    staged = work / name
    if (staged / "config.json").is_file():
        print(f"drafter (block {block_size}): already trained in {work}")
        return staged
    if not (work / "target.final.pt").is_file():
        raise ValueError(f"stage: no trained target in {work} yet (run the target stage, or `all`, first)")
    device = settings.torch_device
    torch.manual_seed(settings.seed)
    tokenizer = load_tokenizer(settings.tokenizer)
    _, mask_id = special_ids(tokenizer)
    target = trained_target(settings, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    raw = drafter_raw_config(settings, json.loads((work / settings.pair / "config.json").read_text())["text_config"],
                             block_size, mask_id)
    drafter = DFlashDrafter(DFlashConfig.from_dict(raw)).to(device)
    drafter.init_weights()
    drafter.bind(target).train()

    train_tokens = corpus_tokens(settings.corpus, "train", settings.tokenizer)
    heldout = fixed_windows(corpus_tokens(settings.corpus, "heldout", settings.tokenizer), settings.seq_len,
                            settings.eval_windows)
    batches = Batches(train_tokens, settings.seq_len, settings.batch_size, settings.seed + 17)
    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = make_optimizer(drafter.parameters(), settings.drafter_lr, settings.weight_decay)
    weights = position_weights(block_size, device)
    count = settings.anchor_tokens // block_size
    depth = block_size - 1

    state_path, step, trained = work / f"{name}.state.pt", 0, 0.0
    state = load_state(state_path)
    if state is not None:
        drafter.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        restore_rng(state["rng"], batches, generator)
        step, trained = state["step"], state["seconds"]
        print(f"drafter (block {block_size}): resuming at step {step} ({trained:.0f} s trained)")
    log = CsvLog(work / f"{name}.train_log.csv", ["step", "elapsed_s", "lr", "loss", "accept_tf",
                                                   *[f"acc_{k}" for k in range(1, depth + 1)], "heldout_accept_tf"],
                 through_step=step if state else None)

    def save() -> None:
        save_state(state_path, model=drafter.state_dict(), optimizer=optimizer.state_dict(),
                   rng=rng_state(batches, generator), step=step, seconds=time.perf_counter() - start)

    budget, start = settings.drafter_minutes * 60, time.perf_counter() - trained
    with progress(settings.drafter_steps, step, f"drafter b{block_size}") as bar:
        while step < settings.drafter_steps and time.perf_counter() - start < budget:
            STOP.check(save, f"drafter (block {block_size}) at step {step}")
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
            bar.update(1)
            last = step == settings.drafter_steps
            if step % settings.log_every == 0 or step == 1 or last:
                metrics = block_metrics(logits.detach(), labels, valid)
                evaluate = step % settings.eval_every == 0 or last
                bar.set_postfix(loss=f"{loss.item():.3f}", accept_tf=f"{metrics['accept_tf']:.2f}")
                log.row(step=step, elapsed_s=time.perf_counter() - start, lr=lr, loss=loss.item(),
                        accept_tf=metrics["accept_tf"],
                        **{f"acc_{k + 1}": a for k, a in enumerate(metrics["accuracy"])},
                        heldout_accept_tf=(evaluate_drafter(target, drafter.eval(), heldout, settings)["accept_tf"]
                                           if evaluate else ""))
                drafter.train()
            if step % settings.checkpoint_every == 0:
                save()
    save()
    elapsed = time.perf_counter() - start
    final = evaluate_drafter(target, drafter.eval(), heldout, settings)
    part = work / f"{name}.part"
    shutil.rmtree(part, ignore_errors=True)
    save_drafter(drafter, part)
    if DFlashConfig.from_dict(raw) != drafter.config:
        raise AssertionError("the drafter's config.json would not load as the drafter trained")
    (part / "config.json").write_text(json.dumps(raw, indent=2) + "\n")  # the real drafter's keys, as loaded
    link_tokenizer(part, settings.pair)
    shutil.copyfile(work / f"{name}.train_log.csv", part / "train_log.csv")
    write_eval(part, settings, steps=step, seconds=elapsed, device=str(device), block_size=block_size,
               parameters=sum(p.numel() for p in drafter.parameters()),
               heldout_accuracy=final["accuracy"], heldout_accept_tf=final["accept_tf"])
    os.replace(part, staged)
    print(f"drafter (block {block_size}): {step} steps in {elapsed:.0f} s, held-out teacher-forced accepted "
          f"length {final['accept_tf']:.2f} -> {staged}")
    return staged


def start_run(settings: Settings) -> None:
    """Create the run's work folder, or check a cut run's settings before resuming it."""
    work = settings.work
    if settings.restart and work.exists():
        shutil.rmtree(work)
    resolved = json.loads(json.dumps(asdict(settings), default=lambda path: str(Path(path).resolve())))
    mine = {k: v for k, v in resolved.items() if k not in STATE_KEYS_IGNORED}
    if work.exists():
        saved = json.loads((work / "settings.json").read_text())
        changed = sorted(k for k in mine if saved.get(k) != mine[k])
        if changed:
            raise ValueError(f"settings: {work} holds a cut run with other {', '.join(changed)} "
                             f"({', '.join(f'{saved.get(k)!r} then' for k in changed)}): rerun it as it was, "
                             "or pass --restart to discard it")
        print(f"resuming the run in {work}")
        return
    present = [name for name in settings.folders if (settings.out / name).exists()]
    if present and not settings.retrain:
        raise ValueError(f"out: {', '.join(present)} already in {settings.out}; pass --retrain to train the pair "
                         "again (the new folders replace them only once all are complete)")
    for split in ("train", "heldout"):  # a missing corpus or tokenizer is refused before any folder is made
        corpus_tokens(settings.corpus, split, settings.tokenizer)
    work.mkdir(parents=True)
    (work / "settings.json").write_text(json.dumps(mine, indent=1) + "\n")


def finish_run(settings: Settings) -> list[Path]:
    """Move every staged folder of the run into `out`, then remove the work folder."""
    work = settings.work
    missing = [name for name in settings.folders if not (work / name / "config.json").is_file()
               and not (work / "publishing").is_file()]
    if missing:
        raise ValueError(f"stage: {', '.join(missing)} not trained in {work} yet")
    (work / "publishing").touch()  # from here a rerun only finishes the moves
    for name in settings.folders:
        if (work / name).exists():
            publish(work / name, settings.out / name)
    shutil.rmtree(work)
    paths = [settings.out / name for name in settings.folders]
    sizes = ", ".join(f"{p.name} {checkpoint_mb(p):.1f} MB" for p in paths)
    pair_mb = checkpoint_mb(paths[0]) + checkpoint_mb(paths[1]) if len(paths) > 1 else checkpoint_mb(paths[0])
    print(f"pair {settings.pair} in {settings.out}: {sizes}; target + first drafter {pair_mb:.1f} MB "
          f"(budget {CHECKPOINT_BUDGET_BYTES / 1e6:.0f} MB)")
    return paths


# ----------------------------------------------------------------------------------------------
# acceptance on held-out prompts

def acceptance_rows(models_dir, block_size: int, *, pair: str = DEEP, budgets=ACCEPTANCE_BUDGETS, n_prompts: int = 64,
                    prompt_tokens: int = 128, new_tokens: int = 256, device: str = "auto") -> list[dict]:
    """Mean acceptance length of the DFlash chain and of DDTree at each budget (T = 0), one row each.

    The target's greedy run from each prompt is recorded once with the drafter's top-k at every
    position (kdtree_lib.acceptance.record_oracle); chain and trees are then built from it, exactly the
    rounds a live decode makes.
    """
    from .acceptance import oracle_rows, record_oracle
    device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                          "cpu" if device == "auto" else device)
    target_path, drafter_path = stand_in_paths(block_size, models_dir, pair)
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
        if not (settings.out / drafter_dir(block_size, settings.pair) / "config.json").is_file():
            print(f"no drafter for block size {block_size} in {settings.out}: skipped")
            continue
        rows += acceptance_rows(settings.out, block_size, pair=settings.pair, n_prompts=n_prompts, prompt_tokens=prompt_tokens,
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


def link_tokenizer(directory: Path, target_dir: str) -> None:
    """The drafter uses the target's tokenizer: a relative link to it (valid once both are in place)."""
    link = directory / "tokenizer.json"
    if not link.exists() and not link.is_symlink():
        link.symlink_to(Path("..") / target_dir / "tokenizer.json")


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
    parser.add_argument("--pair", choices=sorted(SHAPES), default=None, help=f"the pair to train (default {DEEP})")
    parser.add_argument("--retrain", action="store_true", help="replace the pair in --out once the new one is complete")
    parser.add_argument("--restart", action="store_true", help="discard a cut run's work instead of resuming it")
    defaults = Settings(out=Path(), corpus=Path())
    for name in ("device", "seed", "seq_len", "batch_size", "steps", "lr", "max_minutes", "drafter_steps",
                 "drafter_lr", "drafter_minutes", "anchor_tokens", "labels", "experts", "bias_rate", "warmup",
                 "log_every", "eval_every", "eval_windows", "checkpoint_every"):
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
    for name in ("steps", "drafter_steps", "batch_size", "seq_len", "log_every", "eval_every", "eval_windows",
                 "checkpoint_every"):
        if name in values and values[name] < 1:
            raise cli.UsageError(f"argument --{name.replace('_', '-')}: expected an integer >= 1, got {values[name]}")
    if "block_sizes" in values:
        values["block_sizes"] = tuple(values["block_sizes"])
    return args.stage, Settings(**values, command=list(argv if argv is not None else sys.argv[1:])), acceptance


# a CPU smoke run: every code path, seconds not minutes
TINY_SETTINGS = dict(seq_len=64, batch_size=2, steps=5, drafter_steps=5, warmup=2, anchor_tokens=16,
                     log_every=1, eval_every=5, eval_windows=2, checkpoint_every=2)


@cli.command
def main(argv=None) -> int:
    stage, settings, acceptance = parse_args(argv)
    torch.set_float32_matmul_precision("high")  # TF32 for what autocast leaves in float32
    if stage in ("target", "drafter", "all"):
        start_run(settings)
        publishing = (settings.work / "publishing").is_file()  # a cut between two moves: only the moves are left
        try:
            with STOP:
                if stage in ("target", "all") and not publishing:
                    train_target(settings)
                if stage in ("drafter", "all") and not publishing:
                    for block_size in settings.block_sizes:
                        train_drafter(settings, block_size)
        except Stopped as stopped:
            print(f"stopped (SIGTERM): {stopped}, state saved in {settings.work}; the same command continues")
            return EXIT_STOPPED
        if stage == "all":
            finish_run(settings)
    if stage == "acceptance":
        measure_acceptance(settings, **acceptance)
    return 0


if __name__ == "__main__":
    sys.exit(main())
