#include "cc/refit_packer.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace dockyard::kernels {
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

[[noreturn]] void ThrowInvalid(const char* function, const std::string& what) {
  throw std::invalid_argument(std::string(function) + ": " + what);
}

std::string SpanName(int64_t index) { return "span " + std::to_string(index); }

bool IsPowerOfTwo(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

// Rounds `v` (>= 0) up to a multiple of the power of two `alignment`; false
// when that overflows int64.
bool AlignUp(int64_t v, int64_t alignment, int64_t* out) {
  if (v > kInt64Max - (alignment - 1)) return false;
  *out = (v + alignment - 1) & ~(alignment - 1);
  return true;
}

// Copies `count` elements of N bytes between two strided element sequences.
// memcpy with a constant size compiles to one load and one store.
template <int N>
void CopyElements(char* dst, int64_t dst_stride, const char* src,
                  int64_t src_stride, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    std::memcpy(dst, src, N);
    dst += dst_stride;
    src += src_stride;
  }
}

void CopyStridedElements(int64_t element_size, char* dst, int64_t dst_stride,
                         const char* src, int64_t src_stride, int64_t count) {
  switch (element_size) {
    case 1: return CopyElements<1>(dst, dst_stride, src, src_stride, count);
    case 2: return CopyElements<2>(dst, dst_stride, src, src_stride, count);
    case 4: return CopyElements<4>(dst, dst_stride, src, src_stride, count);
    case 8: return CopyElements<8>(dst, dst_stride, src, src_stride, count);
    case 16: return CopyElements<16>(dst, dst_stride, src, src_stride, count);
    default:
      // validate_spans only lets the sizes above through.
      throw std::logic_error("refit_packer: unexpected element size");
  }
}

// Copies elements [begin, end) (row-major order) of `span`'s tensor into the
// bucket at `bucket`.
void CopyElementRange(const internal::CollapsedSpan& span, char* bucket,
                      int64_t begin, int64_t end) {
  if (begin >= end) return;
  const int64_t es = span.element_size;
  char* contiguous = bucket + span.offset + begin * es;
  const auto ndim = static_cast<int64_t>(span.shape.size());
  if (ndim == 0) {  // A single element (begin == 0, end == 1).
    std::memcpy(contiguous, span.data, es);
    return;
  }
  // Unravel `begin` into a row-major multi-index.
  std::vector<int64_t> index(ndim);
  int64_t rest = begin;
  for (int64_t d = ndim - 1; d >= 0; --d) {
    index[d] = rest % span.shape[d];
    rest /= span.shape[d];
  }
  const int64_t inner_size = span.shape[ndim - 1];
  const int64_t inner_stride = span.byte_strides[ndim - 1];
  int64_t e = begin;
  while (e < end) {
    char* strided = span.data;
    for (int64_t d = 0; d < ndim; ++d)
      strided += index[d] * span.byte_strides[d];
    const int64_t count = std::min(inner_size - index[ndim - 1], end - e);
    if (inner_stride == es) {  // The innermost dim is dense: one memcpy.
      std::memcpy(contiguous, strided, count * es);
    } else {
      CopyStridedElements(es, contiguous, es, strided, inner_stride, count);
    }
    contiguous += count * es;
    e += count;
    // Advance the multi-index by `count` (only the innermost digit can be
    // partial; carry into the outer ones).
    index[ndim - 1] += count;
    for (int64_t d = ndim - 1; d > 0 && index[d] == span.shape[d]; --d) {
      index[d] = 0;
      ++index[d - 1];
    }
  }
}

// Copies the byte range [begin, end) of `spans` laid end to end (span i
// covers [starts[i], starts[i] + nbytes)) into `bucket`. Cuts fall on element
// boundaries: a cut at byte c inside span i is element (c - starts[i]) /
// element_size, the same for the worker that ends there and the one that
// starts there, so every element is copied exactly once.
void CopyByteRange(const std::vector<const internal::CollapsedSpan*>& spans,
                   const std::vector<int64_t>& starts, char* bucket,
                   int64_t begin, int64_t end) {
  // The first span that ends after `begin`.
  auto it = std::upper_bound(starts.begin(), starts.end(), begin);
  size_t i = static_cast<size_t>(it - starts.begin());
  i = i == 0 ? 0 : i - 1;
  for (; i < spans.size() && starts[i] < end; ++i) {
    const internal::CollapsedSpan& span = *spans[i];
    if (span.numel == 0) continue;
    auto element_at = [&](int64_t cut) {
      const int64_t local =
          std::clamp<int64_t>(cut - starts[i], 0, span.nbytes);
      return local / span.element_size;
    };
    CopyElementRange(span, bucket, element_at(begin), element_at(end));
  }
}

