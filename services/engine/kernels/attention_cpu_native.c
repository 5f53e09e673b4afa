/* Paged decode attention on the CPU, fp32 compute: one query token per sequence, keys and values read in
   place from the paged KV cache through each sequence's block table -- an fp32 cache, or an fp8 (e4m3)
   cache with a scale per (block, kv head), dequantized in registers (kernels/kv_fp8.py has the scheme).
   Also the fp8 cache's writer: new K/V rows truncated onto their blocks' scales, raised when needed.

   Built by attention_native.py with the machine's C compiler (-O3 -march=native -fopenmp) and called
   through ctypes; the Python wrapper checks the operands' dtypes and layouts, and this file checks every
   index it follows (rows, context lengths, block ids) before it reads anything.

   For sequence b (query row rows[b], ctx_lens[b] tokens in the cache including this step's) and query
   head h (kv head h / group):
       out[rows[b], h] = softmax(scale * q[rows[b], h] . K[j]  for j in [lo, ctx)) . V
   with lo = max(0, ctx - window) for a sliding window, else 0, and K[j]/V[j] at
   cache[table[b][j / block_size], j % block_size, kv head].

   Why this exists: the torch path gathers every decode sequence's blocks into a padded copy (one
   index_select per layer for K and one for V) and runs SDPA with an additive mask over the padding; on
   a CPU decode step that is three passes over the KV bytes plus the padding. Here each (sequence,
   kv head) pair reads its keys and values once, exactly, with an online softmax over block-sized chunks
   (running max and sum per query head, the accumulator rescaled when the max grows), and the pairs are
   shared out over the OpenMP threads. The query heads of one kv head (GQA) share each key and value load.

   fp8: a key or value row is decoded once into a small stack buffer that the G query heads share; a
   block's scales are applied to the scores (q . s k = s (q . k)) and to the softmax weights, never per
   element. The fp32 and fp8 kernels are one always-inlined body specialized on a constant flag, so the
   fp32 path compiles to what it was.

   fp32 with 1, 2, 4 or 8 query heads per kv head and a head width that is a multiple of 8 (G x width/8 within
   register reach) takes attend_regs instead: the heads' accumulators live in registers for the whole sequence,
   a value row is loaded once for all heads, the softmax bookkeeping is vector work over a tile and the heads,
   and the next block's rows are prefetched as a block begins. On an Intel Xeon (AVX-512) VM, 256 sequences of
   100-170 tokens, 4 heads of 32 per kv head: 35 -> 25 ns per (key, kv head) a thread with the blocks in memory
   (the reads bind it there: ~10 GB/s a thread), 22 -> 12 ns with them in cache.

   Prefetches go to L2 (locality 1), and each (sequence, kv head) item asks for the next item's first block before
   it starts: on an AMD EPYC (AVX-512) VM, 256 sequences over randomly placed blocks of four layers' caches, the
   decode step's attention took 9.5 -> 6.6 ms at 100-180 tokens, 2.5 -> 1.6 at 16-40, 27.3 -> 18.0 at 300-600
   (medians of 15 interleaved rounds; outputs bit-identical). perf had put a quarter of the kernel's samples on
   its value loads and an eighth on prefetcht0 itself: 64 L1 prefetches issued at once, more than the core has
   miss buffers for. */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16     /* query heads per kv head */
#define MAX_HEAD_DIM 256
#define PV_TILE 16       /* keys whose values are accumulated per pass (fp8: decoded into a tile) */
#define MAX_BLOCK 256    /* block_size: one chunk of scores per query head lives on the stack */

enum { OK = 0, BAD_SHAPE = 1, BAD_ROW = 2, BAD_CONTEXT = 3, BAD_BLOCK = 4, TOO_LARGE = 5, BAD_SLOT = 6,
       BLOCK_TWICE = 7, NO_MEMORY = 8 };

int mplex_attn_abi_version(void) { return 3; }

typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef uint32_t vu8 __attribute__((vector_size(32)));
typedef uint8_t vb8 __attribute__((vector_size(8)));

static inline vf8 load8(const float *p) { vf8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, vf8 v) { memcpy(p, &v, sizeof v); }
static inline vf8 splat8(float x) { return (vf8){x, x, x, x, x, x, x, x}; }
/* mask lanes (-1 or 0, from a vector comparison) ? a : b */
static inline vf8 select8(vi8 mask, vf8 a, vf8 b) { return (vf8)((mask & (vi8)a) | (~mask & (vi8)b)); }
static inline float hsum8(vf8 v)
{
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}


/* Eight dot-product accumulators reduced at once: lane j of the result is hsum8(a_j), summed in hsum8's order
   (halves first, then pairs), so a key's score is the same bits whichever path computed it. */
