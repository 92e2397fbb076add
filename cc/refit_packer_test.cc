// Tests of the core refit packer (cc/refit_packer.h), on the harness of
// cc/testing.h: it prints each failure with its line, then
// "refit_packer_test: N passed, M failed", and exits nonzero on any failure.
//
// Copies are checked against a naive element-by-element reference (unravel
// every row-major index, read the element at its strided address), written
// independently of the library's dim collapsing and byte-range splitting.

#include "cc/refit_packer.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cc/testing.h"

namespace {

using dockyard::testing::FillPseudoRandom;

using dockyard::kernels::BucketPlan;
using dockyard::kernels::BucketSpan;
using dockyard::kernels::pack_bucket;
using dockyard::kernels::plan_buckets;
using dockyard::kernels::StridedTensor;

// A strided view over its own storage. `storage_elements` is how many
// elements the storage holds; `element_offset` is where element 0 starts.
struct HostTensor {
  std::vector<char> storage;
  StridedTensor view;
};

HostTensor MakeTensor(int64_t element_size, std::vector<int64_t> shape,
                      std::vector<int64_t> strides, int64_t storage_elements,
                      int64_t element_offset, uint64_t seed) {
  HostTensor t;
  t.storage.resize(static_cast<size_t>(storage_elements * element_size));
  FillPseudoRandom(&t.storage, seed);
  t.view.data = t.storage.data() + element_offset * element_size;
  t.view.element_size = element_size;
  t.view.shape = std::move(shape);
  t.view.strides = std::move(strides);
  return t;
}

// Row-major strides of a dense tensor of `shape`.
std::vector<int64_t> DenseStrides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    strides[d] = s;
    s *= shape[d];
  }
  return strides;
}

HostTensor MakeDense(int64_t element_size, std::vector<int64_t> shape,
                     uint64_t seed) {
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  std::vector<int64_t> strides = DenseStrides(shape);
  return MakeTensor(element_size, std::move(shape), std::move(strides), numel,
                    0, seed);
}

int64_t NumElements(const StridedTensor& t) {
  int64_t n = 1;
  for (int64_t s : t.shape) n *= s;
  return n;
}

// Address of the element with row-major index `flat`.
char* ElementAddress(const StridedTensor& t, int64_t flat) {
  int64_t offset = 0;
  for (size_t d = t.shape.size(); d-- > 0;) {
    offset += (flat % t.shape[d]) * t.strides[d];
    flat /= t.shape[d];
  }
  return static_cast<char*>(t.data) + offset * t.element_size;
}

// The tensor's elements in row-major order, as bytes.
std::vector<char> ReferenceBytes(const StridedTensor& t) {
  std::vector<char> out;
  const int64_t n = NumElements(t);
  for (int64_t e = 0; e < n; ++e) {
    const char* p = ElementAddress(t, e);
    out.insert(out.end(), p, p + t.element_size);
  }
  return out;
}

// A bucket where every span's reference bytes sit at its offset and every
// other byte is 0.
std::vector<char> ReferenceBucket(const std::vector<BucketSpan>& spans,
                                  int64_t bucket_nbytes) {
  std::vector<char> bucket(static_cast<size_t>(bucket_nbytes), 0);
  for (const BucketSpan& s : spans) {
    const std::vector<char> bytes = ReferenceBytes(s.tensor);
    if (!bytes.empty())
      std::memcpy(bucket.data() + s.offset, bytes.data(), bytes.size());
  }
  return bucket;
}

bool SameBytes(const std::vector<char>& a, const std::vector<char>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0);
}

// --- Planning ---------------------------------------------------------------

