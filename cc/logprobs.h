// Fused log-prob gather with optional entropy, forward and backward (core
// library: no Python, no CUDA).
//
// For logits x of one token (a row of V values) and its target id t, with
// z = x / T (temperature T > 0):
//
//   logprob = z[t] - logsumexp(z)
//   entropy = logsumexp(z) - sum_k softmax(z)_k * z_k
//
// The forward pass reads each row once, from memory, with an online
// logsumexp: the row goes through in cache-sized chunks; each chunk's maximum
// updates a running maximum M (rescaling the running sums), then the chunk's
// exp((x - M) / T) are added to the running sum S (and S-weighted shifted
// logits to a third sum for the entropy). Nothing of size (N, V) is written.
//
// The backward pass recomputes the softmax row by row from the saved per-row
// statistics (M and log S, together the logsumexp: lse = M / T + log S) and
// writes d loss / d logits straight into one (N, V) buffer in the logits'
// dtype:
//
//   d logprob / d x_k = (onehot(t)_k - p_k) / T
//   d entropy / d x_k = -p_k * (log p_k + entropy) / T
//
// (the latter from dH/dz_k = -p_k (z_k - E_p[z]) and z_k - E_p[z] =
// log p_k + H).
//
// Layout: logits are (num_rows, vocab_size) with unit stride along the vocab
// and `row_stride` elements between rows (>= vocab_size is not required:
// rows may overlap or repeat, they are only read). Per-row arrays are
// contiguous (num_rows). The gradient buffer is C-contiguous (num_rows,
// vocab_size). bfloat16 values are passed as their uint16 bit patterns.
//
// Numerics: sums in double; exp in float (max relative error ~2e-7); the
// logits' shift by the row maximum happens before scaling by 1 / T, so
// results are accurate relative to the logits' spread, not their magnitude
// (rows of 1e30 work). Special values:
//   - -inf logits (masked vocabulary) have probability exactly 0 and
//     gradient exactly 0 (from both outputs);
//   - a target whose logit is -inf has logprob -inf (its gradient stays
//     finite: g / T at the target, as torch's);
//   - a row whose logits are all -inf, or that holds a NaN or +inf, gives NaN
//     logprob, entropy, statistics and gradient row (as torch does);
//   - vocab_size 1 gives logprob 0 and entropy 0.
// x / T must be representable in float (e.g. not 3e38 / 0.5).
//
// Rows are processed in parallel with std::thread for large inputs; results
// do not depend on the thread count. On x86-64 the inner loops run with AVX2
// when the CPU has it (same operations, so the same results bit for bit).

#ifndef DOCKYARD_CC_LOGPROBS_H_
#define DOCKYARD_CC_LOGPROBS_H_

#include <cstdint>

namespace dockyard::kernels {

enum class LogitsDtype {
  kFloat32,
  kBFloat16,  // uint16 bit patterns: the high half of a float32.
};

// Forward. Writes, per row r:
//   logprobs[r]: float log p(target)
//   entropy[r]:  float entropy (skipped when `entropy` is null)
//   row_max[r]:  float max_k logits[r, k] (the raw logit, not divided by T)
//   row_log_sum[r]: double log sum_k exp((logits[r, k] - row_max[r]) / T)
// row_max and row_log_sum are what gather_logprobs_backward needs; either may
// be null when not wanted.
//
// Throws std::invalid_argument (nothing written) for: negative sizes, a
// vocab_size of 0 with rows, num_rows * vocab_size or the last row's offset
// overflowing int64, a negative row_stride, temperature not finite or <= 0,
// an unknown dtype enumerator, null pointers (logits, targets, logprobs) with
// a nonzero size. Throws std::out_of_range (nothing written) for a target id
// outside [0, vocab_size), naming the first such row and id.
void gather_logprobs(const void* logits, LogitsDtype dtype, int64_t num_rows,
                     int64_t vocab_size, int64_t row_stride,
                     const int64_t* targets, double temperature,
                     float* logprobs, float* entropy, float* row_max,
                     double* row_log_sum);

// Backward. Writes grad_logits (C-contiguous (num_rows, vocab_size), in the
// logits' dtype):
//   grad_logits[r, k] = grad_logprobs[r] * d logprob[r] / d logits[r, k]
//                     + grad_entropy[r] * d entropy[r] / d logits[r, k]
// from the forward's row_max, row_log_sum and (for the entropy term) entropy.
// grad_logprobs and grad_entropy may be null, meaning all zeros; entropy may
// be null only when grad_entropy is.
//
// Throws as gather_logprobs (same argument rules), plus std::invalid_argument
// for a null row_max, row_log_sum or grad_logits with a nonzero size, or a
// non-null grad_entropy without entropy.
void gather_logprobs_backward(const void* logits, LogitsDtype dtype,
                              int64_t num_rows, int64_t vocab_size,
                              int64_t row_stride, const int64_t* targets,
                              double temperature, const float* row_max,
                              const double* row_log_sum, const float* entropy,
                              const float* grad_logprobs,
                              const float* grad_entropy, void* grad_logits);

// Shared with the CUDA implementation (cc/cuda/logprobs_cuda.h) so that both
// validate and word their errors alike; not for other callers.
namespace internal {

// Every argument check except the target ids (which needs the data).
// `backward` selects the backward's extra pointer rules; for the forward,
// pass nullptr for the backward-only pointers.
void validate_logprobs_args(const char* fn, const void* logits,
                            LogitsDtype dtype, int64_t num_rows,
                            int64_t vocab_size, int64_t row_stride,
                            const int64_t* targets, double temperature,
                            bool backward, const void* out,
                            const float* row_max, const double* row_log_sum,
                            const float* entropy, const float* grad_entropy);

// Throws the std::out_of_range for target id `id` at `row`.
[[noreturn]] void throw_target_out_of_range(const char* fn, int64_t row,
                                            int64_t id, int64_t vocab_size);

}  // namespace internal
}  // namespace dockyard::kernels

#endif  // DOCKYARD_CC_LOGPROBS_H_