// Copies every span with bytes into `bucket`, split across workers by bytes.
void RunCopies(const std::vector<internal::CollapsedSpan>& collapsed,
               char* bucket, int num_threads) {
  std::vector<const internal::CollapsedSpan*> spans;
  std::vector<int64_t> starts;
  int64_t total = 0;  // No overflow: the spans do not overlap in the bucket.
  for (const internal::CollapsedSpan& s : collapsed) {
    if (s.nbytes == 0) continue;
    spans.push_back(&s);
    starts.push_back(total);
    total += s.nbytes;
  }
  if (total == 0) return;
  int64_t workers = num_threads;
  if (workers == 0) {
    const int64_t hw = std::max(1u, std::thread::hardware_concurrency());
    workers =
        std::min(hw, (total + kMinBytesPerThread - 1) / kMinBytesPerThread);
  }
  workers = std::max<int64_t>(1, std::min(workers, total));
  if (workers == 1) {
    CopyByteRange(spans, starts, bucket, 0, total);
    return;
  }
  // Worker t copies bytes [cut(t), cut(t + 1)), cut(t) = t * total / workers
  // computed in two steps so that t * total cannot overflow.
  auto cut = [&](int64_t t) {
    return (total / workers) * t + ((total % workers) * t) / workers;
  };
  auto run = [&](int64_t t) {
    CopyByteRange(spans, starts, bucket, cut(t), cut(t + 1));
  };
  std::vector<std::thread> threads;
  threads.reserve(workers - 1);
  int64_t next = 1;
  try {
    for (; next < workers; ++next) threads.emplace_back(run, next);
  } catch (const std::system_error&) {
    // The system refused another thread: copy the remaining ranges here
    // rather than fail (started threads are joined below either way).
  }
  run(0);
  for (; next < workers; ++next) run(next);
  for (std::thread& th : threads) th.join();
}

// Validates one span for a bucket of `bucket_nbytes` bytes and returns it
// collapsed (see internal::CollapsedSpan).
internal::CollapsedSpan CollapseSpan(const char* function, int64_t idx,
                                     const StridedTensor& t, int64_t offset,
                                     int64_t bucket_nbytes) {
  const int64_t es = t.element_size;
  if (es != 1 && es != 2 && es != 4 && es != 8 && es != 16) {
    ThrowInvalid(function, SpanName(idx) +
                               ": element_size must be 1, 2, 4, "
                               "8 or 16, got " +
                               std::to_string(es));
  }
  if (t.shape.size() != t.strides.size()) {
    ThrowInvalid(function, SpanName(idx) + ": shape has " +
                               std::to_string(t.shape.size()) +
                               " dims but strides has " +
                               std::to_string(t.strides.size()));
  }
  int64_t numel = 1;
  bool empty = false;
  for (size_t d = 0; d < t.shape.size(); ++d) {
    if (t.shape[d] < 0 || t.strides[d] < 0) {
      ThrowInvalid(function, SpanName(idx) + ": dim " + std::to_string(d) +
                                 " has size " + std::to_string(t.shape[d]) +
                                 " and stride " + std::to_string(t.strides[d]) +
                                 "; both must be >= 0");
    }
    empty = empty || t.shape[d] == 0;
  }
  for (size_t d = 0; d < t.shape.size() && !empty; ++d) {
    if (numel > kInt64Max / es / t.shape[d]) {
      ThrowInvalid(function, SpanName(idx) + ": byte size overflows int64");
    }
    numel *= t.shape[d];
  }
  if (empty) numel = 0;
  internal::CollapsedSpan c;
  c.data = static_cast<char*>(t.data);
  c.element_size = es;
  c.numel = numel;
  c.nbytes = numel * es;
  c.offset = offset;
  if (c.offset < 0) {
    ThrowInvalid(function, SpanName(idx) + ": offset must be >= 0, got " +
                               std::to_string(c.offset));
  }
  if (c.offset > bucket_nbytes || c.nbytes > bucket_nbytes - c.offset) {
    throw std::out_of_range(std::string(function) + ": " + SpanName(idx) +
                            " covers bytes [" + std::to_string(c.offset) +
                            ", " + std::to_string(c.offset) + " + " +
                            std::to_string(c.nbytes) + ") but the bucket has " +
                            std::to_string(bucket_nbytes) + " bytes");
  }
  if (numel == 0) return c;
  if (t.data == nullptr) {
    ThrowInvalid(function, SpanName(idx) +
                               ": data is null but the tensor "
                               "has elements");
  }
  // Collapse: drop size-1 dims, then merge an outer dim into the inner one
  // when outer stride == inner stride * inner size (they walk memory as
  // one dim). Element strides become byte strides: no overflow, as the
  // tensor's extent is addressable memory.
  for (size_t d = 0; d < t.shape.size(); ++d) {
    if (t.shape[d] == 1) continue;
    const int64_t stride = t.strides[d] * es;
    if (!c.shape.empty() && c.byte_strides.back() == stride * t.shape[d]) {
      c.shape.back() *= t.shape[d];
      c.byte_strides.back() = stride;
    } else {
      c.shape.push_back(t.shape[d]);
      c.byte_strides.push_back(stride);
    }
  }
  // The tensor's memory extent: [data, data + reach + element_size).
  int64_t reach = 0;
  for (size_t d = 0; d < c.shape.size(); ++d) {
    reach += (c.shape[d] - 1) * c.byte_strides[d];
  }
  c.extent = reach + es;
  return c;
}

