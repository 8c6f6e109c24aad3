// diffusers-trtllm: host binding for TRT-LLM FMHAv2's warp-specialized SAGE kernels (sm_90, e4m3 Q/K/V, bf16 out).
//
// FlashInfer ships the kernels' sources and generator but its fmha_v2_run never fills `params.sage`; this file
// does, for the kernels that diffusers_trtllm/kernels/fmha_v2_sage.py generates (padding mask, PACKED_QKV layout for
// Q and K, V read transposed by its patched DMA code). The generated header "sage_kernels.h" declares those
// kernels' launchers and `launch_sage_kernel`, which picks one by (q block, k block, KV step, skip-softmax, softmax
// statistics, tile map).

#include <fused_multihead_attention.h>

#include <cmath>
#include <cstring>

#include "sage_kernels.h"
#include "tvm_ffi_utils.h"

namespace {

uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

}  // namespace

// qk:           [total_tokens, heads_q + heads_kv, 128] float8_e4m3fn (Q heads, then K heads)
// v_t:          [heads_kv, 128, columns] float8_e4m3fn, V transposed, keys in the kernel's P order within 16-key
//               groups, zeros between sequences
// v_starts:     [batch + 1] int32, sequence b's first column in v_t
// out:          [total_tokens, heads_q, 128] bfloat16
// q_scale:      [batch, heads_q, ceil(max_seqlen / q_block)] float32, block i of sequence b covers its tokens
//               [i * q_block, (i + 1) * q_block)
// k_scale:      [batch, heads_q, ceil(max_seqlen / k_block)] float32 (indexed by query head), or empty when k_block
//               is 0 (the caller folded K's scale into q_scale)
// v_scale:      [batch, heads_q, 128] float32, V's per-channel scales (indexed by query head), applied by the
//               patched epilogue
// cu_seqlens:   [batch + 1] int32 (queries and keys of a sequence are the same tokens)
// tile_counter: [1] int32 scratch for the persistent scheduler, owned by the caller's stream
// skip_counts:  [1] int32 to which the skipping kernels add their skipped tiles of 64 query rows x 128 keys
//               (skip_counts.patch), or empty: no count
// softmax_stats: [total_tokens, heads_q, 2] float32, each row's (max / sqrt(head_dim), sum) (FMHAv2's
//               Softmax_saver_tma), written by the kernels built with softmax statistics; empty: the kernels
//               without them run
// tile_map_entry, tile_map: int32 [batch, heads_q, query tiles, ceil(ceil(max_seqlen / 128) / 32)], contiguous,
//               Skip-Softmax reuse (tile_map_reuse.patch, kv_step 256): the tile-map kernel skips the tiles set
//               in tile_map_entry (the caller's copy of tile_map) untested and ORs those its test skips into
//               tile_map; with tile_map_entry empty, the map-writing kernel (Skip-Softmax) ORs the tiles it skips
//               into a zeroed tile_map and reads no map; both empty: the kernels without a map
void sage_attention(ffi::TensorView qk, ffi::TensorView v_t, ffi::TensorView v_starts, ffi::TensorView out,
                    ffi::TensorView q_scale, ffi::TensorView k_scale, ffi::TensorView v_scale,
                    ffi::TensorView cu_seqlens, ffi::TensorView tile_counter, ffi::TensorView skip_counts,
                    ffi::TensorView softmax_stats, ffi::TensorView tile_map_entry, ffi::TensorView tile_map,
                    int64_t heads_q, int64_t heads_kv, int64_t max_seqlen,
                    int64_t q_block, int64_t k_block, int64_t kv_step, double softmax_scale,
                    double skip_softmax_threshold_scale_factor) {
  TVM_FFI_ICHECK_EQ(qk.dtype(), dl_float8_e4m3fn) << "qk must be float8_e4m3fn";
  TVM_FFI_ICHECK_EQ(v_t.dtype(), dl_float8_e4m3fn) << "v_t must be float8_e4m3fn";
  TVM_FFI_ICHECK_EQ(out.dtype(), dl_bfloat16) << "out must be bfloat16";
  TVM_FFI_ICHECK_EQ(q_scale.dtype(), dl_float32) << "q_scale must be float32";
  TVM_FFI_ICHECK_EQ(v_scale.dtype(), dl_float32) << "v_scale must be float32";
  TVM_FFI_ICHECK_EQ(cu_seqlens.dtype(), dl_int32) << "cu_seqlens must be int32";
  TVM_FFI_ICHECK_EQ(v_starts.dtype(), dl_int32) << "v_starts must be int32";
  TVM_FFI_ICHECK(skip_counts.dtype() == dl_int32 && skip_counts.ndim() == 1 && skip_counts.shape()[0] <= 1)
      << "skip_counts must be int32 [1] (skipped tiles) or empty";
  TVM_FFI_ICHECK_EQ(qk.ndim(), 3) << "qk must be [tokens, heads_q + heads_kv, head_dim]";
  const bool save_stats = softmax_stats.numel() > 0;
  TVM_FFI_ICHECK(!save_stats || (softmax_stats.dtype() == dl_float32 && softmax_stats.ndim() == 3 &&
                                 softmax_stats.shape()[0] == qk.shape()[0] && softmax_stats.shape()[1] == heads_q &&
                                 softmax_stats.shape()[2] == 2 && softmax_stats.IsContiguous()))
      << "softmax_stats must be a contiguous float32 [tokens, heads_q, 2] tensor or empty";
  TVM_FFI_ICHECK_EQ(qk.shape()[1], heads_q + heads_kv) << "qk's head count is not heads_q + heads_kv";
  TVM_FFI_ICHECK_EQ(heads_q % heads_kv, 0) << "heads_q must be a multiple of heads_kv";
  const int64_t head_dim = qk.shape()[2];
  TVM_FFI_ICHECK(v_t.ndim() == 3 && v_t.shape()[0] == heads_kv && v_t.shape()[1] == head_dim)
      << "v_t must be [heads_kv, head_dim, columns]";
  TVM_FFI_ICHECK_EQ(v_t.shape()[2] % 16, 0) << "v_t's columns must be a multiple of 16 (TMA row stride)";
  const int64_t total_tokens = qk.shape()[0];
  const int64_t batch = cu_seqlens.shape()[0] - 1;
  const bool reuse = tile_map.numel() > 0;
  const bool writes_map_only = reuse && tile_map_entry.numel() == 0;  // the map-writing kernel: no entry map
  if (reuse) {
    const int64_t words = ((max_seqlen + 127) / 128 + 31) / 32;
    for (const ffi::TensorView* map : {&tile_map_entry, &tile_map}) {
      if (writes_map_only && map == &tile_map_entry) {
        TVM_FFI_ICHECK_EQ(map->numel(), 0) << "the map-writing kernel (kv_step 256) reads no tile_map_entry";
        continue;
      }
      TVM_FFI_ICHECK(map->dtype() == dl_int32 && map->ndim() == 4 && map->shape()[0] == batch &&
                     map->shape()[1] == heads_q && map->shape()[2] <= (max_seqlen + 63) / 64 &&
                     map->shape()[3] == words && map->IsContiguous())
          << "tile maps must be contiguous int32 [batch, heads_q, <= ceil(max_seqlen / 64), " << words << "]";
      TVM_FFI_ICHECK(map->shape()[2] == tile_map.shape()[2]) << "tile_map_entry and tile_map differ in shape";
    }
    TVM_FFI_ICHECK_LE((max_seqlen + 127) / 128, 0xFFFF) << "tile maps: a step names its tiles in 16 bits";
    const bool skips = skip_softmax_threshold_scale_factor > 0.0;
    TVM_FFI_ICHECK(q_block == 64 && kv_step == 256 && (skips || !writes_map_only))
        << "tile maps need 64-query steps of 256 keys (two 128-key tiles), and Skip-Softmax where the map is "
           "written only";
  }
  TVM_FFI_ICHECK(v_scale.ndim() == 3 && v_scale.shape()[0] == batch && v_scale.shape()[1] == heads_q &&
                 v_scale.shape()[2] == head_dim && v_scale.IsContiguous())
      << "v_scale must be a contiguous [batch, heads_q, head_dim] tensor";

  bert::Fused_multihead_attention_params_v2 params;
  std::memset(&params, 0, sizeof(params));
  params.qkv_ptr = qk.data_ptr();
  params.q_stride_in_bytes = params.k_stride_in_bytes = (heads_q + heads_kv) * head_dim;  // one byte per element
  params.v_ptr = v_t.data_ptr();
  params.v_stride_in_bytes = v_t.shape()[2];
  params.o_ptr = out.data_ptr();
  params.o_stride_in_bytes = heads_q * head_dim * 2;
  params.b = static_cast<int>(batch);
  params.h = static_cast<int>(heads_q);
  params.h_kv = static_cast<int>(heads_kv);
  params.h_q_per_kv = static_cast<int>(heads_q / heads_kv);
  params.s = static_cast<int>(max_seqlen);
  params.d = params.dv = static_cast<int>(head_dim);
  params.num_grouped_heads = 1;
  params.sliding_window_size = INT_MAX;
  params.cu_q_seqlens = static_cast<int*>(cu_seqlens.data_ptr());
  params.cu_kv_seqlens = static_cast<int*>(v_starts.data_ptr());  // the patched DMA's V^T columns
  // Warp-specialized kernels take the bmm1 scale in the log2 domain (they use exp2).
  params.scale_bmm1 = float_bits(static_cast<float>(softmax_scale * M_LOG2E));
  params.scale_softmax = float_bits(1.f);
  params.scale_bmm2 = float_bits(1.f);  // V's per-channel scales are applied through params.sage.v
  params.is_uniform_q = total_tokens == batch * max_seqlen;
  params.tile_id_counter_ptr = static_cast<uint32_t*>(tile_counter.data_ptr());
  params.skip_softmax_threshold_scale_factor = static_cast<float>(skip_softmax_threshold_scale_factor);
  if (skip_counts.shape()[0] == 1) {  // else a null pointer (memset above): the kernel counts nothing
    params.skip_softmax_skipped_blocks = static_cast<uint32_t*>(skip_counts.data_ptr());
  }
  if (reuse) {
    params.tile_map_entry = writes_map_only ? nullptr : static_cast<const uint32_t*>(tile_map_entry.data_ptr());
    params.tile_map = static_cast<uint32_t*>(tile_map.data_ptr());
    params.tile_map_q_tiles = static_cast<int>(tile_map.shape()[2]);
    params.tile_map_words = static_cast<int>(tile_map.shape()[3]);
  }
  if (save_stats) {
    params.softmax_stats_ptr = softmax_stats.data_ptr();
    params.softmax_stats_stride_in_bytes = heads_q * 2 * sizeof(float);
  }
  params.sage.q.block_size = static_cast<int>(q_block);
  params.sage.q.max_nblock = static_cast<int>((max_seqlen + q_block - 1) / q_block);
  params.sage.q.scales = static_cast<float*>(q_scale.data_ptr());
  // Kernels without V blocks never read params.sage.v: the patched epilogue takes V's per-channel scales from it.
  params.sage.v.max_nblock = static_cast<int>(head_dim);
  params.sage.v.scales = static_cast<float*>(v_scale.data_ptr());
  if (k_block > 0) {
    params.sage.k.block_size = static_cast<int>(k_block);
    params.sage.k.max_nblock = static_cast<int>((max_seqlen + k_block - 1) / k_block);
    params.sage.k.scales = static_cast<float*>(k_scale.data_ptr());
  }

  int device;
  FMHA_CHECK_CUDA(cudaGetDevice(&device));
  bert::Fused_multihead_attention_launch_params launch;
  launch.flash_attention = true;
  launch.warp_specialization = true;
  launch.use_tma = true;
  launch.force_fp32_acc = true;
  launch.attention_mask_type = fmha::Attention_mask_type::PADDING;
  launch.attention_input_layout = fmha::Attention_input_layout::PACKED_QKV;
  launch.total_q_seqlen = static_cast<int>(total_tokens);
  launch.total_kv_seqlen = static_cast<int>(batch * max_seqlen);
  // a tile map at factor 0 runs the tile-map kernel without the test (it would skip nothing)
  launch.enable_skip_softmax = skip_softmax_threshold_scale_factor > 0.0;
  FMHA_CHECK_CUDA(cudaDeviceGetAttribute(&launch.multi_processor_count, cudaDevAttrMultiProcessorCount, device));
  FMHA_CHECK_CUDA(cudaDeviceGetAttribute(&launch.device_l2_cache_size, cudaDevAttrL2CacheSize, device));

  cudaStream_t stream = get_stream(qk.device());
  TVM_FFI_ICHECK(launch_sage_kernel(static_cast<int>(q_block), static_cast<int>(k_block),
                                    static_cast<int>(kv_step), launch.enable_skip_softmax, save_stats, reuse,
                                    reuse && !writes_map_only, params, launch, stream))
      << "no SAGE kernel was built for q_block " << q_block << ", k_block " << k_block << ", kv_step " << kv_step
      << ", skip-softmax " << launch.enable_skip_softmax << ", softmax statistics " << save_stats << ", tile map "
      << reuse << ", map read " << (reuse && !writes_map_only);
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(sage_attention, sage_attention);