static inline vf8 hsum8x8(vf8 a0, vf8 a1, vf8 a2, vf8 a3, vf8 a4, vf8 a5, vf8 a6, vf8 a7)
{
    const vf8 p01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
    const vf8 p23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
    const vf8 p45 = __builtin_shufflevector(a4, a5, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a4, a5, 4, 5, 6, 7, 12, 13, 14, 15);
    const vf8 p67 = __builtin_shufflevector(a6, a7, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a6, a7, 4, 5, 6, 7, 12, 13, 14, 15);
    const vf8 q03 = __builtin_shufflevector(p01, p23, 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(p01, p23, 1, 3, 5, 7, 9, 11, 13, 15);
    const vf8 q47 = __builtin_shufflevector(p45, p67, 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(p45, p67, 1, 3, 5, 7, 9, 11, 13, 15);
    return __builtin_shufflevector(q03, q47, 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(q03, q47, 1, 3, 5, 7, 9, 11, 13, 15);
}


/* acc[0 .. 8 DV) += sum over t < n of p[t] v_t (fp32 rows `row` floats apart), the accumulator in registers
   across the keys: DV is a constant at each call site. The same operations, in the same order, per element
   as the generic loop. */
static inline __attribute__((always_inline)) void pv_rows(float *restrict acc, const float *restrict p,
                                                          const float *restrict vb, int64_t row, int n, const int DV)
{
    vf8 a[8];
    for (int c = 0; c < DV; c++)
        a[c] = load8(acc + 8 * c);
    for (int t = 0; t < n; t++) {
        const vf8 pv = splat8(p[t]);
        const float *vt = vb + t * row;
        for (int c = 0; c < DV; c++)
            a[c] += pv * load8(vt + 8 * c);
    }
    for (int c = 0; c < DV; c++)
        store8(acc + 8 * c, a[c]);
}

/* exp(x) for x <= 0 on eight lanes: x = n ln2 + r with |r| <= ln2/2, exp(r) by the classic degree-7
   minimax polynomial (relative error ~1e-7, like libm's expf), 2^n through the exponent bits.
   Inputs below -87 give 0 (they are scores far below the running max). */
static inline vf8 exp8_nonpos(vf8 x)
{
    const vf8 lo = splat8(-87.0f);
    vi8 under = x < lo;
    x = select8(under, lo, x);
    vf8 fx = x * splat8(1.44269504088896341f) + splat8(0.5f);
    vi8 n = __builtin_convertvector(fx, vi8);           /* truncates toward zero */
    vf8 nf = __builtin_convertvector(n, vf8);
    vi8 gt = nf > fx;                                    /* -1 where truncation rounded up: floor */
    n += gt;
    nf = __builtin_convertvector(n, vf8);
    x = x - nf * splat8(0.693359375f) - nf * splat8(-2.12194440e-4f);
    vf8 z = x * x;
    vf8 y = splat8(1.9875691500e-4f);
    y = y * x + splat8(1.3981999507e-3f);
    y = y * x + splat8(8.3334519073e-3f);
    y = y * x + splat8(4.1665795894e-2f);
    y = y * x + splat8(1.6666665459e-1f);
    y = y * x + splat8(5.0000001201e-1f);
    y = y * z + x + splat8(1.0f);
    vi8 bits = (n + 127) << 23;
    vf8 scale;
    memcpy(&scale, &bits, sizeof scale);
    y = y * scale;
    return select8(under, splat8(0.0f), y);
}

static inline float exp_nonpos(float x)
{
    vf8 v = exp8_nonpos(splat8(x));
    return v[0];
}

/* fp8 code -> the value it stands for at scale 1: the midpoint of its truncation interval (see
   kv_fp8.decode_codes). Magnitude bits placed in an fp32 with exponent bias 120 and the half-ulp bit set
   give 2^(e-7) (1 + (m + 1/2)/8) for e >= 1; for e = 0 that formula's v is 2^-7 + (m + 1/2) 2^-10, and
   the subnormal value (m + 1/2) 2^-9 is 2v - 2^-6 (exact, and no fp32 subnormal is ever formed). */
#if defined(__F16C__) && defined(__SSE4_1__)
#include <immintrin.h>
/* With F16C: the code's bits placed in an fp16 (kv_fp8.decode_codes' layout, half-ulp bit set) and widened
   by the hardware conversion, exact for fp16 subnormals too. The result is the value / 256: callers fold
   the 256 into their scales (FP8_DECODE_SCALE). */
#define FP8_DECODE_SCALE 256.0f
static inline void decode8_fp8(const uint8_t *p, float *out)
{
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i mag = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7);
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
    const __m128i h = _mm_or_si128(_mm_or_si128(mag, sign), _mm_set1_epi16(0x40));
    _mm256_storeu_ps(out, _mm256_cvtph_ps(h));
}
#else
#define FP8_DECODE_SCALE 1.0f
static inline void decode8_fp8(const uint8_t *p, float *out)
{
    vb8 b;
    memcpy(&b, p, sizeof b);
    vu8 c = __builtin_convertvector(b, vu8);
    vu8 mag = ((c & 0x7Fu) << 20) + (120u << 23) + (1u << 19);
    vf8 v;
    memcpy(&v, &mag, sizeof v);
    vi8 sub = (vi8)((c & 0x78u) == 0u);
    v = select8(sub, v * splat8(2.0f) - splat8(0.015625f), v);
    vu8 bits;
    memcpy(&bits, &v, sizeof bits);
    bits |= (c & 0x80u) << 24;
    memcpy(out, &bits, sizeof bits);
}
#endif

/* The same for one code, at the scale decode8_fp8 returns (value / FP8_DECODE_SCALE; exact either way). */
static inline float decode1_fp8(uint8_t c)
{
    uint32_t mag = ((uint32_t)(c & 0x7F) << 20) + (120u << 23) + (1u << 19);
    float v;
    memcpy(&v, &mag, sizeof v);
    if ((c & 0x78) == 0)
        v = 2.0f * v - 0.015625f;
    return ((c & 0x80) ? -v : v) / FP8_DECODE_SCALE;
}

static inline void decode_row_fp8(const uint8_t *p, float *out, int D, int D8)
{
    int i = 0;
    for (; i < D8; i += 8)
        decode8_fp8(p + i, out + i);
    for (; i < D; i++)
        out[i] = decode1_fp8(p[i]);
}

/* One (sequence, kv head): G query heads of width D against keys [lo, ctx). FP8 is a compile-time
   constant at each call site: the caches are float (FP8 = 0) or e4m3 bytes with per-(block, kv head)
   scales k_scales / v_scales [num_blocks, kv_heads] (FP8 = 1). */
static inline __attribute__((always_inline)) void
attend_impl(const float *restrict q, float *restrict out, const void *k_cache, const void *v_cache,
            const float *k_scales, const float *v_scales, const int64_t *table, int64_t lo, int64_t ctx,
            int64_t block_size, int64_t kv_heads, int64_t kvh, int G, int D, float scale, const int FP8)
{
    float acc[MAX_GROUP * MAX_HEAD_DIM];
    float m[MAX_GROUP], l[MAX_GROUP];
    float s[MAX_GROUP][MAX_BLOCK];
    float row_buf[MAX_HEAD_DIM]; /* fp8: the decoded key or value row */
    float vtile[PV_TILE * 64]; /* fp8, head_dim <= 64: a tile's decoded value rows */
    const int D8 = D & ~7;
    const int64_t row = kv_heads * D; /* elements between consecutive token slots of a block */
    for (int g = 0; g < G; g++)
        m[g] = -INFINITY, l[g] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)(G * D));

    for (int64_t j0 = lo; j0 < ctx;) {
        const int64_t blk = table[j0 / block_size];
        const int64_t off = j0 % block_size;
        const int n = (int)((ctx - j0 < block_size - off) ? ctx - j0 : block_size - off);
        const int64_t first = (blk * block_size + off) * row + kvh * D;
        const float *kb = FP8 ? NULL : (const float *)k_cache + first;
        const float *vb = FP8 ? NULL : (const float *)v_cache + first;
        const uint8_t *kb8 = FP8 ? (const uint8_t *)k_cache + first : NULL;
        const uint8_t *vb8 = FP8 ? (const uint8_t *)v_cache + first : NULL;
        const float k_scale = FP8 ? scale * (k_scales[blk * kv_heads + kvh] * FP8_DECODE_SCALE) : scale;
        const float v_scale = FP8 ? v_scales[blk * kv_heads + kvh] * FP8_DECODE_SCALE : 1.0f;

        /* scores of this chunk: eight keys at a time (fp32, head_dim a multiple of 8), then one at a time */
        int t8 = 0;
        if (!FP8 && D8 == D) {
            for (; t8 + 8 <= n; t8 += 8) {
                const float *k0 = kb + t8 * row;
                for (int g = 0; g < G; g++) {
                    const float *qg = q + g * D;
                    vf8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
                    for (int i = 0; i < D; i += 8) {
                        const vf8 qv = load8(qg + i);
                        a0 += qv * load8(k0 + i);
                        a1 += qv * load8(k0 + row + i);
                        a2 += qv * load8(k0 + 2 * row + i);
                        a3 += qv * load8(k0 + 3 * row + i);
                        a4 += qv * load8(k0 + 4 * row + i);
                        a5 += qv * load8(k0 + 5 * row + i);
                        a6 += qv * load8(k0 + 6 * row + i);
                        a7 += qv * load8(k0 + 7 * row + i);
                    }
                    store8(&s[g][t8], hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7) * splat8(k_scale));
                }
            }
        }
        for (int t = t8; t < n; t++) {
            const float *kt;
            if (FP8) {
                if (t + 1 < n)
                    __builtin_prefetch(vb8 + t * row, 0, 3);
                decode_row_fp8(kb8 + t * row, row_buf, D, D8);
                kt = row_buf;
            } else {
                kt = kb + t * row;
                if (t + 1 < n)
                    __builtin_prefetch(vb + t * row, 0, 3);
            }
            for (int g = 0; g < G; g++) {
                const float *qg = q + g * D;
                vf8 a = {0};
                int i = 0;
                for (; i < D8; i += 8)
                    a += load8(qg + i) * load8(kt + i);
                float d = hsum8(a);
                for (; i < D; i++)
                    d += qg[i] * kt[i];
                s[g][t] = d * k_scale;
            }
        }
        /* online softmax: new max, rescale what was accumulated, p = exp(s - max) */
        for (int g = 0; g < G; g++) {
            float mx = m[g];
            for (int t = 0; t < n; t++)
                mx = s[g][t] > mx ? s[g][t] : mx;
            const float corr = exp_nonpos(m[g] - mx); /* m = -inf on the first chunk: 0 */
            m[g] = mx;
            float sum = 0.0f;
            int t = 0;
            for (; t + 8 <= n; t += 8) {
                vf8 p = exp8_nonpos(load8(&s[g][t]) - splat8(mx));
                store8(&s[g][t], p);
                sum += hsum8(p);
            }
            for (; t < n; t++) {
                s[g][t] = exp_nonpos(s[g][t] - mx);
                sum += s[g][t];
            }
            l[g] = l[g] * corr + sum;
            if (corr != 1.0f) {
                float *ag = acc + g * D;
                for (int i = 0; i < D; i++)
                    ag[i] *= corr;
            }
        }
        /* acc += p . V (fp8: p v_scale . decoded V). Head widths of up to 64 keep each query head's accumulator in
           registers across a tile of keys (an fp8 tile's V rows decoded once into `vtile` for the G heads). */
        const int fast = D % 8 == 0 && D <= 64;
        for (int t0 = 0; fast && t0 < n; t0 += PV_TILE) {
            const int m = n - t0 < PV_TILE ? n - t0 : PV_TILE;
            const float *vsrc = FP8 ? vtile : vb + t0 * row;
            const int64_t vrow = FP8 ? D : row;
            if (FP8) {
                for (int t = 0; t < m; t++)
                    decode_row_fp8(vb8 + (t0 + t) * row, vtile + t * D, D, D8);
                for (int g = 0; g < G; g++)
                    for (int t = t0; t < t0 + m; t++)
                        s[g][t] *= v_scale; /* p v_scale, the product the loop below forms */
            }
            for (int g = 0; g < G; g++) {
                float *ag = acc + g * D;
                const float *pg = s[g] + t0;
                switch (D / 8) { /* a constant width for each call: the accumulator unrolled into registers */
                case 1: pv_rows(ag, pg, vsrc, vrow, m, 1); break;
                case 2: pv_rows(ag, pg, vsrc, vrow, m, 2); break;
                case 3: pv_rows(ag, pg, vsrc, vrow, m, 3); break;
                case 4: pv_rows(ag, pg, vsrc, vrow, m, 4); break;
                case 5: pv_rows(ag, pg, vsrc, vrow, m, 5); break;
                case 6: pv_rows(ag, pg, vsrc, vrow, m, 6); break;
                case 7: pv_rows(ag, pg, vsrc, vrow, m, 7); break;
                default: pv_rows(ag, pg, vsrc, vrow, m, 8); break;
                }
            }
        }
        for (int t = 0; !fast && t < n; t++) {
            const float *vt;
            if (FP8) {
                decode_row_fp8(vb8 + t * row, row_buf, D, D8);
                vt = row_buf;
            } else {
                vt = vb + t * row;
            }
            for (int g = 0; g < G; g++) {
                float *ag = acc + g * D;
                const float p = FP8 ? s[g][t] * v_scale : s[g][t];
                const vf8 pv = splat8(p);
                int i = 0;
                for (; i < D8; i += 8)
                    store8(ag + i, load8(ag + i) + pv * load8(vt + i));
                for (; i < D; i++)
                    ag[i] += p * vt[i];
            }
        }
        j0 += n;
    }
    for (int g = 0; g < G; g++) {
        const float inv = 1.0f / l[g];
        for (int i = 0; i < D; i++)
            out[g * D + i] = acc[g * D + i] * inv;
    }
}


