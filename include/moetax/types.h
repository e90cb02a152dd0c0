/*
 * moetax/types.h - tensor element types (ggml numbering), block layouts and
 * scalar conversions.
 *
 * DESIGN
 *   Type ids are ggml's, so a GGUF tensor's type field maps 1:1. moetax knows the
 *   block size and byte size of every ggml type (so `inspect` can read any file)
 *   but computes with F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K,
 *   Q4_K, Q5_K and Q6_K only.
 *
 *   Q8_0: blocks of 32 values: f16 scale d, then 32 int8 q; value = q * d.
 *   Q4_0: blocks of 32 values: f16 scale d, then 16 bytes; byte j holds value j
 *         in its low nibble and value j+16 in its high nibble; value = (q-8) * d.
 *   Q5_0 (22 bytes): f16 d, qh[4] (a little-endian uint32), then Q4_0's 16 nibble
 *         bytes; value j's fifth bit is bit j of qh: value = (q - 16) * d, q in 0..31.
 *         llama-quantize writes it where a Q4_K matrix's rows are not whole super-blocks
 *         (DeepSeek-V2-Lite's expert down projections, 1408 wide, in Q4_K_M files).
 *   Q4_1 (20 bytes): f16 d, f16 m, Q4_0's nibbles: value = q * d + m, q in 0..15.
 *   Q5_1 (24 bytes): f16 d, f16 m, qh[4], nibbles as Q5_0's: value = q * d + m, q in 0..31.
 *         llama-quantize writes it where a Q5_K matrix's rows are not whole super-blocks.
 *   IQ4_NL (18 bytes): Q4_0's layout, the nibble an index into a fixed table of 16
 *         int8 levels (moetax_iq4nl_values): value = d * table[q]. llama-quantize
 *         writes it where an IQ4_XS (before 2026 also a Q2_K/Q3_K) matrix's rows are
 *         not whole super-blocks.
 *
 *   k-quants (ggml's, super-blocks of QK_K = 256 values):
 *   Q2_K (84 bytes): scales[16], qs[64], f16 d, f16 dmin. Sixteen sub-blocks of
 *         16 values; scales[j] holds sub-block j's 4-bit scale (low nibble) and
 *         4-bit min (high); value = d*(scales[j]&15)*q - dmin*(scales[j]>>4), q in
 *         0..3. In half h (values 128h..128h+127), value 128h+32k+l (k < 4, l < 32)
 *         is bits 2k..2k+1 of qs[32h+l].
 *   Q3_K (110 bytes): hmask[32], qs[64], scales[12], f16 d. Sixteen sub-blocks
 *         of 16 values, 6-bit scales s_j (moetax_q3k_scales), value = d*(s_j-32)*q,
 *         q in -4..3: value 128h+32k+l has low 2 bits from bits 2k..2k+1 of
 *         qs[32h+l] and q = low - 4 unless bit 4h+k of hmask[l] is set (then q = low).
 *   Q4_K (144 bytes): f16 d, f16 dmin, scales[12], qs[128]. Eight sub-blocks
 *         of 32 values, each with a 6-bit scale sc_j and 6-bit min m_j packed
 *         in scales[12] (moetax_q4k_scale_min); value = d*sc_j*q - dmin*m_j,
 *         q in 0..15. Chunk c (values 64c..64c+63) is qs[32c..32c+31]: byte l
 *         holds value 64c+l (sub-block 2c) low and 64c+32+l (2c+1) high.
 *   Q5_K (176 bytes): f16 d, f16 dmin, scales[12], qh[32], qs[128]: Q4_K's
 *         layout with a fifth bit: value 64c+l adds 16 if qh[l] bit 2c is set,
 *         value 64c+32+l if bit 2c+1 is; q in 0..31.
 *   Q6_K (210 bytes): ql[128], qh[64], int8 scales[16], f16 d. Sixteen
 *         sub-blocks of 16 values, value v = d * scales[v/16] * (q - 32), q in
 *         0..63. In half h (values 128h..128h+127; ql[64h..], qh[32h..]), for
 *         l < 32: values 128h+l, +32, +64, +96 take their low 4 bits from
 *         ql[l] low, ql[l+32] low, ql[l] high, ql[l+32] high and their high 2
 *         bits from qh[l] bits 0-1, 2-3, 4-5, 6-7.
 *
 * INVARIANTS
 *   - A row of n values of type t takes n / blck_size(t) * type_size(t) bytes,
 *     and n must be a multiple of blck_size(t).
 *   - The *_ref conversions here are the scalar references every optimized
 *     kernel is tested against; they match ggml's reference quantizers bit for bit.
 */
#ifndef MOETAX_TYPES_H
#define MOETAX_TYPES_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

