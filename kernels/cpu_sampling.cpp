// Exponential-race sampling for CPUs with counter-based random numbers.
//
// Registered as the Torch op `batchinfer_cpu::exponential_race_` (built and loaded by cpu_extension.py).
// A row's token is argmax_t (logit_t + g_t) with g_t = -log(-log(u_t)) a Gumbel variable, which draws t
// with probability softmax(logits)_t (the Gumbel-max trick; equivalently argmax p_t / E_t with E_t
// exponential, the "exponential race" vLLM's sampler uses). Unlike an inverse-CDF lookup, a last-bit
// change of one logit can only change the result when two scores nearly tie.
//
// The uniforms are counter based, never drawn from a stateful generator: u_t is a function of the row's
// 64-bit key, its counter (the index of the token being sampled) and the token id t. The row's 64-bit
// state is output `counter` of the SplitMix64 stream seeded with `key` (Steele, Lea & Flood 2014); token
// t's 32 bits are lowbias32(lowbias32(t ^ state_lo) ^ state_hi), a bijection of t for each state
// (Wellons' integer hash "lowbias32"), computed 8 tokens per AVX2 instruction. So a row's draw depends on
// nothing else in the batch, and tokens that cannot win need no random number: with 23-bit uniforms in
// [2^-24, 1 - 2^-24], g lies in [-2.81, 16.7], so a block of tokens whose logits all lie more than
// kPruneMargin below the row's largest logit is skipped whole.
//
// Also `batchinfer_cpu::argmax_rows_`, greedy sampling's argmax of each row, with torch.argmax's answer (the
// lowest index of the row's maximum; a NaN counts as the maximum, so a row with one returns its first NaN) in
// two vectorised passes over the row (its maximum, then the first index holding it) where torch's CPU argmax
// compares element by element (about 2.8 ms against 0.3 for the 64 x 49,152 logits of a decode step).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;
constexpr float kPruneMargin = 20.0f;  // > max g - min g = 16.64 + 2.81

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Output `index` (0-based) of the SplitMix64 stream seeded with `seed`.
inline uint64_t splitmix64_at(uint64_t seed, uint64_t index) { return mix64(seed + (index + 1) * kGamma); }

#pragma omp declare simd notinbranch
inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// ln(x) for normal x > 0: musl's logf range reduction (x = 2^k * m with m in [sqrt(1/2), sqrt(2)), in
// integer arithmetic) and Cephes' logf polynomial, relative error about 1e-7; no branch, so it vectorises.
#pragma omp declare simd notinbranch
inline float log_positive(float x) {
  uint32_t ix = __builtin_bit_cast(uint32_t, x) + (0x3f800000u - 0x3f3504f3u);
  const float k = static_cast<float>(static_cast<int32_t>(ix >> 23) - 0x7f);
  const float m = __builtin_bit_cast(float, (ix & 0x007fffffu) + 0x3f3504f3u) - 1.0f;
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  y += -2.12194440e-4f * k;
  y += -0.5f * z;
  return m + y + 0.693359375f * k;
}

constexpr int64_t kBlock = 64;  // tokens per pruning block

// Scores logit + Gumbel noise of tokens [begin, begin + n) of a row with state (lo, hi).
inline void block_scores(const float* __restrict row, int64_t begin, int64_t n, uint32_t lo, uint32_t hi,
                         float* __restrict scores) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t bits = lowbias32(lowbias32(static_cast<uint32_t>(begin + j) ^ lo) ^ hi);
    const float u = (static_cast<float>(bits >> 9) + 0.5f) * 0x1p-23f;  // exact: 24 significant bits at most
    scores[j] = row[begin + j] - log_positive(-log_positive(u));
  }
}

