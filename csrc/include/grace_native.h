/* grace native kernels: a C ABI with no toolkit dependency.
 *
 * libgrace_cpu.so exports the grace_cpu_* functions (host pointers; built from csrc/cpu/, a file
 * per family; libgrace_cpu_avx2.so is the same sources compiled for x86-64-v3, taken where the CPU
 * runs it), libgrace_cuda.so the grace_cuda_* functions (device pointers plus the caller's
 * cudaStream_t, passed as void*; built from csrc/cuda/).
 * Both are loaded with ctypes (grace/native/_loader.py), so NumPy arrays, torch tensors and
 * anything DLPack exports (TensorFlow) reach the same kernels.
 *
 * Formats are those of the pure tensor-op code (grace/core/bits.py, grace/compressors/):
 *   packed stream: bit b of element i's w-bit code is stream bit w*i + b; stream bit n is bit
 *   n % 8 of byte n / 8; the last byte is zero-padded.
 * Floating-point reductions on the CPU follow NumPy's pairwise summation exactly (float32,
 * 8 accumulators, blocks of 128), so CPU payloads equal the NumPy reference byte for byte.
 *
 * Index types (idx_type): 0 uint8, 1 int16, 2 int32, 3 int64 (the payload index dtypes).
 * Value types (val_type): 0 float32, 1 float64.
 * Functions returning int: 0 on success, < 0 on bad arguments (the caller then falls back).
 */
#ifndef GRACE_NATIVE_H
#define GRACE_NATIVE_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GRACE_NATIVE_ABI 31

enum { GRACE_U8 = 0, GRACE_I16 = 1, GRACE_I32 = 2, GRACE_I64 = 3 };
enum { GRACE_F32 = 0, GRACE_F64 = 1 };

/* ---- CPU ------------------------------------------------------------------------------ */
int grace_cpu_abi(void);
/* the instruction set the library was compiled for ("x86-64-v3", "x86-64-v2", "generic") and
 * whether this CPU runs x86-64-v3 code (AVX2, FMA, BMI2...): the loader takes libgrace_cpu_avx2.so then */
const char* grace_cpu_isa(void);
int grace_cpu_runs_x86_64_v3(void);
/* 1 where the x86-64-v3 build's kernels take their AVX-512 bodies (the CPU has AVX-512F and
 * BW, and GRACE_NATIVE_AVX512 is not 0), else 0 */
int grace_cpu_uses_avx512(void);
/* 1 where the passes over large inputs prefetch ahead themselves (not on an AMD CPU, whose hardware
 * prefetcher keeps their streams busy and which the extra instructions slowed; GRACE_NATIVE_PREFETCH
 * set to 0 or 1 decides instead), else 0 */
int grace_cpu_uses_prefetch(void);
void grace_cpu_set_num_threads(int n); /* <= 0: OpenMP's default */
int grace_cpu_get_num_threads(void);
/* the last-level cache's bytes the kernels plan by (fp16's payloads stay in it where it holds what a
 * step writes before reading them back, else are streamed past it); < 0: what the system tells (one
 * cache instance's size, as Linux's sysfs gives it, else the C library's figure; 0 where neither has one) */
void grace_cpu_set_cache_bytes(int64_t n);
int64_t grace_cpu_get_cache_bytes(void);

/* bit packing of codes < 2**bits, bits in 1..8; out has ceil(n * bits / 8) bytes */
int grace_cpu_pack(const uint8_t* codes, int64_t n, int bits, uint8_t* out);
int grace_cpu_unpack(const uint8_t* packed, int64_t n, int bits, uint8_t* codes);

/* fused quantize + pack (float32 in) */
void grace_cpu_sign_pack(const float* x, int64_t n, int negative, uint8_t* out); /* bit = x >= 0 (negative: x < 0) */
void grace_cpu_efsign_compress(const float* x, int64_t n, uint8_t* out, float* scale);
void grace_cpu_onebit_compress(const float* x, int64_t n, uint8_t* out, float* means);
void grace_cpu_maxabs(const float* x, int64_t n, float* out);
void grace_cpu_terngrad_compress(const float* x, const float* u, int64_t n, const float* scale, uint8_t* out);
void grace_cpu_qsgd_norms(const float* x, int64_t n, int64_t bucket, float* norms);
/* norms: one per bucket, given (have_norms != 0) or computed and written */
int grace_cpu_qsgd_compress(const float* x, const float* u, int64_t n, int levels, int64_t bucket, int bits,
                            float* norms, int have_norms, uint8_t* out);
void grace_cpu_natural_compress(const float* x, const float* u, int64_t n, uint8_t* signs, uint8_t* codes);

/* fused unpack + decode (float32 out) */
/* (2b-1)*scale; scale NULL: 1 */
void grace_cpu_sign_decode(const uint8_t* packed, int64_t n, const float* scale, float* out);
void grace_cpu_onebit_decode(const uint8_t* packed, int64_t n, const float* means, float* out);
void grace_cpu_terngrad_decode(const uint8_t* packed, int64_t n, const float* scale, float* out);
/* elements [starts[s], starts[s] + lengths[s]) of one payload's codes decoded into outs[s] (s < count),
 * as grace_cpu_terngrad_decode decodes them: a shard's decoding written over the gradients it spans */