enum moetax_type {
    MOETAX_TYPE_F32 = 0,
    MOETAX_TYPE_F16 = 1,
    MOETAX_TYPE_Q4_0 = 2,
    MOETAX_TYPE_Q4_1 = 3,
    MOETAX_TYPE_Q5_0 = 6,
    MOETAX_TYPE_Q5_1 = 7,
    MOETAX_TYPE_Q8_0 = 8,
    MOETAX_TYPE_Q8_1 = 9,
    MOETAX_TYPE_Q2_K = 10,
    MOETAX_TYPE_Q3_K = 11,
    MOETAX_TYPE_Q4_K = 12,
    MOETAX_TYPE_Q5_K = 13,
    MOETAX_TYPE_Q6_K = 14,
    MOETAX_TYPE_Q8_K = 15,
    MOETAX_TYPE_IQ2_XXS = 16,
    MOETAX_TYPE_IQ2_XS = 17,
    MOETAX_TYPE_IQ3_XXS = 18,
    MOETAX_TYPE_IQ1_S = 19,
    MOETAX_TYPE_IQ4_NL = 20,
    MOETAX_TYPE_IQ3_S = 21,
    MOETAX_TYPE_IQ2_S = 22,
    MOETAX_TYPE_IQ4_XS = 23,
    MOETAX_TYPE_I8 = 24,
    MOETAX_TYPE_I16 = 25,
    MOETAX_TYPE_I32 = 26,
    MOETAX_TYPE_I64 = 27,
    MOETAX_TYPE_F64 = 28,
    MOETAX_TYPE_IQ1_M = 29,
    MOETAX_TYPE_BF16 = 30,
    MOETAX_TYPE_TQ1_0 = 34,
    MOETAX_TYPE_TQ2_0 = 35,
    MOETAX_TYPE_MXFP4 = 39,
    MOETAX_TYPE_COUNT = 40,
};

#define MOETAX_QK8_0 32
#define MOETAX_QK4_0 32

typedef struct moetax_block_q8_0 {
    uint16_t d;                 /* f16 scale */
    int8_t qs[MOETAX_QK8_0];    /* quants */
} moetax_block_q8_0;

typedef struct moetax_block_q4_0 {
    uint16_t d;                 /* f16 scale */
    uint8_t qs[MOETAX_QK4_0 / 2]; /* nibbles: low = value j, high = value j+16 */
} moetax_block_q4_0;

typedef struct moetax_block_q5_0 {
    uint16_t d;                 /* f16 scale */
    uint8_t qh[4];              /* fifth bits: bit j of the little-endian uint32 is value j's */
    uint8_t qs[MOETAX_QK4_0 / 2]; /* low nibbles, as Q4_0's */
} moetax_block_q5_0;

typedef struct moetax_block_q4_1 {
    uint16_t d, m;              /* f16 scale and minimum */
    uint8_t qs[MOETAX_QK4_0 / 2]; /* nibbles, as Q4_0's */
} moetax_block_q4_1;

typedef struct moetax_block_q5_1 {
    uint16_t d, m;              /* f16 scale and minimum */
    uint8_t qh[4];              /* fifth bits, as Q5_0's */
    uint8_t qs[MOETAX_QK4_0 / 2];
} moetax_block_q5_1;

typedef struct moetax_block_iq4_nl {
    uint16_t d;                 /* f16 scale */
    uint8_t qs[MOETAX_QK4_0 / 2]; /* indices into moetax_iq4nl_values, nibbles as Q4_0's */
} moetax_block_iq4_nl;

/* IQ4_NL's 16 levels (ggml's kvalues_iq4nl). */
extern const int8_t moetax_iq4nl_values[16];

#define MOETAX_QK_K 256

typedef struct moetax_block_q2_k {
    uint8_t scales[MOETAX_QK_K / 16]; /* low nibble: scale, high nibble: min */
    uint8_t qs[MOETAX_QK_K / 4];      /* 2-bit levels */
    uint16_t d;                       /* f16 super-block scale of the scales */
    uint16_t dmin;                    /* f16 super-block scale of the mins */
} moetax_block_q2_k;

typedef struct moetax_block_q3_k {
    uint8_t hmask[MOETAX_QK_K / 8]; /* high bits (set: no -4) */
    uint8_t qs[MOETAX_QK_K / 4];    /* low 2 bits */
    uint8_t scales[12];             /* 16 6-bit scales, packed */
    uint16_t d;
} moetax_block_q3_k;

typedef struct moetax_block_q4_k {
    uint16_t d;                 /* f16 super-block scale of the scales */
    uint16_t dmin;              /* f16 super-block scale of the mins */
    uint8_t scales[12];         /* 8 6-bit scales and 8 6-bit mins, packed */
    uint8_t qs[MOETAX_QK_K / 2];
} moetax_block_q4_k;

typedef struct moetax_block_q5_k {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[MOETAX_QK_K / 8]; /* fifth bits */
    uint8_t qs[MOETAX_QK_K / 2];
} moetax_block_q5_k;

