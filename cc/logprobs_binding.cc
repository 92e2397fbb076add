// The nanobind layer of gather_logprobs / gather_logprobs_backward (registered
// into _dockyard_kernels by cc/dockyard_kernels_binding.cc).
//
// Only argument plumbing lives here: arrays arrive through DLPack (torch
// tensors, numpy arrays, ...) without copies, calls dispatch on the arrays'
// device, and the GIL is released while the kernel runs. The maths and its
// validation are in cc/logprobs.cc and cc/cuda/logprobs_cuda.cu. nanobind
// turns std::invalid_argument into ValueError, std::out_of_range into
// IndexError and std::runtime_error into RuntimeError.
//
// Build with -DDOCKYARD_WITH_CUDA (and link cc/cuda/logprobs_cuda) for the
// CUDA path; without it CUDA arrays raise a RuntimeError saying so.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cc/bindings.h"
#include "cc/logprobs.h"
#ifdef DOCKYARD_WITH_CUDA
#include "cc/cuda/logprobs_cuda.h"
#endif

namespace nb = nanobind;

namespace dockyard::kernels {
namespace {

// (num_rows, vocab_size), float32 or bfloat16, unit stride along the vocab,
// any row stride (checked below; the dtype has no static type).
using LogitsNV = nb::ndarray<nb::ndim<2>>;
// The gradient buffer: C-contiguous (num_rows, vocab_size), logits' dtype.
using GradNV = nb::ndarray<nb::ndim<2>, nb::c_contig>;
using TargetsN = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig>;
using FloatN = nb::ndarray<float, nb::ndim<1>, nb::c_contig>;
using ConstFloatN = nb::ndarray<const float, nb::ndim<1>, nb::c_contig>;
using DoubleN = nb::ndarray<double, nb::ndim<1>, nb::c_contig>;
using ConstDoubleN = nb::ndarray<const double, nb::ndim<1>, nb::c_contig>;

struct Device {
  int type;
  int id;
};

template <typename Array>
void CheckSameDevice(const char* fn, const Device& device, const Array& a,
                     const char* name) {
  if (!a.is_valid()) return;  // None.
  if (a.device_type() != device.type || a.device_id() != device.id) {
    throw std::invalid_argument(std::string(fn) + ": " + name +
                                " is not on the logits' device");
  }
}

template <typename Array>
void CheckRows(const char* fn, int64_t num_rows, const Array& a,
               const char* name) {
  if (!a.is_valid()) return;
  if (static_cast<int64_t>(a.shape(0)) != num_rows) {
    throw std::invalid_argument(
        std::string(fn) + ": " + name + " has " + std::to_string(a.shape(0)) +
        " rows but logits have " + std::to_string(num_rows));
  }
}

// A per-row array (None allowed): one entry per logits row, on the logits'
// device.
template <typename Array>
void CheckPerRow(const char* fn, int64_t num_rows, const Device& device,
                 const Array& a, const char* name) {
  CheckRows(fn, num_rows, a, name);
  CheckSameDevice(fn, device, a, name);
}

LogitsDtype DtypeOf(const char* fn, nb::dlpack::dtype dt, const char* name) {
  if (dt == nb::dtype<float>()) return LogitsDtype::kFloat32;
  if (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) &&
      dt.bits == 16 && dt.lanes == 1) {
    return LogitsDtype::kBFloat16;
  }
  throw std::invalid_argument(std::string(fn) + ": " + name +
                              " must be float32 or bfloat16");
}

// Checks the logits' layout and returns their row stride in elements.
int64_t RowStride(const char* fn, const LogitsNV& logits) {
  const auto vocab_size = static_cast<int64_t>(logits.shape(1));
  if (vocab_size > 1 && logits.stride(1) != 1) {
    throw std::invalid_argument(
        std::string(fn) +
        ": logits must have unit stride along the vocab "
        "(dim 1), got " +
        std::to_string(logits.stride(1)) + "; pass logits.contiguous()");
  }
  if (logits.stride(0) < 0) {
    throw std::invalid_argument(std::string(fn) +
                                ": logits have a negative row stride");
  }
  return logits.stride(0);
}

template <typename Array>
auto DataOrNull(const Array& a) -> decltype(a.data()) {
  return a.is_valid() ? a.data() : nullptr;
}

#ifndef DOCKYARD_WITH_CUDA
[[noreturn]] void ThrowNoCuda(const char* fn) {
  throw std::runtime_error(std::string(fn) +
                           ": _dockyard_kernels was built without CUDA; "
                           "rebuild with --config=cuda");
}
#endif

[[noreturn]] void ThrowBadDevice(const char* fn, int type) {
  throw std::invalid_argument(std::string(fn) + ": unsupported device type " +
                              std::to_string(type) +
                              " (DLPack code); CPU and CUDA are supported");
}

void GatherLogprobs(const LogitsNV& logits, const TargetsN& targets,
                    double temperature, const FloatN& logprobs,
                    const FloatN& entropy, const FloatN& row_max,
                    const DoubleN& row_log_sum, uintptr_t stream,
                    bool check_targets) {
  constexpr const char* kFn = "gather_logprobs";
  const LogitsDtype dtype = DtypeOf(kFn, logits.dtype(), "logits");
  const int64_t row_stride = RowStride(kFn, logits);
  const auto num_rows = static_cast<int64_t>(logits.shape(0));
  const auto vocab_size = static_cast<int64_t>(logits.shape(1));
  const Device device{logits.device_type(), logits.device_id()};
  CheckPerRow(kFn, num_rows, device, targets, "targets");
  CheckPerRow(kFn, num_rows, device, logprobs, "logprobs");
  CheckPerRow(kFn, num_rows, device, entropy, "entropy");
  CheckPerRow(kFn, num_rows, device, row_max, "row_max");
  CheckPerRow(kFn, num_rows, device, row_log_sum, "row_log_sum");

  if (device.type == nb::device::cpu::value) {
    // The arrays stay referenced by the caller's frame, so their memory lives
    // on while other Python threads run.
    nb::gil_scoped_release release;
    gather_logprobs(logits.data(), dtype, num_rows, vocab_size, row_stride,
                    targets.data(), temperature, logprobs.data(),
                    DataOrNull(entropy), DataOrNull(row_max),
                    DataOrNull(row_log_sum));
    return;
  }
  if (device.type == nb::device::cuda::value) {
#ifdef DOCKYARD_WITH_CUDA
    // Released: a checked call waits for its stream.
    nb::gil_scoped_release release;
    gather_logprobs_cuda(logits.data(), dtype, num_rows, vocab_size, row_stride,
                         targets.data(), temperature, logprobs.data(),
                         DataOrNull(entropy), DataOrNull(row_max),
                         DataOrNull(row_log_sum),
                         reinterpret_cast<cudaStream_t>(stream), check_targets);
    return;
#else
    (void)stream;
    (void)check_targets;
    ThrowNoCuda(kFn);
#endif
  }
  ThrowBadDevice(kFn, device.type);
}

void GatherLogprobsBackward(const LogitsNV& logits, const TargetsN& targets,
                            double temperature, const ConstFloatN& row_max,
                            const ConstDoubleN& row_log_sum,
                            const ConstFloatN& entropy,
                            const ConstFloatN& grad_logprobs,
                            const ConstFloatN& grad_entropy,
                            const GradNV& grad_logits, uintptr_t stream,
                            bool check_targets) {
  constexpr const char* kFn = "gather_logprobs_backward";
  const LogitsDtype dtype = DtypeOf(kFn, logits.dtype(), "logits");
  if (DtypeOf(kFn, grad_logits.dtype(), "grad_logits") != dtype) {
    throw std::invalid_argument(std::string(kFn) +
                                ": grad_logits must have the logits' dtype");
  }
  const int64_t row_stride = RowStride(kFn, logits);
  const auto num_rows = static_cast<int64_t>(logits.shape(0));
  const auto vocab_size = static_cast<int64_t>(logits.shape(1));
  if (static_cast<int64_t>(grad_logits.shape(0)) != num_rows ||
      static_cast<int64_t>(grad_logits.shape(1)) != vocab_size) {
    throw std::invalid_argument(std::string(kFn) +
                                ": grad_logits must have the logits' shape");
  }
  const Device device{logits.device_type(), logits.device_id()};
  CheckPerRow(kFn, num_rows, device, targets, "targets");
  CheckPerRow(kFn, num_rows, device, row_max, "row_max");
  CheckPerRow(kFn, num_rows, device, row_log_sum, "row_log_sum");
  CheckPerRow(kFn, num_rows, device, entropy, "entropy");
  CheckPerRow(kFn, num_rows, device, grad_logprobs, "grad_logprobs");
  CheckPerRow(kFn, num_rows, device, grad_entropy, "grad_entropy");
  CheckSameDevice(kFn, device, grad_logits, "grad_logits");

  if (device.type == nb::device::cpu::value) {
    nb::gil_scoped_release release;
    gather_logprobs_backward(logits.data(), dtype, num_rows, vocab_size,
                             row_stride, targets.data(), temperature,
                             row_max.data(), row_log_sum.data(),
                             DataOrNull(entropy), DataOrNull(grad_logprobs),
                             DataOrNull(grad_entropy), grad_logits.data());
    return;
  }
  if (device.type == nb::device::cuda::value) {
#ifdef DOCKYARD_WITH_CUDA
    // Released: a checked call waits for its stream.
    nb::gil_scoped_release release;
    gather_logprobs_backward_cuda(
        logits.data(), dtype, num_rows, vocab_size, row_stride, targets.data(),
        temperature, row_max.data(), row_log_sum.data(), DataOrNull(entropy),
        DataOrNull(grad_logprobs), DataOrNull(grad_entropy), grad_logits.data(),
        reinterpret_cast<cudaStream_t>(stream), check_targets);
    return;
#else
    (void)stream;
    (void)check_targets;
    ThrowNoCuda(kFn);
#endif
  }
  ThrowBadDevice(kFn, device.type);
}

}  // namespace

