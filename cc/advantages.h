// Group-relative advantages for GRPO (core library: no Python, no CUDA).
//
// GRPO samples `group_size` completions per prompt and scores each one; a
// sample's advantage is its reward minus a baseline computed from the other
// samples of the same prompt ("group"), optionally divided by the group's
// reward standard deviation.
//
// Layout: `rewards` and `out` are row-major (num_groups, group_size) float32
// arrays; row g holds the rewards of group g.
//
// Numerics: every sum is accumulated in double, so rewards anywhere in the
// float range (e.g. 1e30, whose square overflows float) and large rewards with
// small differences (e.g. 1e7 + 0.5) stay accurate. Only the final cast to
// float can overflow, when a true advantage exceeds the float range (e.g.
// rewards of +-3e38): there is no float answer then, and the result is +-inf.

#ifndef DOCKYARD_CC_ADVANTAGES_H_
#define DOCKYARD_CC_ADVANTAGES_H_

#include <cstdint>

namespace dockyard::kernels {

enum class Baseline {
  // Baseline of sample i = mean of the OTHER samples of its group (RLOO).
  // Equivalent closed form: adv_i = n / (n - 1) * (r_i - mean). A group of one
  // sample has no others: its advantage is 0.
  kLeaveOneOut,
  // Baseline = mean of the whole group (the sample itself included).
  kGroupMean,
};

// Writes the advantages of `rewards` into `out`, both (num_groups, group_size).
//
// normalize_std: divide each advantage by (std + epsilon), std being the
//   unbiased (n - 1) standard deviation of the group's rewards, as torch.std.
// Degenerate groups give exactly 0, never NaN or inf: a group of one sample,
//   or a group whose rewards are all exactly equal (no signal to learn from;
//   this holds with or without normalisation).
//
// `out` may be the same pointer as `rewards` (in place); any other overlap is
// not allowed. Groups are processed in parallel with std::thread when there
// are many of them; the result does not depend on the thread count.
//
// Throws std::invalid_argument (the contents of `out` are unspecified then)
// when: a size is negative or num_groups * group_size overflows int64;
// epsilon is negative or not finite; a pointer is null while the size is
// nonzero; `baseline` is not a known enumerator; a reward is NaN or +-inf
// (the message names the first such group and index, in row-major order).
void group_advantages(const float* rewards, int64_t num_groups,
                      int64_t group_size, Baseline baseline, bool normalize_std,
                      float epsilon, float* out);

// Shared with the CUDA implementation (cc/cuda/advantages_cuda.h) so that both
// validate and word their errors alike; not for other callers.
namespace internal {

// Throws std::invalid_argument for every argument error listed above except
// non-finite rewards (which needs the data).
void validate_group_advantages_args(const float* rewards, int64_t num_groups,
                                    int64_t group_size, Baseline baseline,
                                    float epsilon, const float* out);

// Throws the std::invalid_argument for a non-finite reward at (group, index).
[[noreturn]] void throw_non_finite_reward(int64_t group, int64_t index,
                                          float value);

}  // namespace internal
}  // namespace dockyard::kernels

#endif  // DOCKYARD_CC_ADVANTAGES_H_
