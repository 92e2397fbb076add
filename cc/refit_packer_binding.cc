// The nanobind layer of the refit packer (registered into _dockyard_kernels
// by cc/dockyard_kernels_binding.cc).
//
// Only argument plumbing lives here: tensors arrive through DLPack (no
// copies) with their strides, and calls dispatch on the bucket's device. The
// planning, copies and their validation are in cc/refit_packer.cc and
// cc/cuda/refit_packer_cuda.cu. nanobind turns std::invalid_argument into
// ValueError, std::out_of_range into IndexError and std::runtime_error into
// RuntimeError.
//
// The copies are byte copies, so dtypes only matter through their size; the
// Python module passes every tensor as a same-size integer view (uint8, int16,
// int32, int64), which DLPack exports whatever the original dtype (bfloat16,
// bool, float8 ...).
//
// Two entry points, the ones python/dockyard_rl/kernels/ calls:
// - refit_plan_buckets (refit_planning.py): the layout of the buckets;
// - refit_pack_bucket (refit_copy.py's PackPlan.pack_bucket): one bucket per
//   call, its tensors converted and validated per call.
//
// Build with -DDOCKYARD_WITH_CUDA (and link cc/cuda/refit_packer_cuda) for the
// CUDA path; without it CUDA buckets raise a RuntimeError saying so.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "cc/bindings.h"
#include "cc/refit_packer.h"
#ifdef DOCKYARD_WITH_CUDA
#include "cc/cuda/refit_packer_cuda.h"
#endif

namespace nb = nanobind;

namespace dockyard::kernels {
namespace {

// A bucket: 1-D, C-contiguous bytes on any device.
using BucketBytes = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig>;
// A tensor of any dtype, shape, strides and device.
using AnyArray = nb::ndarray<>;

std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>
PlanBuckets(const std::vector<int64_t>& tensor_nbytes,
            int64_t bucket_size_bytes, int64_t alignment) {
  BucketPlan plan = plan_buckets(tensor_nbytes, bucket_size_bytes, alignment);
  return {std::move(plan.bucket_of), std::move(plan.offset_of),
          std::move(plan.bucket_sizes)};
}

// Tensor `i`'s memory as the core library describes it.
StridedTensor ToStrided(const char* function, const AnyArray& t, size_t i) {
  const nb::dlpack::dtype dt = t.dtype();
  if (dt.lanes != 1 || dt.bits % 8 != 0) {
    throw std::invalid_argument(std::string(function) + ": tensor " +
                                std::to_string(i) +
                                " has a dtype that is not whole bytes");
  }
  StridedTensor s;
  s.data = t.data();
  s.element_size = dt.bits / 8;
  s.shape.resize(t.ndim());
  s.strides.resize(t.ndim());
  for (size_t d = 0; d < t.ndim(); ++d) {
    s.shape[d] = static_cast<int64_t>(t.shape(d));
    s.strides[d] = t.stride(d);
  }
  return s;
}

// The spans of `tensors` at `offsets`, after checking that every tensor is on
// the bucket's device.
std::vector<BucketSpan> ToSpans(const char* function, const BucketBytes& bucket,
                                const std::vector<AnyArray>& tensors,
                                const std::vector<int64_t>& offsets) {
  if (tensors.size() != offsets.size()) {
    throw std::invalid_argument(
        std::string(function) + ": got " + std::to_string(tensors.size()) +
        " tensors but " + std::to_string(offsets.size()) + " offsets");
  }
  std::vector<BucketSpan> spans(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const AnyArray& t = tensors[i];
    if (t.device_type() != bucket.device_type() ||
        t.device_id() != bucket.device_id()) {
      throw std::invalid_argument(std::string(function) + ": tensor " +
                                  std::to_string(i) +
                                  " is not on the bucket's device");
    }
    spans[i].tensor = ToStrided(function, t, i);
    spans[i].offset = offsets[i];
  }
  return spans;
}

[[noreturn]] void ThrowDevice(const char* function, const BucketBytes& bucket) {
  if (bucket.device_type() == nb::device::cuda::value) {
    throw std::runtime_error(std::string(function) +
                             ": _dockyard_kernels was built without CUDA; "
                             "rebuild with --config=cuda");
  }
  throw std::invalid_argument(std::string(function) +
                              ": unsupported device type " +
                              std::to_string(bucket.device_type()) +
                              " (DLPack code); CPU and CUDA are supported");
}

void PackBucket(const BucketBytes& bucket, const std::vector<AnyArray>& tensors,
                const std::vector<int64_t>& offsets, int num_threads,
                uintptr_t stream) {
  constexpr const char* kFn = "pack_bucket";
  const std::vector<BucketSpan> spans = ToSpans(kFn, bucket, tensors, offsets);
  const auto nbytes = static_cast<int64_t>(bucket.shape(0));
  if (bucket.device_type() == nb::device::cpu::value) {
    // The arrays stay referenced by the caller's frame while other Python
    // threads run.
    nb::gil_scoped_release release;
    pack_bucket(spans, bucket.data(), nbytes, num_threads);
    return;
  }
#ifdef DOCKYARD_WITH_CUDA
  if (bucket.device_type() == nb::device::cuda::value) {
    internal::validate_num_threads(kFn, num_threads);  // Unused on CUDA.
    nb::gil_scoped_release release;
    pack_bucket_cuda(spans, bucket.data(), nbytes,
                     reinterpret_cast<cudaStream_t>(stream));
    return;
  }
#endif
  (void)stream;
  ThrowDevice(kFn, bucket);
}

}  // namespace

void bind_refit_packer(nb::module_& m) {
  m.def("refit_plan_buckets", &PlanBuckets, nb::arg("tensor_nbytes"),
        nb::arg("bucket_size_bytes"), nb::arg("alignment"),
        "Places tensors of the given byte sizes, in order, into buckets of at "
        "most bucket_size_bytes (a tensor larger than that gets its own). "
        "Returns (bucket_of, offset_of, bucket_sizes). Raises ValueError for "
        "a bad alignment or bucket size, or a negative size.");
  m.def("refit_pack_bucket", &PackBucket, nb::arg("bucket").noconvert(),
        nb::arg("tensors"), nb::arg("offsets"), nb::arg("num_threads") = 0,
        nb::arg("stream") = 0,
        "Copies each tensor's row-major bytes into bucket (1-D uint8, "
        "C-contiguous, same device) at its offset and zeroes the other bytes. "
        "Tensors may have any strides. num_threads: CPU workers, 0 = "
        "automatic. stream: a cudaStream_t as int for CUDA buckets (0 = "
        "default stream); CUDA copies are asynchronous on it. Raises "
        "ValueError for bad spans (overlap, bad sizes) and IndexError for a "
        "span past the bucket's end, before writing anything.");
}

}  // namespace dockyard::kernels