/* The fp32 cache's path for the common shapes: G query heads of width D = 8 DV, G * DV <= 24, both constants at
   each call site (attend_regs_any). Every query head's accumulator stays in registers for the whole sequence,
   the heads' value updates interleaved so each value row is loaded once for all G heads, and the running max,
   its correction and the sums are vector operations over the tile (up to 16 keys) and over the heads; key
   tiles that end inside a block pad their scores with -inf. Products and sums contract to FMAs here. Not
   bit-identical to attend_impl (another summation order), and checked like it against a float64 reference. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
static inline float hmax8(vf8 v)
{
    vf8 a = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v = select8(v > a, v, a);
    a = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v = select8(v > a, v, a);
    a = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    v = select8(v > a, v, a);
    return v[0];
}

/* Ask for one kv head's key and value rows of block `blk` (rows `row` floats apart), into L2: 64 L1 prefetches
   at once were more than the core has miss buffers for (see the top of this file). */
static inline __attribute__((always_inline)) void
prefetch_block(const float *k_cache, const float *v_cache, int64_t blk, int64_t block_size, int64_t row, int64_t kvh,
               const int D)
{
    const float *kn = k_cache + blk * block_size * row + kvh * D, *vn = v_cache + blk * block_size * row + kvh * D;
    for (int64_t t = 0; t < block_size; t++)
        for (int c = 0; c < D; c += 16) {
            __builtin_prefetch(kn + t * row + c, 0, 1);
            __builtin_prefetch(vn + t * row + c, 0, 1);
        }
}

