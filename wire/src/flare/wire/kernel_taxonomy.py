"""What a GPU kernel (or CPU operator) is, how much work it does, and what the GPU can do.

Stdlib only: loaded inside training processes and by `flare import-kineto`.

Categories follow the paper's split (GEMM, attention, NCCL) plus the memory and
elementwise families that make up most kernel counts. Matching is by substrings of the
demangled or mangled name, ordered most-specific first, so the usual renames keep their
category: `ncclKernel_AllReduce_*` → `ncclDevKernel_AllReduce_*` (NCCL 2.19),
`cutlass_80_tensorop_*` → `sm90_xmma_gemm_*` / `nvjet_*` (cuBLAS 12 on Hopper),
`flash_fwd_kernel` → `flash::flash_fwd_splitkv_kernel` / `fmha_cutlassF_*`, Triton's
`triton_poi_/triton_red_/triton_per_/triton_mm` prefixes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

GEMM = "gemm"
ATTENTION = "attention"
COMMUNICATION = "communication"
ELEMENTWISE = "elementwise"
REDUCTION = "reduction"
MEMCPY = "memcpy"
MEMSET = "memset"
OTHER = "other"

# (category, compiled pattern), first match wins. Attention before GEMM: flash kernels
# contain "gemm" in their template arguments; communication first of all because NCCL
# kernels contain "Reduce"/"Sum".
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (category, re.compile(pattern, re.IGNORECASE))
    for category, pattern in (
        (COMMUNICATION, r"nccl|rccl|c10d::|gloo:|allreduce|all_reduce|allgather|all_gather|"
         r"reducescatter|reduce_scatter|alltoall|all_to_all|sendrecv|broadcast_|"
         r"^(record_param_comms|nccl:)|cross_device_reduce|one_shot_all_reduce|multimem"),
        (MEMCPY, r"^memcpy|^\[?memcpy|cudaMemcpy|copy_device_to_device|^aten::copy_|^aten::to$|"
         r"^aten::_to_copy"),
        (MEMSET, r"^memset|cudaMemset|^aten::zero_$|^aten::fill_$"),
        (ATTENTION, r"flash|fmha|attention|attn|scaled_dot_product|_efficient_attention|"
         r"cudnn_generated_fort_native_sdpa|sdpa"),
        (GEMM, r"gemm|cutlass|cublas|xmma|nvjet|wgmma|hgmma|matmul|^aten::(mm|addmm|bmm|"
         r"baddbmm|linear|_scaled_mm|addmv|mv|dot)$|triton_.*mm|_mm_|gemv|s1688|s16816|"
         r"h1688|h16816|i8816|implicit_gemm|conv|cudnn::.*(fprop|dgrad|wgrad)"),
        (REDUCTION, r"reduce|reduction|softmax|norm|cub::|scan|argmax|argmin|topk|sort|"
         r"sum_kernel|mean|^triton_red_|^triton_per_|multi_tensor_apply|welford|cumsum"),
        (ELEMENTWISE, r"elementwise|vectorized|unrolled|pointwise|^triton_poi_|functor|"
         r"cat_?array|catarray|index|gather|scatter|fill|copy|transpose|permute|where|"
         r"^aten::(add|sub|mul|div|relu|gelu|silu|tanh|sigmoid|exp|log|pow|neg|abs|clamp|"
         r"masked_fill|dropout|add_|mul_|div_|sub_)|nchwtonhwc|nhwctonchw|cast|embedding"),
    )
)

_cache: dict[str, str] = {}


def categorize(name: str) -> str:
    """Category of a kernel or operator name; cached because names repeat every step."""
    category = _cache.get(name)
    if category is None:
        category = OTHER
        for candidate, pattern in _RULES:
            if pattern.search(name):
                category = candidate
                break
        if len(_cache) < 65536:
            _cache[name] = category
    return category


# NCCL kernel names: ncclKernel_AllReduce_RING_LL_Sum_float, ncclDevKernel_AllGather_RING_LL,
# ncclDevKernel_SendRecv, ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t.
_NCCL_OP = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", re.IGNORECASE)
_OP_NAMES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reducescatter": "reduce_scatter",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "sendrecv": "send_recv",
    "send": "send",
    "recv": "recv",
    "alltoall": "all_to_all",
}


def collective_op(name: str) -> str | None:
    """The collective operation of a communication kernel or annotation, snake_case."""
    match = _NCCL_OP.search(name)
    raw = match.group(1) if match else name.rsplit(":", 1)[-1]
    key = raw.lower().replace("_", "")
    # torch spellings: _all_gather_base, allgather_into_tensor_coalesced, alltoall_base
    for suffix in ("coalesced", "intotensor", "base"):
        key = key.removesuffix(suffix)
    return _OP_NAMES.get(key)


# ---------------------------------------------------------------- FLOPs from shapes

_GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
             "aten::linear", "aten::_scaled_mm"}
_ATTENTION_FWD_OPS = {"aten::_scaled_dot_product_flash_attention",
                      "aten::_scaled_dot_product_efficient_attention",
                      "aten::_scaled_dot_product_cudnn_attention",
                      "aten::_flash_attention_forward", "aten::_efficient_attention_forward",
                      "aten::scaled_dot_product_attention"}
_ATTENTION_BWD_OPS = {"aten::_scaled_dot_product_flash_attention_backward",
                      "aten::_scaled_dot_product_efficient_attention_backward",
                      "aten::_scaled_dot_product_cudnn_attention_backward",
                      "aten::_flash_attention_backward", "aten::_efficient_attention_backward"}
FLOP_OPS = frozenset(_GEMM_OPS | _ATTENTION_FWD_OPS | _ATTENTION_BWD_OPS)


def gemm_flops(m: int, n: int, k: int, batch: int = 1) -> int:
    """2·b·m·n·k: one multiply and one add per inner-product term."""
    return 2 * batch * m * n * k


def attention_flops(batch: int, heads: int, s_q: int, s_k: int, head_dim: int,
                    backward: bool = False) -> int:
    """4·b·s_q·s_k·(h·d) forward (QKᵀ and PV), twice that backward."""
    flops = 4 * batch * s_q * s_k * heads * head_dim
    return 2 * flops if backward else flops


def op_flops(op_name: str, input_dims: Sequence[Sequence[int]]) -> int | None:
    """FLOPs of one PyTorch operator from its recorded input shapes, None when unknown."""
    dims = [list(d) for d in input_dims if isinstance(d, (list, tuple))]
    try:
        if op_name in ("aten::mm", "aten::_scaled_mm"):
            (m, k), (_, n) = dims[0], dims[1]
            return gemm_flops(m, n, k)
        if op_name == "aten::addmm":  # (bias, a, b)
            (m, k), (_, n) = dims[1], dims[2]
            return gemm_flops(m, n, k)
        if op_name == "aten::bmm":
            (b, m, k), (_, _, n) = dims[0], dims[1]
            return gemm_flops(m, n, k, b)
        if op_name == "aten::baddbmm":
            (b, m, k), (_, _, n) = dims[1], dims[2]
            return gemm_flops(m, n, k, b)
        if op_name == "aten::linear":  # (input [..., k], weight [n, k])
            a, w = dims[0], dims[1]
            rows = 1
            for size in a[:-1]:
                rows *= size
            return gemm_flops(rows, w[0], w[1])
        if op_name == "aten::matmul":
            a, b = dims[0], dims[1]
            if len(a) < 2 or len(b) < 2:
                return None
            batch = 1
            for size in a[:-2]:
                batch *= size
            return gemm_flops(a[-2], b[-1], a[-1], batch)
        if op_name in _ATTENTION_FWD_OPS or op_name in _ATTENTION_BWD_OPS:
            # SDPA layout (batch, heads, seq, head_dim) for q and k; the backward ops take
            # grad_out first, then q, k.
            offset = 1 if op_name in _ATTENTION_BWD_OPS else 0
            q, k = dims[offset], dims[offset + 1]
            if len(q) != 4 or len(k) != 4:
                return None
            if op_name.startswith("aten::_flash_attention") or \
                    op_name.startswith("aten::_efficient_attention"):
                b, s_q, h, d = q  # these take (batch, seq, heads, head_dim)
                s_k = k[1]
            else:
                b, h, s_q, d = q
                s_k = k[2]
            return attention_flops(b, h, s_q, s_k, d, backward=op_name in _ATTENTION_BWD_OPS)
    except (IndexError, ValueError, TypeError):
        return None
    return None


# ---------------------------------------------------------------- peak tables

# Dense (no sparsity) peak TFLOPS by GPU model and dtype, from NVIDIA datasheets.
# Keys are matched as substrings of the device name, most specific first.
_PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "tf32": 494.0, "fp32": 67.0}),
    ("H100 PCIE", {"bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "tf32": 378.0, "fp32": 51.0}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "tf32": 494.0, "fp32": 67.0}),
    ("H800", {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "tf32": 494.0, "fp32": 67.0}),
    ("H20", {"bf16": 148.0, "fp16": 148.0, "fp8": 296.0, "tf32": 74.0, "fp32": 44.0}),
    ("GH200", {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "tf32": 494.0, "fp32": 67.0}),
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "tf32": 1100.0, "fp32": 80.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5, "int8": 624.0}),
    ("A800", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5, "int8": 624.0}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("L40S", {"bf16": 362.0, "fp16": 362.0, "fp8": 733.0, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "fp8": 242.0, "tf32": 60.0, "fp32": 30.3}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
)

# Peak memory bandwidth, GB/s, for memory-bound kernels (memcpy, elementwise).
_PEAK_GBPS: tuple[tuple[str, float], ...] = (
    ("H200", 4800.0), ("H100 PCIE", 2000.0), ("H100", 3350.0), ("H800", 3350.0),
    ("H20", 4000.0), ("B200", 8000.0), ("A100-SXM4-80GB", 2039.0), ("A100", 1555.0),
    ("A800", 2039.0), ("L40S", 864.0), ("L4", 300.0), ("V100", 900.0),
)

_DTYPE_ALIASES = {
    "bfloat16": "bf16", "torch.bfloat16": "bf16", "c10::bfloat16": "bf16", "bf16": "bf16",
    "half": "fp16", "float16": "fp16", "torch.float16": "fp16", "c10::half": "fp16",
    "fp16": "fp16", "float": "fp32", "float32": "fp32", "torch.float32": "fp32",
    "fp32": "fp32", "tf32": "tf32", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
    "c10::float8_e4m3fn": "fp8", "fp8": "fp8", "int8": "int8", "signed char": "int8",
}


def normalize_dtype(dtype: str | None) -> str | None:
    if not dtype:
        return None
    return _DTYPE_ALIASES.get(dtype.strip().lower())


def peak_tflops(gpu_model: str | None, dtype: str | None) -> float | None:
    """Datasheet dense peak for (model, dtype), None when either is unknown."""
    key = normalize_dtype(dtype)
    if not gpu_model or key is None:
        return None
    model = gpu_model.upper()
    for needle, table in _PEAK_TFLOPS:
        if needle.upper() in model:
            return table.get(key)
    return None


def peak_gbps(gpu_model: str | None) -> float | None:
    if not gpu_model:
        return None
    model = gpu_model.upper()
    for needle, gbps in _PEAK_GBPS:
        if needle.upper() in model:
            return gbps
    return None


_DTYPE_BYTES = {
    "float": 4, "float32": 4, "fp32": 4, "double": 8, "float64": 8, "half": 2,
    "float16": 2, "c10::half": 2, "bfloat16": 2, "c10::bfloat16": 2, "bf16": 2,
    "int": 4, "int32": 4, "long": 8, "int64": 8, "long int": 8, "short": 2,
    "int16": 2, "signed char": 1, "unsigned char": 1, "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "c10::float8_e4m3fn": 1,
}


def dtype_bytes(dtype: str | None) -> int | None:
    if not dtype:
        return None
    return _DTYPE_BYTES.get(dtype.strip().lower())


_TF32_KERNEL = re.compile(r"tf32|s1688|s16816|s16832|xmma.*f32", re.IGNORECASE)


def compute_dtype(kernel_name: str, tensor_dtype: str | None) -> str | None:
    """The dtype the tensor cores ran at: fp32 tensors on TF32 kernels run at TF32 peak."""
    key = normalize_dtype(tensor_dtype)
    if key == "fp32" and _TF32_KERNEL.search(kernel_name):
        return "tf32"
    return key


# NVML clocks-event (throttle) reasons, nvmlClocksEventReason*/nvmlClocksThrottleReason*.
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# Reasons that slow a busy GPU below what it was asked to run at.
HARMFUL_THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def throttle_reason_names(mask: int) -> list[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
