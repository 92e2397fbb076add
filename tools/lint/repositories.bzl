"""Repository rules that fetch the lint tools (run at fetch time, cached by Bazel).

    lint_python_tools(name, lock)         -> @name//:ruff, :clang_format, :mypy (a site folder)
    npm_buildifier(name, version, sha256) -> @name//:buildifier

Both go through the machine's own package managers (pip, npm): no index or registry host is
written into the repository. Neither tool is a runtime dependency, so they stay out of the venv
and the images.
"""

load("//tools:repository_utils.bzl", "PIP_ENV_VARS", "pip_install_lock", "run_or_fail")

_ENV_VARS = PIP_ENV_VARS + ["NPM_CONFIG_REGISTRY"]

def _lint_python_tools_impl(rctx):
    rctx.report_progress("Installing the lint tools of {}".format(rctx.attr.lock))
    pip_install_lock(rctx, rctx.path(rctx.attr.lock), "site")
    rctx.file("WORKSPACE", "workspace(name = \"{}\")\n".format(rctx.name))
    rctx.file("BUILD.bazel", """package(default_visibility = ["//visibility:public"])

# ruff's wheel ships the static binary as a script; clang-format's keeps it in package data.
exports_files([
    "site/bin/ruff",
    "site/clang_format/data/bin/clang-format",
    "site/mypy/__init__.py",
])

alias(name = "ruff", actual = "site/bin/ruff")

alias(name = "clang_format", actual = "site/clang_format/data/bin/clang-format")

# mypy runs as `python -m mypy` with this folder on PYTHONPATH (site/mypy/__init__.py marks it).
filegroup(
    name = "mypy",
    srcs = glob(["site/**"], exclude = ["site/bin/**", "site/clang_format/**", "**/*.pyc"]),
)
""")

lint_python_tools = repository_rule(
    implementation = _lint_python_tools_impl,
    attrs = {
        "lock": attr.label(
            mandatory = True,
            allow_single_file = True,
            doc = "a hash-pinned tools/python/lock.py lock",
        ),
    },
    environ = _ENV_VARS,
    doc = "The lock's wheels (ruff, mypy, clang-format) installed into one folder.",
)

# The npm package carries buildifier's static binaries for every platform; we take this one's.
_BUILDIFIER_PLATFORMS = {
    "amd64": "linux_amd64",
    "x86_64": "linux_amd64",
    "aarch64": "linux_arm64",
    "arm64": "linux_arm64",
}

def _npm_buildifier_impl(rctx):
    npm = rctx.which("npm")
    if not npm:
        fail("No `npm` on PATH: buildifier comes from the npm registry's @bazel/buildifier " +
             "package (Debian: apt-get install npm; tools/bazel installs it).")

    # (repository_ctx.os.arch is Bazel >= 5; uname works on both.)
    arch = run_or_fail(rctx, ["uname", "-m"]).strip()
    if rctx.os.name != "linux" or arch not in _BUILDIFIER_PLATFORMS:
        fail("buildifier: no binary for {} {} in @bazel/buildifier".format(rctx.os.name, arch))
    package = "@bazel/buildifier@" + rctx.attr.version
    rctx.report_progress("Fetching {} through npm".format(package))
    tarball = run_or_fail(rctx, [npm, "pack", "--silent", package]).strip()
    tarball = tarball.splitlines()[-1]
    digest = run_or_fail(rctx, ["sha256sum", tarball]).split(" ")[0]
    if digest != rctx.attr.sha256:
        fail("{} has sha256 {}, the pin says {}: refusing it".format(
            tarball,
            digest,
            rctx.attr.sha256,
        ))
    rctx.extract(tarball, stripPrefix = "package")
    rctx.delete(tarball)
    binary = "buildifier-" + _BUILDIFIER_PLATFORMS[arch]
    rctx.file("WORKSPACE", "workspace(name = \"{}\")\n".format(rctx.name))
    rctx.file("BUILD.bazel", """package(default_visibility = ["//visibility:public"])

alias(name = "buildifier", actual = "{}")

exports_files(["{}"])
""".format(binary, binary))

npm_buildifier = repository_rule(
    implementation = _npm_buildifier_impl,
    attrs = {
        "version": attr.string(mandatory = True),
        "sha256": attr.string(mandatory = True, doc = "of the npm package tarball"),
    },
    environ = _ENV_VARS,
    doc = "buildifier's static binary from the npm package @bazel/buildifier, pinned by sha256.",
)