#define REG_TILE 16
static inline __attribute__((always_inline)) void
attend_regs(const float *restrict q, float *restrict out, const float *restrict k_cache,
            const float *restrict v_cache, const int64_t *table, int64_t lo, int64_t ctx, int64_t block_size,
            int64_t kv_heads, int64_t kvh, float scale, const int G, const int DV)
{
    const int D = 8 * DV;
    const int64_t row = kv_heads * D;
    vf8 acc[8][8];
    float mrun[8] __attribute__((aligned(32))), mnew[8] __attribute__((aligned(32)));
    float lrun[8];
    float s[8][REG_TILE] __attribute__((aligned(32)));
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) {
        mrun[g] = g < G ? -INFINITY : 0.0f;
        mnew[g] = 0.0f;
        lrun[g] = 0.0f;
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; g++)
#pragma GCC unroll 8
        for (int c = 0; c < DV; c++)
            acc[g][c] = splat8(0.0f);

    for (int64_t j0 = lo; j0 < ctx;) {
        const int64_t blk = table[j0 / block_size];
        const int64_t off = j0 % block_size;
        int64_t left = block_size - off < ctx - j0 ? block_size - off : ctx - j0;
        const int n = left < REG_TILE ? (int)left : REG_TILE;
        const int64_t first = (blk * block_size + off) * row + kvh * D;
        const float *kb = k_cache + first, *vb = v_cache + first;
        const int nv = (n + 7) / 8; /* score vectors of the tile */
        if (j0 == lo || off == 0) { /* a block begins: ask for the next one's rows of this kv head */
            const int64_t nxt = j0 / block_size + 1;
            if (nxt * block_size < ctx)
                prefetch_block(k_cache, v_cache, table[nxt], block_size, row, kvh, D);
        }

        int t8 = 0;
        for (; t8 + 8 <= n; t8 += 8) {
            const float *k0 = kb + t8 * row;
#pragma GCC unroll 8
            for (int g = 0; g < G; g++) {
                const float *qg = q + g * D;
                vf8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
#pragma GCC unroll 8
                for (int c = 0; c < DV; c++) {
                    const vf8 qv = load8(qg + 8 * c);
                    a0 += qv * load8(k0 + 8 * c);
                    a1 += qv * load8(k0 + row + 8 * c);
                    a2 += qv * load8(k0 + 2 * row + 8 * c);
                    a3 += qv * load8(k0 + 3 * row + 8 * c);
                    a4 += qv * load8(k0 + 4 * row + 8 * c);
                    a5 += qv * load8(k0 + 5 * row + 8 * c);
                    a6 += qv * load8(k0 + 6 * row + 8 * c);
                    a7 += qv * load8(k0 + 7 * row + 8 * c);
                }
                store8(&s[g][t8], hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7) * splat8(scale));
            }
        }
        for (int t = t8; t < n; t++) {
            const float *kt = kb + t * row;
#pragma GCC unroll 8
            for (int g = 0; g < G; g++) {
                vf8 a = {0};
#pragma GCC unroll 8
                for (int c = 0; c < DV; c++)
                    a += load8(q + g * D + 8 * c) * load8(kt + 8 * c);
                s[g][t] = hsum8(a) * scale;
            }
        }
        for (int t = n; t < 8 * nv; t++)
