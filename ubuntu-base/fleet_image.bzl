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

def fleet_layers(variant):
    """The python and application layers of one variant, shared by its trainer and inference images."""
    tags = ["manual"]
    oci_layer(
        name = "fleet_python_layer_" + variant,
        tars = ["@fleet_site_packages_%s//:site.tar" % variant],
        tags = tags,
    )
    oci_layer(
        name = "fleet_app_layer_" + variant,
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
    """One role's image: the shared layers of `variant` (see fleet_layers) and the role's config."""
    oci_image(
        name = name,
        entrypoint = ["/usr/bin/python3", "-m", "dockyard_rl.cluster.join"],
        env = {
            "DOCKYARD_FLEET_ROLE": role,
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONPATH": "/opt/dockyard",
        },
        labels = {
            "org.opencontainers.image.title": "dockyard-%s-%s" % (role, variant),
            "org.opencontainers.image.description": "dockyard_rl %s fleet node (%s)" % (role, variant),
        },
        layers = [
            ":fleet_rootfs_layer",
            ":fleet_python_layer_" + variant,
            ":fleet_app_layer_" + variant,
        ],
        tag = "dockyard/%s-%s:latest" % (role, variant),
        workdir = "/opt/dockyard",
        tags = ["manual"],
    )
