"""The target's settings (`settings.target`), and the allowed values of its switches.

Each list below is the one declaration of what the target accepts: the kernel backends
(kernels/select.py picks among them), the linear-layer weight formats (model/linear.py packs
them) and the KV cache dtypes (config.py maps them to torch). They live here, not in those
modules, because the CLI validates settings without importing torch; those modules import
them from here. Field names are EngineConfig's, so the composition root passes the group
through (`EngineConfig(**settings.target...)`), and EngineConfig built without the settings
(tests, benchmarks) is checked against these same declarations.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field

from services.common.env import MODEL_DTYPES
from services.common.settings_group import SettingsGroup

KernelBackend = Literal["auto", "triton", "cpu", "reference"]
KERNEL_BACKENDS: tuple[str, ...] = get_args(KernelBackend)

WeightFormat = Literal["auto", "none", "bf16", "bf16-avx512", "gguf", "gguf-bf16", "fp16", "int8"]
WEIGHT_FORMATS: tuple[str, ...] = get_args(WeightFormat)
GGUF_FORMATS = ("gguf", "gguf-bf16")  # the formats that multiply a GGUF file's own blocks

KvDtype = Literal[("auto", *MODEL_DTYPES, "fp8")]

ForwardKind = Literal["auto", "generic"]
FORWARD_KINDS: tuple[str, ...] = get_args(ForwardKind)
KV_DTYPES: tuple[str, ...] = get_args(KvDtype)

PreemptionMode = Literal["auto", "swap", "recompute"]  # services/target/engine/scheduler.py
PREEMPTION_MODES: tuple[str, ...] = get_args(PreemptionMode)

KvColdPrecision = Literal["auto", "off", "fp8"]  # services/target/engine/kv_precision.py
KV_COLD_PRECISIONS: tuple[str, ...] = get_args(KvColdPrecision)

MAX_DRAFT_TIMEOUT_MS = 60_000  # longest per-step deadline of a draft call


class TargetSettings(SettingsGroup):
    kv_dtype: KvDtype = Field(
        "auto", description="KV cache dtype; auto = same as dtype (float32 on the CPU, where "
        "attention computes in float32), fp8 = float8 with scales")
    kernels: KernelBackend = Field(
        "auto", description="attention kernels; auto = Triton where CUDA is present, else cpu")
    weights: WeightFormat = Field(
        "auto", description="linear-layer weights; auto = gguf-bf16 for a bf16 model prepared from a GGUF "
        "(the default model) on a CPU with AVX512-BF16, else specmesh's AVX-512 kernel (bf16-avx512) for a "
        "bf16 model on an AVX-512 CPU, else oneDNN-packed bf16 on a CPU with bf16 dot products in "
        "hardware, else fp16 packed for fbgemm when a bf16/fp16 model runs on the CPU; "
        "int8 = per-channel int8 (fbgemm dynamic quantization); gguf = the blocks of the GGUF a prepared "
        "model came from (the default model), multiplied by specmesh's AVX512-BF16 kernel with outputs equal "
        "to bf16-avx512's bit for bit in fewer bytes (a CPU without AVX512-BF16 falls back to bf16-avx512); "
        "gguf-bf16 = those blocks for calls of 1-3 rows, bf16 panels of the same values for more")
    forward: ForwardKind = Field(
        "auto", description="the model's forward; auto = a lean forward where one computes the model exactly "
        "(Gemma 3, the Llama family), else transformers' modules; generic = transformers' modules always "
        "(to compare against or to diagnose; not with tensor_parallel > 1)")
    device: str = Field("cpu", description="torch device of the target (cpu, cuda, cuda:N)")
    chat_template: str = Field("", description="chat template of the target model: a Jinja file (or a "
                               "JSON file with \"chat_template\"), a name (gemma3, or none = plain prompts only), "
                               "or empty = the model's own, Gemma 3's for a model without one that has Gemma's "
                               "turn tokens (the default model)")
    block_size: int = Field(16, gt=0, description="tokens per KV block")
    num_blocks: int = Field(2048, gt=0, description="KV blocks in the target's pool")
    kv_host_bytes: int = Field(1 << 30, ge=0, description="host tier below the target's KV pool: bytes of "
                               "evicted prefix blocks kept in host memory and restored instead of "
                               "recomputed, and preempted sequences' KV swapped out and back (see preemption_mode); "
                               "0 = none")
    feature_cache_bytes: int = Field(64 << 20, ge=0, description="bytes of the feature head's inputs (the "
                                     "target's last-layer features) kept for cached prefix blocks, so a request "
                                     "drafting with the head reuses a cached prefix and its head still sees the "
                                     "whole context; such a request recomputes cached blocks whose features are "
                                     "gone; 0 = none kept (a head's context then starts after the cached prefix)")
    preemption_mode: PreemptionMode = Field(
        "auto", description="what a sequence preempted for lack of KV blocks keeps: auto = its KV is swapped "
        "out to the host tier and back where the copies are measured cheaper than recomputing it, swap = "
        "always swapped, recompute = never; either way it is recomputed when the host tier has no room")
    kv_cold_precision: KvColdPrecision = Field(
        "auto", description="precision of the host tier's copies of evicted prefix blocks, and of preempted "
        "sequences' swapped-out blocks, that start at or past kv_cold_after_tokens: fp8 = float8_e4m3fn with a scale per token and KV head (the --kv-dtype fp8 format; "
        "about a quarter of a float32 block, half of a bf16 one), restored into the pool dequantized; auto = fp8 "
        "only when the tier would otherwise drop an older entry and the model's accuracy cost, as measured by "
        "benchmarks/kv_precision.py, is within the stated bound (else full precision); off = full precision always")
    kv_cold_after_tokens: int = Field(256, ge=0, description="a prefix's first tokens whose host-tier copies stay "
                                      "in full precision whatever kv_cold_precision says (long prefixes' later "
                                      "blocks are the cold ones)")
    kv_shared_url: str = Field("", description="shared tier below the host tier: a Redis URL "
                               "(redis://host:port/db) where committed prefix blocks are written and from which "
                               "blocks other replicas computed are loaded instead of recomputed; needs "
                               "kv_host_bytes > 0 (loads go through the host tier); empty = none")
    kv_shared_bytes: int = Field(1 << 30, gt=0, description="bytes of shared-tier entries this replica keeps "
                                 "written; past it its own oldest entries are deleted")
    kv_shared_ttl_s: int = Field(3600, gt=0, description="seconds a shared-tier entry lives in Redis")
    kv_shared_timeout_ms: int = Field(100, gt=0, le=10_000, description="timeout of one shared-tier Redis "
                                      "call (ms); past it, or with Redis down, the prefix is recomputed")
    kv_shared_prefix: str = Field("specmesh:kv", min_length=1, description="key prefix of the shared tier's "
                                  "entries in Redis (the model id and block hash follow)")
    max_num_seqs: int = Field(32, gt=0, description="sequences the target runs at once")
    max_batched_tokens: int = Field(512, gt=0, description="tokens per engine step "
                                    "(prefill chunks + decodes + verify trees)")
    max_queued_requests: int = Field(256, ge=0, description="requests waiting beyond max_num_seqs; "
                                     "more are refused with RESOURCE_EXHAUSTED")
    max_queued_tokens: int = Field(262144, gt=0, description="prompt tokens waiting for admission at the "
                                   "target; more are refused with RESOURCE_EXHAUSTED")
    draft_timeout_ms: int = Field(500, gt=0, le=MAX_DRAFT_TIMEOUT_MS,
                                  description="per-step deadline of the target's draft call (ms)")
    tensor_parallel: int = Field(1, ge=1, le=64, description="ranks of one target, one process each, over "
                                 "torch.distributed (gloo on the CPU, NCCL on CUDA: rank r on cuda:r): weights "
                                 "and KV heads split N ways; the lean forwards only (Gemma 3, the Llama family)")
    fault_injection: bool = Field(False, description="testing only: SIGUSR1 makes the target's engine "
                                  "loop fail once outside a step (exercises its supervision and restart)")

    def engine_fields(self) -> dict:
        """The fields EngineConfig takes as they are (it holds the deadline in seconds, and
        fault injection is the serving loop's, services/builders.py)."""
        return self.model_dump(exclude={"draft_timeout_ms", "fault_injection"})
