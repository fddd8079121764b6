// dlite's CPU kernels: the operations of a decoder layer for the narrow passes of decoding (a step, a verify),
// each one call instead of the handful of eager ATen ops it takes otherwise (cpu_kernels.py says why and when).
//
// Every kernel computes in float32, whatever its inputs' dtype (float32 or bfloat16), and computes a row of a pass
// by the same arithmetic however many rows the pass has: a position gets the same result in a step, in any verify
// and in any batch, so from the same prefilled prompt every method writes plain decoding's text.
//
// Weights are group-quantised, as a GGUF file holds them (groups of 32 along a row, the scales in float16):
//   q4   w = code * scale + min, code in 0..15: codes (N, K/2) uint8, byte j of group g holding code 32g+j in its
//        low nibble and code 32g+16+j in its high one; scales (N, K/32, 2) half: [scale, min]
//   q8   w = code * scale, code in -127..127: codes (N, K) int8; scales (N, K/32) half
// A group is dequantised to float32 exactly (the weights a float32 model holds); with bfloat16 activations it is
// rounded to bfloat16, the weights a bfloat16 model holds, and multiplied with AVX512-BF16's dot product.

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

using c10::BFloat16;
using c10::Half;

constexpr int64_t GROUP = 32;  // weights per group along a row
constexpr int64_t MAX_GROUPS = 1024;  // the most groups a row may have (K up to 32 768)

// A vector is as wide as the machine's registers: GCC keeps a vector wider than those in memory, element by element
// (on an AVX2 machine 16-float vectors made the 4-bit matmul 10 times slower than float32's)
#if defined(__AVX512F__)
constexpr int LANES = 16;
#elif defined(__AVX__)
constexpr int LANES = 8;
#else
constexpr int LANES = 4;
#endif
constexpr int PARTS = GROUP / LANES;  // vectors a group
typedef float fvec __attribute__((vector_size(4 * LANES)));
typedef int32_t ivec __attribute__((vector_size(4 * LANES)));

// ------------------------------------------------------------------------------------------------ vector loads

