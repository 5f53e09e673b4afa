/* Paged decode attention on the CPU, fp32: one query token per sequence, keys and values read in place
   from the paged KV cache through each sequence's block table.

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
   shared out over the OpenMP threads. The query heads of one kv head (GQA) share each key and value load. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16     /* query heads per kv head */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256    /* block_size: one chunk of scores per query head lives on the stack */

enum { OK = 0, BAD_SHAPE = 1, BAD_ROW = 2, BAD_CONTEXT = 3, BAD_BLOCK = 4, TOO_LARGE = 5 };

int mplex_attn_abi_version(void) { return 1; }

typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));

static inline vf8 load8(const float *p) { vf8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, vf8 v) { memcpy(p, &v, sizeof v); }
static inline vf8 splat8(float x) { return (vf8){x, x, x, x, x, x, x, x}; }
/* mask lanes (-1 or 0, from a vector comparison) ? a : b */
static inline vf8 select8(vi8 mask, vf8 a, vf8 b) { return (vf8)((mask & (vi8)a) | (~mask & (vi8)b)); }
static inline float hsum8(vf8 v)
{
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
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

/* One (sequence, kv head): G query heads of width D against keys [lo, ctx). */
static void attend(const float *restrict q, float *restrict out, const float *k_cache, const float *v_cache,
                   const int64_t *table, int64_t lo, int64_t ctx, int64_t block_size, int64_t kv_heads,
                   int64_t kvh, int G, int D, float scale)
{
    float acc[MAX_GROUP * MAX_HEAD_DIM];
    float m[MAX_GROUP], l[MAX_GROUP];
    float s[MAX_GROUP][MAX_BLOCK];
    const int D8 = D & ~7;
    const int64_t row = kv_heads * D; /* floats between consecutive token slots of a block */
    for (int g = 0; g < G; g++)
        m[g] = -INFINITY, l[g] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)(G * D));

    for (int64_t j0 = lo; j0 < ctx;) {
        const int64_t blk = table[j0 / block_size];
        const int64_t off = j0 % block_size;
        const int n = (int)((ctx - j0 < block_size - off) ? ctx - j0 : block_size - off);
        const float *kb = k_cache + (blk * block_size + off) * row + kvh * D;
        const float *vb = v_cache + (blk * block_size + off) * row + kvh * D;

        /* scores of this chunk */
        for (int t = 0; t < n; t++) {
            const float *kt = kb + t * row;
            if (t + 1 < n)
                __builtin_prefetch(vb + t * row, 0, 3);
            for (int g = 0; g < G; g++) {
                const float *qg = q + g * D;
                vf8 a = {0};
                int i = 0;
                for (; i < D8; i += 8)
                    a += load8(qg + i) * load8(kt + i);
                float d = hsum8(a);
                for (; i < D; i++)
                    d += qg[i] * kt[i];
                s[g][t] = d * scale;
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
        /* acc += p . V */
        for (int t = 0; t < n; t++) {
            const float *vt = vb + t * row;
            for (int g = 0; g < G; g++) {
                float *ag = acc + g * D;
                const float p = s[g][t];
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
    const int G = (int)(num_heads / kv_heads), D = (int)head_dim;
    const int64_t n_items = n_seqs * kv_heads;

#pragma omp parallel for schedule(dynamic, 4) num_threads(nthreads) if (nthreads > 1 && n_items > 1)
    for (int64_t it = 0; it < n_items; it++) {
        const int64_t b = it / kv_heads, kvh = it % kv_heads;
        const int64_t ctx = ctx_lens[b];
        const int64_t lo = window > 0 && ctx > window ? ctx - window : 0;
        attend(q + rows[b] * ldq + kvh * G * D, out + rows[b] * ldo + kvh * G * D, k_cache, v_cache,
               tables + b * width, lo, ctx, block_size, kv_heads, kvh, G, D, scale);
    }
    return OK;
}
