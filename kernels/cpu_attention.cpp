// Paged attention for x86/ARM CPUs that reads K/V from the cache blocks in place (no gather).
//
// Registered as the Torch op `batchinfer_cpu::paged_attention_` (built and loaded by cpu_extension.py).
// One work item is a (query token, KV head) pair: the `num_heads / num_kv_heads` query heads that share a KV
// head are scored together, so every K/V row is read once per token, and a thread's consecutive items of one
// token run together (attend_heads), its rows streamed once. Softmax is exact and two-pass over a per-thread
// score buffer (max, then exp and sum) in fp32, as in vLLM's CPU paged-attention kernel
// (csrc/cpu/attention.cpp); items are split into one contiguous run per thread of about equal cost (context
// length) with at::parallel_for, so torch.set_num_threads governs it and a small batch still splits evenly.
// For head sizes 64 and 128 with 1-4 query heads per KV head the K and V rows are converted to float32 in
// registers (sixteen lanes), the query heads' scores and output rows held in registers over a tile of eight
// positions. Optionally it also writes each (token, head)'s
// log-sum-exp of its scaled scores, so a caller can merge this partial attention with another over
// other keys (cascade attention, worker/engine/executor/layers/attention/cascade.py).
//
// Batch invariant: a token's output is a fixed sequence of float operations on its query, its context
// and the cached K/V, whatever other tokens share the call, which thread runs it or how its KV heads are split
// between threads. Every reduction has
// a fixed lane structure (`dot_lanes`, `dot_chunks`, `transpose_sum8`, `lane_sum`) and score rows start 64-byte
// aligned, so the compiler's vectorised loops never split a row differently from one call to the next
// (docs/engine.md, "Batch-invariant numerics").
//
// A sliding window limits each token to its last `sliding_window` positions (itself included), and only
// those are read: blocks before the window may have been returned to the pool. A soft-cap replaces each
// scaled score s by cap * tanh(s / cap) (Gemma 2); without one the softmax pass is unchanged.
//
// A bfloat16 cache (a bfloat16 model's, or a float32 model's halved) is read the same way, each element widened
// to float32 exactly (its 16 bits become the high half of a float32), with no scales.
//
// A quantized cache (int8 or fp8 e4m3 elements, docs/engine.md "Quantized KV cache") comes with float32
// scales [2, num_blocks, block_size, num_kv_heads, num_groups], one per stored (token, KV head, group of
// head_size / num_groups channels): the kernel converts each K/V row to float32 as it streams in, once per KV
// head for all the query heads of its group, multiplying each element by its group's scale on the way
// (dequantize_row: element * scale, the very float the store handed back for a fresh prompt), so the blocks
// are read in place and never dequantized into a copy.
//
// A token-tree mask (speculative verification of a draft tree, Miao et al. 2023 "SpecInfer") gives a token
// a bit set over its sequence's query rows: the token sees every position before the query and the query
// rows whose bit is set (its ancestors, the sequence's last token and itself). Hidden rows are read like
// the others (they lie inside the causal range) but score -inf and weigh exactly 0; a token without
// tree bits pays one predictable branch per tile of positions.

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_bf16.h"
#include "cpu_exp.h"
#include "cpu_lanes.h"

namespace {

using batchinfer_kernels::exp_clamped;
using batchinfer_kernels::ivec8;
using batchinfer_kernels::lane_sum;
using batchinfer_kernels::load8;
using batchinfer_kernels::round_bf16;
using batchinfer_kernels::store8;
using batchinfer_kernels::vec16;
using batchinfer_kernels::vec8;
using batchinfer_kernels::widen_bf16;

constexpr int64_t kTile = 8;  // positions scored together

// float8 e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities) to float32, by table.
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int bits = 0; bits < 256; ++bits) {
      const int exponent = (bits >> 3) & 0xF, mantissa = bits & 0x7;
      float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                      : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      if (exponent == 0xF && mantissa == 0x7) magnitude = std::numeric_limits<float>::quiet_NaN();
      value[bits] = (bits & 0x80) ? -magnitude : magnitude;
    }
  }
};
const Fp8Table kFp8Table;

// A cache element type: float, Bf16 (the 16 bits of a bfloat16), int8_t, or Fp8 (the byte of a float8_e4m3fn).
struct Fp8 {
  uint8_t bits;
};
struct Bf16 {
  uint16_t bits;
};
inline float to_float(float x) { return x; }
inline float to_float(Bf16 x) { return widen_bf16(x.bits); }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(Fp8 x) { return kFp8Table.value[x.bits]; }
// Whether a cache element type carries float32 scales per (token, KV head, group of channels).
template <typename T>
constexpr bool kScaled = std::is_same_v<T, int8_t> || std::is_same_v<T, Fp8>;