void bind_logprobs(nb::module_& m) {
  // noconvert: a dtype or layout mismatch is a TypeError, never a silent copy
  // (a copy of an output would swallow the results). Optional arrays accept
  // None.
  m.def("gather_logprobs", &GatherLogprobs, nb::arg("logits").noconvert(),
        nb::arg("targets").noconvert(), nb::arg("temperature"),
        nb::arg("logprobs").noconvert(), nb::arg("entropy").noconvert().none(),
        nb::arg("row_max").noconvert().none(),
        nb::arg("row_log_sum").noconvert().none(), nb::arg("stream") = 0,
        nb::arg("check_targets") = true,
        "Fused log-prob gather: for logits (N, V) float32/bfloat16 (unit "
        "stride along V) and int64 targets (N), writes float32 logprobs (N) "
        "= log_softmax(logits / temperature)[target] and, when given, "
        "float32 entropy (N), float32 row_max (N) and float64 row_log_sum "
        "(N) (the statistics the backward needs). stream: a cudaStream_t as "
        "int for CUDA arrays (0 = default stream), ignored on CPU. Raises "
        "IndexError for a target outside [0, V), ValueError for bad "
        "arguments. check_targets (CUDA only; the CPU path always checks "
        "before writing): True waits for the stream once to raise that "
        "IndexError (the outputs are written by then, NaN in bad rows); "
        "False only queues the kernel, and a bad id gives NaN in its row.");
  m.def("gather_logprobs_backward", &GatherLogprobsBackward,
        nb::arg("logits").noconvert(), nb::arg("targets").noconvert(),
        nb::arg("temperature"), nb::arg("row_max").noconvert(),
        nb::arg("row_log_sum").noconvert(),
        nb::arg("entropy").noconvert().none(),
        nb::arg("grad_logprobs").noconvert().none(),
        nb::arg("grad_entropy").noconvert().none(),
        nb::arg("grad_logits").noconvert(), nb::arg("stream") = 0,
        nb::arg("check_targets") = true,
        "Backward of gather_logprobs: writes grad_logits (C-contiguous (N, "
        "V), logits' dtype) = grad_logprobs * (onehot - p) / T + "
        "grad_entropy * (-p (log p + entropy)) / T, from the forward's "
        "row_max, row_log_sum and entropy. grad_logprobs / grad_entropy None "
        "= zeros; entropy is required with grad_entropy. stream and "
        "check_targets as for gather_logprobs (pass check_targets=False "
        "right after a checked forward on the same targets: no wait).");
}

}  // namespace dockyard::kernels