#pragma GCC unroll 8
            for (int g = 0; g < G; g++)
                s[g][t] = -INFINITY;

        /* the new running maxima, their corrections for every head at once, p = exp(s - max) */
#pragma GCC unroll 8
        for (int g = 0; g < G; g++) {
            vf8 v = load8(s[g]);
            if (nv > 1) {
                const vf8 w = load8(s[g] + 8);
                v = select8(v > w, v, w);
            }
            const float mx = hmax8(v);
            mnew[g] = mx > mrun[g] ? mx : mrun[g];
        }
        const vf8 corr = exp8_nonpos(load8(mrun) - load8(mnew));
#pragma GCC unroll 8
        for (int g = 0; g < G; g++) {
            const vf8 mg = splat8(mnew[g]);
            vf8 p = exp8_nonpos(load8(s[g]) - mg);
            store8(s[g], p);
            if (nv > 1) {
                const vf8 p1 = exp8_nonpos(load8(s[g] + 8) - mg);
                store8(s[g] + 8, p1);
                p += p1;
            }
            lrun[g] = lrun[g] * corr[g] + hsum8(p);
            const vf8 cg = splat8(corr[g]);
#pragma GCC unroll 8
            for (int c = 0; c < DV; c++)
                acc[g][c] *= cg;
            mrun[g] = mnew[g];
        }
        /* acc += p . V: one load of each value row for the G heads */
        for (int t = 0; t < n; t++) {
            const float *vt = vb + t * row;
            vf8 vr[8];
#pragma GCC unroll 8
            for (int c = 0; c < DV; c++)
                vr[c] = load8(vt + 8 * c);
#pragma GCC unroll 8
            for (int g = 0; g < G; g++) {
                const vf8 pg = splat8(s[g][t]);
#pragma GCC unroll 8
                for (int c = 0; c < DV; c++)
                    acc[g][c] += pg * vr[c];
            }
        }
        j0 += n;
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; g++) {
        const vf8 inv = splat8(1.0f / lrun[g]);
#pragma GCC unroll 8
        for (int c = 0; c < DV; c++)
            store8(out + g * D + 8 * c, acc[g][c] * inv);
    }
}

#define REGS_CASE(G_, DV_) \
    case (G_) * 16 + (DV_): \
        attend_regs(q, out, k_cache, v_cache, table, lo, ctx, block_size, kv_heads, kvh, scale, G_, DV_); \
        return 1;

/* 1 where (G, D) has a register path (and it ran), else 0 */
static int attend_regs_any(const float *restrict q, float *restrict out, const float *k_cache, const float *v_cache,
                           const int64_t *table, int64_t lo, int64_t ctx, int64_t block_size, int64_t kv_heads,
                           int64_t kvh, int G, int D, float scale)
{
    if (D % 8)
        return 0;
    switch (G * 16 + D / 8) {
    REGS_CASE(1, 1) REGS_CASE(1, 2) REGS_CASE(1, 3) REGS_CASE(1, 4) REGS_CASE(1, 5) REGS_CASE(1, 6) REGS_CASE(1, 7)
    REGS_CASE(1, 8)
    REGS_CASE(2, 1) REGS_CASE(2, 2) REGS_CASE(2, 3) REGS_CASE(2, 4) REGS_CASE(2, 5) REGS_CASE(2, 6) REGS_CASE(2, 7)
    REGS_CASE(2, 8)
    REGS_CASE(4, 1) REGS_CASE(4, 2) REGS_CASE(4, 3) REGS_CASE(4, 4) REGS_CASE(4, 5) REGS_CASE(4, 6)
    REGS_CASE(8, 1) REGS_CASE(8, 2) REGS_CASE(8, 3)
    default:
        return 0;
    }
}
#pragma GCC pop_options

static void attend(const float *restrict q, float *restrict out, const float *k_cache, const float *v_cache,
                   const int64_t *table, int64_t lo, int64_t ctx, int64_t block_size, int64_t kv_heads,
                   int64_t kvh, int G, int D, float scale)
{
    attend_impl(q, out, k_cache, v_cache, NULL, NULL, table, lo, ctx, block_size, kv_heads, kvh, G, D, scale, 0);
}

static void attend_fp8(const float *restrict q, float *restrict out, const uint8_t *k_cache, const uint8_t *v_cache,
                       const float *k_scales, const float *v_scales, const int64_t *table, int64_t lo, int64_t ctx,
                       int64_t block_size, int64_t kv_heads, int64_t kvh, int G, int D, float scale)
{
    attend_impl(q, out, k_cache, v_cache, k_scales, v_scales, table, lo, ctx, block_size, kv_heads, kvh, G, D,
                scale, 1);
}