static inline fvec load(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

static inline fvec load(const BFloat16* p) {  // bfloat16 is float32's upper half
  ivec v;
#if defined(__AVX512F__)
  __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
  std::memcpy(&v, &w, sizeof v);
#elif defined(__AVX2__)
  __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
  std::memcpy(&v, &w, sizeof v);
#else
  for (int i = 0; i < LANES; ++i) {
    uint16_t bits;
    std::memcpy(&bits, p + i, 2);
    v[i] = int32_t(uint32_t(bits) << 16);
  }
#endif
  fvec f;
  std::memcpy(&f, &v, sizeof f);
  return f;
}

static inline void store(float* p, fvec v) { std::memcpy(p, &v, sizeof v); }

static inline void store(BFloat16* p, fvec v) {
  for (int i = 0; i < LANES; ++i) p[i] = BFloat16(v[i]);
}

template <typename Byte>
static inline ivec widen(const Byte* p) {  // LANES bytes → LANES int32, zero- or sign-extended by Byte
  ivec v;
#if defined(__AVX512F__)
  __m128i b = _mm_loadu_si128((const __m128i*)p);
  __m512i w = std::is_signed_v<Byte> ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  std::memcpy(&v, &w, sizeof v);
#elif defined(__AVX2__)
  __m128i b = _mm_loadl_epi64((const __m128i*)p);
  __m256i w = std::is_signed_v<Byte> ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  std::memcpy(&v, &w, sizeof v);
#else
  for (int i = 0; i < LANES; ++i) v[i] = p[i];
#endif
  return v;
}

static inline float sum(fvec v) {
#if defined(__AVX512F__)
  __m512 a;
  std::memcpy(&a, &v, sizeof a);
  return _mm512_reduce_add_ps(a);
#else
  float s = 0.f;
  for (int i = 0; i < LANES; ++i) s += v[i];
  return s;
#endif
}

#if defined(__AVX__)
static inline __m256 sums8(const __m256* v) {  // 8 vectors of 8 → their 8 sums
  const __m256 v01 = _mm256_hadd_ps(v[0], v[1]), v23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 v45 = _mm256_hadd_ps(v[4], v[5]), v67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 low = _mm256_hadd_ps(v01, v23), high = _mm256_hadd_ps(v45, v67);  // [0..3 of each half's sums | 4..7]
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}
#endif

// LANES vectors → a vector of their sums, r[k] = sum(v[k]) (in an order of its own: each sum depends on its vector alone)
static inline fvec sums(const fvec* v) {
  fvec r;
#if defined(__AVX512F__)
  __m256 halves[16];  // each vector's two halves added
  for (int k = 0; k < 16; ++k) {
    __m512 a;
    std::memcpy(&a, v + k, sizeof a);
    halves[k] = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  }
  const __m256 low = sums8(halves), high = sums8(halves + 8);
  std::memcpy(&r, &low, sizeof low);
  std::memcpy(reinterpret_cast<float*>(&r) + 8, &high, sizeof high);
#elif defined(__AVX__)
  __m256 a[8];
  std::memcpy(a, v, sizeof a);
  const __m256 s = sums8(a);
  std::memcpy(&r, &s, sizeof r);
#else
  for (int k = 0; k < LANES; ++k) r[k] = sum(v[k]);
#endif
  return r;
}

static inline void to_float(const Half* h, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(h + i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
#endif
  for (; i < n; ++i) out[i] = float(h[i]);
}

static inline fvec splat(float v) { return fvec{} + v; }

// e^x for a vector of floats to about an ulp (Cephes' expf: x = k ln 2 + r, a degree-5 polynomial in r, 2^k put in the
// exponent bits); 0 below -87 (and for -inf)
static inline fvec expv(fvec x) {
  const fvec low = splat(-87.f), high = splat(88.f);
  const fvec c = x < low ? low : (x > high ? high : x);
  const fvec y = c * 1.44269504088896341f + 0.5f;
  fvec k = __builtin_convertvector(__builtin_convertvector(y, ivec), fvec);  // truncated, then floored
  k = y < k ? k - 1.f : k;
  const fvec r = c - k * 0.693359375f + k * 2.12194440e-4f;
  fvec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const ivec bits = (__builtin_convertvector(k, ivec) + 127) << 23;
  fvec power;
  std::memcpy(&power, &bits, sizeof power);
  return x < low ? splat(0.f) : p * power;
}

// ------------------------------------------------------------------------------------------------ linear layers

// A weight format: ``row(n, scales)`` converts output row n's scales to float32 (q4: [scale, min] per group), and
// ``group(n, g, scales, w)`` dequantises its group g with them: w[i] holds weights i·LANES .. (i + 1)·LANES − 1.
struct Q4 {
  const uint8_t* codes;
  const Half* halves;  // (N, K/GROUP, 2)
  int64_t K;
  static constexpr int SCALES = 2;
  void row(int64_t n, float* scales) const { to_float(halves + n * (K / GROUP) * 2, (K / GROUP) * 2, scales); }
  void group(int64_t n, int64_t g, const float* scales, fvec (&w)[PARTS]) const {
    for (int h = 0; h < PARTS / 2; ++h) {  // byte j: code j in its low nibble, code 16 + j in its high one
      const ivec c = widen(codes + n * K / 2 + g * GROUP / 2 + h * LANES);
#if defined(__AVX512F__)  // the group's 16 levels, then each weight looked up: one multiply-add a group, not two
      const fvec levels = fvec{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} * scales[2 * g] + scales[2 * g + 1];
      __m512 table;
      __m512i low, high;
      std::memcpy(&table, &levels, 64);
      const ivec c0 = c & 15, c1 = c >> 4;
      std::memcpy(&low, &c0, 64);
      std::memcpy(&high, &c1, 64);
      const __m512 v0 = _mm512_permutexvar_ps(low, table), v1 = _mm512_permutexvar_ps(high, table);
      std::memcpy(&w[h], &v0, 64);
      std::memcpy(&w[PARTS / 2 + h], &v1, 64);
#else
      w[h] = __builtin_convertvector(c & 15, fvec) * scales[2 * g] + scales[2 * g + 1];
      w[PARTS / 2 + h] = __builtin_convertvector(c >> 4, fvec) * scales[2 * g] + scales[2 * g + 1];
#endif
    }
  }
};

struct Q8 {
  const int8_t* codes;
  const Half* halves;  // (N, K/GROUP)
  int64_t K;
  static constexpr int SCALES = 1;
  void row(int64_t n, float* scales) const { to_float(halves + n * (K / GROUP), K / GROUP, scales); }
  void group(int64_t n, int64_t g, const float* scales, fvec (&w)[PARTS]) const {
    const int8_t* c = codes + n * K + g * GROUP;
    for (int i = 0; i < PARTS; ++i) w[i] = __builtin_convertvector(widen(c + i * LANES), fvec) * scales[g];
  }
};

// A dense weight (N, K) in float32 or bfloat16 (a drafter's, trained in a float type)
template <typename T>
struct Dense {
  const T* weights;
  int64_t K;
  static constexpr int SCALES = 0;
  void row(int64_t, float*) const {}
  void group(int64_t n, int64_t g, const float*, fvec (&w)[PARTS]) const {
    for (int i = 0; i < PARTS; ++i) w[i] = load(weights + n * K + g * GROUP + i * LANES);
  }
};

// out[m, n] = x[m] · w[n] for the M rows of x (M, K) float32 and the output rows n0..n1.  Each row's products go to
// two accumulators (a group's even and odd vectors), so that the sums do not wait on each other, whatever M is.
template <int M, typename W, typename T>
static void rows_float(const W& w, const float* x, T* out, int64_t N, int64_t n0, int64_t n1) {
  const int64_t K = w.K;
  float scales[MAX_GROUPS * W::SCALES + 1];
  for (int64_t n = n0; n < n1; ++n) {
    w.row(n, scales);
    fvec even[M], odd[M];
    for (int m = 0; m < M; ++m) even[m] = odd[m] = fvec{};
    for (int64_t g = 0; g < K / GROUP; ++g) {
      fvec parts[PARTS];
      w.group(n, g, scales, parts);
      for (int m = 0; m < M; ++m) {
        const float* xg = x + m * K + g * GROUP;
        for (int i = 0; i < PARTS; i += 2) {
          even[m] += parts[i] * load(xg + i * LANES);
          odd[m] += parts[i + 1] * load(xg + (i + 1) * LANES);
        }
      }
    }
    for (int m = 0; m < M; ++m) out[m * N + n] = T(sum(even[m] + odd[m]));
  }
}

#if defined(__AVX512BF16__)
// the same for x (M, K) bfloat16: the weights rounded to bfloat16 (a bfloat16 model's), 32 products of a row and a
// group in one dot-product instruction
template <int M, typename W>
static void rows_bf16(const W& w, const BFloat16* x, BFloat16* out, int64_t N, int64_t n0, int64_t n1) {
  const int64_t K = w.K;
  float scales[MAX_GROUPS * W::SCALES + 1];
  for (int64_t n = n0; n < n1; ++n) {
    w.row(n, scales);
    __m512 even[M], odd[M];
    for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < K / GROUP; ++g) {
      fvec parts[PARTS];  // 2 of 16
      w.group(n, g, scales, parts);
      __m512 a0, a1;
      std::memcpy(&a0, &parts[0], 64);
      std::memcpy(&a1, &parts[1], 64);
      const __m512bh wg = _mm512_cvtne2ps_pbh(a1, a0);  // elements 0..15 from a0, 16..31 from a1
      for (int m = 0; m < M; ++m) {
        const __m512bh xg = (__m512bh)_mm512_loadu_si512(x + m * K + g * GROUP);
        if (g % 2) odd[m] = _mm512_dpbf16_ps(odd[m], wg, xg);
        else even[m] = _mm512_dpbf16_ps(even[m], wg, xg);
      }
    }
    for (int m = 0; m < M; ++m) out[m * N + n] = BFloat16(_mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m])));
  }
}
#endif