bool MemoryOverlaps(const internal::CollapsedSpan& c, const void* bucket,
                    int64_t bucket_nbytes) {
  if (c.nbytes == 0 || bucket_nbytes == 0) return false;
  const auto lo = reinterpret_cast<uintptr_t>(c.data);
  const auto hi = lo + static_cast<uintptr_t>(c.extent);
  const auto b_lo = reinterpret_cast<uintptr_t>(bucket);
  const auto b_hi = b_lo + static_cast<uintptr_t>(bucket_nbytes);
  return lo < b_hi && b_lo < hi;
}

// The spans must not overlap in the bucket (empty spans cover nothing).
void CheckNoOverlapInBucket(const char* function,
                            const std::vector<internal::CollapsedSpan>& spans) {
  std::vector<int64_t> members;
  for (size_t i = 0; i < spans.size(); ++i) {
    if (spans[i].nbytes > 0) members.push_back(static_cast<int64_t>(i));
  }
  std::sort(members.begin(), members.end(), [&](int64_t a, int64_t b) {
    return spans[a].offset < spans[b].offset;
  });
  for (size_t k = 1; k < members.size(); ++k) {
    const internal::CollapsedSpan& prev = spans[members[k - 1]];
    const internal::CollapsedSpan& next = spans[members[k]];
    if (prev.offset + prev.nbytes > next.offset) {
      const int64_t a = std::min(members[k - 1], members[k]);
      const int64_t b = std::max(members[k - 1], members[k]);
      ThrowInvalid(function, SpanName(a) + " and " + SpanName(b) +
                                 " overlap in the bucket");
    }
  }
}

}  // namespace

BucketPlan plan_buckets(const std::vector<int64_t>& tensor_nbytes,
                        int64_t bucket_size_bytes, int64_t alignment) {
  constexpr const char* kFn = "plan_buckets";
  if (!IsPowerOfTwo(alignment) || alignment < kMinAlignment ||
      alignment > kMaxAlignment) {
    ThrowInvalid(kFn, "alignment must be a power of two in [" +
                          std::to_string(kMinAlignment) + ", " +
                          std::to_string(kMaxAlignment) + "], got " +
                          std::to_string(alignment));
  }
  if (bucket_size_bytes <= 0 || bucket_size_bytes % alignment != 0) {
    ThrowInvalid(kFn,
                 "bucket_size_bytes must be a positive multiple of the "
                 "alignment (" +
                     std::to_string(alignment) + "), got " +
                     std::to_string(bucket_size_bytes));
  }
  BucketPlan plan;
  const size_t n = tensor_nbytes.size();
  plan.bucket_of.resize(n);
  plan.offset_of.resize(n);
  int64_t end = 0;  // The current bucket's end (bytes used, no tail padding).
  for (size_t i = 0; i < n; ++i) {
    const int64_t nbytes = tensor_nbytes[i];
    if (nbytes < 0) {
      ThrowInvalid(kFn, "tensor " + std::to_string(i) +
                            " has a negative size (" + std::to_string(nbytes) +
                            " bytes)");
    }
    if (plan.bucket_sizes.empty()) plan.bucket_sizes.push_back(0);
    int64_t offset = 0;
    if (!AlignUp(end, alignment, &offset))
      ThrowInvalid(kFn, "offsets overflow int64");
    // `offset + nbytes <= bucket_size_bytes`, written without overflow.
    const bool fits =
        offset <= bucket_size_bytes && nbytes <= bucket_size_bytes - offset;
    if (nbytes > 0 && !fits && end > 0) {
      // Close the current bucket (its size is its aligned end) and start a
      // new one at offset 0.
      plan.bucket_sizes.back() = offset;
      plan.bucket_sizes.push_back(0);
      offset = 0;
      end = 0;
    }
    if (nbytes > kInt64Max - offset)
      ThrowInvalid(kFn, "offsets overflow int64");
    plan.bucket_of[i] = static_cast<int64_t>(plan.bucket_sizes.size()) - 1;
    plan.offset_of[i] = offset;
    end = std::max(end, offset + nbytes);
  }
  if (!plan.bucket_sizes.empty()) {
    int64_t last = 0;
    if (!AlignUp(end, alignment, &last))
      ThrowInvalid(kFn, "offsets overflow int64");
    plan.bucket_sizes.back() = last;
  }
  return plan;
}

