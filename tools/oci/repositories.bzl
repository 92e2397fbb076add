"""Repository rules that fetch an image's pinned contents (run at fetch time, cached by Bazel).

    deb_rootfs(name, lock)         -> @name//:rootfs.tar   Debian packages from a deb_lock.py lock
    pip_site_packages(name, lock, prefix)
                                   -> @name//:layer.tar.gz wheels from a tools/python/lock.py lock

Both verify every file against the lock's sha256 and go through the machine's own package
managers (apt-get download, pip): no mirror or index host is written into the repository.
rootfs.tar's entry metadata is normalized later by oci_layer; layer.tar.gz is already a finished
layer (tools/oci/oci.py), written straight from the installed folder: a CUDA lock installs into
more than 10 GB, which an intermediate tarball and a second compression pass would double.
"""

load("//tools:repository_utils.bzl", "PIP_ENV_VARS", "host_python", "pip_install_lock", "run_or_fail")

def _export(rctx, file_name):
    rctx.file("WORKSPACE", "workspace(name = \"{}\")\n".format(rctx.name))
    rctx.file("BUILD.bazel", "exports_files([\"{}\"])\n".format(file_name))

def _deb_rootfs_impl(rctx):
    lock = rctx.path(rctx.attr.lock)
    script = rctx.path(rctx.attr._script)
    rctx.path(rctx.attr._lock_module)  # deb_rootfs.py imports it: refetch when it changes
    rctx.path(rctx.attr._compile_script)  # deb_rootfs.py runs it: likewise
    cache = rctx.os.environ.get("HOME", "/tmp") + "/.cache/dockyard_rl/debs"
    rctx.report_progress("Fetching the Debian packages of {}".format(rctx.attr.lock))
    run_or_fail(rctx, [
        host_python(rctx),
        script,
        "--lock",
        lock,
        "--out",
        "rootfs.tar",
        "--cache",
        cache,
    ])
    _export(rctx, "rootfs.tar")

deb_rootfs = repository_rule(
    implementation = _deb_rootfs_impl,
    attrs = {
        "lock": attr.label(
            mandatory = True,
            allow_single_file = True,
            doc = "a tools/oci/deb_lock.py lock (.lock.json)",
        ),
        "_script": attr.label(default = "//tools/oci:deb_rootfs.py"),
        "_lock_module": attr.label(default = "//tools/oci:deb_lock.py"),
        "_compile_script": attr.label(default = "//tools/oci:compile_python.py"),
    },
    environ = PIP_ENV_VARS,
    doc = "A root filesystem tarball of the lock's Debian packages (tools/oci/deb_rootfs.py).",
)

def _pip_site_packages_impl(rctx):
    lock = rctx.path(rctx.attr.lock)
    rctx.report_progress("Installing the wheels of {}".format(rctx.attr.lock))
    pip_install_lock(rctx, lock, "site")

    # Console scripts carry this machine's interpreter path: the image runs `python3 -m ...`.
    rctx.delete("site/bin")
    if rctx.attr.compile:
        run_or_fail(rctx, [
            host_python(rctx),
            rctx.path(rctx.attr._compile_script),
            "site",
            "/" + rctx.attr.prefix.strip("/"),
        ])
    rctx.report_progress("Writing the layer of {}".format(rctx.attr.lock))
    run_or_fail(rctx, [
        host_python(rctx),
        rctx.path(rctx.attr._oci_tool),
        "layer",
        "--out",
        "layer.tar.gz",
        "--tree",
        "{}=site".format(rctx.attr.prefix.strip("/")),
    ])
    rctx.delete("site")
    _export(rctx, "layer.tar.gz")

pip_site_packages = repository_rule(
    implementation = _pip_site_packages_impl,
    attrs = {
        "lock": attr.label(
            mandatory = True,
            allow_single_file = True,
            doc = "a hash-pinned tools/python/lock.py lock",
        ),
        "prefix": attr.string(
            default = "usr/local/lib/python3.11/dist-packages",
            doc = "where the packages go in the image",
        ),
        "compile": attr.bool(default = False, doc = "add reproducible bytecode " +
                                                    "(tools/oci/compile_python.py)"),
        "_compile_script": attr.label(default = "//tools/oci:compile_python.py"),
        "_oci_tool": attr.label(default = "//tools/oci:oci.py"),
    },
    environ = PIP_ENV_VARS,
    doc = "The lock's wheels installed at `prefix`, as one deterministic image layer.",
)