// The most rows a linear's block takes: their accumulators and a group's weights fit the 16 vector registers AVX2
// has (AVX-512 has 32)
constexpr int ROW_BLOCK = LANES == 16 ? 8 : 4;

// f(std::integral_constant<int, R>, row) for the rows of a pass in blocks of up to ROW_BLOCK
template <typename F>
static void row_blocks(int64_t M, F f) {
  int64_t r = 0;
  for (; r + ROW_BLOCK <= M; r += ROW_BLOCK) f(std::integral_constant<int, ROW_BLOCK>{}, r);
  switch (M - r) {
    case 1: f(std::integral_constant<int, 1>{}, r); break;
    case 2: f(std::integral_constant<int, 2>{}, r); break;
    case 3: f(std::integral_constant<int, 3>{}, r); break;
    case 4: f(std::integral_constant<int, 4>{}, r); break;
    case 5: f(std::integral_constant<int, 5>{}, r); break;
    case 6: f(std::integral_constant<int, 6>{}, r); break;
    case 7: f(std::integral_constant<int, 7>{}, r); break;
    default: break;
  }
}

// kernel(rows, r, n0, n1) over the output rows, one contiguous block of them per thread, for the pass's rows in blocks
template <typename Kernel>
static void over_outputs(int64_t M, int64_t N, Kernel kernel) {
  const int64_t grain = std::max<int64_t>(16, N / at::get_num_threads() + 1);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    row_blocks(M, [&](auto rows, int64_t r) { kernel(rows, r, n0, n1); });
  });
}

template <typename W, typename T>
static void linear_float(const W& w, const float* x, T* out, int64_t M, int64_t N) {
  over_outputs(M, N, [&](auto rows, int64_t r, int64_t n0, int64_t n1) {
    rows_float<decltype(rows)::value>(w, x + r * w.K, out + r * N, N, n0, n1);
  });
}

template <typename W>
static at::Tensor linear(const at::Tensor& x_in, const W& w, int64_t N) {
  const int64_t K = w.K;
  TORCH_CHECK(x_in.size(-1) == K && K % GROUP == 0 && K / GROUP <= MAX_GROUPS, "linear: x has ", x_in.size(-1), " features, the weights ", K);
  const at::Tensor x = x_in.contiguous().view({-1, K});
  const int64_t M = x.size(0);
  auto shape = x_in.sizes().vec();
  shape.back() = N;
  at::Tensor out = at::empty(shape, x_in.options());
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    const BFloat16* xp = x.data_ptr<BFloat16>();
    BFloat16* op = out.data_ptr<BFloat16>();
    over_outputs(M, N, [&](auto rows, int64_t r, int64_t n0, int64_t n1) {
      rows_bf16<decltype(rows)::value>(w, xp + r * K, op + r * N, N, n0, n1);
    });
    return out;
  }
#endif
  const at::Tensor xf = x.to(at::kFloat);
  if (out.scalar_type() == at::kBFloat16)
    linear_float(w, xf.data_ptr<float>(), out.data_ptr<BFloat16>(), M, N);
  else
    linear_float(w, xf.data_ptr<float>(), out.data_ptr<float>(), M, N);
  return out;
}

// x (…, K) float32 or bfloat16 → x @ wᵀ (…, N) in x's dtype
at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf, "linear_q4: codes uint8, scales half");
  return linear(x, Q4{codes.data_ptr<uint8_t>(), scales.data_ptr<Half>(), codes.size(1) * 2}, codes.size(0));
}

at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && scales.scalar_type() == at::kHalf, "linear_q8: codes int8, scales half");
  return linear(x, Q8{codes.data_ptr<int8_t>(), scales.data_ptr<Half>(), codes.size(1)}, codes.size(0));
}