void grace_cpu_terngrad_decode_pieces(const uint8_t* packed, const float* scale, int64_t count,
                                      const int64_t* starts, const int64_t* lengths, float* const* outs);
int grace_cpu_qsgd_decode(const uint8_t* packed, int64_t n, int levels, int64_t bucket, int bits,
                          const float* norms, float* out);
void grace_cpu_natural_decode(const uint8_t* signs, const uint8_t* codes, int64_t n, float* out);
/* the sum of `count` decoded rows of codes (row j: ceil(n*b/8) bytes at packed + j*ceil(n*b/8)),
 * row after row in float32: mode 0 signSGD (+-1), 1 scaled sign (scalars[j] each), 2 1-bit SGD
 * (scalars[2j], scalars[2j+1]: the two means), all of b = 1 bit; 3 TernGrad (b = 2 bits, its
 * scale scalars[j]); each decoded as its decoder above does */
void grace_cpu_bits_sum(const uint8_t* packed, int64_t count, int64_t n, const float* scalars, int mode, float* out);
/* out = p - the decoded bits (mode as bits_sum; out may be p): a sign-family residual in one pass */
void grace_cpu_bits_residual(const float* p, const uint8_t* packed, int64_t n, const float* scalars, int mode,
                             float* out);
/* grace_cpu_bits_sum of each segment s of a bucket, rank r's row at packed[s * ranks + r] and its
 * scalars at scalars[s * ranks + r] (NULL for mode 0), into out[s] (numels[s] elements), each sum
 * finished elementwise: its sign where vote, then divided by divisors[0 .. ndiv) in turn (ndiv <= 4) */
void grace_cpu_bits_sum_segments(int64_t segments, int ranks, const uint8_t* const* packed,
                                 const float* const* scalars, int mode, const int64_t* numels, int vote,
                                 const float* divisors, int ndiv, float* const* out);

/* decoded sums of a bucket: segment s's ranks' payloads (rank r's at [s * ranks + r]) decoded as
 * their decoders above do and added row after row in float32, into out[s] (numels[s] elements),
 * finished as in grace_cpu_bits_sum_segments */
int grace_cpu_qsgd_sum_segments(int64_t segments, int ranks, const uint8_t* const* packed, const float* const* norms,
                                const int64_t* numels, int levels, int64_t bucket, int bits, int vote,
                                const float* divisors, int ndiv, float* const* out);
void grace_cpu_natural_sum_segments(int64_t segments, int ranks, const uint8_t* const* signs,
                                    const uint8_t* const* codes, const int64_t* numels, int vote, const float* divisors,
                                    int ndiv, float* const* out);

/* DGC's momentum correction: p = v + (m * u + g) into v_out, p - v into u_out (one pass) */
void grace_cpu_dgc_compensate(const float* u, const float* v, const float* g, int64_t n, float m, float* u_out,
                              float* v_out);
/* DGC's selection of every segment of a bucket from its compensated p (grace_cpu_dgc_compensate's v_out):
 * each segment's ks[s] largest |p| (ties to the lowest index; indices in the segment, int64, ascending;
 * values and idx from the previous segments' ks on), p sent where |p| >= cut[s] and +0.0 under it; and
 * momentum factor masking where sent: p = p - (0 + value) over p, u = u * 0 where 0 + value != 0. Where
 * `flag` is given, whether any p is an inf or a NaN into it (a float32, or a byte where flag_width is 1).
 * Where `frame` is given, the pairs go there instead (grace_cpu_pairs_into_frame; `pairs` the sum of ks).
 * 0, or -1 (nothing written) on bad arguments. */
int grace_cpu_dgc_select_segments(float* p, float* u, int64_t segments, const int64_t* starts, const int64_t* numels,
                                  const int64_t* ks, const float* cut, float* values, int64_t* idx, void* flag,
                                  int flag_width, uint8_t* frame, const int64_t* slots, int64_t pairs,
                                  int64_t zero_from, int64_t frame_size);
/* The selected pairs (float32 values, int64 indices in their segment) written into a fixed layout's frame
 * instead (grace_cuda_topk_ef_segments' `frame`): pair j's value at byte slots[j], its index's low
 * slots[2 * pairs + j] bytes (little-endian) at byte slots[pairs + j]; then the frame's bytes
 * [zero_from, frame_size) zeroed (its padding, after the flag byte). */
void grace_cpu_pairs_into_frame(const float* values, const int64_t* idx, int64_t pairs, const int64_t* slots,
                                uint8_t* frame, int64_t zero_from, int64_t frame_size);
/* Pieces gathered into one buffer: nbytes[j] bytes from src[j] to dst + offsets[j], j < pieces (a
 * variable-length frame's pieces, from the rooms a bucket call counted them into). */
void grace_cpu_copy_pieces(int64_t pieces, const void* const* src, const int64_t* nbytes, uint8_t* dst,
                           const int64_t* offsets);
