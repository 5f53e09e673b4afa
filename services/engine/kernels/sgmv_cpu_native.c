/* SGMV on the CPU: every short adapter segment of one projection group in one call, fp32.

   Built by sgmv_native.py with the machine's C compiler (-O3 -march=native -fopenmp) and called through
   ctypes; the Python host wrapper checks every operand first, and this file checks what it indexes again.

   For each segment s (rows pos[start_s..end_s) of the step, all using adapter slot slot_s) and each
   module p of the group:  y[t, off_p : off_p + size_p] += (x[t] . A_p^T) . Bt_p  for every row t, where
   A_p [r, d_in] and Bt_p [r, size_p] (the LoRA scale folded in) are the slot's own exact-rank weights,
   found in `table` by (slot, layer, module). A rank of 0 means the slot's adapter skips that module.

   Why this exists: on the CPU a LoRA step is bound by reading adapter weights (a 250-row decode step
   over ~90 adapters reads more adapter bytes than base-model bytes). Batched torch ops have to pad
   adapters to shared shapes and gather/scatter rows around them; here each adapter's bytes are read
   exactly once per segment at its own rank, and segments are shared out over the OpenMP threads
   (disjoint rows, so no two threads write the same output). */
#include <stddef.h>
#include <stdint.h>

#define MPLEX_MAX_RANK 512

enum { OK = 0, BAD_SLOT = 1, BAD_RANK = 2, BAD_POINTER = 3, BAD_ROW = 4, BAD_PART = 5, BAD_SEGMENT = 6, BAD_SHAPE = 7 };

int mplex_sgmv_abi_version(void) { return 1; }

/* y[0:size] += (x . A^T) . Bt for one row. */
static void row_delta(const float *restrict x, float *restrict y, const float *restrict a,
                      const float *restrict bt, int r, int d_in, int size)
{
    float v[MPLEX_MAX_RANK];
    for (int k = 0; k < r; k++) {
        const float *restrict ak = a + (ptrdiff_t)k * d_in;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int i = 0; i < d_in; i++)
            acc += x[i] * ak[i];
        v[k] = acc;
    }
    /* Output in blocks that stay in registers while every rank row is added into them. */
    enum { BLOCK = 64 };
    for (int j0 = 0; j0 < size; j0 += BLOCK) {
        const int n = size - j0 < BLOCK ? size - j0 : BLOCK;
        float acc[BLOCK];
#pragma omp simd
        for (int j = 0; j < n; j++)
            acc[j] = y[j0 + j];
        for (int k = 0; k < r; k++) {
            const float *restrict bk = bt + (ptrdiff_t)k * size + j0;
            const float vk = v[k];
#pragma omp simd
            for (int j = 0; j < n; j++)
                acc[j] += vk * bk[j];
        }
#pragma omp simd
        for (int j = 0; j < n; j++)
            y[j0 + j] = acc[j];
    }
}

/* x [num_rows, d_in] (row stride ldx), y [num_rows, y_cols] (row stride ldy).
   pos [*]: step position -> row of x/y (NULL: the identity). segs [n_seg, 3]: start, end, slot.
   table [n_slots, n_layers, n_modules, 3]: A pointer, Bt pointer, rank.
   parts [n_parts, 3]: module index, output column offset, output size.
   Returns 0, or an error code (nothing is written then). */
int mplex_sgmv_group(const float *x, int64_t ldx, int64_t d_in, float *y, int64_t ldy, int64_t y_cols,
                     int64_t num_rows, const int64_t *pos, const int64_t *segs, int64_t n_seg,
                     const int64_t *table, int64_t n_slots, int64_t n_layers, int64_t n_modules, int64_t layer,
                     const int64_t *parts, int64_t n_parts, int64_t nthreads)
{
    if (layer < 0 || layer >= n_layers || d_in <= 0 || ldx < d_in || y_cols <= 0 || ldy < y_cols)
        return BAD_SHAPE;
    for (int64_t p = 0; p < n_parts; p++) {
        const int64_t *q = parts + 3 * p;
        if (q[0] < 0 || q[0] >= n_modules || q[1] < 0 || q[2] <= 0 || q[1] + q[2] > y_cols)
            return BAD_PART;
    }
    for (int64_t s = 0; s < n_seg; s++) {
        const int64_t start = segs[3 * s], end = segs[3 * s + 1], slot = segs[3 * s + 2];
        if (start < 0 || end < start || end > num_rows)
            return BAD_SEGMENT;
        if (slot < 0 || slot >= n_slots)
            return BAD_SLOT;
        for (int64_t p = 0; p < n_parts; p++) {
            const int64_t *e = table + ((slot * n_layers + layer) * n_modules + parts[3 * p]) * 3;
            if (e[2] < 0 || e[2] > MPLEX_MAX_RANK)
                return BAD_RANK;
            if (e[2] > 0 && (e[0] == 0 || e[1] == 0))
                return BAD_POINTER;
        }
        if (pos)
            for (int64_t i = start; i < end; i++)
                if (pos[i] < 0 || pos[i] >= num_rows)
                    return BAD_ROW;
    }

#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1 && n_seg > 1)
    for (int64_t s = 0; s < n_seg; s++) {
        const int64_t start = segs[3 * s], end = segs[3 * s + 1], slot = segs[3 * s + 2];
        for (int64_t p = 0; p < n_parts; p++) {
            const int64_t *q = parts + 3 * p;
            const int64_t *e = table + ((slot * n_layers + layer) * n_modules + q[0]) * 3;
            const int r = (int)e[2];
            if (r == 0)
                continue;
            const float *a = (const float *)(intptr_t)e[0];
            const float *bt = (const float *)(intptr_t)e[1];
            for (int64_t i = start; i < end; i++) {
                const int64_t t = pos ? pos[i] : i;
                row_delta(x + t * ldx, y + t * ldy + q[1], a, bt, r, (int)d_in, (int)q[2]);
            }
        }
    }
    return OK;
}