// ------------------------------------------------------------------------------------------------ norms, the MLP's gate

#define FLOAT_OR_BF16(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// out (H,) = x / rms(x) * weight, as Hugging Face's RMSNorm: normalised in float32, rounded to T, times the weight
template <typename T>
static void norm_row(const T* x, const T* weight, float eps, int64_t H, T* out) {
  float squares = 0.f;
  for (int64_t j = 0; j < H; ++j) squares += float(x[j]) * float(x[j]);
  const float r = 1.f / std::sqrt(squares / H + eps);
  for (int64_t j = 0; j < H; ++j) out[j] = T(float(T(float(x[j]) * r)) * float(weight[j]));
}

// x (…, H) → RMSNorm(x)
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  const at::Tensor x = x_in.contiguous();
  const int64_t H = x.size(-1), M = x.numel() / H;
  at::Tensor out = at::empty_like(x);
  FLOAT_OR_BF16(x.scalar_type(), "rms_norm", [&] {
    for (int64_t m = 0; m < M; ++m)
      norm_row(x.data_ptr<scalar_t>() + m * H, weight.data_ptr<scalar_t>(), float(eps), H, out.data_ptr<scalar_t>() + m * H);
  });
  return out;
}

// h, delta (…, H) → (h + delta, RMSNorm(h + delta)): a residual connection and the next norm
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h_in, const at::Tensor& delta_in, const at::Tensor& weight, double eps) {
  const at::Tensor h = h_in.contiguous(), delta = delta_in.contiguous();
  const int64_t H = h.size(-1), M = h.numel() / H;
  at::Tensor sum = at::empty_like(h), out = at::empty_like(h);
  FLOAT_OR_BF16(h.scalar_type(), "add_rms_norm", [&] {
    const scalar_t *hp = h.data_ptr<scalar_t>(), *dp = delta.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    for (int64_t i = 0; i < M * H; ++i) sp[i] = scalar_t(float(hp[i]) + float(dp[i]));
    for (int64_t m = 0; m < M; ++m) norm_row(sp + m * H, weight.data_ptr<scalar_t>(), float(eps), H, out.data_ptr<scalar_t>() + m * H);
  });
  return {sum, out};
}

template <typename T>
static void silu_mul_row(const T* gate_up, int64_t I, float* gate, T* out) {
  for (int64_t j = 0; j < I; ++j) gate[j] = float(gate_up[j]);
  int64_t j = 0;
  for (; j + LANES <= I; j += LANES) store(gate + j, load(gate + j) / (1.f + expv(-load(gate + j))));
  for (; j < I; ++j) gate[j] = gate[j] / (1.f + std::exp(-gate[j]));
  for (int64_t j = 0; j < I; ++j) out[j] = T(float(T(gate[j])) * float(gate_up[I + j]));
}

// gate_up (…, 2I): [gate, up] → silu(gate) * up (…, I)
at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  const at::Tensor gate_up = gate_up_in.contiguous();
  const int64_t I = gate_up.size(-1) / 2, M = gate_up.numel() / (2 * I);
  auto shape = gate_up.sizes().vec();
  shape.back() = I;
  at::Tensor out = at::empty(shape, gate_up.options());
  std::vector<float> gate(I);
  FLOAT_OR_BF16(gate_up.scalar_type(), "silu_mul", [&] {
    for (int64_t m = 0; m < M; ++m) silu_mul_row(gate_up.data_ptr<scalar_t>() + m * 2 * I, I, gate.data(), out.data_ptr<scalar_t>() + m * I);
  });
  return out;
}

// ------------------------------------------------------------------------------------------------ attention

constexpr int64_t MAX_HEAD_DIM = 128;  // attention takes head dims of a multiple of 16 up to this (SmolLM2 64, Qwen3 128)
constexpr int64_t MAX_GROUP = 8;  // and up to this many query heads a KV head (SmolLM2 3, Qwen3-4B 4, Qwen3-8B 4)

// One head x (d,) at one position, after Qwen3's per-head RMSNorm where ``norm`` is given, turned by the rotary
// embedding (cos, sin (d,); Hugging Face's rotate_half convention) → out (d,) float32, each value rounded to T as
// the model's own would be
template <typename T>
static void rotate(const T* x, const T* norm, float eps, const float* cos, const float* sin, int64_t d, float* out) {
  T normed[MAX_HEAD_DIM];
  if (norm)
    norm_row(x, norm, eps, d, normed);
  else
    std::memcpy(normed, x, d * sizeof(T));
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = float(normed[j]), b = float(normed[j + half]);
    out[j] = float(T(a * cos[j] - b * sin[j]));
    out[j + half] = float(T(b * cos[j + half] + a * sin[j + half]));
  }
}

// f(std::integral_constant<int, D>) for the head dim d (a multiple of 16, at most MAX_HEAD_DIM)
template <int D = 16, typename F>
static void with_head_dim(int64_t d, F f) {
  if constexpr (D <= MAX_HEAD_DIM) {
    if (d == D) return f(std::integral_constant<int, D>{});
    with_head_dim<D + 16>(d, f);
  }
}

// f(std::integral_constant<int, G>) for the query heads a KV head serves (1 to MAX_GROUP)
template <int G = 1, typename F>
static void with_group(int64_t group, F f) {
  if constexpr (G <= MAX_GROUP) {
    if (group == G) return f(std::integral_constant<int, G>{});
    with_group<G + 1>(group, f);
  }
}

