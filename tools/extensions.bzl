"""Module extension for Bazel >= 7 (MODULE.bazel): the same repositories as the WORKSPACE build.

The venv toolchain and the CUDA toolkit come from the same repository rules, so every BUILD file
works unchanged under both builds.
"""

load("//tools/cuda:cuda_toolkit.bzl", "cuda_toolkit")
load("//tools/python:venv.bzl", "python_venv")

def _dockyard_repositories_impl(_module_ctx):
    python_venv(
        name = "dockyard_python",
        locks = {
            "//requirements:cpu.lock.txt": "cpu",
            "//requirements:cuda.lock.txt": "cuda",
        },
    )
    cuda_toolkit(name = "dockyard_cuda")

dockyard_repositories = module_extension(implementation = _dockyard_repositories_impl)
