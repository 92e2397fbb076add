"""Module extension for Bazel >= 7 (MODULE.bazel): the same repositories as the WORKSPACE build.

The venv toolchain, the CUDA toolkit, the images' pinned contents and the lint tools come from the same
repository rules, so every BUILD file works unchanged under both builds.
"""

load("//tools/cuda:cuda_toolkit.bzl", "cuda_toolkit")
load("//tools/lint:repositories.bzl", "lint_python_tools", "npm_buildifier")
load("//tools/oci:repositories.bzl", "deb_rootfs", "pip_site_packages")
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
    deb_rootfs(name = "sandbox_rootfs", lock = "//ubuntu-base:sandbox_packages.lock.json")
    pip_site_packages(
        name = "sandbox_site_packages",
        lock = "//requirements:sandbox.lock.txt",
        compile = True,
    )
    deb_rootfs(name = "fleet_rootfs", lock = "//ubuntu-base:fleet_packages.lock.json")
    pip_site_packages(name = "fleet_site_packages_cpu", lock = "//requirements:cpu.lock.txt")
    pip_site_packages(name = "fleet_site_packages_cuda", lock = "//requirements:cuda.lock.txt")
    lint_python_tools(name = "lint_tools", lock = "//requirements:lint.lock.txt")
    npm_buildifier(
        name = "buildifier",
        sha256 = "b96ea9b13003036c801f52bee6f9b0314738f8432e5cb9d814c89f59292604ee",
        version = "8.2.1",
    )

dockyard_repositories = module_extension(implementation = _dockyard_repositories_impl)
