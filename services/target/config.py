"""Target engine configuration, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.env import allowed_values, default_of
from services.common.limits import RequestLimits
from services.common.tls import MeshTls
from services.target.model.linear import WEIGHT_FORMATS

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {**_DTYPES, "fp8": torch.float8_e4m3fn}
_KERNELS = allowed_values("kernels")
_WEIGHTS = WEIGHT_FORMATS


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    # Defaults and help of these are the settings' (services/common/env.py).
    dtype: str = default_of("dtype")
    kv_dtype: str = default_of("kv_dtype")
    device: str = default_of("device")
    block_size: int = default_of("block_size")
    num_blocks: int = default_of("num_blocks")
    kv_host_bytes: int = default_of("kv_host_bytes")  # host tier bound (services/target/engine/host_tier.py); 0 = off
    max_num_seqs: int = default_of("max_num_seqs")
    max_batched_tokens: int = default_of("max_batched_tokens")
    max_queued_requests: int = default_of("max_queued_requests")
    max_tokens_limit: int = default_of("max_tokens_limit")
    max_queued_tokens: int = default_of("max_queued_tokens")
    max_samples: int = default_of("max_samples")  # largest n (samples of one prompt) a request may ask for
    enable_prefix_caching: bool = True
    kernels: str = default_of("kernels")
    name: str = ""  # model id in prefix-cache keys and metrics; "" = the model directory's name
    draft_address: str = ""  # draft service for speculative decoding; "" = never speculate
    chat_template: str = ""  # --chat-template FILE|NAME (services/common/models/chat_templates.py); "" = the model's own
    weights: str = default_of("weights")  # linear-layer format: auto, none, bf16, bf16-avx512, fp16, int8 (services/target/model/linear.py)
    draft_timeout_s: float = 0.5  # per-step deadline of a draft call; past it the step decodes normally
    # The target's mesh identity for its calls to the draft service (services/common/tls.py
    # MeshTls); None = plaintext (dev mode, tests).
    mesh_tls: MeshTls | None = None
    # Prompt bytes and stop sequences, checked before tokenizing (services/common/limits.py).
    limits: RequestLimits = RequestLimits()
    # Compiled constraint grammars persist here across restarts (services/target/structured/
    # compiler.py); None = in memory only.
    grammar_cache_dir: Path | None = None
    grammar_compile_timeout_s: float = 10.0  # a constraint compiling longer is refused (INVALID_ARGUMENT)
    grammar_max_bytes: int = 64 << 20  # a compiled grammar larger than this is refused

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.kv_dtype != "auto" and self.kv_dtype not in _KV_DTYPES:
            raise ValueError(f"kv_dtype must be 'auto' or one of {sorted(_KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.weights not in _WEIGHTS:
            raise ValueError(f"weights must be one of {_WEIGHTS}, got {self.weights!r}")
        if self.kernels not in _KERNELS:
            raise ValueError(f"kernels must be one of {_KERNELS}, got {self.kernels!r}")
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_batched_tokens", "max_tokens_limit",
                     "max_queued_tokens", "max_samples"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.draft_timeout_s <= 60:
            raise ValueError(f"draft_timeout_s must be in (0, 60], got {self.draft_timeout_s}")
        if not 0 < self.grammar_compile_timeout_s <= 600 or self.grammar_max_bytes <= 0:
            raise ValueError("grammar_compile_timeout_s must be in (0, 600] and grammar_max_bytes > 0")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.kv_host_bytes < 0:
            raise ValueError(f"kv_host_bytes must be >= 0 (0 = no host tier), got {self.kv_host_bytes}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        """"auto": the model dtype, except float32 for 16-bit models on a CPU that does not
        multiply bf16 natively, where attention computes in float32 (bf16 values are exact in
        float32, so no kv entry is converted per layer per step). With native bf16 a bf16 model
        keeps a bf16 cache (its keys and values are bf16 already: nothing is rounded) and attends
        with bf16 matmuls (services/target/kernels/paged_attention_cpu.py)."""
        if self.kv_dtype != "auto":
            return _KV_DTYPES[self.kv_dtype]
        if torch.device(self.device).type == "cpu" and self.dtype in ("bfloat16", "float16"):
            from services.target.model.linear import native_bf16_cpu
            return torch.bfloat16 if self.dtype == "bfloat16" and native_bf16_cpu() else torch.float32
        return self.torch_dtype