/* A variable-length frame of a bucket call's pieces: its header (each piece's count, int64, from byte 0;
 * piece j's count is counts[j / per]), then the pieces, the widest items first and in order among equals
 * (so each lies aligned; piece j: its count of widths[j]-byte items, 1, 2, 4 or 8, from src[j]), then zeros
 * to its size (the pieces' end plus the overflow flag's byte where flagged, rounded up to 8). sizes[0] =
 * that size, sizes[1] = the pieces' end. The frame is written only where it is not NULL and the size is
 * at most `room` bytes: 1 where written, 0 where not, -1 on bad arguments (nothing written). */
int grace_cpu_variable_frame(int64_t pieces, int64_t per, const void* const* src, const int64_t* counts,
                             const int64_t* widths, int flagged, uint8_t* frame, int64_t room, int64_t* sizes);
/* The other way: `ranks` variable-length frames as grace_cpu_variable_frame writes them (per = 1), end to
 * end in `total` bytes of data, each of `pieces` pieces (item sizes widths[j]): rank r's piece j's address
 * into pointers[slots[j] + r] and its count into counts[slots[j] + r] (the caller's order: field by field),
 * and how many frames' overflow flag byte is set into flags_set where flagged. 0; 1 where a rank sent its
 * dense bucket (its first header entry -1; nothing more read); -1 where the headers do not add up to
 * total bytes (or bad arguments). */
int grace_cpu_variable_rows(const uint8_t* data, int64_t total, int64_t ranks, int64_t pieces, const int64_t* widths,
                            int flagged, const int64_t* slots, uint64_t* pointers, int64_t* counts,
                            int64_t* flags_set);
/* DGC's cut of every segment of a bucket of n elements (numels[s] from starts[s]): the needs[s]-th largest
 * |p| of a sample of sizes[s] elements (1 <= needs[s] <= sizes[s] <= numels[s]), as DGC.segment_cut finds it:
 * where sizes[s] < numels[s] (d) those at floor(u_j * d) (u_j, j < sizes[s]: the uniform draws of the seed
 * words (s0[s], s1[s]); the product in float32; a place past the bucket read at its last), else every
 * element; into cut[s]. 0, or -1 on bad arguments. */
int grace_cpu_dgc_cut_segments(const float* p, int64_t n, int64_t segments, const int64_t* starts,
                               const int64_t* numels, const int64_t* sizes, const int64_t* needs, const uint32_t* s0,
                               const uint32_t* s1, float* cut);
/* DGC's selection of one tensor's p of d elements (DGC.select): the threshold, the need-th largest |p|
 * of S elements drawn as grace_cpu_dgc_cut_segments draws them (every element where S = d); the
 * elements with |p| >= threshold, ascending, cut to the k largest |p| (ties to the lowest index) where
 * more; their indices into idx (room for k); their count, or -1 on bad arguments (1 <= need <= S <= d,
 * 1 <= k <= d unless d = 0). */
int64_t grace_cpu_dgc_select(const float* p, int64_t d, int64_t S, int64_t need, int64_t k, uint32_t s0,
                             uint32_t s1, int64_t* idx);
/* DGC's whole step for each gradient s of a bucket: the momentum correction above, the threshold
 * from a sample of |p| (counter-based draws of s0[s], s1[s]), the selection (at most k; counts[s]
 * of them: values[s] and idx[s] of type idx_types[s]) and momentum factor masking; g[s] taken as
 * g[s] * scales[s] where scales is not NULL (DGC's clipping); -1 on bad arguments */
int grace_cpu_dgc_step_many(int64_t count, const float* const* g, const float* const* u, const float* const* v,
                            float* const* u_out, float* const* v_out, const int64_t* n, float m, double ratio,
                            double sample_ratio, const uint32_t* s0, const uint32_t* s1, float* const* values,
                            void* const* idx, const int* idx_types, int64_t* counts, const float* scales,
                            float* nonfinite);

/* counter-based uniform draws: draw j (0 <= j < numels[s]) of segment s is
 * (h(h(j ^ s0[s]) ^ s1[s]) >> 8) * 2^-24, h a 32-bit integer hash (grace/core/draws.py), written
 * in a row into out (the segments one after another) */
void grace_cpu_uniform_segments(int64_t segments, const int64_t* numels, const uint32_t* s0, const uint32_t* s1,
                                float* out);
/* random indices of segment s: the first ks[s] distinct of floor(h_j * numels[s] / 2^32), h_j the
 * hash of draw j as above, ascending, in a row into out; -1 where a k > n or an n > 2^32 */
int grace_cpu_random_indices_segments(int64_t segments, const int64_t* numels, const int64_t* ks, const uint32_t* s0,
                                      const uint32_t* s1, int64_t* out);

/* selection. topk: the k largest (by value, or by magnitude when by_abs), ties to the lowest
 * index, indices ascending. Returns the count written, < 0 on bad arguments. */
int64_t grace_cpu_topk(const void* x, int val_type, int64_t n, int64_t k, int by_abs, void* idx, int idx_type,
                       void* values);
/* indices (ascending) of |x| >= thr (by_abs) or x >= thr; idx (and values if not NULL) have
 * room for n; returns the count */
int64_t grace_cpu_threshold(const void* x, int val_type, int64_t n, double thr, int by_abs, void* idx, int idx_type,
                            void* values);
int64_t grace_cpu_nonzero(const uint8_t* mask, int64_t n, void* idx, int idx_type);

