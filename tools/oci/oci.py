"""Daemonless OCI image assembly: deterministic layers and an OCI image layout, as Bazel actions.

    oci.py layer --out L.tar.gz [--file DEST=SRC[:MODE] ...] [--dir DEST ...] [--tar T.tar ...]
                 [--tree DEST=DIR ...]
    oci.py image --out IMAGE.tar --digest-out D --layer L.tar.gz ... [--entrypoint JSON]
                 [--cmd JSON] [--env K=V ...] [--user U] [--workdir W] [--port 9090/tcp ...]
                 [--label K=V ...] [--tag repo:tag] [--architecture amd64] [--os linux]

`layer` writes one gzip-compressed tar: the listed files (mode 0644 unless given, 0755 when the
source is executable), folders (0755 unless given), the entries of existing tarballs (e.g. an
unpacked distribution root) and whole folder trees (files, folders and symlinks, modes kept; e.g.
an installed site-packages, streamed without an intermediate tarball), merged. Every entry is
normalized so the bytes depend only on the content: sorted paths, mtime 0, uid/gid 0, no
user/group names, PAX format; gzip with mtime 0 and no file name. Parent folders are added (0755)
so every path has one.

`image` writes an OCI image layout (https://github.com/opencontainers/image-spec, layout.md) as a
tarball: `oci-layout`, `index.json`, `blobs/sha256/<digest>` for the config, the manifest and
each layer, plus Docker's `manifest.json` so `docker load` takes the same file. `skopeo` reads it
as `oci-archive:IMAGE.tar`, `podman load -i IMAGE.tar` loads it. The image config's `created` is
the epoch and `history` is one entry per layer, so equal inputs give an equal manifest digest,
written to `--digest-out` as `sha256:<hex>`.

Not covered: multi-platform indexes, whiteouts (layers only add files), compression other than
gzip, and pushing (use `skopeo copy oci-archive:IMAGE.tar docker://REGISTRY/REPO:TAG`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import gzip
import hashlib
import io
import json
import os
import pathlib
import stat
import sys
import tarfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import IO

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
EPOCH = "1970-01-01T00:00:00Z"
_GZIP_LEVEL = 6
_CHUNK_BYTES = 1 << 20


# ---------------------------------------------------------------------------------------- layers


def _normalized(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.pax_headers = {}
    return info


def _parents(path: str) -> list[str]:
    parts = path.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def _clean_path(path: str) -> str:
    """`path` relative to the image root ("./usr/bin/" -> "usr/bin"); "" for the root itself.
    Resolved as if absolute, so ".." cannot climb above the root."""
    return os.path.normpath("/" + path).lstrip("/")


def _tree_entries(dest: str, root: pathlib.Path):
    """(header, opener or None) of everything below `root`, named under `dest`; symlinks are kept
    as links, sockets and devices are left out."""
    if not root.is_dir():
        raise ValueError(f"--tree {dest}={root}: not a folder")
    # Walk order does not matter: write_layer sorts every entry by path.
    for folder, subfolders, names in os.walk(root):
        for name in subfolders + names:
            path = pathlib.Path(folder, name)
            status = path.lstat()
            info = tarfile.TarInfo(f"{dest}/{path.relative_to(root)}")
            info.mode = stat.S_IMODE(status.st_mode)
            if stat.S_ISLNK(status.st_mode):
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
                yield info, None
            elif stat.S_ISDIR(status.st_mode):
                info.type = tarfile.DIRTYPE
                yield info, None
            elif stat.S_ISREG(status.st_mode):
                info.size = status.st_size
                yield info, functools.partial(path.open, "rb")


def write_layer(
    out: pathlib.Path,
    files: Sequence[tuple[str, pathlib.Path, int | None]],
    dirs: Sequence[str] = (),
    tars: Sequence[pathlib.Path] = (),
    trees: Sequence[tuple[str, pathlib.Path]] = (),
) -> None:
    """The deterministic layer of `files` (dest, source, mode or None), `dirs` ("dest" or
    "dest:octal mode"), the entries of `tars` and the contents of `trees` (dest, folder) (module
    docstring). A path given twice is an error, not a silent overwrite. File contents stream from
    their sources to the gzip output (a fleet image's Python layer is gigabytes)."""
    # name -> (normalized header, opener of the content or None)
    entries: dict[str, tuple[tarfile.TarInfo, Callable[[], IO[bytes]] | None]] = {}

    def add(info: tarfile.TarInfo, opener, origin: str) -> None:
        name = _clean_path(info.name)
        if not name:
            if info.isdir():
                return  # the root folder ("./" in a distribution tarball)
            raise ValueError(f"{info.name!r} from {origin} is not a path inside the image")
        if name in entries:
            if info.isdir() and entries[name][0].isdir():
                return  # the same folder from two sources
            raise ValueError(f"{name!r} is in the layer twice (again from {origin})")
        info.name = name
        entries[name] = (_normalized(info), opener)

    with contextlib.ExitStack() as open_tars:
        for tar_path in tars:
            source = open_tars.enter_context(tarfile.open(tar_path))
            for member in source.getmembers():
                if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
                    continue  # devices and fifos do not belong in an image layer
                if member.islnk():
                    member.linkname = _clean_path(member.linkname)
                # The member is copied: add() renames and normalizes its own header.
                opener = functools.partial(source.extractfile, member) if member.isfile() else None
                add(copy.copy(member), opener, str(tar_path))
        for dest, root in trees:
            for info, opener in _tree_entries(dest, root):
                add(info, opener, f"--tree {root}")
        for dest, path, mode in files:
            info = tarfile.TarInfo(dest)
            info.size = path.stat().st_size
            executable = path.stat().st_mode & stat.S_IXUSR
            info.mode = mode if mode is not None else (0o755 if executable else 0o644)
            add(info, functools.partial(path.open, "rb"), str(path))
        for spec in dirs:
            dest, _, mode = spec.partition(":")
            info = tarfile.TarInfo(dest)
            info.type, info.mode = tarfile.DIRTYPE, int(mode, 8) if mode else 0o755
            add(info, None, "--dir")
        for name in list(entries):
            for parent in _parents(name):
                if parent not in entries:
                    info = tarfile.TarInfo(parent)
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    entries[parent] = (_normalized(info), None)
                elif not entries[parent][0].isdir():
                    raise ValueError(f"{parent!r} is a file, but {name!r} is below it")

        with (
            out.open("wb") as raw_out,
            gzip.GzipFile(
                filename="", mode="wb", fileobj=raw_out, mtime=0, compresslevel=_GZIP_LEVEL
            ) as compressed,
            tarfile.open(fileobj=compressed, mode="w", format=tarfile.PAX_FORMAT) as tarred,
        ):
            for name in sorted(entries):
                info, opener = entries[name]
                if opener is None:
                    tarred.addfile(info)
                else:
                    with opener() as content:
                        tarred.addfile(info, content)


# ----------------------------------------------------------------------------------------- image


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _canonical(document: dict) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


@dataclasses.dataclass(frozen=True)
class LayerBlob:
    """A gzip layer file as the image documents name it."""

    path: pathlib.Path
    digest: str  # sha256 of the compressed bytes: the blob's name and the manifest's digest
    size: int
    diff_id: str  # sha256 of the uncompressed tar: the config's rootfs.diff_ids


def describe_layer(path: pathlib.Path) -> LayerBlob:
    """Reads the layer once, in chunks: a CUDA fleet image's Python layer is gigabytes
    compressed and several times that uncompressed, more than this machine's memory."""
    compressed, uncompressed = hashlib.sha256(), hashlib.sha256()
    decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS)  # 16+: the gzip wrapper
    size = 0
    try:
        with path.open("rb") as layer:
            while chunk := layer.read(_CHUNK_BYTES):
                size += len(chunk)
                compressed.update(chunk)
                # Bounded output per call, so one highly compressible chunk cannot balloon.
                data = decompressor.decompress(chunk, _CHUNK_BYTES)
                while data:
                    uncompressed.update(data)
                    data = decompressor.decompress(decompressor.unconsumed_tail, _CHUNK_BYTES)
                if decompressor.unused_data:
                    raise ValueError(
                        f"{path}: data after the gzip stream (layers are one gzip member)"
                    )
            uncompressed.update(decompressor.flush())
    except zlib.error as error:
        raise ValueError(f"{path} is not a gzip layer: {error}") from None
    if not decompressor.eof:
        raise ValueError(f"{path} is a truncated gzip stream")
    return LayerBlob(
        path, "sha256:" + compressed.hexdigest(), size, "sha256:" + uncompressed.hexdigest()
    )


