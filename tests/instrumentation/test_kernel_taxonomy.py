"""Kernel names as real traces spell them, across NCCL/cuBLAS/flash renames."""

from __future__ import annotations

import pytest

from flare.wire import kernel_taxonomy as kt

NAMES = {
    # NCCL before and after 2.19's rename, and the torch annotation
    "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)": "communication",
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "nccl:all_reduce": "communication",
    # GEMMs: Ampere cutlass, Hopper cuBLAS, cuBLASLt nvjet, Triton
    "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_256x128_32x3_tn_align4>(cutlass_80_tensorop_s1688gemm_256x128_32x3_tn_align4::Params)": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas": "gemm",
    "nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_TNT": "gemm",
    "triton_tem_fused_mm_0": "gemm",
    "aten::addmm": "gemm",
    # attention: flash v2, xformers/fmha, cuDNN SDPA
    "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, false>(flash::Flash_fwd_params)": "attention",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": "attention",
    # memory and the rest
    "Memcpy HtoD (Pageable -> Device)": "memcpy",
    "Memset (Device)": "memset",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)": "elementwise",
    "triton_poi_fused_add_mul_0": "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, unsigned int, float, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, unsigned int, float, 4>)": "reduction",
    "triton_red_fused__softmax_1": "reduction",
    "void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>, float>(...)": "reduction",
    "some_custom_kernel_v2": "other",
}


@pytest.mark.parametrize(("name", "category"), NAMES.items(), ids=[n[:40] for n in NAMES])
def test_categories(name, category):
    assert kt.categorize(name) == category


def test_collective_ops_from_kernel_and_torch_names():
    assert kt.collective_op("ncclKernel_ReduceScatter_RING_SIMPLE_Sum_bf16") == "reduce_scatter"
    assert kt.collective_op("ncclDevKernel_AllGather_RING_LL") == "all_gather"
    assert kt.collective_op("nccl:_reduce_scatter_base") == "reduce_scatter"
    assert kt.collective_op("allgather_into_tensor_coalesced") == "all_gather"
    assert kt.collective_op("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t") == "send_recv"
    assert kt.collective_op("not_a_collective") is None


def test_flops_from_operator_shapes():
    assert kt.op_flops("aten::mm", [[128, 256], [256, 512]]) == 2 * 128 * 512 * 256
    assert kt.op_flops("aten::addmm", [[512], [128, 256], [256, 512], [], []]) == 2 * 128 * 512 * 256
    assert kt.op_flops("aten::bmm", [[4, 8, 16], [4, 16, 32]]) == 2 * 4 * 8 * 32 * 16
    assert kt.op_flops("aten::linear", [[2, 10, 64], [32, 64], [32]]) == 2 * 20 * 32 * 64
    # SDPA (batch, heads, seq, head_dim): 4·b·s_q·s_k·h·d forward, twice backward
    q = [2, 8, 1024, 64]
    assert kt.op_flops("aten::_scaled_dot_product_flash_attention", [q, q, q]) == 4 * 2 * 1024 * 1024 * 8 * 64
    assert kt.op_flops("aten::_scaled_dot_product_flash_attention_backward", [q, q, q, q]) == \
        2 * 4 * 2 * 1024 * 1024 * 8 * 64
    assert kt.op_flops("aten::mm", [[], []]) is None
    assert kt.op_flops("aten::relu", [[4, 4]]) is None


def test_peak_tables_and_throttle_reasons():
    assert kt.peak_tflops("NVIDIA A100-SXM4-80GB", "c10::BFloat16") == 312.0
    assert kt.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert kt.peak_tflops("NVIDIA H800", "float8_e4m3fn") == 1979.0
    assert kt.peak_tflops("NVIDIA H200", "bfloat16") == 989.0
    assert kt.peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert kt.peak_tflops("Some GPU", "bf16") is None
    assert kt.compute_dtype("cutlass_80_tensorop_s1688gemm_128x128", "float") == "tf32"
    assert kt.throttle_reason_names(0x20 | 0x4) == ["sw_power_cap", "sw_thermal_slowdown"]