/* fused error feedback for the sparsifiers:
 *   p = g*gamma + r*beta (each factor applied only when its flag is set);
 *   select; values = p[idx]; new_r = p - scatter(idx, values)   (p where not sent, 0 where sent) */
int64_t grace_cpu_topk_ef(const float* g, const float* r, int64_t n, int64_t k, float beta, float gamma, int flags,
                          float* values, void* idx, int idx_type, float* new_r);
int64_t grace_cpu_threshold_ef(const float* g, const float* r, int64_t n, float thr, float beta, float gamma,
                               int flags, float* values, void* idx, int idx_type, float* new_r);

/* dense[numel] = 0, then dense[idx[i]] += values[i] for each payload in order.
 * Returns 0, or -1 if an index is out of [0, numel) (dense is then unspecified). */
int grace_cpu_scatter_add(int count, const void* const* idx, const int* idx_types, const void* const* values,
                          const int64_t* lengths, int val_type, int64_t numel, void* dense);
/* a bucket in one call (segment s at its own pointers): grace_cpu_topk_ef on every segment, and
 * every segment's sparse aggregate over `ranks` payloads ([s * ranks + r]) divided by `divisor`.
 * The bucket steps' (and grace_cpu_dgc_step_many's and grace_cpu_compress_many's) last argument,
 * `nonfinite` (may be NULL), receives the overflow flag: 1.0f where any gradient holds an inf or a
 * NaN, else 0.0f (top-k's and the sign family's steps read it from the payload field that carries
 * every inf and NaN of theirs, as the exchange does) */
int grace_cpu_topk_ef_many(int64_t count, const float* const* g, const float* const* r, float* const* new_r,
                           const int64_t* n, const int64_t* k, float beta, float gamma, int flags,
                           float* const* values, void* const* idx, const int* idx_types, float* nonfinite);
/* EF-signSGD's (mode 1) or 1-bit SGD's (mode 2) residual step for every segment: p = compensate(g, r)
 * into new_r, its bits and scalars into packed[s] and scalars[s], then new_r = p - decode(bits); or,
 * kept_packed given, new_r = p with the bits and scalars copied there (the subtraction deferred: the
 * next call reads them as r_packed and r_scalars, r being such a p) */
int grace_cpu_bits_ef_many(int64_t count, const float* const* g, const float* const* r,
                           const uint8_t* const* r_packed, const float* const* r_scalars, float* const* new_r,
                           const int64_t* n, float beta, float gamma, int flags, int mode, uint8_t* const* packed,
                           float* const* scalars, uint8_t* const* kept_packed, float* const* kept_scalars,
                           float* nonfinite);
/* grace_cpu_threshold_ef on every segment, the counts into counts[s] (values[s], idx[s]: room for n[s]) */
int grace_cpu_threshold_ef_many(int64_t count, const float* const* g, const float* const* r, float* const* new_r,
                                const int64_t* n, float thr, float beta, float gamma, int flags, float* const* values,
                                void* const* idx, const int* idx_types, int64_t* counts,
                                float* nonfinite);
/* random-k's residual step for every segment: p = compensate(g, r) into new_r, the values at the k[s]
 * distinct indices idx[s] (times scale[s] where scale is given), and new_r there p - (0 + value) */
int grace_cpu_randomk_ef_many(int64_t count, const float* const* g, const float* const* r, float* const* new_r,
                              const int64_t* n, const int64_t* k, const int64_t* const* idx, float beta, float gamma,
                              int flags, const float* scale, float* const* values, float* nonfinite);
/* random-k's residual step for every segment of a flat bucket, the indices drawn as a GPU draws them: the
 * k[s] smallest 32-bit hashes of draws 0 .. numels[s] - 1 of the seed words (s0[s], s1[s]) (ties to the
 * lowest index), ascending, written in the bucket (starts[s] + i, int64); p = compensate(g, r) into new_r
 * (the whole buffer), the values p times scales[s] (NULL: as they are), new_r there p - (0 + value);
 * the overflow flag as grace_cuda_topk_ef_segments writes it. 0, or -1 where a k is outside [0, numels[s]]. */
int grace_cpu_randomk_ef_segments(const float* g, const float* r, int64_t segments, const int64_t* starts,
                                  const int64_t* numels, const int64_t* ks, const uint32_t* s0, const uint32_t* s1,
                                  const float* scales, float beta, float gamma, int flags, float* values, int64_t* idx,
                                  float* new_r, void* flag, int flag_width);
int grace_cpu_scatter_add_segments(int64_t segments, int ranks, const void* const* idx, const int* idx_types,
                                   const void* const* values, const int64_t* lengths, float divisor,
                                   const int64_t* numels, float* const* dense);
/* The mean of `ranks` frames of a bucket whose segments send k (value, index) pairs each, end to end in
 * `frames` (`frame_size` bytes each), read in place: out[numel] = 0, or NaN everywhere where a rank's
 * overflow flag byte (at `flag_at` in its frame; -1: none) is set; else, rank after rank, each pair j
 * of `count` added: its float32 value (at byte slots[j] of the frame) / divisor, at its index (the
 * little-endian integer of slots[2 * count + j] bytes at byte slots[count + j]) plus its segment's
 * start slots[3 * count + j]. `flagged` (NULL: not asked): the number of ranks that flagged an overflow,
 * as one float. 0, or -1 (CPU: nothing written) where an index falls outside [0, numel). */