/* The operands' shapes and every index the kernels follow; OK or an error code. */
static int check_decode(int64_t ldq, int64_t ldo, int64_t n_rows, int64_t num_blocks, int64_t block_size,
                        int64_t kv_heads, int64_t head_dim, int64_t num_heads, const int64_t *rows,
                        const int64_t *ctx_lens, const int64_t *tables, int64_t width, int64_t n_seqs, int64_t window)
{
    if (kv_heads <= 0 || num_heads <= 0 || num_heads % kv_heads || head_dim <= 0 || block_size <= 0 ||
        ldq < num_heads * head_dim || ldo < num_heads * head_dim || width < 0 || n_seqs < 0)
        return BAD_SHAPE;
    if (num_heads / kv_heads > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK)
        return TOO_LARGE;
    for (int64_t b = 0; b < n_seqs; b++) {
        if (rows[b] < 0 || rows[b] >= n_rows)
            return BAD_ROW;
        const int64_t ctx = ctx_lens[b];
        if (ctx < 1 || ctx > width * block_size)
            return BAD_CONTEXT;
        const int64_t lo = window > 0 && ctx > window ? ctx - window : 0;
        for (int64_t j = lo / block_size; j < (ctx + block_size - 1) / block_size; j++)
            if (tables[b * width + j] < 0 || tables[b * width + j] >= num_blocks)
                return BAD_BLOCK;
    }
    return OK;
}

/* q [n_rows, num_heads, head_dim] with row stride ldq (floats); out likewise with ldo.
   Caches [num_blocks, block_size, kv_heads, head_dim] contiguous.
   rows [n_seqs], ctx_lens [n_seqs], tables [n_seqs, width] (block ids; only the first
   ceil(ctx / block_size) of a row are read). window <= 0: no sliding window.
   Returns 0, or an error code (nothing is written then). */
int mplex_paged_decode_attention(const float *q, int64_t ldq, float *out, int64_t ldo, int64_t n_rows,
                                 const float *k_cache, const float *v_cache, int64_t num_blocks,
                                 int64_t block_size, int64_t kv_heads, int64_t head_dim, int64_t num_heads,
                                 const int64_t *rows, const int64_t *ctx_lens, const int64_t *tables,
                                 int64_t width, int64_t n_seqs, int64_t window, float scale, int64_t nthreads)
{
    int rc = check_decode(ldq, ldo, n_rows, num_blocks, block_size, kv_heads, head_dim, num_heads, rows, ctx_lens,
                          tables, width, n_seqs, window);
    if (rc)
        return rc;
    const int G = (int)(num_heads / kv_heads), D = (int)head_dim;
    const int64_t n_items = n_seqs * kv_heads;

#pragma omp parallel for schedule(dynamic, 4) num_threads(nthreads) if (nthreads > 1 && n_items > 1)
    for (int64_t it = 0; it < n_items; it++) {
        const int64_t b = it / kv_heads, kvh = it % kv_heads;
        const int64_t ctx = ctx_lens[b];
        const int64_t lo = window > 0 && ctx > window ? ctx - window : 0;
        const float *qb = q + rows[b] * ldq + kvh * G * D;
        float *ob = out + rows[b] * ldo + kvh * G * D;
        if (it + 1 < n_items) { /* the next item's first block, while this one runs */
            const int64_t b1 = (it + 1) / kv_heads;
            const int64_t lo1 = window > 0 && ctx_lens[b1] > window ? ctx_lens[b1] - window : 0;
            prefetch_block(k_cache, v_cache, tables[b1 * width + lo1 / block_size], block_size, kv_heads * D,
                           (it + 1) % kv_heads, D);
        }
        if (!attend_regs_any(qb, ob, k_cache, v_cache, tables + b * width, lo, ctx, block_size, kv_heads, kvh, G,
                             D, scale))
            attend(qb, ob, k_cache, v_cache, tables + b * width, lo, ctx, block_size, kv_heads, kvh, G, D, scale);
    }
    return OK;
}

/* The same over an fp8 cache: e4m3 bytes [num_blocks, block_size, kv_heads, head_dim] with scales
   [num_blocks, kv_heads] fp32 (contiguous). */
int mplex_paged_decode_attention_fp8(const float *q, int64_t ldq, float *out, int64_t ldo, int64_t n_rows,
                                     const uint8_t *k_cache, const uint8_t *v_cache, const float *k_scales,
                                     const float *v_scales, int64_t num_blocks, int64_t block_size,
                                     int64_t kv_heads, int64_t head_dim, int64_t num_heads, const int64_t *rows,
                                     const int64_t *ctx_lens, const int64_t *tables, int64_t width, int64_t n_seqs,
                                     int64_t window, float scale, int64_t nthreads)
{
    int rc = check_decode(ldq, ldo, n_rows, num_blocks, block_size, kv_heads, head_dim, num_heads, rows, ctx_lens,
                          tables, width, n_seqs, window);
    if (rc)
        return rc;
    const int G = (int)(num_heads / kv_heads), D = (int)head_dim;
    const int64_t n_items = n_seqs * kv_heads;

#pragma omp parallel for schedule(dynamic, 4) num_threads(nthreads) if (nthreads > 1 && n_items > 1)
    for (int64_t it = 0; it < n_items; it++) {
        const int64_t b = it / kv_heads, kvh = it % kv_heads;
        const int64_t ctx = ctx_lens[b];
        const int64_t lo = window > 0 && ctx > window ? ctx - window : 0;
        attend_fp8(q + rows[b] * ldq + kvh * G * D, out + rows[b] * ldo + kvh * G * D, k_cache, v_cache, k_scales,
                   v_scales, tables + b * width, lo, ctx, block_size, kv_heads, kvh, G, D, scale);
    }
    return OK;
}