typedef int8_t i8vec8 __attribute__((vector_size(8)));
inline vec8 load8_float(const float* p) { return load8(p); }
inline vec8 load8_float(const int8_t* p) {
#if defined(__AVX2__)
  // NOTE: GCC lowers the generic conversion of an 8-byte vector lane by lane (kernels/cpu_gemm.cpp has the
  // same); the intrinsics give one vpmovsxbd and one vcvtdq2ps per eight elements.
  return reinterpret_cast<vec8>(
      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  i8vec8 raw;
  std::memcpy(&raw, p, sizeof(raw));
  return __builtin_convertvector(raw, vec8);
#endif
}
inline vec8 load8_float(const Bf16* p) {
#if defined(__AVX2__)
  return reinterpret_cast<vec8>(_mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16)));
#else
  vec8 v;
  for (int i = 0; i < 8; ++i) v[i] = to_float(p[i]);
  return v;
#endif
}
inline vec8 load8_float(const Fp8* p) {
  const float* t = kFp8Table.value;
  return vec8{t[p[0].bits], t[p[1].bits], t[p[2].bits], t[p[3].bits],
              t[p[4].bits], t[p[5].bits], t[p[6].bits], t[p[7].bits]};
}

// q . k folded to eight lanes: lane l sums q[d] k[d] over the d = l and d = l + 8 (mod 16), each a fused
// multiply-add chain in d order, and then adds the two (16 lanes folded once). A tail of head_size % 16
// elements (test-sized heads only) is added lane by lane.
template <int64_t kHeadSize, typename T>
inline vec8 dot_lanes(const float* __restrict q, const T* __restrict k, int64_t head_size) {
  const int64_t n = kHeadSize > 0 ? kHeadSize : head_size;
  vec8 lo = {}, hi = {};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    lo += load8(q + d) * load8_float(k + d);
    hi += load8(q + d + 8) * load8_float(k + d + 8);
  }
  if (kHeadSize == 0 && d < n) {
    float tail[16] = {};
    for (int64_t i = 0; d + i < n; ++i) tail[i] = q[d + i] * to_float(k[d + i]);
    lo += load8(tail);
    hi += load8(tail + 8);
  }
  return lo + hi;
}

// One KV head's row as float32: a float cache's row itself; any other element type widened into `buffer`
// (head_size floats) once, so the num_queries_per_kv query heads that share the KV head read it converted (the
// widening is exact for every element type, so the results are those of converting per query head).
template <int64_t kHeadSize, typename T>
inline const float* widen_row(const T* __restrict row, int64_t head_size, float* __restrict buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    const int64_t n = kHeadSize > 0 ? kHeadSize : head_size;
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) store8(buffer + d, load8_float(row + d));
    for (; d < n; ++d) buffer[d] = to_float(row[d]);
    return buffer;
  }
}

// One KV head's quantized row dequantized into `buffer` (head_size floats): element * scale of its group, the
// groups `group_size` channels each with their scales at `group_scales` (the float multiply of the store's
// stored values, kernels/cpu_kv_store.cpp, so every path reads the same numbers).
template <int64_t kHeadSize, typename T>
inline const float* dequantize_row(const T* __restrict row, int64_t head_size, const float* __restrict group_scales,
                                   int64_t group_size, float* __restrict buffer) {
  const int64_t n = kHeadSize > 0 ? kHeadSize : head_size;
  for (int64_t begin = 0, i = 0; begin < n; begin += group_size, ++i) {
    const float group_scale = group_scales[i];
    const int64_t end = begin + group_size;
    int64_t d = begin;
    for (; d + 8 <= end; d += 8) store8(buffer + d, load8_float(row + d) * group_scale);
    for (; d < end; ++d) buffer[d] = to_float(row[d]) * group_scale;
  }
  return buffer;
}

// One KV head's row as float32 for reading (widen_row, dequantize_row for a quantized cache: `group_scales`
// then holds the row's scales, null otherwise).
template <int64_t kHeadSize, typename T>
inline const float* read_row(const T* __restrict row, int64_t head_size, const float* group_scales, int64_t group_size,
                             float* __restrict buffer) {
  if constexpr (kScaled<T>) {
    return dequantize_row<kHeadSize>(row, head_size, group_scales, group_size, buffer);
  } else {
    return widen_row<kHeadSize>(row, head_size, buffer);
  }
}