int grace_cpu_sparse_frames_mean(const uint8_t* frames, int ranks, int64_t frame_size, const int64_t* slots,
                                 int64_t count, int64_t flag_at, float divisor, int64_t numel, float* out,
                                 float* flagged);
/* The mean of `ranks` frames of a bucket whose `segments` send a number of (value, index) pairs that
 * varies by rank and step, end to end in `frames` (`nbytes`), read in place: out[numel] = 0, then rank
 * after rank, each pair's float32 value / divisor added at its index. `table` has a row of
 * GRACE_PAIR_COLUMNS int64 per (rank, segment), ranks first: the byte of the segment's first value,
 * of its first index, its first pair among the rank's pairs, its count, the segment's start in the
 * bucket and its indices' width (1 to 8 bytes, little-endian; values and indices lie in a row each).
 * 0, or -1 (CPU: nothing written) where a piece lies outside the frames or an index outside [0, numel). */
#define GRACE_PAIR_COLUMNS 6
int grace_cpu_sparse_variable_mean(const uint8_t* frames, int64_t nbytes, const int64_t* table, int64_t segments,
                                   int ranks, float divisor, int64_t numel, float* out);
/* Threshold's selection of a bucket of `segments` segments in a row (starting at starts[s]; starts[0] = 0,
 * the last one ending at n) before its frame is made: p = compensate(g, r) (beta, gamma, flags as in
 * grace_cpu_threshold_ef) into p[n]; take[i] = 1 where |p[i]| >= thr, else 0; each segment's count into
 * counts[s] and twice into header[2s], header[2s + 1]; where `flag` is given, the overflow flag (1 where a
 * g is an inf or a NaN) into it (a float32, or a byte where flag_width is 1) and as bit GRACE_FLAG_SHIFT of
 * the header's last count. 0, or -1 on a bad layout. */
#define GRACE_FLAG_SHIFT 62
int grace_cpu_threshold_select_segments(const float* g, const float* r, int64_t n, const int64_t* starts,
                                        int64_t segments, float thr, float beta, float gamma, int flags, float* p,
                                        uint8_t* take, int64_t* counts, int64_t* header, void* flag, int flag_width);
/* Threshold's frame from its selection (grace_cpu_threshold_select_segments' mask `take` of p[n]): each
 * segment's taken values and indices within the segment, in order, where its row of `table` lays them (a row
 * of GRACE_PAIR_COLUMNS per segment, as grace_cpu_sparse_variable_mean reads a rank's), and the new residual
 * p - (0 + p) over p in their place; then at byte `tail` the flag byte (where `flag` is given) and zeros up to
 * `frame_size`. 0, or -1 (CPU: nothing written) where the table does not fit the mask or the frame. */
int grace_cpu_threshold_write_segments(float* p, const uint8_t* take, int64_t n, const int64_t* table,
                                       int64_t segments, uint8_t* frame, int64_t frame_size, int64_t tail,
                                       const uint8_t* flag);
/* The mean of an allreduced sparse sum (random-k's): out[numel] = 0, or NaN everywhere where `flag` (the
 * ranks' summed overflow flags, one float; NULL: none) is above 0; else each of the `count` summed values
 * / divisor added at its index (distinct). 0, or -1 (CPU: nothing written) where an index falls outside
 * [0, numel). */
int grace_cpu_sparse_sum_mean(const float* values, const int64_t* idx, int64_t count, float divisor, const float* flag,
                              int64_t numel, float* out);

/* natural_compress with counter-based draws of seed words (s0, s1) (draw i of grace_cpu_uniform_segments
 * for element i), made where they are used */
void grace_cpu_natural_compress_drawn(const float* x, int64_t n, uint32_t s0, uint32_t s1, uint8_t* signs,
                                      uint8_t* codes);
/* the same for TernGrad (its scale, max |x|, written here) and QSGD (its norms written here) */
void grace_cpu_terngrad_compress_drawn(const float* x, int64_t n, uint32_t s0, uint32_t s1, float* scale,
                                       uint8_t* out);
int grace_cpu_qsgd_compress_drawn(const float* x, int64_t n, uint32_t s0, uint32_t s1, int levels, int64_t bucket,
                                  int bits, float* norms, uint8_t* out);
/* the payloads of a bucket's gradients in one call (segment s at its own pointers), by method 0
 * signSGD, 1 TernGrad, 2 QSGD, 3 natural compression (above; out0: the bits or codes, out1: the
 * scalars or natural's codes); -1 on bad arguments */
int grace_cpu_compress_many(int method, int64_t count, const float* const* x, const int64_t* n, const uint32_t* s0,
                            const uint32_t* s1, void* const* out0, void* const* out1, int levels, int64_t bucket,
                            int bits, float* nonfinite);
/* fp16's payload, a bucket at a time (segment s at its own pointers): outs[s][i] = xs[s][i] / divisor
 * rounded to IEEE half (nearest even), and its decode outs[s][i] = (float(halves[s][i]) * factor) / divisor.
 * held: the bytes of payload written before these are read back (a step's, every bucket's; 0: these
 * alone): the halves stay in the caches where those fit in the last-level cache, else are streamed */