constexpr int64_t KEY_CHUNK = 128;  // keys a work item attends over (a multiple of 16): a row's keys are split at multiples of it
constexpr int64_t MERGES_A_THREAD = 64;  // the fewest (token, KV head) merges worth a thread of their own
constexpr int64_t VALUE_BLOCK = 16;  // values taken by every query of a chunk in turn, while they are in the L1 cache

// The M queries q (M, D) of one KV head, scaled, over a chunk of its n keys and values K, V (n, D), query m over the
// first limit[m] of them (0 .. n) → the chunk's share, unnormalised: out (M, D) = Σ_t e_mt V_t with e_mt =
// exp(q_m·K_t − top_m), top (M,) the largest score and total (M,) = Σ_t e_mt (−inf, 0 and 0 where limit[m] is 0);
// ``scores`` (M, KEY_CHUNK) their scratch.  Keys are taken LANES at a time, values VALUE_BLOCK at a time, each block
// read once from memory for all M queries; a query's arithmetic is its own, the same whatever else a pass holds.
template <int D, typename T>
static void attend_chunk(const float* q, const int64_t* limit, int64_t M, const T* K, const T* V, int64_t n, float* scores,
                         float* top, float* total, float* out) {
  T padded[LANES * D];  // the chunk's last keys where they fill part of a group, zeros after them
  for (int64_t t0 = 0; t0 < n; t0 += LANES) {
    const T* group = K + t0 * D;
    if (t0 + LANES > n) {
      std::fill(padded, padded + LANES * D, T(0));
      std::memcpy(padded, group, (n - t0) * D * sizeof(T));
      group = padded;
    }
    for (int64_t m = 0; m < M; ++m) {
      if (t0 >= limit[m]) continue;
      fvec products[LANES] = {};  // key k's products with the query, a lane a share of the dimensions
      for (int j = 0; j < D / LANES; ++j) {
        const fvec query = load(q + m * D + LANES * j);
        for (int k = 0; k < LANES; ++k) products[k] += query * load(group + k * D + LANES * j);
      }
      store(scores + m * KEY_CHUNK + t0, sums(products));
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    float* score = scores + m * KEY_CHUNK;
    const int64_t v = limit[m];
    fvec most = splat(-INFINITY);
    int64_t t = 0;
    for (; t + LANES <= v; t += LANES) {
      const fvec x = load(score + t);
      most = most < x ? x : most;
    }
    float largest = -INFINITY;
    for (int k = 0; k < LANES; ++k) largest = std::max(largest, most[k]);
    for (; t < v; ++t) largest = std::max(largest, score[t]);
    fvec exps{};
    t = 0;
    for (; t + LANES <= v; t += LANES) {
      const fvec e = expv(load(score + t) - largest);
      store(score + t, e);
      exps += e;
    }
    for (; t < v; ++t) {  // the last few, one at a time
      score[t] = expv(splat(score[t] - largest))[0];
      exps[0] += score[t];
    }
    top[m] = largest;
    total[m] = sum(exps);
    for (int j = 0; j < D / LANES; ++j) store(out + m * D + LANES * j, fvec{});
  }
  for (int64_t t0 = 0; t0 < n; t0 += VALUE_BLOCK)
    for (int64_t m = 0; m < M; ++m) {
      const float* score = scores + m * KEY_CHUNK;
      const int64_t t1 = std::min(t0 + VALUE_BLOCK, limit[m]);
      if (t0 >= t1) continue;
      fvec acc[D / LANES];
      for (int j = 0; j < D / LANES; ++j) acc[j] = load(out + m * D + LANES * j);
      for (int64_t t = t0; t < t1; ++t)
        for (int j = 0; j < D / LANES; ++j) acc[j] += score[t] * load(V + t * D + LANES * j);
      for (int j = 0; j < D / LANES; ++j) store(out + m * D + LANES * j, acc[j]);
    }
}

// The attention of a pass's queries (B, Q, H, D) float32 over their rows' keys and values → out (B, Q, H·D), as flash
// decoding splits it: a work item a row, KV head and chunk of KEY_CHUNK keys (each key read once for the row's Q·G
// queries of that head), then each query's chunks merged in order.  A chunk starts at a multiple of KEY_CHUNK, so a
// query's chunks, and its result, are the same in a step, in any verify and in any batch.
template <int D, int G, typename T>
static void attend_rows(const float* queries, const T* keys, const T* values, T* out, const int64_t* slot, const int64_t* start,
                        int64_t B, int64_t Q, int64_t KV, int64_t A, float scale, bool causal) {
  const int64_t M = Q * G;  // a row's queries of one KV head: token i's heads are i G .. i G + G − 1
  std::vector<int64_t> first(B + 1, 0);  // row b's work items: first[b] .. first[b + 1] − 1, KV head by KV head
  for (int64_t b = 0; b < B; ++b) first[b + 1] = first[b] + KV * ((start[b] + Q + KEY_CHUNK - 1) / KEY_CHUNK);
  // a query's limit: the keys it attends to, 0 .. its own position (causal), or all of its row's
  const auto seen = [&](int64_t b, int64_t i) { return causal ? start[b] + i + 1 : start[b] + Q; };
  // each work item's share, largest score and total for its M queries: every one written before it is read
  const std::unique_ptr<float[]> shares(new float[first[B] * M * D]), tops(new float[first[B] * M]), totals(new float[first[B] * M]);
  at::parallel_for(0, first[B], 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> q(M * D), scores(M * KEY_CHUNK);
    std::vector<int64_t> limit(M);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = std::upper_bound(first.begin(), first.end(), w) - first.begin() - 1;
      const int64_t chunks = (first[b + 1] - first[b]) / KV, h = (w - first[b]) / chunks, c = (w - first[b]) % chunks;
      const int64_t from = c * KEY_CHUNK, n = std::min(KEY_CHUNK, start[b] + Q - from);
      for (int64_t i = 0; i < Q; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const float* query = queries + (((b * Q + i) * KV + h) * G + g) * D;
          for (int64_t j = 0; j < D; ++j) q[(i * G + g) * D + j] = query[j] * scale;
          limit[i * G + g] = std::clamp(seen(b, i) - from, int64_t(0), n);
        }
      const int64_t at = ((slot[b] * KV + h) * A + from) * D;
      attend_chunk<D>(q.data(), limit.data(), M, keys + at, values + at, n, scores.data(), tops.get() + w * M,
                      totals.get() + w * M, shares.get() + w * M * D);
    }
  });
  at::parallel_for(0, B * Q * KV, MERGES_A_THREAD, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {  // row b, token i, KV head h: its G queries over their chunks
      const int64_t b = w / (Q * KV), i = w / KV % Q, h = w % KV;
      const int64_t chunks = (first[b + 1] - first[b]) / KV, used = (seen(b, i) + KEY_CHUNK - 1) / KEY_CHUNK;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t m = i * G + g, item = first[b] + h * chunks;
        float largest = -INFINITY;
        for (int64_t c = 0; c < used; ++c) largest = std::max(largest, tops[(item + c) * M + m]);
        fvec acc[D / LANES] = {};
        float total = 0.f;
        for (int64_t c = 0; c < used; ++c) {
          const float weight = expv(splat(tops[(item + c) * M + m] - largest))[0];
          total += weight * totals[(item + c) * M + m];
          const float* share = shares.get() + ((item + c) * M + m) * D;
          for (int j = 0; j < D / LANES; ++j) acc[j] += weight * load(share + LANES * j);
        }
        for (int j = 0; j < D / LANES; ++j) store(out + (((b * Q + i) * KV + h) * G + g) * D + LANES * j, acc[j] * (1.f / total));
      }
    }
  });
}

