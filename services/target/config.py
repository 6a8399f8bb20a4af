"""Target engine configuration, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.env import MODEL_DTYPES, MeshSettings, check_declared
from services.common.limits import RequestLimits
from services.common.tls import MeshTls
from services.target.settings import GGUF_FORMATS, MAX_DRAFT_TIMEOUT_MS, TargetSettings

_DTYPES = {name: getattr(torch, name) for name in MODEL_DTYPES}
_KV_DTYPES = {**_DTYPES, "fp8": torch.float8_e4m3fn}  # and "auto" (services/target/settings.py KV_DTYPES)
# Defaults, limits and allowed values of the fields that are settings are declared once, in
# their settings group (services/target/settings.py; dtype and request limits: the mesh's).
_TARGET = TargetSettings()
_MESH = MeshSettings()
_TARGET_FIELDS = tuple(_TARGET.engine_fields())
_MESH_FIELDS = ("dtype", "max_tokens_limit", "max_samples")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    dtype: str = _MESH.dtype
    kv_dtype: str = _TARGET.kv_dtype
    device: str = _TARGET.device
    block_size: int = _TARGET.block_size
    num_blocks: int = _TARGET.num_blocks
    kv_host_bytes: int = _TARGET.kv_host_bytes  # host tier bound (services/target/engine/host_tier.py); 0 = off
    # Features of cached prefix blocks for feature-head sequences (speculation/prefix_features.py); 0 = none.
    feature_cache_bytes: int = _TARGET.feature_cache_bytes
    preemption_mode: str = _TARGET.preemption_mode  # swap or recompute preempted sequences (engine/scheduler.py)
    # Host-tier copies of long prefixes' later blocks in FP8 (services/target/engine/kv_precision.py).
    kv_cold_precision: str = _TARGET.kv_cold_precision
    kv_cold_after_tokens: int = _TARGET.kv_cold_after_tokens
    # The shared tier (services/target/engine/shared_tier.py): Redis URL ("" = off), this replica's
    # byte bound there, entry lifetime, per-call timeout and key prefix.
    kv_shared_url: str = _TARGET.kv_shared_url
    kv_shared_bytes: int = _TARGET.kv_shared_bytes
    kv_shared_ttl_s: int = _TARGET.kv_shared_ttl_s
    kv_shared_timeout_ms: int = _TARGET.kv_shared_timeout_ms
    kv_shared_prefix: str = _TARGET.kv_shared_prefix
    max_num_seqs: int = _TARGET.max_num_seqs
    max_batched_tokens: int = _TARGET.max_batched_tokens
    max_queued_requests: int = _TARGET.max_queued_requests
    max_tokens_limit: int = _MESH.max_tokens_limit
    max_queued_tokens: int = _TARGET.max_queued_tokens
    max_samples: int = _MESH.max_samples  # largest n (samples of one prompt) a request may ask for
    enable_prefix_caching: bool = True
    kernels: str = _TARGET.kernels
    name: str = ""  # model id in prefix-cache keys and metrics; "" = the model directory's name
    draft_address: str = ""  # draft service for speculative decoding; "" = never speculate
    chat_template: str = _TARGET.chat_template  # --chat-template FILE|NAME (services/common/models/chat_templates.py); "" = the model's own
    weights: str = _TARGET.weights  # linear-layer format (services/target/model/linear.py)
    forward: str = _TARGET.forward  # auto = lean forward where one exists; generic = transformers' modules
    tensor_parallel: int = _TARGET.tensor_parallel  # ranks of this target (services/target/tp/); 1 = one process
    draft_timeout_s: float = _TARGET.draft_timeout_ms / 1000  # per-step deadline of a draft call; past it the step decodes normally
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
    # Rows a grammar restricts to few tokens get logits over those only (structured/vocab_subsets.py);
    # False: every row through the whole output layer (the A/B of benchmarks/structured_outputs.py).
    grammar_vocab_subsets: bool = True

    def __post_init__(self) -> None:
        check_declared(TargetSettings, self, _TARGET_FIELDS)
        check_declared(MeshSettings, self, _MESH_FIELDS)
        if not 0 < self.draft_timeout_s <= MAX_DRAFT_TIMEOUT_MS / 1000:
            raise ValueError(f"draft_timeout_s must be in (0, {MAX_DRAFT_TIMEOUT_MS / 1000:g}], "
                             f"got {self.draft_timeout_s}")
        if self.kv_shared_url and not (self.kv_host_bytes and self.enable_prefix_caching):
            raise ValueError("kv_shared_url needs kv_host_bytes > 0 and prefix caching: shared-tier "
                             "entries are loaded through the host tier")
        if self.kv_cold_precision == "fp8" and (self.kv_dtype == "fp8" or not self.kv_host_bytes):
            raise ValueError("kv_cold_precision 'fp8' needs a host tier (kv_host_bytes > 0) below a pool that is not "
                             "FP8 already (kv_dtype is not fp8)")
        if self.forward == "generic" and self.tensor_parallel > 1:
            raise ValueError("forward 'generic' cannot be split across ranks: tensor_parallel > 1 needs "
                             "a lean forward (forward auto, Gemma 3 or the Llama family)")
        if not 0 < self.grammar_compile_timeout_s <= 600 or self.grammar_max_bytes <= 0:
            raise ValueError("grammar_compile_timeout_s must be in (0, 600] and grammar_max_bytes > 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        """"auto": the model dtype, except float32 for 16-bit models on a CPU where their attention
        would multiply bf16 in torch without native bf16 (bf16 values are exact in float32, so no
        kv entry is converted per layer per step). A bf16 model keeps a bf16 cache (its keys and
        values are bf16 already: nothing is rounded) where the CPU multiplies bf16 natively (bf16
        matmuls, services/target/kernels/paged_attention_cpu.py) and where specmesh's C++ kernels
        attend its decode rows and small trees in the pool (`cpp_attention_expected`: AVX2 CPUs
        included; a float32 pool there left decode rows to per-sequence gathers and torch's
        float32 SDPA, 1.2x slower single-stream steps and 1.6x slower 18-row steps on an AVX2 EPYC,
        `benchmarks/engine_step.py --kv-dtype`)."""
        if self.kv_dtype != "auto":
            return _KV_DTYPES[self.kv_dtype]
        if torch.device(self.device).type == "cpu" and self.dtype in ("bfloat16", "float16"):
            from services.target.model.linear import native_bf16_cpu
            bf16 = self.dtype == "bfloat16" and (native_bf16_cpu() or self.cpp_attention_expected)
            return torch.bfloat16 if bf16 else torch.float32
        return self.torch_dtype

    @property
    def cpp_attention_expected(self) -> bool:
        """Whether a bf16 model's attention will run in specmesh's C++ kernels here, as far as the
        configuration tells: its C++ row ops run on specmesh's linear kernels (`weights` auto,
        bf16-avx512, gguf or gguf-bf16, on a CPU where the kernel module builds) under a lean forward
        (`forward` auto; an architecture without one, services/target/model/lean_forward.py, then
        attends in torch over the same pool)."""
        from services.target.kernels import cpu_linear
        return (torch.device(self.device).type == "cpu"
                and self.weights in ("auto", "bf16-avx512", *GGUF_FORMATS)
                and self.forward == "auto" and cpu_linear.available())
