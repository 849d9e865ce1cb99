"""The DFlash block-diffusion drafter, in the z-lab checkpoint format.

    config.py      DFlashConfig from a z-lab config.json, YaRN's settings, the target layers read,
                   the drafter's placements over a TP group
    model.py       the modules (split-KV attention, Qwen3 layers), the draft cache, DFlashDrafter
    checkpoint.py  safetensors writing (one file or shards), reading per TP rank, load_drafter
"""
from .checkpoint import load_drafter, read_drafter_weights, save_drafter, write_safetensors
from .config import DEFAULT_DRAFTER_PLACEMENT, DRAFTER_PLACEMENTS, DFlashConfig, YarnRope, build_target_layer_ids
from .model import DFlashDrafter, TargetHead, hf_features, split_kv_attention

__all__ = ["DEFAULT_DRAFTER_PLACEMENT", "DRAFTER_PLACEMENTS", "DFlashConfig", "DFlashDrafter", "TargetHead",
           "YarnRope", "build_target_layer_ids", "hf_features", "load_drafter", "read_drafter_weights",
           "save_drafter", "split_kv_attention", "write_safetensors"]