void TestPlanHandExample() {
  // Alignment 16, buckets of 64 bytes:
  //   t0 10 B -> b0 @0 (end 10)
  //   t1 20 B -> b0 @16 (end 36)
  //   t2 40 B -> @48 would end at 88 > 64: b1 @0 (b0 closes at 48)
  //   t3 100 B (larger than a bucket) -> b2 @0 (b1 closes at 48)
  //   t4 0 B -> stays in b2 at the aligned end, @112
  //   t5 8 B -> @112 would end past 64: b3 @0; b2 closes at 112, b3 at 16.
  const BucketPlan plan = plan_buckets({10, 20, 40, 100, 0, 8}, 64, 16);
  CHECK((plan.bucket_of == std::vector<int64_t>{0, 0, 1, 2, 2, 3}));
  CHECK((plan.offset_of == std::vector<int64_t>{0, 16, 0, 0, 112, 0}));
  CHECK((plan.bucket_sizes == std::vector<int64_t>{48, 48, 112, 16}));
}

void TestPlanExactFitAndEmpties() {
  // 64 + 64 fill a 128-byte bucket exactly; the next byte starts a bucket.
  BucketPlan plan = plan_buckets({64, 64, 1}, 128, 16);
  CHECK((plan.bucket_of == std::vector<int64_t>{0, 0, 1}));
  CHECK((plan.offset_of == std::vector<int64_t>{0, 64, 0}));
  CHECK((plan.bucket_sizes == std::vector<int64_t>{128, 16}));
  // No tensors: no buckets. Only empty tensors: one empty bucket.
  plan = plan_buckets({}, 256, 256);
  CHECK(plan.bucket_sizes.empty() && plan.bucket_of.empty());
  plan = plan_buckets({0, 0}, 256, 256);
  CHECK((plan.bucket_of == std::vector<int64_t>{0, 0}));
  CHECK((plan.offset_of == std::vector<int64_t>{0, 0}));
  CHECK((plan.bucket_sizes == std::vector<int64_t>{0}));
  // Leading empty tensors share the first bucket with an oversize tensor.
  plan = plan_buckets({0, 1000, 4}, 256, 256);
  CHECK((plan.bucket_of == std::vector<int64_t>{0, 0, 1}));
  CHECK((plan.offset_of == std::vector<int64_t>{0, 0, 0}));
  CHECK((plan.bucket_sizes == std::vector<int64_t>{1024, 256}));
}

void TestPlanProperties() {
  // Pseudo-random sizes: every bucket is a multiple of the alignment and at
  // most the bucket size unless it holds one oversize tensor; offsets are
  // aligned and increase within a bucket without overlap.
  std::vector<char> noise(4000);
  FillPseudoRandom(&noise, 7);
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < noise.size(); i += 2) {
    const auto r = static_cast<unsigned char>(noise[i]);
    sizes.push_back(
        r % 5 == 0 ? 0
                   : r * (1 + static_cast<unsigned char>(noise[i + 1]) % 7));
  }
  const int64_t bucket = 1024, align = 64;
  const BucketPlan plan = plan_buckets(sizes, bucket, align);
  std::vector<int64_t> end_of(plan.bucket_sizes.size(), 0);
  std::vector<int> nonempty_in(plan.bucket_sizes.size(), 0);
  int64_t prev_bucket = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t b = plan.bucket_of[i], off = plan.offset_of[i];
    CHECK(b == prev_bucket || b == prev_bucket + 1);
    CHECK(off % align == 0);
    CHECK(off >= end_of[b]);  // In order, no overlap.
    CHECK(off + sizes[i] <= plan.bucket_sizes[b]);
    end_of[b] = off + sizes[i];
    if (sizes[i] > 0) ++nonempty_in[b];
    prev_bucket = b;
  }
  for (size_t b = 0; b < plan.bucket_sizes.size(); ++b) {
    CHECK(plan.bucket_sizes[b] % align == 0);
    CHECK(plan.bucket_sizes[b] <= bucket || nonempty_in[b] == 1);
  }
}