def image_documents(
    layers: Sequence[LayerBlob],
    *,
    entrypoint: Sequence[str] | None = None,
    cmd: Sequence[str] | None = None,
    env: Sequence[str] = (),
    user: str = "",
    workdir: str = "",
    ports: Sequence[str] = (),
    labels: dict[str, str] | None = None,
    architecture: str = "amd64",
    os_name: str = "linux",
) -> tuple[bytes, bytes]:
    """(config, manifest) JSON bytes of an image made of `layers`, bottom first."""
    container_config: dict = {"Env": list(env), "Labels": dict(labels or {})}
    if entrypoint is not None:
        container_config["Entrypoint"] = list(entrypoint)
    if cmd is not None:
        container_config["Cmd"] = list(cmd)
    if user:
        container_config["User"] = user
    if workdir:
        container_config["WorkingDir"] = workdir
    if ports:
        container_config["ExposedPorts"] = {port: {} for port in ports}
    config = _canonical(
        {
            "architecture": architecture,
            "os": os_name,
            "created": EPOCH,
            "config": container_config,
            "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
            "history": [
                {"created": EPOCH, "created_by": f"dockyard_rl tools/oci layer {i}"}
                for i in range(len(layers))
            ],
        }
    )
    manifest = _canonical(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": {"mediaType": MEDIA_CONFIG, "digest": _digest(config), "size": len(config)},
            "layers": [
                {"mediaType": MEDIA_LAYER, "digest": layer.digest, "size": layer.size}
                for layer in layers
            ],
            "annotations": dict(labels or {}),
        }
    )
    return config, manifest


