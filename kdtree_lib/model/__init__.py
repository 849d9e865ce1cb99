"""The target model: Kimi K2.6 / DeepSeek-V3 (MLA + MoE), config-driven, tensor-parallel.

    config.py      ModelConfig from config.json (DeepseekV3, or K2.5/K2.6's text_config)
    model.py       the modules, the absorbed KV cache, prefill and tree verify
    checkpoint.py  safetensors loading (sharded per rank, INT4 experts dequantized), writing
    tp.py          tensor-parallel groups and the spawn launcher
    sharded.py     TP workers a notebook or test can launch
    costs.py       parameter, byte and attention-cost accounting at the real shapes
"""
from .checkpoint import CheckpointReader, load_target, save_checkpoint
from .config import ModelConfig, QuantConfig, load_config
from .model import KVCache, TargetOutput, Transformer
from .tp import TensorParallel, launch

__all__ = ["CheckpointReader", "KVCache", "ModelConfig", "QuantConfig", "TargetOutput", "TensorParallel",
           "Transformer", "launch", "load_config", "load_target", "save_checkpoint"]