void TestPlanErrors() {
  EXPECT_INVALID_ARGUMENT(plan_buckets({1}, 256, 8),
                          "alignment must be a power of two in [16,");
  EXPECT_INVALID_ARGUMENT(plan_buckets({1}, 240, 48), "got 48");
  EXPECT_INVALID_ARGUMENT(plan_buckets({1}, 100, 16),
                          "bucket_size_bytes must be a positive multiple of "
                          "the alignment (16), got 100");
  EXPECT_INVALID_ARGUMENT(plan_buckets({1}, 0, 16), "got 0");
  EXPECT_INVALID_ARGUMENT(plan_buckets({1, -3}, 256, 16),
                          "tensor 1 has a negative size (-3 bytes)");
  EXPECT_INVALID_ARGUMENT(plan_buckets({INT64_MAX - 4, INT64_MAX - 4}, 256, 16),
                          "overflow");
}

// --- Copies -----------------------------------------------------------------

// Packs `tensors` at `offsets` with several thread counts and compares each
// bucket with the reference bucket (padding included).
void CheckPack(const std::vector<HostTensor>& tensors,
               const std::vector<int64_t>& offsets, int64_t bucket_nbytes) {
  std::vector<BucketSpan> spans;
  for (size_t i = 0; i < tensors.size(); ++i) {
    spans.push_back({tensors[i].view, offsets[i]});
  }
  const std::vector<char> expected = ReferenceBucket(spans, bucket_nbytes);
  for (int threads : {0, 1, 2, 3, 7}) {
    std::vector<char> bucket(static_cast<size_t>(bucket_nbytes),
                             'x');  // Not zero: padding must be written.
    pack_bucket(spans, bucket.data(), bucket_nbytes, threads);
    CHECK(SameBytes(bucket, expected));
  }
}

void TestPackLayouts() {
  std::vector<HostTensor> t;
  // Contiguous 2-D float32-sized elements.
  t.push_back(MakeDense(4, {3, 5}, 1));
  // Transposed (5, 3) view of a (3, 5) storage: strides (1, 5).
  t.push_back(MakeTensor(2, {5, 3}, {1, 5}, 15, 0, 2));
  // 3-D slice with steps [1:, ::2, ::3] of a (4, 6, 7) storage.
  t.push_back(MakeTensor(8, {3, 3, 3}, {42 * 1, 14, 3}, 4 * 6 * 7, 42, 3));
  // 0-d tensor (one element).
  t.push_back(MakeTensor(1, {}, {}, 1, 0, 4));
  // Empty tensor.
  t.push_back(MakeTensor(4, {0, 9}, {9, 1}, 0, 0, 5));
  // 16-byte elements, column of a matrix (stride 4).
  t.push_back(MakeTensor(16, {6}, {4}, 24, 1, 6));
  // A size-1 dim with an odd stride between dense dims.
  t.push_back(MakeTensor(2, {2, 1, 8}, {8, 1000, 1}, 16, 0, 7));
  std::vector<int64_t> offsets;
  int64_t pos = 0;
  for (const HostTensor& h : t) {
    offsets.push_back(pos);
    pos += (NumElements(h.view) * h.view.element_size + 15) / 16 * 16;
  }
  CheckPack(t, offsets, pos + 32);  // Tail padding too.
}

void TestPackLargeThreaded() {
  // ~3 MiB: the automatic thread count uses several workers, and explicit
  // counts split the transposed tensor in the middle of rows.
  std::vector<HostTensor> t;
  t.push_back(MakeDense(4, {512, 513}, 11));
  t.push_back(MakeTensor(2, {700, 600}, {1, 700}, 700 * 600, 0, 12));
  t.push_back(MakeDense(1, {3}, 13));
  const int64_t n0 = 512 * 513 * 4, n1 = 700 * 600 * 2;
  CheckPack(t, {0, n0, n0 + n1 + 16}, n0 + n1 + 32);
}

void TestUnorderedOffsets() {
  // Spans need not come in offset order.
  std::vector<HostTensor> t;
  t.push_back(MakeDense(4, {4}, 21));
  t.push_back(MakeDense(4, {4}, 22));
  CheckPack(t, {32, 0}, 48);
}

