#!/usr/bin/env bash
# GPU checks of the C++/CUDA kernels on a machine WITHOUT Bazel (e.g. a lent GPU box that has
# python3 with torch + nanobind + pytest, and nvcc). It builds what `tools/bazel build
# --config=cuda //cc:_dockyard_kernels.so` builds, by hand with the same flags, then runs the C++
# tests (CPU and CUDA), the kernels' pytest files and the benchmarks on the GPU.
#
# Usage, from the repository root:  tools/gpu/check_kernels.sh OUT_DIR [python3]
# Everything it prints is also written to OUT_DIR/*.log.
set -euo pipefail
out="$1"; py="${2:-python3}"
kernels=(advantages logprobs refit_packer)
mkdir -p "$out/build"
build="$out/build"

nb="$($py -c 'import nanobind, os; print(os.path.dirname(nanobind.__file__))')"
py_include="$($py -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
cuda_home="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
arch="-gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_80,code=sm_80"
cxx="g++ -std=c++17 -O2 -fPIC -pthread -I. -Wall -Wextra"
ext_flags="-fvisibility=hidden -DDOCKYARD_WITH_CUDA -I$nb/include -I$nb/ext/robin_map/include -I$py_include"

echo "== build (nvcc $(nvcc --version | tail -1), $($py --version))"
objects=()
for k in "${kernels[@]}"; do
  $cxx -c "cc/$k.cc" -o "$build/$k.o"
  nvcc -std=c++17 -O3 -Xcompiler=-fPIC -I. $arch -c "cc/cuda/${k}_cuda.cu" -o "$build/${k}_cuda.o"
  $cxx $ext_flags -c "cc/${k}_binding.cc" -o "$build/${k}_binding.o"
  objects+=("$build/$k.o" "$build/${k}_cuda.o" "$build/${k}_binding.o")
  $cxx "cc/${k}_test.cc" "$build/$k.o" -o "$build/${k}_test"
  $cxx -I"$cuda_home/include" "cc/cuda/${k}_cuda_test.cc" "$build/$k.o" "$build/${k}_cuda.o" \
    -L"$cuda_home/lib64" -lcudart -Wl,-rpath,"$cuda_home/lib64" -o "$build/${k}_cuda_test"
done
g++ -std=c++17 -O3 -fPIC $ext_flags -DNB_COMPACT_ASSERTIONS -fno-strict-aliasing \
  -c "$nb/src/nb_combined.cpp" -o "$build/nb_combined.o"
$cxx $ext_flags -c cc/dockyard_kernels_binding.cc -o "$build/module.o"
g++ -shared -pthread -Wl,--gc-sections "$build/module.o" "${objects[@]}" "$build/nb_combined.o" \
  -L"$cuda_home/lib64" -lcudart -Wl,-rpath,"$cuda_home/lib64" -o "$build/_dockyard_kernels.so"

status=0
echo "== C++ tests (CPU core, then CUDA parity)"
for k in "${kernels[@]}"; do
  "$build/${k}_test" > "$out/${k}_test.log" 2>&1 || status=1; tail -1 "$out/${k}_test.log"
  "$build/${k}_cuda_test" > "$out/${k}_cuda_test.log" 2>&1 || status=1; tail -1 "$out/${k}_cuda_test.log"
done

echo "== pytest (kernels, on the GPU where CUDA tests exist)"
export PYTHONPATH="$build:python:."
$py -m pytest -q -p no:cacheprovider -rs python/dockyard_rl/kernels 2>&1 | tee "$out/pytest.log" | tail -15 \
  || status=1
[[ "${PIPESTATUS[0]}" == 0 ]] || status=1

echo "== benchmarks on the GPU"
$py tests/benchmarks/logprobs_benchmark.py --device cuda --dtypes float32 bfloat16 2>&1 \
  | tee "$out/logprobs_benchmark.log" || status=1
$py tests/benchmarks/refit_packer_benchmark.py --device cuda 2>&1 \
  | tee "$out/refit_packer_benchmark.log" || status=1
exit "$status"