// One pass's attention for B rows of Q tokens each, with the rotary embedding and the writes into the KV cache.
//   qkv (B, Q, (H + 2 KV) d): the fused q, k, v projection's output, in the cache's dtype
//   cos, sin (B, Q, d) float32: the rotary embedding at each token's position
//   keys, values (slots, KV, A, d): row b's tokens are written to slot slots[b], positions starts[b] .. starts[b] + Q − 1
//   q_norm, k_norm (d,): Qwen3's per-head norms before the rotation, or empty tensors
//   → (B, Q, H d): query (b, i) attends to positions 0 .. starts[b] + i of its slot (causal), or to all of
//     0 .. starts[b] + Q − 1 (not causal: a drafter's block, which attends both ways)
at::Tensor attention(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in, at::Tensor keys,
                     at::Tensor values, const at::Tensor& slots_in, const at::Tensor& starts_in, int64_t H,
                     const at::Tensor& q_norm, const at::Tensor& k_norm, double eps, double scale, bool causal) {
  const at::Tensor qkv = qkv_in.contiguous(), cos = cos_in.to(at::kFloat).contiguous(), sin = sin_in.to(at::kFloat).contiguous();
  const at::Tensor slots = slots_in.to(at::kLong).contiguous(), starts = starts_in.to(at::kLong).contiguous();
  const int64_t B = qkv.size(0), Q = qkv.size(1), KV = keys.size(1), A = keys.size(2), d = keys.size(3);
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.scalar_type() == qkv.scalar_type(), "attention: the cache");
  TORCH_CHECK(d % 16 == 0 && d <= MAX_HEAD_DIM && H % KV == 0 && H / KV <= MAX_GROUP && qkv.size(2) == (H + 2 * KV) * d,
              "attention: the heads' shapes");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(start[b] + Q <= A, "attention: the pass runs past the cache's ", A, " positions");
  at::Tensor queries = at::empty({B, Q, H, d}, qkv.options().dtype(at::kFloat));
  at::Tensor out = at::empty({B, Q, H * d}, qkv.options());
  float* qp = queries.data_ptr<float>();
  FLOAT_OR_BF16(qkv.scalar_type(), "attention", [&] {
    using T = scalar_t;
    const T* x = qkv.data_ptr<T>();
    T *kp = keys.data_ptr<T>(), *vp = values.data_ptr<T>(), *op = out.data_ptr<T>();
    const T* qn = q_norm.numel() ? q_norm.data_ptr<T>() : nullptr;
    const T* kn = k_norm.numel() ? k_norm.data_ptr<T>() : nullptr;
    float rotated[MAX_HEAD_DIM];
    for (int64_t token = 0; token < B * Q; ++token) {
      const int64_t b = token / Q, i = token % Q;
      const T* heads = x + token * (H + 2 * KV) * d;
      const float *c = cos.data_ptr<float>() + token * d, *s = sin.data_ptr<float>() + token * d;
      for (int64_t h = 0; h < H; ++h) rotate(heads + h * d, qn, float(eps), c, s, d, qp + (token * H + h) * d);
      for (int64_t h = 0; h < KV; ++h) {
        const int64_t at = ((slot[b] * KV + h) * A + start[b] + i) * d;
        rotate(heads + (H + h) * d, kn, float(eps), c, s, d, rotated);
        for (int64_t j = 0; j < d; ++j) kp[at + j] = T(rotated[j]);
        std::memcpy(vp + at, heads + (H + KV + h) * d, d * sizeof(T));
      }
    }
    with_head_dim(d, [&](auto D) {
      with_group(H / KV, [&](auto G) {
        attend_rows<decltype(D)::value, decltype(G)::value>(qp, kp, vp, op, slot, start, B, Q, KV, A, float(scale), causal);
      });
    });
  });
  return out;
}