void TestCopyErrors() {
  HostTensor a = MakeDense(4, {4}, 31);
  std::vector<char> bucket(64);
  char* b = bucket.data();
  auto one = [&](StridedTensor v, int64_t offset) {
    return std::vector<BucketSpan>{{std::move(v), offset}};
  };
  EXPECT_THROW_MSG(pack_bucket(one(a.view, 56), b, 64), std::out_of_range,
                   "pack_bucket: span 0 covers bytes [56, 56 + 16) but the "
                   "bucket has 64 bytes");
  EXPECT_INVALID_ARGUMENT(pack_bucket(one(a.view, -16), b, 64),
                          "offset must be >= 0, got -16");
  EXPECT_INVALID_ARGUMENT(pack_bucket({{a.view, 0}, {a.view, 8}}, b, 64),
                          "span 0 and span 1 overlap in the bucket");
  EXPECT_INVALID_ARGUMENT(pack_bucket(one(a.view, 0), nullptr, 64),
                          "bucket is null");
  EXPECT_INVALID_ARGUMENT(pack_bucket(one(a.view, 0), b, -1),
                          "bucket_nbytes must be >= 0");
  EXPECT_INVALID_ARGUMENT(pack_bucket(one(a.view, 0), b, 64, -1),
                          "num_threads must be in [0, 1024]");
  StridedTensor bad = a.view;
  bad.element_size = 3;
  EXPECT_INVALID_ARGUMENT(pack_bucket(one(bad, 0), b, 64),
                          "element_size must be 1, 2, 4, 8 or 16, got 3");
  bad = a.view;
  bad.strides = {1, 1};
  EXPECT_INVALID_ARGUMENT(pack_bucket(one(bad, 0), b, 64),
                          "shape has 1 dims but strides has 2");
  bad = a.view;
  bad.strides = {-1};
  EXPECT_INVALID_ARGUMENT(pack_bucket(one(bad, 0), b, 64), "both must be >= 0");
  bad = a.view;
  bad.data = nullptr;
  EXPECT_INVALID_ARGUMENT(pack_bucket(one(bad, 0), b, 64), "data is null");
  bad.shape = {0};  // No elements: a null pointer is fine.
  pack_bucket(one(bad, 0), b, 64);
  bad = a.view;
  bad.shape = {INT64_MAX / 2};
  EXPECT_INVALID_ARGUMENT(pack_bucket(one(bad, 0), b, 64),
                          "byte size overflows int64");

  // A zero-stride (expanded) source: several elements read one address.
  StridedTensor expanded = a.view;
  expanded.shape = {4, 3};
  expanded.strides = {1, 0};
  pack_bucket(one(expanded, 0), b, 64);
  // A tensor inside the bucket's memory.
  StridedTensor inside = a.view;
  inside.data = b + 32;
  EXPECT_INVALID_ARGUMENT(pack_bucket(one(inside, 0), b, 64),
                          "span 0: the tensor's memory overlaps the bucket");

  // Nothing was written by a failing call.
  std::vector<char> guard(64, 'g');
  EXPECT_INVALID_ARGUMENT(
      pack_bucket({{a.view, 0}, {a.view, 8}}, guard.data(), 64), "overlap");
  CHECK(SameBytes(guard, std::vector<char>(64, 'g')));
}

void TestEmptyBucket() {
  pack_bucket({}, nullptr, 0);
  HostTensor e = MakeTensor(8, {0}, {1}, 0, 0, 41);
  e.view.data = nullptr;
  pack_bucket({{e.view, 0}}, nullptr, 0);
}

}  // namespace

int main() {
  return dockyard::testing::RunTests(
      "refit_packer_test",
      {
          {"PlanHandExample", TestPlanHandExample},
          {"PlanExactFitAndEmpties", TestPlanExactFitAndEmpties},
          {"PlanProperties", TestPlanProperties},
          {"PlanErrors", TestPlanErrors},
          {"PackLayouts", TestPackLayouts},
          {"PackLargeThreaded", TestPackLargeThreaded},
          {"UnorderedOffsets", TestUnorderedOffsets},
          {"CopyErrors", TestCopyErrors},
          {"EmptyBucket", TestEmptyBucket},
      });
}