def write_image(
    out: pathlib.Path, layer_paths: Sequence[pathlib.Path], tag: str, **config_keys
) -> str:
    """Writes the OCI layout tarball (module docstring); returns the manifest digest. Layers
    stream from their files into the tarball."""
    layers = [describe_layer(path) for path in layer_paths]
    config, manifest = image_documents(layers, **config_keys)
    manifest_digest = _digest(manifest)
    index = _canonical(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_INDEX,
            "manifests": [
                {
                    "mediaType": MEDIA_MANIFEST,
                    "digest": manifest_digest,
                    "size": len(manifest),
                    "annotations": {
                        "org.opencontainers.image.ref.name": tag.split(":")[-1],
                        "io.containerd.image.name": tag,
                    },
                }
            ],
        }
    )
    docker_manifest = json.dumps(
        [
            {
                "Config": f"blobs/sha256/{_digest(config)[7:]}",
                "RepoTags": [tag],
                "Layers": [f"blobs/sha256/{layer.digest[7:]}" for layer in layers],
            }
        ]
    ).encode()
    # name -> (size, opener); a layer listed twice is stored once, as its digest names it.
    files: dict[str, tuple[int, Callable[[], IO[bytes]]]] = {
        name: (len(data), functools.partial(io.BytesIO, data))
        for name, data in [
            ("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
            ("index.json", index),
            ("manifest.json", docker_manifest),
            (f"blobs/sha256/{_digest(config)[7:]}", config),
            (f"blobs/sha256/{manifest_digest[7:]}", manifest),
        ]
    }
    for layer in layers:
        files[f"blobs/sha256/{layer.digest[7:]}"] = (
            layer.size,
            functools.partial(layer.path.open, "rb"),
        )
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tarred:
        for folder in ("blobs", "blobs/sha256"):
            info = _normalized(tarfile.TarInfo(folder))
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tarred.addfile(info)
        for name in sorted(files):
            size, opener = files[name]
            info = _normalized(tarfile.TarInfo(name))
            info.size, info.mode = size, 0o644
            with opener() as content:
                tarred.addfile(info, content)
    return manifest_digest


# ------------------------------------------------------------------------------------------- CLI


def _pairs(values: Iterable[str], flag: str) -> list[tuple[str, str]]:
    pairs = []
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag} {value!r}: expected KEY=VALUE")
        pairs.append((key, rest))
    return pairs