// out[j] = the sum of the eight lanes of x[j], for j = 0 .. 7, by one fixed tree (lane l with l + 4, then
// with l + 2, then the pair): the transposed reduction of eight dot products in 14 shuffles and 7 adds,
// instead of a horizontal sum per dot product. Each out[j] depends on x[j] alone.
inline vec8 transpose_sum8(const vec8* x) {
  vec8 pairs[4];  // lanes 0-3: x[2i] folded to four lanes, 4-7: x[2i + 1]
  for (int i = 0; i < 4; ++i) {
    pairs[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], ivec8{0, 1, 2, 3, 8, 9, 10, 11}) +
               __builtin_shuffle(x[2 * i], x[2 * i + 1], ivec8{4, 5, 6, 7, 12, 13, 14, 15});
  }
  vec8 quads[2];  // two lanes each of x[4i], x[4i + 2], x[4i + 1], x[4i + 3], in that order
  for (int i = 0; i < 2; ++i) {
    quads[i] = __builtin_shuffle(pairs[2 * i], pairs[2 * i + 1], ivec8{0, 1, 8, 9, 4, 5, 12, 13}) +
               __builtin_shuffle(pairs[2 * i], pairs[2 * i + 1], ivec8{2, 3, 10, 11, 6, 7, 14, 15});
  }
  const vec8 sums = __builtin_shuffle(quads[0], quads[1], ivec8{0, 2, 8, 10, 4, 6, 12, 14}) +
                    __builtin_shuffle(quads[0], quads[1], ivec8{1, 3, 9, 11, 5, 7, 13, 15});
  return __builtin_shuffle(sums, ivec8{0, 4, 1, 5, 2, 6, 3, 7});  // sums held x[0, 2, 4, 6, 1, 3, 5, 7]
}

constexpr int64_t kMaxHeads = 256;
constexpr int64_t kAlignFloats = 16;  // 64 bytes

inline int64_t aligned_row(int64_t n) { return (n + kAlignFloats - 1) / kAlignFloats * kAlignFloats; }

struct Shapes {
  int64_t num_heads, num_kv_heads, head_size, block_size, num_queries_per_kv;
  int64_t query_stride_token, query_stride_head, max_num_blocks_per_seq;
  int64_t cache_stride_kv;   // elements between the K and the V half of the cache
  int64_t scales_stride_kv;  // floats between the K and the V half of the scales (quantized caches)
  int64_t num_scale_groups;  // scales per (token, KV head) of a quantized cache, each over head_size / it channels
};

// A position's slot (block_id * block_size + offset) through one sequence's block table, one position after
// the next from `pos` on (no division per position).
struct SlotCursor {
  const int32_t* block_table;
  int64_t block_size, block, offset;
  SlotCursor(const int32_t* table, int64_t size, int64_t pos)
      : block_table(table), block_size(size), block(pos / size), offset(pos % size) {}
  int64_t next() {
    const int64_t slot = static_cast<int64_t>(block_table[block]) * block_size + offset;
    if (++offset == block_size) {
      offset = 0;
      ++block;
    }
    return slot;
  }
};

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }

// Sixteen cache elements as float32, each converted exactly as load8_float converts it.
template <typename T>
inline vec16 load16_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return load16(p);
#if defined(__AVX512F__)
  } else if constexpr (std::is_same_v<T, Bf16>) {
    return reinterpret_cast<vec16>(_mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16)));
  } else if constexpr (std::is_same_v<T, int8_t>) {
    return reinterpret_cast<vec16>(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#endif
  } else {
    return __builtin_shufflevector(load8_float(p), load8_float(p + 8), 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                   14, 15);
  }
}

// One KV head's row of kHeadSize elements as kHeadSize / 16 float32 vectors in registers: widened, or for a
// quantized cache each element times its group's scale (`group_scales`, groups of `group_size` channels; the
// products dequantize_row computes; a group narrower than 16 channels goes through `buffer` by dequantize_row).
template <int64_t kHeadSize, typename T>
inline void load_row(const T* __restrict row, const float* __restrict group_scales, int64_t group_size,
                     float* __restrict buffer, vec16* chunks) {
  constexpr int64_t kChunks = kHeadSize / 16;
  if constexpr (kScaled<T>) {
    if (group_size % 16 != 0) {
      dequantize_row<kHeadSize>(row, kHeadSize, group_scales, group_size, buffer);
      for (int64_t c = 0; c < kChunks; ++c) chunks[c] = load16(buffer + 16 * c);
      return;
    }
#pragma GCC unroll 8
    for (int64_t c = 0; c < kChunks; ++c) chunks[c] = load16_float(row + 16 * c) * group_scales[16 * c / group_size];
  } else {
#pragma GCC unroll 8
    for (int64_t c = 0; c < kChunks; ++c) chunks[c] = load16_float(row + 16 * c);
  }
}

// dot_lanes with the K row in registers: lane l of one sixteen-lane chain sums q[d] k[d] over d = l (mod 16) in
// d order, and its two halves are added (the very operations of dot_lanes, so the same eight lanes).
template <int64_t kChunks>
inline vec8 dot_chunks(const float* __restrict q, const vec16* k) {
  vec16 acc = {};
#pragma GCC unroll 8
  for (int64_t c = 0; c < kChunks; ++c) acc += load16(q + 16 * c) * k[c];
  return __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
}

// How far ahead of the position being read its K (pass 1) or V (pass 3) rows are prefetched, into L2
// (prefetcht1): that beat prefetching into L1 by about 1.5x with the cache in DRAM (docs/engine.md, "Decode
// attention in registers").
constexpr int64_t kPrefetchPositions = 16;

