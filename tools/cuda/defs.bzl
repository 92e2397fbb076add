"""`cuda_library`: compiles .cu files with the local nvcc into a cc_library.

Bazel 4 has no CUDA rules, so each .cu file is one genrule running nvcc (position-independent
code, so the objects can go into a Python extension), and the objects become a cc_library that
links libcudart. On a machine without a CUDA toolkit the targets are tagged `manual` (so `//...`
skips them) and building one explicitly fails with a message saying what to install.
"""

load("@dockyard_cuda//:defs.bzl", "HAS_CUDA", "NVCC")

# Ampere (A100), Ada (L40S), Hopper (H100/H200), plus PTX for newer GPUs to JIT-compile.
CUDA_ARCH_FLAGS = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_89,code=sm_89",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]

NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "-Xcompiler=-fPIC",
    "-I.",
] + CUDA_ARCH_FLAGS

def cuda_library(name, srcs, hdrs = [], deps = [], compile_data = [], visibility = None):
    """Compiles `srcs` (.cu) with nvcc into a cc_library linking libcudart.

    Args:
      name: the cc_library's name.
      srcs: .cu files, one nvcc invocation each.
      hdrs: this library's headers (included from the workspace root, like every C++ file here).
      deps: cc_libraries the objects link against.
      compile_data: headers of `deps` that the .cu files include (nvcc runs outside the C++ rules,
        so it only sees files listed here or in `hdrs`).
      visibility: as usual.
    """
    objects = []
    for src in srcs:
        obj = "_{}_{}.o".format(name, src.replace("/", "_").replace(".cu", ""))
        if HAS_CUDA:
            # nvcc names its temp files after its pid; inside Bazel's sandbox every action's pid
            # is small and equal while /tmp is shared, so concurrent nvcc runs would collide:
            # give each run a private TMPDIR.
            cmd = ("export TMPDIR=$$(mktemp -d) && trap 'rm -rf \"$$TMPDIR\"' EXIT && " +
                   "{nvcc} {flags} -c $(location {src}) -o $@").format(
                nvcc = NVCC,
                flags = " ".join(NVCC_FLAGS),
                src = src,
            )
        else:
            cmd = "echo 'No CUDA toolkit found: install one (nvcc + cudart) or set CUDA_PATH, then re-run.' >&2; exit 1"
        native.genrule(
            name = obj + "_nvcc",
            srcs = [src] + hdrs + compile_data,
            outs = [obj],
            cmd = cmd,
            message = "nvcc " + src,
            tags = [] if HAS_CUDA else ["manual"],
        )
        objects.append(obj)
    native.cc_library(
        name = name,
        srcs = objects,
        hdrs = hdrs,
        deps = deps + (["@dockyard_cuda//:cudart"] if HAS_CUDA else []),
        tags = [] if HAS_CUDA else ["manual"],
        visibility = visibility,
    )