void grace_cpu_half_encode_many(int64_t count, const float* const* xs, const int64_t* numels, float divisor,
                                uint16_t* const* outs, int64_t held);
void grace_cpu_half_decode_many(int64_t count, const uint16_t* const* halves, const int64_t* numels, float factor,
                                float divisor, float* const* outs);
/* a bucket's sums divided, segment s at its own pointers: outs[s][i] = xs[s][i] / divisor (IEEE
 * division, as the tensor ops divide by a number on a CPU; outs may be xs) */
void grace_cpu_divide_many(int64_t count, const float* const* xs, const int64_t* numels, float divisor,
                           float* const* outs);
/* a bucket's overflow check, segment s at its own pointers: *flag = 1 where any xs[s] holds an inf or
 * a NaN, left as it is otherwise (a flag other passes of the step set too) */
void grace_cpu_flag_nonfinite_many(int64_t count, const float* const* xs, const int64_t* numels, float* flag);
/* PowerSGD's products for count float32 matrices, one after another: matrix s is rows[s] x
 * cols[s], its factors q[s] (cols x r[s]) and p[s] (rows x r[s]), all row-major; each element
 * summed in one fixed order on every build and thread count. project: p = M q, M = a, or
 * M = a + b (b not NULL: an array with an entry per matrix) written into m (which may be a or
 * b), or M = a + (b - dp dq^T) where dp and dp[s] are not NULL (dp rows x r, dq cols x r: a
 * residual whose subtraction was left to this pass, each element of dp dq^T made as expand makes
 * out); *nonfinite = 1.0f where an a holds an inf or a NaN, left as it is otherwise (may be NULL).
 * back: q = M^T p, where unit is set each p of one column first made p / |p| in place (the
 * squares summed in float64; the first unit vector where p is zero). expand: q_out = q / divisor,
 * then out = p q_out^T; where e is not NULL, also e = m - out (e may be m, out may not). */
void grace_cpu_lowrank_project_many(int64_t count, const float* const* a, const float* const* b,
                                    const float* const* dp, const float* const* dq, const int64_t* rows,
                                    const int64_t* cols, const float* const* q, const int64_t* r, float* const* m,
                                    float* const* p, float* nonfinite);
void grace_cpu_lowrank_back_many(int64_t count, const float* const* m, const int64_t* rows, const int64_t* cols,
                                 float* const* p, const int64_t* r, int unit, float* const* q);
void grace_cpu_lowrank_expand_many(int64_t count, const float* const* p, const float* const* q, const int64_t* rows,
                                   const int64_t* cols, const int64_t* r, float divisor, float* const* q_out,
                                   float* const* out, const float* const* m, float* const* e);

/* ---- CUDA (device pointers; stream is a cudaStream_t) ---------------------------------- */
int grace_cuda_abi(void);
int grace_cuda_device_count(void); /* 0 when there is no usable device or driver */
int grace_cuda_device_sync(void); /* cudaDeviceSynchronize (TensorFlow tensors: no stream to order on) */
int grace_cuda_pack(const uint8_t* codes, int64_t n, int bits, uint8_t* out, void* stream);
int grace_cuda_unpack(const uint8_t* packed, int64_t n, int bits, uint8_t* codes, void* stream);
int grace_cuda_sign_pack(const float* x, int64_t n, int negative, uint8_t* out, void* stream);
int grace_cuda_efsign_compress(const float* x, int64_t n, uint8_t* out, float* scale, void* stream);
int grace_cuda_onebit_compress(const float* x, int64_t n, uint8_t* out, float* means, void* stream);
int grace_cuda_maxabs(const float* x, int64_t n, float* out, void* stream);
int grace_cuda_terngrad_compress(const float* x, const float* u, int64_t n, const float* scale, uint8_t* out,
                                 void* stream);
int grace_cuda_qsgd_norms(const float* x, int64_t n, int64_t bucket, float* norms, void* stream);
int grace_cuda_qsgd_compress(const float* x, const float* u, int64_t n, int levels, int64_t bucket, int bits,
                             float* norms, int have_norms, uint8_t* out, void* stream);
int grace_cuda_natural_compress(const float* x, const float* u, int64_t n, uint8_t* signs, uint8_t* codes,
                                void* stream);
int grace_cuda_sign_decode(const uint8_t* packed, int64_t n, const float* scale, float* out, void* stream);
int grace_cuda_onebit_decode(const uint8_t* packed, int64_t n, const float* means, float* out, void* stream);
int grace_cuda_bits_sum(const uint8_t* packed, int64_t count, int64_t n, const float* scalars, int mode, float* out,
                        void* stream);
int grace_cuda_terngrad_decode(const uint8_t* packed, int64_t n, const float* scale, float* out, void* stream);
int grace_cuda_qsgd_decode(const uint8_t* packed, int64_t n, int levels, int64_t bucket, int bits,
                           const float* norms, float* out, void* stream);