// Attention of KV heads g_begin .. g_end - 1 of one query token, each with the r = num_queries_per_kv query heads
// that share it (heads g * r .. g * r + r - 1), over positions context_start .. context_end - 1 of its sequence.
// A KV head's results are the same whichever other KV heads share the call: work items are (token, KV head) pairs,
// and a thread's consecutive items of one token come here together so the token's K/V rows are streamed once.
//
// Pass 1 scores kTile positions at a time: for each KV head, each of the tile's K rows is converted to float32
// once (in registers when kHeadSize and kR are fixed, else into `row_float`), dotted with the head's r scaled
// query rows and folded to eight lanes; the tile's eight per query head are reduced together (transpose_sum8)
// and stored as one vector. Meanwhile the K rows kPrefetchPositions ahead are prefetched (blocks are scattered,
// so the hardware prefetcher cannot follow them across a block boundary). Pass 2 is the exact softmax per query
// head (max, exp, lane_sum); pass 3 accumulates p * V in position order (prefetching V rows the same way), a tile
// at a time for each KV head, each output element one chain of `o + p * v` (in registers over the tile when
// kHeadSize and kR are fixed), then scales by 1 / sum.
//
// `scores` holds num_heads rows of aligned_row(context_end - context_start) floats, 64-byte aligned; `q_scaled`
// num_heads * head_size; `row_float` head_size. kHeadSize > 0 fixes head_size at compile time (a multiple of 16),
// 0 reads it from `s`; kR > 0 fixes r (kHeadSize > 0 only), 0 reads it. soft_cap > 0 caps the scaled scores
// (cap * tanh(s / cap)); 0 leaves them as they are. T is the cache element type; for a quantized cache
// (kScaled<T>) `scales` holds the K half's scales then, `scales_stride_kv` floats on, the V half's,
// num_kv_heads * num_scale_groups per slot; otherwise it is null. tree_bits != 0: positions tree_base + j are
// visible only where bit j is set (the token-tree mask above). `out` and `lse` point at the token's rows.
template <int64_t kHeadSize, int64_t kR, typename T>
void attend_heads(const Shapes& s, int64_t g_begin, int64_t g_end, const float* query, const T* cache,
                  const float* scales, const int32_t* block_table, int64_t context_start, int64_t context_end,
                  float scale, float soft_cap, int64_t tree_base, uint64_t tree_bits, float* out, float* lse,
                  float* scores, float* q_scaled, float* row_float) {
  static_assert(kHeadSize % 16 == 0 && (kR == 0 || kHeadSize > 0));
  constexpr bool kRegisters = kR > 0;  // K and V rows and the output rows in registers
  constexpr int64_t kChunks = kHeadSize / 16;
  const int64_t r = kR > 0 ? kR : s.num_queries_per_kv;
  const int64_t head_size = kHeadSize > 0 ? kHeadSize : s.head_size;
  const int64_t token_stride = s.num_kv_heads * head_size;  // elements between positions inside a block
  const int64_t context_len = context_end - context_start, row_stride = aligned_row(context_len);
  const int64_t head_begin = g_begin * r, head_end = g_end * r;
  for (int64_t h = head_begin; h < head_end; ++h) {
    const float* q = query + h * s.query_stride_head;
#pragma omp simd
    for (int64_t d = 0; d < head_size; ++d) q_scaled[h * head_size + d] = q[d] * scale;
  }
  const int64_t num_groups = s.num_scale_groups, group_size = head_size / std::max<int64_t>(num_groups, 1);
  const T* value_cache = cache + s.cache_stride_kv;
  const float* value_scales = scales == nullptr ? nullptr : scales + s.scales_stride_kv;
  // The scales of KV head g's row at `slot` in one half of the scales (null for a cache without scales).
  const auto row_scales = [&](const float* half_scales, int64_t slot, int64_t g) {
    return half_scales == nullptr ? nullptr : half_scales + (slot * s.num_kv_heads + g) * num_groups;
  };
  const auto tree_hidden = [&](int64_t pos) {
    return tree_bits != 0 && pos >= tree_base && ((tree_bits >> (pos - tree_base)) & 1) == 0;
  };

  // The heads' part of a position's row: `span_bytes` from g_begin's first element.
  const int64_t span_bytes = (g_end - g_begin) * head_size * static_cast<int64_t>(sizeof(T));
  SlotCursor ahead(block_table, s.block_size, context_start);
  int64_t ahead_pos = context_start;
  const T* ahead_half = cache;
  // Prefetches the next `count` rows of one stream: the K rows in position order, then the V rows.
  const auto prefetch_ahead = [&](int64_t count) {
    for (; count > 0; --count, ++ahead_pos) {
      if (ahead_pos == context_end) {
        if (ahead_half == value_cache) return;
        ahead = SlotCursor(block_table, s.block_size, context_start);
        ahead_pos = context_start;
        ahead_half = value_cache;
      }
      const char* row = reinterpret_cast<const char*>(ahead_half + ahead.next() * token_stride + g_begin * head_size);
      for (int64_t b = 0; b < span_bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
    }
  };
  prefetch_ahead(kPrefetchPositions);

  vec8 max_score[kMaxHeads];
  std::fill(max_score + head_begin, max_score + head_end, vec8{} - std::numeric_limits<float>::infinity());
  const vec8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  SlotCursor keys(block_table, s.block_size, context_start);
  int64_t slots[kTile];
  for (int64_t tile_start = context_start; tile_start < context_end; tile_start += kTile) {
    const int64_t n = std::min(kTile, context_end - tile_start);
    prefetch_ahead(kTile);
    for (int64_t j = 0; j < kTile; ++j) slots[j] = j < n ? keys.next() : slots[0];  // padding, never read
    for (int64_t g = g_begin; g < g_end; ++g) {
      const int64_t first_head = g * r;
      vec8 dots[kR > 0 ? kR : kMaxHeads][kTile];
#pragma GCC unroll 8
      for (int64_t j = 0; j < kTile; ++j) {
        const T* row = cache + slots[j] * token_stride + g * head_size;
        if constexpr (kRegisters) {
          vec16 k[kChunks];
          load_row<kHeadSize>(row, row_scales(scales, slots[j], g), group_size, row_float, k);
#pragma GCC unroll 4
          for (int64_t i = 0; i < kR; ++i) dots[i][j] = dot_chunks<kChunks>(q_scaled + (first_head + i) * kHeadSize, k);
        } else {
          const float* k = read_row<kHeadSize>(row, head_size, row_scales(scales, slots[j], g), group_size, row_float);
          for (int64_t i = 0; i < r; ++i) {
            dots[i][j] = dot_lanes<kHeadSize>(q_scaled + (first_head + i) * head_size, k, head_size);
          }
        }
      }
      if (tree_bits != 0) {
        for (int64_t j = 0; j < n; ++j) {
          if (!tree_hidden(tile_start + j)) continue;
          for (int64_t i = 0; i < r; ++i) dots[i][j] = vec8{} - std::numeric_limits<float>::infinity();
        }
      }
#pragma GCC unroll 4
      for (int64_t i = 0; i < r; ++i) {
        const int64_t h = first_head + i;
        vec8 tile_scores = transpose_sum8(dots[i]);
        store8(scores + h * row_stride + tile_start - context_start, tile_scores);
        tile_scores = lane < static_cast<float>(n) ? tile_scores : max_score[h];
        max_score[h] = tile_scores > max_score[h] ? tile_scores : max_score[h];
      }
    }
  }

  float inv_sum[kMaxHeads];
  for (int64_t h = head_begin; h < head_end; ++h) {
    float* __restrict row = scores + h * row_stride;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t l = 0; l < kTile; ++l) m = std::max(m, max_score[h][l]);
    if (soft_cap > 0.0f) {
      // tanh is increasing, so the capped maximum is the cap of the maximum.
      const float inv_cap = 1.0f / soft_cap;
      m = soft_cap * std::tanh(m * inv_cap);
      for (int64_t l = 0; l < context_len; ++l) row[l] = exp_clamped(soft_cap * std::tanh(row[l] * inv_cap) - m);
    } else {
#pragma omp simd
      for (int64_t l = 0; l < context_len; ++l) row[l] = exp_clamped(row[l] - m);
    }
    if (tree_bits != 0) {
      // exp of a clamped -inf is tiny, not 0 (and a soft-cap maps -inf to -cap): hidden rows weigh exactly 0.
      for (int64_t pos = std::max(tree_base, context_start); pos < context_end; ++pos) {
        if (tree_hidden(pos)) row[pos - context_start] = 0.0f;
      }
    }
    const float sum = lane_sum(row, context_len);
    inv_sum[h] = 1.0f / sum;
    if (lse != nullptr) lse[h] = m + std::log(sum);
  }

  std::fill(out + head_begin * head_size, out + head_end * head_size, 0.0f);
  SlotCursor values(block_table, s.block_size, context_start);
  for (int64_t tile_start = 0; tile_start < context_len; tile_start += kTile) {
    const int64_t n = std::min(kTile, context_len - tile_start);
    prefetch_ahead(kTile);
    for (int64_t j = 0; j < n; ++j) slots[j] = values.next();
    for (int64_t g = g_begin; g < g_end; ++g) {
      const int64_t first_head = g * r;
      const float* head_scores = scores + first_head * row_stride + tile_start;
      if constexpr (kRegisters) {
        float* __restrict o = out + first_head * kHeadSize;
        vec16 acc[kR][kChunks];
        for (int64_t i = 0; i < kR; ++i) {
          for (int64_t c = 0; c < kChunks; ++c) acc[i][c] = load16(o + i * kHeadSize + 16 * c);
        }
        for (int64_t j = 0; j < n; ++j) {
          vec16 v[kChunks];
          load_row<kHeadSize>(value_cache + slots[j] * token_stride + g * kHeadSize,
                              row_scales(value_scales, slots[j], g), group_size, row_float, v);
#pragma GCC unroll 4
          for (int64_t i = 0; i < kR; ++i) {
            const float p = head_scores[i * row_stride + j];
#pragma GCC unroll 8
            for (int64_t c = 0; c < kChunks; ++c) acc[i][c] = acc[i][c] + p * v[c];
          }
        }
        for (int64_t i = 0; i < kR; ++i) {
          for (int64_t c = 0; c < kChunks; ++c) store16(o + i * kHeadSize + 16 * c, acc[i][c]);
        }
      } else {
        for (int64_t j = 0; j < n; ++j) {
          const float* __restrict v = read_row<kHeadSize>(value_cache + slots[j] * token_stride + g * head_size,
                                                          head_size, row_scales(value_scales, slots[j], g),
                                                          group_size, row_float);
          for (int64_t i = 0; i < r; ++i) {
            const float p = head_scores[i * row_stride + j];
            float* __restrict o = out + (first_head + i) * head_size;
            int64_t d = 0;
            for (; d + 8 <= head_size; d += 8) store8(o + d, load8(o + d) + p * load8(v + d));
#pragma omp simd
            for (int64_t e = d; e < head_size; ++e) o[e] += p * v[e];
          }
        }
      }
    }
  }
  for (int64_t h = head_begin; h < head_end; ++h) {
    float* __restrict o = out + h * head_size;
    const float inv = inv_sum[h];
#pragma omp simd
    for (int64_t d = 0; d < head_size; ++d) o[d] *= inv;
  }
}

void paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& block_tables, double scale, const std::optional<at::Tensor>& lse,
                     std::optional<int64_t> sliding_window, std::optional<double> logits_soft_cap,
                     const std::optional<at::Tensor>& kv_scales, const std::optional<at::Tensor>& tree_mask) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu() && out.device().is_cpu(),
              "paged_attention_: CPU tensors only");
  const at::ScalarType cache_type = kv_cache.scalar_type();
  const bool quantized = cache_type == at::kChar || cache_type == at::kFloat8_e4m3fn;
  const bool bf16_io = query.scalar_type() == at::kBFloat16;
  TORCH_CHECK((query.scalar_type() == at::kFloat || bf16_io) && out.scalar_type() == query.scalar_type() &&
                  (cache_type == at::kFloat || cache_type == at::kBFloat16 || quantized),
              "paged_attention_: float32 or bfloat16 query and out (one dtype), float32, bfloat16, int8 or "
              "float8_e4m3fn kv_cache only");
  const bool with_scales = kv_scales.has_value() && kv_scales->defined();
  TORCH_CHECK(with_scales == quantized, "paged_attention_: kv_scales are required with (only with) a quantized kv_cache");
  if (with_scales) {
    TORCH_CHECK(kv_scales->device().is_cpu() && kv_scales->scalar_type() == at::kFloat && kv_scales->is_contiguous() &&
                    kv_scales->dim() == 5 && kv_scales->size(0) == 2 && kv_scales->size(1) == kv_cache.size(1) &&
                    kv_scales->size(2) == kv_cache.size(2) && kv_scales->size(3) == kv_cache.size(3) &&
                    kv_scales->size(4) >= 1 && kv_cache.size(4) % kv_scales->size(4) == 0,
                "kv_scales must be a contiguous float32 [2, num_blocks, block_size, num_kv_heads, num_groups] with "
                "num_groups dividing head_size");
  }
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [num_tokens, num_heads, head_size] with unit last stride");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, num_kv_heads, head_size]");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(), "out must be contiguous and shaped like query");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt,
              "query_start_loc, seq_lens and block_tables must be int32");
  TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous() && block_tables.is_contiguous() &&
                  block_tables.dim() == 2,
              "query_start_loc, seq_lens and block_tables must be contiguous; block_tables 2-D");

  TORCH_CHECK(!sliding_window.has_value() || *sliding_window >= 1, "sliding_window must be >= 1");
  TORCH_CHECK(!logits_soft_cap.has_value() || *logits_soft_cap > 0.0, "logits_soft_cap must be > 0");
  const int64_t window = sliding_window.value_or(0);  // 0: no window
  const bool with_lse = lse.has_value() && lse->defined();
  TORCH_CHECK(!with_lse || (lse->scalar_type() == at::kFloat && lse->is_contiguous() && lse->dim() == 2 &&
                            lse->size(0) == query.size(0) && lse->size(1) == query.size(1)),
              "lse must be a contiguous float32 [num_tokens, num_heads]");

  Shapes s;
  const int64_t num_tokens = query.size(0);
  s.num_heads = query.size(1);
  s.head_size = query.size(2);
  const int64_t num_blocks = kv_cache.size(1);
  s.block_size = kv_cache.size(2);
  s.num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == s.head_size, "kv_cache head_size differs from query's");
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  s.num_queries_per_kv = s.num_heads / s.num_kv_heads;
  TORCH_CHECK(s.num_heads <= kMaxHeads, "at most ", kMaxHeads, " query heads");
  s.query_stride_token = query.stride(0);
  s.query_stride_head = query.stride(1);
  s.max_num_blocks_per_seq = block_tables.size(1);
  s.cache_stride_kv = kv_cache.stride(0);
  s.scales_stride_kv = with_scales ? kv_scales->stride(0) : 0;
  s.num_scale_groups = with_scales ? kv_scales->size(4) : 0;

  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.numel() == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "query_start_loc must have num_seqs + 1 entries and block_tables num_seqs rows");
  const bool with_tree = tree_mask.has_value() && tree_mask->defined();
  TORCH_CHECK(!with_tree || (tree_mask->scalar_type() == at::kLong && tree_mask->is_contiguous() &&
                             tree_mask->dim() == 1 && tree_mask->size(0) == num_tokens),
              "tree_mask must be a contiguous int64 [num_tokens]");
  TORCH_CHECK(!with_tree || window == 0, "tree_mask cannot be combined with sliding_window");
  const int64_t* tree_ptr = with_tree ? tree_mask->data_ptr<int64_t>() : nullptr;
  const int32_t* cu_query = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(cu_query[0] == 0 && cu_query[num_seqs] == num_tokens, "query_start_loc must run from 0 to num_tokens");

  // Per token: its sequence and the positions it sees (causal, within the window); validate before any
  // thread reads.
  std::vector<int32_t> token_seq(num_tokens);
  std::vector<int64_t> token_context(num_tokens), token_start(num_tokens), token_tree_base(num_tokens, 0);
  std::vector<uint64_t> token_tree_bits(num_tokens, 0);
  int64_t max_context = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t start = cu_query[seq], end = cu_query[seq + 1], seq_len = lens[seq];
    TORCH_CHECK(start < end && end <= num_tokens && end - start <= seq_len,
                "sequence ", seq, ": need 1 <= query_len <= seq_len");
    const int64_t seq_blocks = (seq_len + s.block_size - 1) / s.block_size;
    TORCH_CHECK(seq_blocks <= s.max_num_blocks_per_seq, "sequence ", seq, ": block table too short");
    for (int64_t b = 0; b < seq_blocks; ++b) {
      const int32_t block_id = tables[seq * s.max_num_blocks_per_seq + b];
      TORCH_CHECK(block_id >= 0 && block_id < num_blocks, "sequence ", seq, ": block id ", block_id, " out of range");
    }
    for (int64_t t = start; t < end; ++t) {
      token_seq[t] = static_cast<int32_t>(seq);
      token_context[t] = seq_len - (end - t) + 1;
      token_start[t] = window > 0 ? std::max<int64_t>(0, token_context[t] - window) : 0;
      const uint64_t bits = tree_ptr == nullptr ? 0 : static_cast<uint64_t>(tree_ptr[t]);
      if (bits != 0) {
        const int64_t row = t - start;
        TORCH_CHECK(end - start <= 64 && ((bits >> row) & 1) == 1 && (row == 63 || (bits >> (row + 1)) == 0),
                    "sequence ", seq, ": a tree row must see itself and no later row (query_len <= 64)");
        token_tree_bits[t] = bits;
        token_tree_base[t] = seq_len - (end - start);
      }
    }
    max_context = std::max(max_context, seq_len);
  }

  // One work item per (token, KV head), token-major; one contiguous run of items per thread, of about equal cost.
  constexpr int64_t kItemOverhead = 16;  // fixed cost of an item, in context positions
  const int64_t num_items = num_tokens * s.num_kv_heads;
  std::vector<int64_t> cu_cost(num_items + 1, 0);
  for (int64_t item = 0; item < num_items; ++item) {
    const int64_t t = item / s.num_kv_heads;
    cu_cost[item + 1] = cu_cost[item] + token_context[t] - token_start[t] + kItemOverhead;
  }
  const int64_t num_parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  std::vector<int64_t> part_start(num_parts + 1, num_items);
  for (int64_t p = 0; p < num_parts; ++p) {
    const int64_t target = cu_cost[num_items] * p / num_parts;
    part_start[p] = std::lower_bound(cu_cost.begin(), cu_cost.end(), target) - cu_cost.begin();
  }

  // bfloat16 query and out: each item widens its token's query heads into a float32 row (exact) and rounds its
  // float32 output heads once (to nearest even), so the bits are those of float32 I/O around .float() / .to().
  const float* q_ptr = bf16_io ? nullptr : query.data_ptr<float>();
  float* out_ptr = bf16_io ? nullptr : out.data_ptr<float>();
  const auto* q_bf16 = bf16_io ? static_cast<const uint16_t*>(query.const_data_ptr()) : nullptr;
  auto* out_bf16 = bf16_io ? static_cast<uint16_t*>(out.data_ptr()) : nullptr;
  Shapes widened = s;  // the float32 row an item widens a bfloat16 query into: heads side by side
  widened.query_stride_head = s.head_size;
  float* lse_ptr = with_lse ? lse->data_ptr<float>() : nullptr;
  const float* scales_ptr = with_scales ? kv_scales->data_ptr<float>() : nullptr;
  const float scale_f = static_cast<float>(scale);
  const float soft_cap = static_cast<float>(logits_soft_cap.value_or(0.0));
  const auto run = [&](auto cache_ptr) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(cache_ptr)>>;
    // A head size and query heads per KV head of the registers path, else the general one.
    const auto select = [&](auto head_size) {
      constexpr int64_t kHeadSize = decltype(head_size)::value;
      const int64_t r = s.num_queries_per_kv;
      return r == 1   ? attend_heads<kHeadSize, 1, T>
             : r == 2 ? attend_heads<kHeadSize, 2, T>
             : r == 3 ? attend_heads<kHeadSize, 3, T>
             : r == 4 ? attend_heads<kHeadSize, 4, T>
                      : attend_heads<kHeadSize, 0, T>;
    };
    const auto attend = s.head_size == 64    ? select(std::integral_constant<int64_t, 64>{})
                        : s.head_size == 128 ? select(std::integral_constant<int64_t, 128>{})
                                             : attend_heads<0, 0, T>;
    at::parallel_for(0, num_parts, 1, [&](int64_t part_begin, int64_t part_end) {
      std::vector<float> scores_buffer(s.num_heads * aligned_row(max_context) + kAlignFloats);
      float* scores = scores_buffer.data();
      scores += (kAlignFloats - reinterpret_cast<uintptr_t>(scores) / sizeof(float) % kAlignFloats) % kAlignFloats;
      std::vector<float> q_scaled(s.num_heads * s.head_size);
      std::vector<float> row_float(s.head_size);  // one K or V row as float32 (read_row)
      std::vector<float> q_row(bf16_io ? s.num_heads * s.head_size : 0), out_row(q_row.size());
      // The thread's items, (token, KV head) pairs token-major, a token's run of KV heads at a time.
      for (int64_t item = part_start[part_begin]; item < part_start[part_end];) {
        const int64_t t = item / s.num_kv_heads, g_begin = item % s.num_kv_heads;
        const int64_t g_end = std::min(s.num_kv_heads, g_begin + part_start[part_end] - item);
        const int64_t h_begin = g_begin * s.num_queries_per_kv, h_end = g_end * s.num_queries_per_kv;
        if (bf16_io) {
          for (int64_t h = h_begin; h < h_end; ++h) {
            const uint16_t* src = q_bf16 + t * s.query_stride_token + h * s.query_stride_head;
            for (int64_t i = 0; i < s.head_size; ++i) q_row[h * s.head_size + i] = widen_bf16(src[i]);
          }
        }
        attend(bf16_io ? widened : s, g_begin, g_end, bf16_io ? q_row.data() : q_ptr + t * s.query_stride_token,
               cache_ptr, scales_ptr, tables + token_seq[t] * s.max_num_blocks_per_seq, token_start[t],
               token_context[t], scale_f, soft_cap, token_tree_base[t], token_tree_bits[t],
               bf16_io ? out_row.data() : out_ptr + t * s.num_heads * s.head_size,
               lse_ptr == nullptr ? nullptr : lse_ptr + t * s.num_heads, scores, q_scaled.data(), row_float.data());
        if (bf16_io) {
          uint16_t* dst = out_bf16 + t * s.num_heads * s.head_size;
          for (int64_t i = h_begin * s.head_size; i < h_end * s.head_size; ++i) dst[i] = round_bf16(out_row[i]);
        }
        item += g_end - g_begin;
      }
    });
  };
  if (cache_type == at::kFloat) {
    run(static_cast<const float*>(kv_cache.const_data_ptr()));
  } else if (cache_type == at::kBFloat16) {
    run(static_cast<const Bf16*>(kv_cache.const_data_ptr()));
  } else if (cache_type == at::kChar) {
    run(static_cast<const int8_t*>(kv_cache.const_data_ptr()));
  } else {
    run(static_cast<const Fp8*>(kv_cache.const_data_ptr()));
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer_cpu, m) {
  m.def(
      "paged_attention_(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor block_tables, float scale, Tensor(b!)? lse=None, int? sliding_window=None, "
      "float? logits_soft_cap=None, Tensor? kv_scales=None, Tensor? tree_mask=None) -> ()");
}

TORCH_LIBRARY_IMPL(batchinfer_cpu, CPU, m) { m.impl("paged_attention_", paged_attention); }
