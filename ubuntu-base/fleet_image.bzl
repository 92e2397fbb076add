"""`fleet_image`: the trainer and inference images, one macro for both roles and both variants.

    fleet_image(name = "trainer_image", role = "trainer", variant = "cpu")

Layers, bottom first: the Debian packages of fleet_packages.lock.json, the wheels of the
variant's lock (requirements/<variant>.lock.txt, the same closure as that venv), and dockyard_rl's
sources with the kernel extension. The entry point is the role's Ray node start-up
(`python3 -m dockyard_rl.cluster.join`, which reads DOCKYARD_FLEET_ROLE); the orchestrator adds
`--address HEAD:PORT` (or `--head`) and the node's resources. The targets are manual: they hold
torch, vLLM and Ray (gigabytes), so they build on request, the CUDA variant with --config=cuda
(which also builds the extension with its CUDA kernels).
"""

load("//tools/oci:defs.bzl", "oci_image", "oci_layer")

# The CUDA variant's kernel extension links libcudart.so.13, which the image has only from the
# nvidia-cuda-runtime wheel (there is no system CUDA toolkit in it). torch preloads that library,
# but importing the extension first would fail without this path.
_CUDA_VARIANT_ENV = {
    "LD_LIBRARY_PATH": "/usr/local/lib/python3.11/dist-packages/nvidia/cu13/lib",
}

def fleet_app_layer(name, variant):
    """The application layer of one variant, shared by its trainer and inference images.

    dockyard_rl's sources and the kernel extension (built with CUDA kernels under --config=cuda).
    The variant's Python layer is the repository rule's finished layer.tar.gz.

    Args:
      name: the target, "fleet_app_layer_<variant>" (fleet_image refers to it by that name).
      variant: "cpu" or "cuda".
    """
    if name != "fleet_app_layer_" + variant:
        fail("fleet_app_layer: name it fleet_app_layer_" + variant)
    tags = ["manual"]
    oci_layer(
        name = name,
        dirs = ["/tmp:1777"],
        files = {"//cc:_dockyard_kernels.so": "/opt/dockyard/_dockyard_kernels.so"},
        prefix = "/opt/dockyard",
        py_srcs_of = [
            "//python/dockyard_rl/cluster:join",
            "//python/launch:grpo_swe",
        ],
        strip_prefix = "python",
        tags = tags,
    )

def fleet_image(name, role, variant):
    """One role's image: the shared layers of `variant` and the role's config.

    Args:
      name: the image target (`<role>_image`, `<role>_image_cuda`).
      role: "trainer" or "inference": the DOCKYARD_FLEET_ROLE the entry point reads.
      variant: "cpu" or "cuda": which lock's Python layer and which fleet_app_layer.
    """
    env = {
        "DOCKYARD_FLEET_ROLE": role,
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "PYTHONPATH": "/opt/dockyard",
    }
    if variant == "cuda":
        env.update(_CUDA_VARIANT_ENV)
    oci_image(
        name = name,
        entrypoint = ["/usr/bin/python3", "-m", "dockyard_rl.cluster.join"],
        env = env,
        labels = {
            "org.opencontainers.image.title": "dockyard-%s-%s" % (role, variant),
            "org.opencontainers.image.description": "dockyard_rl %s fleet node (%s)" % (role, variant),
        },
        layers = [
            ":fleet_rootfs_layer",
            "@fleet_site_packages_%s//:layer.tar.gz" % variant,
            ":fleet_app_layer_" + variant,
        ],
        tag = "dockyard/%s-%s:latest" % (role, variant),
        workdir = "/opt/dockyard",
        tags = ["manual"],
    )