def _file_spec(value: str) -> tuple[str, pathlib.Path, int | None]:
    ((dest, source),) = _pairs([value], "--file")
    mode = None
    if ":" in source and source.rsplit(":", 1)[1].isdigit():
        source, mode_text = source.rsplit(":", 1)
        mode = int(mode_text, 8)
    return dest, pathlib.Path(source), mode


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="oci.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    layer = commands.add_parser("layer", help="write one deterministic layer")
    layer.add_argument("--out", type=pathlib.Path, required=True)
    layer.add_argument("--file", action="append", default=[], help="DEST=SRC[:MODE]")
    layer.add_argument(
        "--dir",
        action="append",
        default=[],
        help="an (empty) folder: DEST[:MODE], mode 0755 unless given",
    )
    layer.add_argument(
        "--tar",
        action="append",
        default=[],
        type=pathlib.Path,
        help="a tarball whose entries go in",
    )
    layer.add_argument(
        "--tree",
        action="append",
        default=[],
        help="DEST=DIR: everything below folder DIR, placed under DEST",
    )
    image = commands.add_parser("image", help="write an OCI image layout tarball")
    image.add_argument("--out", type=pathlib.Path, required=True)
    image.add_argument("--digest-out", type=pathlib.Path, required=True)
    image.add_argument("--layer", action="append", default=[], type=pathlib.Path)
    image.add_argument("--entrypoint", type=json.loads)
    image.add_argument("--cmd", type=json.loads)
    image.add_argument("--env", action="append", default=[])
    image.add_argument("--user", default="")
    image.add_argument("--workdir", default="")
    image.add_argument("--port", action="append", default=[])
    image.add_argument("--label", action="append", default=[])
    image.add_argument(
        "--status-file", type=pathlib.Path, help="Bazel's stable-status.txt (KEY VALUE lines)"
    )
    image.add_argument(
        "--status-label",
        action="append",
        default=[],
        help="LABEL=STATUS_KEY: a label whose value is that status key's",
    )
    image.add_argument("--tag", required=True)
    image.add_argument("--architecture", default="amd64")
    image.add_argument("--os", default="linux")
    args = parser.parse_args(argv)
    try:
        if args.command == "layer":
            trees = [(dest, pathlib.Path(folder)) for dest, folder in _pairs(args.tree, "--tree")]
            write_layer(args.out, [_file_spec(f) for f in args.file], args.dir, args.tar, trees)
        else:
            _pairs(args.env, "--env")  # checks the shape; the config keeps "K=V" strings
            labels = dict(_pairs(args.label, "--label"))
            if args.status_label:
                status = dict(
                    line.split(" ", 1)
                    for line in args.status_file.read_text().splitlines()
                    if " " in line
                )
                for label, key in _pairs(args.status_label, "--status-label"):
                    labels[label] = status.get(key, "unknown")
            digest = write_image(
                args.out,
                args.layer,
                args.tag,
                entrypoint=args.entrypoint,
                cmd=args.cmd,
                env=args.env,
                user=args.user,
                workdir=args.workdir,
                ports=args.port,
                labels=labels,
                architecture=args.architecture,
                os_name=args.os,
            )
            args.digest_out.write_text(digest + "\n")
    except (ValueError, OSError) as error:
        print(f"oci.py {args.command}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