// ------------------------------------------------------------------------------------------------ the drafter's head

// out (M, N) float32 = x (M, K) float32 @ wᵀ, w (N, K) dense in T, over the threads
template <typename T>
static void dense(const at::Tensor& w, const float* x, float* out, int64_t M) {
  const int64_t N = w.size(0), K = w.size(1);
  const Dense<T> weights{w.data_ptr<T>(), K};
  linear_float(weights, x, out, M, N);
}

// A DLite drafter's sequential head, left to right over K positions with greedy picks (model.py, Head):
//   s_i = g ⊙ s_{i−1} + (1 − g) ⊙ tanh(c), [g, c] = W_g [s_{i−1}; E(x_{i−1})] + b_g (without ``gate``: s stays)
//   logits_i = W_V (W_s s_i + from_h_i), x_i = draft_ids[argmax logits_i]
//   from_h (B, K, R): the latent's h part and bias; state (B, R); previous (B,): the anchor's target ids
//   → draft tokens (B, K) (target ids) and the head's probability of each (B, K)
std::tuple<at::Tensor, at::Tensor> greedy_head(const at::Tensor& from_h_in, const at::Tensor& state_in, const at::Tensor& previous_in,
                                               const at::Tensor& token_embedding, const at::Tensor& gate_weight, const at::Tensor& gate_bias,
                                               const at::Tensor& latent_state, const at::Tensor& vocab, const at::Tensor& draft_ids_in) {
  const at::Tensor from_h = from_h_in.to(at::kFloat).contiguous(), draft_ids = draft_ids_in.to(at::kLong).contiguous();
  const int64_t B = from_h.size(0), K = from_h.size(1), R = from_h.size(2), V = vocab.size(0);
  const bool recurrent = gate_weight.numel() > 0;
  TORCH_CHECK(R % GROUP == 0 && vocab.is_contiguous() && latent_state.is_contiguous() && (!recurrent || token_embedding.is_contiguous()),
              "greedy_head: the rank must be a multiple of 32, the weights contiguous");
  std::vector<float> state(B * R), joined(B * 2 * R), gated(B * 2 * R), latent(B * R), logits(B * V);
  const at::Tensor state_float = state_in.to(at::kFloat).contiguous();
  std::memcpy(state.data(), state_float.data_ptr<float>(), B * R * sizeof(float));
  std::vector<int64_t> previous(B);
  const at::Tensor previous_long = previous_in.to(at::kLong).contiguous();
  std::memcpy(previous.data(), previous_long.data_ptr<int64_t>(), B * sizeof(int64_t));
  at::Tensor tokens = at::empty({B, K}, at::kLong), confidence = at::empty({B, K}, at::kFloat);
  const at::ScalarType dtype = vocab.scalar_type();
  auto matmul = [&](const at::Tensor& w, const float* x, float* out) {
    if (dtype == at::kBFloat16) dense<BFloat16>(w, x, out, B);
    else dense<float>(w, x, out, B);
  };
  const at::Tensor bias = gate_bias.to(at::kFloat).contiguous();
  for (int64_t i = 0; i < K; ++i) {
    if (recurrent) {
      for (int64_t b = 0; b < B; ++b) {
        std::memcpy(joined.data() + b * 2 * R, state.data() + b * R, R * sizeof(float));
        float* embedded = joined.data() + b * 2 * R + R;  // E(x_{i−1})
        FLOAT_OR_BF16(token_embedding.scalar_type(), "greedy_head", [&] {
          const scalar_t* row = token_embedding.data_ptr<scalar_t>() + previous[b] * R;
          for (int64_t r = 0; r < R; ++r) embedded[r] = float(row[r]);
        });
      }
      matmul(gate_weight, joined.data(), gated.data());
      for (int64_t b = 0; b < B; ++b)
        for (int64_t r = 0; r < R; ++r) {
          const float g = 1.f / (1.f + std::exp(-(gated[b * 2 * R + r] + bias.data_ptr<float>()[r])));
          const float c = std::tanh(gated[b * 2 * R + R + r] + bias.data_ptr<float>()[R + r]);
          state[b * R + r] = c + g * (state[b * R + r] - c);
        }
    }
    matmul(latent_state, state.data(), latent.data());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t r = 0; r < R; ++r) latent[b * R + r] += from_h.data_ptr<float>()[(b * K + i) * R + r];
    matmul(vocab, latent.data(), logits.data());
    for (int64_t b = 0; b < B; ++b) {
      const float* row = logits.data() + b * V;
      const int64_t best = std::max_element(row, row + V) - row;
      fvec sums{};
      int64_t v = 0;
      for (; v + LANES <= V; v += LANES) sums += expv(load(row + v) - row[best]);
      float total = sum(sums);
      for (; v < V; ++v) total += std::exp(row[v] - row[best]);
      previous[b] = draft_ids.data_ptr<int64_t>()[best];
      tokens.data_ptr<int64_t>()[b * K + i] = previous[b];
      confidence.data_ptr<float>()[b * K + i] = 1.f / total;
    }
  }
  return {tokens, confidence};
}