int grace_cuda_natural_decode(const uint8_t* signs, const uint8_t* codes, int64_t n, float* out, void* stream);
/* topk / topk_ef: k known, outputs sized k; synchronous only in the tie-resolution corner */
int64_t grace_cuda_topk(const void* x, int val_type, int64_t n, int64_t k, int by_abs, void* idx, int idx_type,
                        void* values, void* stream);
int64_t grace_cuda_topk_ef(const float* g, const float* r, int64_t n, int64_t k, float beta, float gamma, int flags,
                           float* values, void* idx, int idx_type, float* new_r, void* stream);
/* variable-length selections: outputs have room for n; returns the count (synchronizes on it) */
int64_t grace_cuda_threshold(const void* x, int val_type, int64_t n, double thr, int by_abs, void* idx,
                             int idx_type, void* values, void* stream);
int64_t grace_cuda_nonzero(const uint8_t* mask, int64_t n, void* idx, int idx_type, void* stream);
int64_t grace_cuda_threshold_ef(const float* g, const float* r, int64_t n, float thr, float beta, float gamma,
                                int flags, float* values, void* idx, int idx_type, float* new_r, void* stream);
/* a bucket's segments (gradients in a row in a flat buffer) in one launch per kernel, each with
 * what its per-tensor function gives it alone (the reductions on the same blocks, in the same
 * order). Host arrays of the segments' sizes, starts (elements of x) and seed words; payloads in
 * a row, each segment's codes from a byte boundary, its scalars after the previous segment's. */
int grace_cuda_uniform_segments(int64_t segments, const int64_t* numels, const uint32_t* s0, const uint32_t* s1,
                                float* out, void* stream);
/* out[j] = segment << 32 | the 32-bit hash of its draw (draws in a row): random indices' sort keys */
int grace_cuda_hash_keys_segments(int64_t segments, const int64_t* numels, const uint32_t* s0, const uint32_t* s1,
                                  int64_t* out, void* stream);
/* the quantizers' segments: segment s's draws are those of the seed words (s0[s], s1[s]) (draw i of
 * grace_cuda_uniform_segments for element i), made where they are used */
int grace_cuda_terngrad_compress_segments(const float* x, int64_t segments, const int64_t* starts,
                                          const int64_t* numels, const uint32_t* s0, const uint32_t* s1,
                                          uint8_t* out, float* scale, void* stream);
int grace_cuda_natural_compress_segments(const float* x, int64_t segments, const int64_t* starts,
                                         const int64_t* numels, const uint32_t* s0, const uint32_t* s1,
                                         uint8_t* signs, uint8_t* codes, void* stream);
int grace_cuda_qsgd_compress_segments(const float* x, int64_t segments, const int64_t* starts, const int64_t* numels,
                                      const uint32_t* s0, const uint32_t* s1, int levels, int64_t bucket, int bits,
                                      uint8_t* out, float* norms, void* stream);
int grace_cuda_efsign_compress_segments(const float* x, int64_t segments, const int64_t* starts,
                                        const int64_t* numels, uint8_t* out, float* scale, void* stream);
int grace_cuda_onebit_compress_segments(const float* x, int64_t segments, const int64_t* starts,
                                        const int64_t* numels, uint8_t* out, float* means, void* stream);
/* residual memory's step with EF-signSGD's (scale) or 1-bit SGD's (means) compression, every segment:
 * p = g * gamma + r * beta (each where flags says: 1 gamma, 2 beta) compressed as *_compress_segments
 * compresses it, the new residual p - its decoding into new_r at the segments' starts; the overflow
 * flag as grace_cuda_topk_ef_segments writes it (from the scalars, which every inf and NaN of p makes
 * non-finite) */
int grace_cuda_efsign_ef_segments(const float* g, const float* r, int64_t segments, const int64_t* starts,
                                  const int64_t* numels, float beta, float gamma, int flags, uint8_t* out,
                                  float* scale, float* new_r, void* flag, int flag_width, void* stream);
int grace_cuda_onebit_ef_segments(const float* g, const float* r, int64_t segments, const int64_t* starts,
                                  const int64_t* numels, float beta, float gamma, int flags, uint8_t* out,
                                  float* means, float* new_r, void* flag, int flag_width, void* stream);
/* grace_cuda_topk_ef of every segment (0 <= ks[s] <= numels[s]): values and int64 indices (in the
 * segment) of the segments in a row, the new residuals in new_r at the segments' starts; flags & 4:
 * no residual (r may be NULL), p = g: each segment's top-k, new_r a scratch buffer. `flag` (may be
 * NULL) receives the overflow flag, 1 where g holds an inf or a NaN, else 0: a float32, or a byte
 * where flag_width is 1. Where `frame` is given, the pairs go there as grace_cpu_pairs_into_frame puts
 * them (values and idx unwritten, may be NULL; `pairs` the sum of ks), its bytes [zero_from,
 * frame_size) zeroed by the last launch */
int grace_cuda_topk_ef_segments(const float* g, const float* r, int64_t segments, const int64_t* starts,
                                const int64_t* numels, const int64_t* ks, float beta, float gamma, int flags,
                                float* values, int64_t* idx, float* new_r, void* flag, int flag_width, uint8_t* frame,
                                const int64_t* slots, int64_t pairs, int64_t zero_from, int64_t frame_size,
                                void* stream);