void exponential_race(const at::Tensor& out, const at::Tensor& logits, const at::Tensor& keys,
                      const at::Tensor& counters) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.is_contiguous(),
              "exponential_race_: logits must be a contiguous float32 CPU tensor [num_rows, vocab_size]");
  const int64_t num_rows = logits.size(0), vocab_size = logits.size(1);
  for (const at::Tensor* t : {&out, &keys, &counters}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous() &&
                    t->size(0) == num_rows,
                "exponential_race_: out, keys and counters must be contiguous int64 [num_rows]");
  }
  const float* logits_ptr = logits.data_ptr<float>();
  const int64_t* key_ptr = keys.data_ptr<int64_t>();
  const int64_t* counter_ptr = counters.data_ptr<int64_t>();
  int64_t* out_ptr = out.data_ptr<int64_t>();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = logits_ptr + r * vocab_size;
      float max_logit = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < vocab_size; ++t) max_logit = std::max(max_logit, row[t]);
      TORCH_CHECK(std::isfinite(max_logit), "exponential_race_: row ", r, " has no finite logit");
      const float threshold = max_logit - kPruneMargin;
      const uint64_t state = splitmix64_at(static_cast<uint64_t>(key_ptr[r]), static_cast<uint64_t>(counter_ptr[r]));
      const uint32_t lo = static_cast<uint32_t>(state), hi = static_cast<uint32_t>(state >> 32);
      float best = -std::numeric_limits<float>::infinity();
      int64_t best_token = -1;
      float scores[kBlock];
      for (int64_t begin = 0; begin < vocab_size; begin += kBlock) {
        const int64_t n = std::min(kBlock, vocab_size - begin);
        float block_max = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, row[begin + j]);
        if (!(block_max >= threshold)) continue;
        block_scores(row, begin, n, lo, hi, scores);
        for (int64_t j = 0; j < n; ++j) {
          if (scores[j] > best) {  // -inf logits stay -inf; strict: the lowest id wins a tie
            best = scores[j];
            best_token = begin + j;
          }
        }
      }
      out_ptr[r] = best_token;
    }
  });
}

// torch.argmax of one row of n >= 1 floats: the first NaN if there is one, else the lowest index of the maximum
// (-0.0 and 0.0 are equal, as they are to torch's comparison).
int64_t argmax_row(const float* __restrict row, int64_t n) {
  float max_value = -std::numeric_limits<float>::infinity();
  bool has_nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_set1_ps(max_value);
  __mmask16 nan_lanes = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(row + i);
    nan_lanes |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, v);  // a NaN lane's result is not used: has_nan decides then
  }
  max_value = _mm512_reduce_max_ps(vmax);
  has_nan = nan_lanes != 0;
#endif
  for (; i < n; ++i) {
    has_nan = has_nan || std::isnan(row[i]);
    max_value = row[i] > max_value ? row[i] : max_value;
  }
  if (has_nan) {
    for (int64_t j = 0; j < n; ++j) {
      if (std::isnan(row[j])) return j;
    }
  }
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(max_value);
  for (; j + 16 <= n; j += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), target, _CMP_EQ_OQ);
    if (hit != 0) return j + __builtin_ctz(hit);
  }
#endif
  for (; j < n; ++j) {
    if (row[j] == max_value) return j;
  }
  return n - 1;  // unreachable: max_value is one of the row's values
}

void argmax_rows(const at::Tensor& out, const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.stride(1) == 1 && logits.size(1) >= 1,
              "argmax_rows_: logits must be a float32 CPU tensor [num_rows, n >= 1] with unit stride in its last "
              "dimension");
  const int64_t num_rows = logits.size(0), n = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kLong && out.dim() == 1 && out.is_contiguous() &&
                  out.size(0) == num_rows,
              "argmax_rows_: out must be a contiguous int64 [num_rows]");
  const float* logits_ptr = logits.data_ptr<float>();
  int64_t* out_ptr = out.data_ptr<int64_t>();
  at::parallel_for(0, num_rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out_ptr[r] = argmax_row(logits_ptr + r * ld, n);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer_cpu, m) {
  m.def("exponential_race_(Tensor(a!) out, Tensor logits, Tensor keys, Tensor counters) -> ()");
  m.def("argmax_rows_(Tensor(a!) out, Tensor logits) -> ()");
}

TORCH_LIBRARY_IMPL(batchinfer_cpu, CPU, m) {
  m.impl("exponential_race_", exponential_race);
  m.impl("argmax_rows_", argmax_rows);
}
