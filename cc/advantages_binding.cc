// The nanobind layer of group_advantages (registered into _dockyard_kernels
// by cc/dockyard_kernels_binding.cc).
//
// Only argument plumbing lives here: arrays arrive through DLPack (torch
// tensors, numpy arrays, ...) without copies, and calls dispatch on the
// arrays' device. The maths and its validation are in cc/advantages.cc and
// cc/cuda/advantages_cuda.cu. nanobind turns std::invalid_argument into
// ValueError and std::runtime_error into RuntimeError.
//
// Build with -DDOCKYARD_WITH_CUDA (and link cc/cuda/advantages_cuda) for the
// CUDA path; without it CUDA arrays raise a RuntimeError saying so.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "cc/advantages.h"
#include "cc/bindings.h"
#ifdef DOCKYARD_WITH_CUDA
#include "cc/cuda/advantages_cuda.h"
#endif

namespace nb = nanobind;

namespace dockyard::kernels {
namespace {

// (num_groups, group_size) float32, C-contiguous, any device.
using RewardsGN = nb::ndarray<const float, nb::ndim<2>, nb::c_contig>;
using OutGN = nb::ndarray<float, nb::ndim<2>, nb::c_contig>;

#ifdef DOCKYARD_WITH_CUDA
constexpr bool kWithCuda = true;
#else
constexpr bool kWithCuda = false;
#endif

Baseline ParseBaseline(const std::string& name) {
  if (name == "leave_one_out") return Baseline::kLeaveOneOut;
  if (name == "group_mean") return Baseline::kGroupMean;
  throw std::invalid_argument("group_advantages: unknown baseline '" + name +
                              "'; valid names: leave_one_out, group_mean");
}

std::string ShapeText(size_t rows, size_t cols) {
  return "(" + std::to_string(rows) + ", " + std::to_string(cols) + ")";
}

void GroupAdvantages(const RewardsGN& rewards, const OutGN& out,
                     const std::string& baseline_name, bool normalize_std,
                     double epsilon_in, uintptr_t stream) {
  // Taken as double so that the signature shows Python's 1e-06, not float's
  // 9.99999997e-07. A value beyond float's range becomes +-inf explicitly (the
  // plain cast would be undefined behaviour), which the core then rejects.
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const float epsilon =
      std::fabs(epsilon_in) > std::numeric_limits<float>::max()
          ? (epsilon_in > 0 ? kInf : -kInf)
          : static_cast<float>(epsilon_in);  // NaN stays NaN.
  const Baseline baseline = ParseBaseline(baseline_name);
  if (rewards.shape(0) != out.shape(0) || rewards.shape(1) != out.shape(1)) {
    throw std::invalid_argument("group_advantages: rewards has shape " +
                                ShapeText(rewards.shape(0), rewards.shape(1)) +
                                " but out has shape " +
                                ShapeText(out.shape(0), out.shape(1)));
  }
  if (rewards.device_type() != out.device_type() ||
      rewards.device_id() != out.device_id()) {
    throw std::invalid_argument(
        "group_advantages: rewards and out are on different devices");
  }
  const auto num_groups = static_cast<int64_t>(rewards.shape(0));
  const auto group_size = static_cast<int64_t>(rewards.shape(1));

  if (rewards.device_type() == nb::device::cpu::value) {
    // The arrays stay referenced by the caller's frame, so their memory lives
    // on while other Python threads run.
    nb::gil_scoped_release release;
    group_advantages(rewards.data(), num_groups, group_size, baseline,
                     normalize_std, epsilon, out.data());
    return;
  }
  if (rewards.device_type() == nb::device::cuda::value) {
#ifdef DOCKYARD_WITH_CUDA
    nb::gil_scoped_release release;  // The call synchronizes its stream.
    group_advantages_cuda(rewards.data(), num_groups, group_size, baseline,
                          normalize_std, epsilon, out.data(),
                          reinterpret_cast<cudaStream_t>(stream));
    return;
#else
    (void)stream;
    throw std::runtime_error(
        "group_advantages: _dockyard_kernels was built without CUDA; rebuild "
        "with --config=cuda");
#endif
  }
  throw std::invalid_argument("group_advantages: unsupported device type " +
                              std::to_string(rewards.device_type()) +
                              " (DLPack code); CPU and CUDA "
                              "are supported");
}

}  // namespace

void bind_advantages(nb::module_& m) {
  m.def("group_advantages", &GroupAdvantages,
        // noconvert: a dtype or layout mismatch is a TypeError, never a silent
        // copy (a copy of `out` would swallow the results).
        nb::arg("rewards").noconvert(), nb::arg("out").noconvert(),
        nb::arg("baseline") = "leave_one_out", nb::arg("normalize_std") = false,
        nb::arg("epsilon") = 1e-6, nb::arg("stream") = 0,
        "Writes group-relative advantages of rewards (num_groups, group_size) "
        "float32 into out (same shape and device). baseline: 'leave_one_out' "
        "or 'group_mean'; normalize_std divides by (unbiased std + epsilon). "
        "stream: a cudaStream_t as int for CUDA arrays (0 = default stream), "
        "ignored on CPU. Raises ValueError for bad arguments or non-finite "
        "rewards.");
}

}  // namespace dockyard::kernels