/* -- the fp8 writer (kv_fp8.write_fp8_kv is the definition; the bytes are the same) ---------------- */

/* The power-of-two scale of a run with this amax: the smallest 2^k with amax < 448 2^k (kv_fp8.scale_exponent). */
static inline float pow2_scale(float amax)
{
    int k;
    if (!(amax <= FLT_MAX)) {
        k = 127; /* NaN or Inf */
    } else if (amax <= 0.0f) {
        k = -126;
    } else {
        int e;
        const float m = frexpf(amax, &e);
        k = e - 9 + (m >= 0.875f);
        k = k < -126 ? -126 : (k > 127 ? 127 : k);
    }
    return ldexpf(1.0f, k);
}

/* The e4m3 code of y (|y| < 448) truncated toward zero (kv_fp8.quantize_trunc). */
static inline uint8_t trunc_code(float y)
{
    uint32_t bits;
    memcpy(&bits, &y, sizeof bits);
    const uint32_t sign = (bits >> 24) & 0x80u, mag = bits & 0x7FFFFFFFu;
    const int e32 = (int)(mag >> 23);
    int code;
    if (e32 >= 121) {
        code = ((e32 - 120) << 3) | (int)((mag >> 20) & 7u);
        code = code > 0x7E ? 0x7E : code;
    } else {
        const float a = fabsf(y) * 512.0f;
        code = a >= 7.0f ? 7 : (int)a;
    }
    return (uint8_t)(sign | (uint32_t)code);
}

/* The lower end of a code's interval: its standard e4m3 value. */
static inline float code_value(uint8_t c)
{
    const int e = (c >> 3) & 15, m = c & 7;
    const float v = e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9);
    return (c & 0x80) ? -v : v;
}

/* One run (tokens t0..t1-1 of the batch, all in block blk from offset off0 on) of one kv head of one cache. */
static void write_run(uint8_t *cache, float *scales, const float *x, int64_t ldx, int64_t t0, int64_t t1,
                      int64_t blk, int64_t off0, int64_t block_size, int64_t kv_heads, int64_t h, int D)
{
    float amax = 0.0f;
    for (int64_t t = t0; t < t1; t++) {
        const float *xt = x + t * ldx + h * D;
        for (int i = 0; i < D; i++) {
            const float a = fabsf(xt[i]);
            amax = (a > amax || a != a) ? a : amax; /* a NaN sticks, as torch's amax */
        }
    }
    const float old = off0 == 0 ? 0.0f : scales[blk * kv_heads + h];
    const float fresh_scale = pow2_scale(amax);
    const float s = fresh_scale > old ? fresh_scale : old;
    const int64_t row = kv_heads * D;
    uint8_t *base = cache + blk * block_size * row + h * D;
    if (off0 > 0 && s > old) { /* the block's earlier tokens, truncated again onto the coarser grid */
        const float ratio = old / s;
        for (int64_t o = 0; o < off0; o++)
            for (int i = 0; i < D; i++)
                base[o * row + i] = trunc_code(code_value(base[o * row + i]) * ratio);
    }
    scales[blk * kv_heads + h] = s;
    for (int64_t t = t0; t < t1; t++) {
        const float *xt = x + t * ldx + h * D;
        uint8_t *dst = base + (off0 + (t - t0)) * row;
        for (int i = 0; i < D; i++)
            dst[i] = trunc_code(xt[i] / s);
    }
}

/* New rows k, v [n_tokens, kv_heads, head_dim] (row strides ldk, ldv floats; heads packed) into their
   slots of fp8 caches [num_blocks, block_size, kv_heads, head_dim] with scales [num_blocks, kv_heads].
   Tokens of one block must be consecutive rows with consecutive slots (one sequence's positions in order),
   and a block may take one such run per call. Returns 0, or an error code (nothing is written then). */
int mplex_fp8_kv_write(uint8_t *k_cache, float *k_scales, uint8_t *v_cache, float *v_scales, int64_t num_blocks,
                       int64_t block_size, int64_t kv_heads, int64_t head_dim, const float *k, int64_t ldk,
                       const float *v, int64_t ldv, const int64_t *slots, int64_t n_tokens, int64_t nthreads)
{
    if (kv_heads <= 0 || head_dim <= 0 || block_size <= 0 || num_blocks <= 0 || n_tokens < 0 ||
        ldk < kv_heads * head_dim || ldv < kv_heads * head_dim)
        return BAD_SHAPE;
    if (n_tokens == 0)
        return OK;
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(n_tokens + 1));
    uint8_t *seen = calloc((size_t)num_blocks, 1);
    if (!starts || !seen) {
        free(starts);
        free(seen);
        return NO_MEMORY;
    }
    int rc = OK;
    int64_t n_runs = 0;
    for (int64_t t = 0; t < n_tokens && rc == OK; t++) {
        const int64_t slot = slots[t];
        if (slot < 0 || slot >= num_blocks * block_size) {
            rc = BAD_SLOT;
        } else if (t > 0 && slot / block_size == slots[t - 1] / block_size) {
            if (slot != slots[t - 1] + 1)
                rc = BLOCK_TWICE; /* within a run slots follow each other */
        } else if (seen[slot / block_size]++) {
            rc = BLOCK_TWICE;
        } else {
            starts[n_runs++] = t;
        }
    }
    starts[n_runs] = n_tokens;
    if (rc == OK) {
        const int D = (int)head_dim;
        const int64_t n_items = 2 * n_runs * kv_heads;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && n_items > 8)
        for (int64_t it = 0; it < n_items; it++) {
            const int which = (int)(it % 2);
            const int64_t h = (it / 2) % kv_heads, r = it / 2 / kv_heads;
            const int64_t t0 = starts[r], t1 = starts[r + 1];
            const int64_t blk = slots[t0] / block_size, off0 = slots[t0] % block_size;
            if (which == 0)
                write_run(k_cache, k_scales, k, ldk, t0, t1, blk, off0, block_size, kv_heads, h, D);
            else
                write_run(v_cache, v_scales, v, ldv, t0, t1, blk, off0, block_size, kv_heads, h, D);
        }
    }
    free(starts);
    free(seen);
    return rc;
}