namespace internal {

void validate_num_threads(const char* function, int num_threads) {
  if (num_threads < 0 || num_threads > kMaxThreads) {
    ThrowInvalid(function,
                 "num_threads must be in [0, " + std::to_string(kMaxThreads) +
                     "] (0 = automatic), got " + std::to_string(num_threads));
  }
}

std::vector<CollapsedSpan> validate_spans(const char* function,
                                          const std::vector<BucketSpan>& spans,
                                          const void* bucket,
                                          int64_t bucket_nbytes) {
  if (bucket_nbytes < 0) {
    ThrowInvalid(function, "bucket_nbytes must be >= 0, got " +
                               std::to_string(bucket_nbytes));
  }
  if (bucket == nullptr && bucket_nbytes > 0) {
    ThrowInvalid(function, "bucket is null but bucket_nbytes is " +
                               std::to_string(bucket_nbytes));
  }
  std::vector<CollapsedSpan> out;
  out.reserve(spans.size());
  for (size_t i = 0; i < spans.size(); ++i) {
    const auto idx = static_cast<int64_t>(i);
    out.push_back(CollapseSpan(function, idx, spans[i].tensor, spans[i].offset,
                               bucket_nbytes));
    if (MemoryOverlaps(out.back(), bucket, bucket_nbytes)) {
      ThrowInvalid(function, SpanName(idx) +
                                 ": the tensor's memory "
                                 "overlaps the bucket");
    }
  }
  CheckNoOverlapInBucket(function, out);
  return out;
}

std::vector<std::pair<int64_t, int64_t>> uncovered_ranges(
    const std::vector<CollapsedSpan>& spans, int64_t bucket_nbytes) {
  std::vector<std::pair<int64_t, int64_t>> covered;
  for (const CollapsedSpan& s : spans) {
    if (s.nbytes > 0) covered.emplace_back(s.offset, s.offset + s.nbytes);
  }
  std::sort(covered.begin(), covered.end());
  std::vector<std::pair<int64_t, int64_t>> gaps;
  int64_t pos = 0;
  for (const auto& [begin, end] : covered) {
    if (begin > pos) gaps.emplace_back(pos, begin);
    pos = std::max(pos, end);
  }
  if (bucket_nbytes > pos) gaps.emplace_back(pos, bucket_nbytes);
  return gaps;
}

}  // namespace internal

void pack_bucket(const std::vector<BucketSpan>& spans, void* bucket,
                 int64_t bucket_nbytes, int num_threads) {
  constexpr const char* kFn = "pack_bucket";
  internal::validate_num_threads(kFn, num_threads);
  const std::vector<internal::CollapsedSpan> collapsed =
      internal::validate_spans(kFn, spans, bucket, bucket_nbytes);
  char* bytes = static_cast<char*>(bucket);
  // Padding is zeroed so that a bucket never carries stale memory (it may
  // leave the machine) and equal tensors always give equal buckets.
  for (const auto& [begin, end] :
       internal::uncovered_ranges(collapsed, bucket_nbytes)) {
    std::memset(bytes + begin, 0, static_cast<size_t>(end - begin));
  }
  RunCopies(collapsed, bytes, num_threads);
}

}  // namespace dockyard::kernels