// ------------------------------------------------------------------------------------------------ a pass's layers

// A target's decoder layers for the narrow passes of decoding, one call a pass instead of eight a layer (runner.py's
// loop, each of whose calls goes through Python and pybind: 0.8–1 ms of a 9.5 ms step on a 2-core AVX2 EPYC), without
// holding Python's lock.  Each layer runs the kernels above in the loop's order, so a pass computes the same bits either way.
class DecoderLayers {
 public:
  // Per layer, ``weights``: the codes and scales (4- or 8-bit) of its q/k/v, o, gate/up and down projections, its
  // q and k norms' weights (empty for Llama), the norm's after its attention and the next norm's (the next layer's
  // first, the model's final one after the last layer); ``numbers``: the q/k norms' epsilon, the other two norms',
  // and the attention's scale
  DecoderLayers(std::vector<std::vector<at::Tensor>> weights, std::vector<std::vector<double>> numbers, int64_t heads)
      : weights_(std::move(weights)), numbers_(std::move(numbers)), heads_(heads) {
    TORCH_CHECK(weights_.size() == numbers_.size(), "DecoderLayers: weights and numbers for every layer");
    for (size_t l = 0; l < weights_.size(); ++l)
      TORCH_CHECK(weights_[l].size() == 12 && numbers_[l].size() == 4, "DecoderLayers: layer ", l, "'s weights and numbers");
  }

  // h (B, Q, H) the pass's embeddings, x their first norm; per layer its cache's keys and values; cos, sin, slots and
  // starts as ``attention`` takes them → (h, x) after the last layer, and h after each layer in ``capture``
  std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> run(at::Tensor h, at::Tensor x, const std::vector<at::Tensor>& keys,
                                                                   const std::vector<at::Tensor>& values, const at::Tensor& cos,
                                                                   const at::Tensor& sin, const at::Tensor& slots,
                                                                   const at::Tensor& starts, const std::vector<int64_t>& capture) const {
    TORCH_CHECK(keys.size() == weights_.size() && values.size() == weights_.size(), "DecoderLayers: a cache for every layer");
    std::vector<at::Tensor> captured;
    for (size_t l = 0; l < weights_.size(); ++l) {
      const std::vector<at::Tensor>& w = weights_[l];
      const std::vector<double>& n = numbers_[l];
      const at::Tensor qkv = project(x, w[0], w[1]);
      const at::Tensor attended = attention(qkv, cos, sin, keys[l], values[l], slots, starts, heads_, w[8], w[9], n[0], n[3], true);
      std::tie(h, x) = add_rms_norm(h, project(attended, w[2], w[3]), w[10], n[1]);
      std::tie(h, x) = add_rms_norm(h, project(silu_mul(project(x, w[4], w[5])), w[6], w[7]), w[11], n[2]);
      if (std::find(capture.begin(), capture.end(), int64_t(l)) != capture.end()) captured.push_back(h);
    }
    return {h, x, captured};
  }

 private:
  static at::Tensor project(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
    return codes.scalar_type() == at::kByte ? linear_q4(x, codes, scales) : linear_q8(x, codes, scales);
  }

  std::vector<std::vector<at::Tensor>> weights_;
  std::vector<std::vector<double>> numbers_;
  int64_t heads_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_q4", &linear_q4, "x (…, K) → x @ wᵀ (…, N), w affine 4-bit in groups of 32");
  m.def("linear_q8", &linear_q8, "x (…, K) → x @ wᵀ (…, N), w symmetric 8-bit in groups of 32");
  m.def("rms_norm", &rms_norm, "x (…, H) → RMSNorm(x)");
  m.def("add_rms_norm", &add_rms_norm, "h, delta (…, H) → (h + delta, RMSNorm(h + delta))");
  m.def("silu_mul", &silu_mul, "[gate, up] (…, 2I) → silu(gate) * up (…, I)");
  m.def("attention", &attention, "a pass's attention with its rotary embedding and KV-cache writes");
  m.def("greedy_head", &greedy_head, "a DLite drafter's sequential head over K positions, greedy");
  py::class_<DecoderLayers>(m, "DecoderLayers")
      .def(py::init<std::vector<std::vector<at::Tensor>>, std::vector<std::vector<double>>, int64_t>())
      .def("run", &DecoderLayers::run, "a narrow pass's decoder layers → (h, x, h after each captured layer)",
           py::call_guard<py::gil_scoped_release>());  // a server's other threads run meanwhile
}