/* ---- The decoder layer's elementwise work around the projections, one pass each (fp32, row-major rows) ----

   The torch path runs these as separate ops, each a pass over the activations with its own allocation:
   RMSNorm is six, RoPE on q and k four, the K/V write three per tensor plus the copy. Bits: the residual add
   and RoPE (products and sums in torch's order, no contraction in this part of the file) are torch's exactly;
   RMSNorm's sum of squares is not (another summation order, as any GEMM's). SiLU-and-multiply stays torch's:
   a pass of it here (a polynomial exp and a division on eight lanes) ran 1.4x slower than torch's two ops. */

/* h [T, H] (rows ldh apart) += d (rows ldd apart) when d is not NULL; then x (rows ldx apart) =
   w * (h / sqrt(mean(h^2) + eps)), HF's LlamaRMSNorm: h * rsqrt(var + eps), then times the weight. */
static void add_rms_norm_row(float *restrict h, const float *restrict d, float *restrict x, const float *restrict w,
                             int64_t H, float eps)
{
    const int64_t H8 = H & ~7;
    vf8 acc0 = {0}, acc1 = {0};
    int64_t i = 0;
    for (; i < H8; i += 8) {
        vf8 v = load8(h + i);
        if (d) {
            v = v + load8(d + i);
            store8(h + i, v);
        }
        if ((i / 8) % 2)
            acc1 += v * v;
        else
            acc0 += v * v;
    }
    float ss = hsum8(acc0 + acc1);
    for (; i < H; i++) {
        float v = h[i];
        if (d) {
            v = v + d[i];
            h[i] = v;
        }
        ss += v * v;
    }
    const float r = 1.0f / sqrtf(ss / (float)H + eps);
    const vf8 rv = splat8(r);
    for (i = 0; i < H8; i += 8)
        store8(x + i, load8(w + i) * (load8(h + i) * rv));
    for (; i < H; i++)
        x[i] = w[i] * (h[i] * r);
}

int mplex_add_rms_norm(float *h, int64_t ldh, const float *d, int64_t ldd, float *x, int64_t ldx, const float *w,
                       int64_t n_rows, int64_t H, float eps, int64_t nthreads)
{
    if (n_rows < 0 || H <= 0 || ldh < H || ldx < H || (d && ldd < H))
        return BAD_SHAPE;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && n_rows * H >= 16384)
    for (int64_t t = 0; t < n_rows; t++)
        add_rms_norm_row(h + t * ldh, d ? d + t * ldd : NULL, x + t * ldx, w, H, eps);
    return OK;
}

/* RoPE on the q and k heads of qkv [T, (num_heads + 2 kv_heads) D] (rows ld apart) in place -- x cos +
   swap_halves(x) sin_signed at each token's position, tables [max_positions, D] -- then each token's k and v
   heads, made cacheable (|x| <= limit else 0: attention.cacheable, limit = its KV_LIMIT), into its slot of the
   fp32 caches [num_slots, kv_heads, D]. Returns 0, or an error code (nothing is written then). */
int mplex_rope_write_kv(float *qkv, int64_t ld, int64_t n_tokens, int64_t num_heads, int64_t kv_heads, int64_t D,
                        const int64_t *positions, const float *cos_t, const float *sin_t, int64_t max_positions,
                        float *k_cache, float *v_cache, int64_t num_slots, const int64_t *slots, float limit,
                        int64_t nthreads)
{
    if (n_tokens < 0 || num_heads <= 0 || kv_heads <= 0 || D <= 0 || D % 2 || D > MAX_HEAD_DIM ||
        ld < (num_heads + 2 * kv_heads) * D)
        return BAD_SHAPE;
    for (int64_t t = 0; t < n_tokens; t++) {
        if (positions[t] < 0 || positions[t] >= max_positions)
            return BAD_CONTEXT;
        if (slots[t] < 0 || slots[t] >= num_slots)
            return BAD_SLOT;
    }
    const int64_t half = D / 2, rotated = num_heads + kv_heads;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && n_tokens >= 64)
    for (int64_t t = 0; t < n_tokens; t++) {
        float *row = qkv + t * ld;
        const float *c = cos_t + positions[t] * D, *s = sin_t + positions[t] * D;
        float x[MAX_HEAD_DIM];
        for (int64_t hd = 0; hd < rotated; hd++) {
            float *y = row + hd * D;
            memcpy(x, y, sizeof(float) * (size_t)D);
            for (int64_t i = 0; i < half; i++)
                y[i] = x[i] * c[i] + x[i + half] * s[i];
            for (int64_t i = half; i < D; i++)
                y[i] = x[i] * c[i] + x[i - half] * s[i];
        }
        float *kd = k_cache + slots[t] * kv_heads * D, *vd = v_cache + slots[t] * kv_heads * D;
        const float *ks = row + num_heads * D, *vs = row + rotated * D;
        for (int64_t i = 0; i < kv_heads * D; i++) {
            kd[i] = fabsf(ks[i]) <= limit ? ks[i] : 0.0f;
            vd[i] = fabsf(vs[i]) <= limit ? vs[i] : 0.0f;
        }
    }
    return OK;
}