typedef struct moetax_block_q6_k {
    uint8_t ql[MOETAX_QK_K / 2]; /* low 4 bits */
    uint8_t qh[MOETAX_QK_K / 4]; /* high 2 bits */
    int8_t scales[MOETAX_QK_K / 16];
    uint16_t d;
} moetax_block_q6_k;

/* ggml's block_q8_K: the prepared activations of k-quant weights (kernels.h). */
typedef struct moetax_block_q8_k {
    float d;
    int8_t qs[MOETAX_QK_K];
    int16_t bsums[MOETAX_QK_K / 16]; /* sums of each 16 quants */
} moetax_block_q8_k;

#ifndef __cplusplus
_Static_assert(sizeof(moetax_block_q2_k) == 84, "block_q2_K is 84 bytes");
_Static_assert(sizeof(moetax_block_q3_k) == 110, "block_q3_K is 110 bytes");
_Static_assert(sizeof(moetax_block_q4_k) == 144, "block_q4_K is 144 bytes");
_Static_assert(sizeof(moetax_block_q5_k) == 176, "block_q5_K is 176 bytes");
_Static_assert(sizeof(moetax_block_q6_k) == 210, "block_q6_K is 210 bytes");
_Static_assert(sizeof(moetax_block_q8_k) == 292, "block_q8_K is 292 bytes");
#endif

/* Sub-block j's (0..7) 6-bit scale and min of a Q4_K/Q5_K scales[12]
 * (ggml's get_scale_min_k4): j < 4: sc = q[j] & 63, m = q[j+4] & 63; else
 * sc = (q[j+4] & 15) | (q[j-4] >> 6) << 4, m = (q[j+4] >> 4) | (q[j] >> 6) << 4. */
