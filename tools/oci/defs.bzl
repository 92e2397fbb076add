"""OCI image rules without a container daemon: `oci_layer` and `oci_image` (see README.md).

    oci_layer(name, srcs = [...], py_srcs_of = [...], prefix = "/app", strip_prefix = "python",
              files = {label: dest}, dirs = [...], tars = [...])
                                                   -> <name>.tar.gz, one deterministic layer
    oci_image(name, layers = [...], entrypoint = [...], cmd = [...], env = {...}, user = "",
              workdir = "", exposed_ports = [...], labels = {...}, tag = "repo:tag")
                                                   -> <name>.tar (OCI layout) and <name>.digest

Both run tools/oci/oci.py, which normalizes every tar entry (sorted, mtime 0, owner 0) and gzips
with a fixed header, so the same inputs give the same digest on any machine.
"""

_TOOL = "//tools/oci:oci"

def _dest(prefix, path):
    return (prefix.rstrip("/") + "/" + path.lstrip("/")).lstrip("/")

def _stripped(ctx, src):
    path = src.short_path
    if ctx.attr.strip_prefix:
        if not path.startswith(ctx.attr.strip_prefix + "/"):
            fail("%s is not under strip_prefix %s" % (path, ctx.attr.strip_prefix))
        path = path[len(ctx.attr.strip_prefix) + 1:]
    return path

def _oci_layer_impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".tar.gz")
    args = ctx.actions.args()
    args.add("layer")
    args.add("--out", out)
    inputs = []
    for src in ctx.files.srcs:
        args.add("--file", "%s=%s" % (_dest(ctx.attr.prefix, _stripped(ctx, src)), src.path))
        inputs.append(src)

    # One depset over all targets: a module two targets share goes in once.
    py_srcs = depset(transitive = [t[PyInfo].transitive_sources for t in ctx.attr.py_srcs_of])
    for src in py_srcs.to_list():
        args.add("--file", "%s=%s" % (_dest(ctx.attr.prefix, _stripped(ctx, src)), src.path))
        inputs.append(src)
    for target, dest in ctx.attr.files.items():
        files = target.files.to_list()
        if len(files) != 1:
            fail("files: %s gives %d files; map single files (use srcs for groups)" %
                 (target.label, len(files)))
        args.add("--file", "%s=%s" % (dest, files[0].path))
        inputs.append(files[0])
    for folder in ctx.attr.dirs:
        args.add("--dir", folder)
    for tar in ctx.files.tars:
        args.add("--tar", tar)
        inputs.append(tar)
    ctx.actions.run(
        executable = ctx.executable._tool,
        arguments = [args],
        inputs = inputs,
        outputs = [out],
        mnemonic = "OciLayer",
        progress_message = "Writing OCI layer %s" % ctx.label,
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

oci_layer = rule(
    implementation = _oci_layer_impl,
    doc = "One deterministic, gzip-compressed layer tarball.",
    attrs = {
        "srcs": attr.label_list(allow_files = True, doc = "files placed at prefix + their " +
                                                          "workspace path minus strip_prefix"),
        "py_srcs_of": attr.label_list(providers = [PyInfo], doc = "py targets whose " +
                                                                  "transitive sources go in like srcs"),
        "prefix": attr.string(default = "/", doc = "folder in the image for srcs"),
        "strip_prefix": attr.string(doc = "workspace folder removed from srcs' paths"),
        "files": attr.label_keyed_string_dict(
            allow_files = True,
            doc = "single file -> its path in the image",
        ),
        "dirs": attr.string_list(doc = "empty folders to create: path or path:octal mode"),
        "tars": attr.label_list(
            allow_files = [".tar", ".tar.gz", ".tgz"],
            doc = "tarballs whose entries are merged in (e.g. a root fs)",
        ),
        "_tool": attr.label(default = _TOOL, executable = True, cfg = "exec"),
    },
)

def _oci_image_impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".tar")
    digest = ctx.actions.declare_file(ctx.label.name + ".digest")
    args = ctx.actions.args()
    args.add("image")
    args.add("--out", out)
    args.add("--digest-out", digest)
    args.add("--tag", ctx.attr.tag or "dockyard/%s:latest" % ctx.label.name)
    for layer in ctx.files.layers:
        args.add("--layer", layer)
    if ctx.attr.entrypoint:
        args.add("--entrypoint", json.encode(ctx.attr.entrypoint))
    if ctx.attr.cmd:
        args.add("--cmd", json.encode(ctx.attr.cmd))
    for key in sorted(ctx.attr.env):
        args.add("--env", "%s=%s" % (key, ctx.attr.env[key]))
    for key in sorted(ctx.attr.labels):
        args.add("--label", "%s=%s" % (key, ctx.attr.labels[key]))

    # The source commit, from Bazel's stable workspace status (tools/workspace_status.sh).
    args.add("--status-file", ctx.info_file)
    args.add("--status-label", "org.opencontainers.image.revision=STABLE_GIT_COMMIT")
    for port in ctx.attr.exposed_ports:
        args.add("--port", port)
    if ctx.attr.user:
        args.add("--user", ctx.attr.user)
    if ctx.attr.workdir:
        args.add("--workdir", ctx.attr.workdir)
    ctx.actions.run(
        executable = ctx.executable._tool,
        arguments = [args],
        inputs = ctx.files.layers + [ctx.info_file],
        outputs = [out, digest],
        mnemonic = "OciImage",
        progress_message = "Writing OCI image %s" % ctx.label,
    )
    return [DefaultInfo(
        files = depset([out, digest]),
        runfiles = ctx.runfiles(files = [out, digest]),
    )]

oci_image = rule(
    implementation = _oci_image_impl,
    doc = "An OCI image layout tarball (skopeo: oci-archive:<name>.tar; podman/docker load).",
    attrs = {
        "layers": attr.label_list(
            allow_files = [".tar.gz"],
            mandatory = True,
            doc = "oci_layer targets, bottom first",
        ),
        "entrypoint": attr.string_list(),
        "cmd": attr.string_list(),
        "env": attr.string_dict(),
        "labels": attr.string_dict(doc = "config labels and manifest annotations"),
        "exposed_ports": attr.string_list(doc = "e.g. 9090/tcp"),
        "user": attr.string(),
        "workdir": attr.string(),
        "tag": attr.string(doc = "repo:tag recorded for podman/docker load"),
        "_tool": attr.label(default = _TOOL, executable = True, cfg = "exec"),
    },
)