/* grace_cpu_randomk_ef_segments: the top-k segment kernels ranking each segment's draws by hash */
int grace_cuda_randomk_ef_segments(const float* g, const float* r, int64_t segments, const int64_t* starts,
                                   const int64_t* numels, const int64_t* ks, const uint32_t* s0, const uint32_t* s1,
                                   const float* scales, float beta, float gamma, int flags, float* values,
                                   int64_t* idx, float* new_r, void* flag, int flag_width, void* stream);
/* every segment's payload decoded into the flat out: method 0 sign bits (b: a scale per segment,
 * or NULL), 1 1-bit SGD (two means each), 2 TernGrad (a scale each), 3 QSGD (its norms),
 * 4 natural compression (a: sign bits, b: codes) */
int grace_cuda_decode_segments(int method, int64_t segments, const int64_t* numels, const uint8_t* a, const void* b,
                               int levels, int64_t bucket, int bits, float* out, void* stream);
/* every segment's aggregate over `ranks` ranks into the flat out: a and b hold each rank's fields as
 * decode_segments takes them, rank after rank (b may be NULL for method 0); each element's decodings
 * added rank after rank, then its sign where vote, then divided by divisors[0 .. ndiv) in turn (ndiv <= 4)
 * as torch divides by a number on a GPU (times its float reciprocal); NaN everywhere where *overflow (a
 * device int64, or NULL) is positive */
int grace_cuda_mean_segments(int method, int64_t segments, const int64_t* numels, int ranks, const uint8_t* a,
                             const void* b, int levels, int64_t bucket, int bits, int vote, const float* divisors,
                             int ndiv, const int64_t* overflow, float* out, void* stream);
/* dense is zeroed by the call; payloads are added one after another (deterministic when the
 * indices within one payload are distinct); out-of-range indices are skipped */
int grace_cuda_scatter_add(int count, const void* const* idx, const int* idx_types, const void* const* values,
                           const int64_t* lengths, int val_type, int64_t numel, void* dense, void* stream);
/* grace_cpu_sparse_frames_mean (slots and flagged on the device): one cooperative launch, the ranks
 * added in turn between grid-wide barriers (where the device refuses one: a fill and a launch per
 * rank); an index outside [0, numel) is skipped */
int grace_cuda_sparse_frames_mean(const uint8_t* frames, int ranks, int64_t frame_size, const int64_t* slots,
                                  int64_t count, int64_t flag_at, float divisor, int64_t numel, float* out,
                                  float* flagged, void* stream);
/* grace_cpu_sparse_variable_mean (the table on the device): one cooperative launch (a fill and a launch
 * per rank where the device refuses one); a piece or index out of range is skipped */
int grace_cuda_sparse_variable_mean(const uint8_t* frames, int64_t nbytes, const int64_t* table, int64_t segments,
                                    int ranks, float divisor, int64_t numel, float* out, void* stream);
/* grace_cpu_threshold_select_segments (starts on the device): a memset and one launch */
int grace_cuda_threshold_select_segments(const float* g, const float* r, int64_t n, const int64_t* starts,
                                         int64_t segments, float thr, float beta, float gamma, int flags, float* p,
                                         uint8_t* take, int64_t* counts, int64_t* header, void* flag, int flag_width,
                                         void* stream);
/* grace_cpu_threshold_write_segments (table and flag on the device): a memset, the ordered compaction's
 * counts and writes, the tail; the table is not checked */
int grace_cuda_threshold_write_segments(float* p, const uint8_t* take, int64_t n, const int64_t* table,
                                        int64_t segments, uint8_t* frame, int64_t frame_size, int64_t tail,
                                        const uint8_t* flag, void* stream);
/* grace_cpu_dgc_compensate (on the device): one launch */
void grace_cuda_dgc_compensate(const float* u, const float* v, const float* g, int64_t n, float m, float* u_out,
                               float* v_out, void* stream);
/* grace_cpu_dgc_select_segments (cut on the device; starts, numels and ks on the host): top-k's segment
 * kernels (grace_cuda_topk_ef_segments), their writes masked by the cut */
int grace_cuda_dgc_select_segments(float* p, float* u, int64_t segments, const int64_t* starts, const int64_t* numels,
                                   const int64_t* ks, const float* cut, float* values, int64_t* idx, void* flag,
                                   int flag_width, uint8_t* frame, const int64_t* slots, int64_t pairs,
                                   int64_t zero_from, int64_t frame_size, void* stream);
/* grace_cpu_dgc_cut_segments (p and cut on the device): a launch per 64 segments, a block per segment */
int grace_cuda_dgc_cut_segments(const float* p, int64_t n, int64_t segments, const int64_t* starts,
                                const int64_t* numels, const int64_t* sizes, const int64_t* needs, const uint32_t* s0,
                                const uint32_t* s1, float* cut, void* stream);
/* grace_cpu_sparse_sum_mean (its flag on the device): one fill, one launch; an index outside [0, numel) is
 * skipped */
int grace_cuda_sparse_sum_mean(const float* values, const int64_t* idx, int64_t count, float divisor,
                               const float* flag, int64_t numel, float* out, void* stream);

#ifdef __cplusplus
}
#endif
#endif