static inline void moetax_q4k_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* The 16 6-bit scales (0..63, stored + 32) of a Q3_K scales[12] (ggml's layout): scale j's
 * low 4 bits are the low (j < 8) or high (j >= 8) nibble of q[j % 8], its high 2 bits bits
 * 2(j/4)..2(j/4)+1 of q[8 + j%4]. */
static inline void moetax_q3k_scales(const uint8_t *q, uint8_t s[16]) {
    for (int j = 0; j < 16; j++)
        s[j] = (uint8_t)(((j < 8 ? q[j] : q[j - 8] >> 4) & 0xf) | (((q[8 + j % 4] >> (2 * (j / 4))) & 3) << 4));
}

/* True if t is a known ggml type id (including ones moetax cannot compute). */
bool moetax_type_valid(uint32_t t);
/* Values per block (1 for plain types), 0 for an unknown type. */
int64_t moetax_type_blck_size(enum moetax_type t);
/* Bytes per block, 0 for an unknown type. */
size_t moetax_type_size(enum moetax_type t);
/* "f32", "q8_0", ...; "unknown" for an unknown id. */
const char *moetax_type_name(enum moetax_type t);
/* Parse a name as printed by moetax_type_name (case-insensitive); returns false if unknown. */
bool moetax_type_from_name(const char *name, enum moetax_type *out);
/* True for the types moetax computes with: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K,
 * Q3_K, Q4_K, Q5_K, Q6_K. */
/* Q2_K .. Q6_K: k-quants, whose matmuls take block_q8_K activation rows (kernels.h). */
bool moetax_type_is_kquant(enum moetax_type t);
bool moetax_type_supported(enum moetax_type t);
/* The type a matrix with rows of ne0 values takes when a whole model is made of type t
 * (quantize, gen): t where its blocks fit the rows; else Q4_K falls back to Q5_0, Q5_K to
 * Q5_1 and Q6_K to Q8_0, as llama-quantize does; Q2_K and Q3_K to Q8_0 (llama.cpp 82bb485 takes
 * Q4_0 there, older versions and ik_llama.cpp IQ4_NL: moetax keeps these few matrices at 8 bits);
 * anything whose blocks still do not fit to F16. */
enum moetax_type moetax_type_fit(enum moetax_type t, int64_t ne0);
/* llama.cpp's general.file_type (llama_ftype) of a model made of type t, as llama-quantize
 * --pure writes it: F32 0, F16 1, Q4_0 2, Q8_0 7, Q2_K 10, Q3_K 12 (Q3_K_M), Q4_K 15
 * (Q4_K_M), Q5_K 17 (Q5_K_M), Q6_K 18, BF16 32. */
uint32_t moetax_type_llama_ftype(enum moetax_type t);
/* Bytes of a row of n values; 0 if n is not a multiple of the block size or
 * the size does not fit (moetax_tensor_nbytes with one dimension). */
size_t moetax_row_size(enum moetax_type t, int64_t n);

/* Why moetax_tensor_nbytes refused a shape. */
enum moetax_nbytes_err {
    MOETAX_NBYTES_OK = 0,
    MOETAX_NBYTES_BAD_TYPE,     /* unknown type id */
    MOETAX_NBYTES_BAD_DIM,      /* a dimension < 1 */
    MOETAX_NBYTES_NOT_BLOCKS,   /* ne[0] is not a multiple of the block size */
    MOETAX_NBYTES_OVERFLOW,     /* the element count or the byte size overflows 63 bits */
};
/* The one checked helper for sizes computed from file values: the bytes of a
 * tensor of type t with dims ne[0..n_dims) (ggml order), every product checked
 * (the first dimension's too), and the element count, which must also fit.
 * On success *nbytes (and *nel when not NULL) are set. */
enum moetax_nbytes_err moetax_tensor_nbytes(enum moetax_type t, int n_dims, const int64_t *ne, uint64_t *nbytes,
                                            int64_t *nel);
/* "byte size overflows", ... for messages. */
const char *moetax_nbytes_err_str(enum moetax_nbytes_err e);

/* Scalar half/bfloat conversions (round to nearest even). */
float moetax_fp16_to_fp32(uint16_t h);
uint16_t moetax_fp32_to_fp16(float f);
float moetax_bf16_to_fp32(uint16_t h);
uint16_t moetax_fp32_to_bf16(float f);

/* Reference row conversions for the supported types; n must be a multiple of
 * the block size. */
void moetax_quantize_row_q8_0_ref(const float *x, moetax_block_q8_0 *y, int64_t n);
/* A Q8_0 quant: roundf(v) for |v| <= 127 (every finite input's, where a block's
 * scale is normal), saturated to -128..127 beyond (a block whose tiny maximum
 * makes 1/d overflow), 0 for a NaN (a block holding one, or an infinity) --
 * defined where the C conversion is not. */
int8_t moetax_q8_round(float v);
/* The index of x's first NaN or infinity, or -1: a row a quantized type cannot hold (its
 * quantizers would write garbage; quantize and --expert-type refuse it, naming the row). */
int64_t moetax_nonfinite_at(const float *x, int64_t n);
void moetax_dequantize_row_q8_0_ref(const moetax_block_q8_0 *x, float *y, int64_t n);
void moetax_quantize_row_q4_0_ref(const float *x, moetax_block_q4_0 *y, int64_t n);
void moetax_dequantize_row_q4_0_ref(const moetax_block_q4_0 *x, float *y, int64_t n);
/* ggml's quantize_row_q5_0_ref: per block d = (the value of largest magnitude) / -16,
 * q = min(31, trunc(x / d + 16.5)). */
void moetax_quantize_row_q5_0_ref(const float *x, moetax_block_q5_0 *y, int64_t n);
/* ggml's quantize_row_q4_1_ref / quantize_row_q5_1_ref: per block d = (max - min) / 15 (31),
 * m = min, q = trunc((x - min) / d + 0.5) (Q4_1: at most 15). */
void moetax_quantize_row_q4_1_ref(const float *x, moetax_block_q4_1 *y, int64_t n);
void moetax_quantize_row_q5_1_ref(const float *x, moetax_block_q5_1 *y, int64_t n);
/* ggml's quantize_iq4_nl without importance weights (llama-quantize's IQ4_NL; not its
 * quantize_row_iq4_nl_ref, which skips the search over scales). */
void moetax_quantize_row_iq4_nl_ref(const float *x, moetax_block_iq4_nl *y, int64_t n);
/* ggml's quantize_row_q{4,5,6}_K_ref (no importance weights) and dequantize_row_*;
 * n a multiple of 256. */
void moetax_quantize_row_q4_k_ref(const float *x, moetax_block_q4_k *y, int64_t n);
void moetax_quantize_row_q5_k_ref(const float *x, moetax_block_q5_k *y, int64_t n);
void moetax_quantize_row_q6_k_ref(const float *x, moetax_block_q6_k *y, int64_t n);
/* ggml's quantize_row_q2_K_ref and quantize_row_q3_K_ref (no importance weights). */
void moetax_quantize_row_q2_k_ref(const float *x, moetax_block_q2_k *y, int64_t n);
void moetax_quantize_row_q3_k_ref(const float *x, moetax_block_q3_k *y, int64_t n);
/* ggml's quantize_row_q8_K_ref (d = max / -127 as float, bsums). */
void moetax_quantize_row_q8_k_ref(const float *x, moetax_block_q8_k *y, int64_t n);

/* Convert n floats to a row of type t (any moetax_type_supported type). Returns
 * false if t is unsupported or n is not a multiple of the block size. */
bool moetax_from_float(enum moetax_type t, const float *x, void *y, int64_t n);
/* Convert a row of n values of type t to floats. */
bool moetax_to_float(enum moetax_type t, const void *x, float *y, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
