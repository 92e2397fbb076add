"""tools/oci: deterministic layers, the OCI layout the rules write, and what skopeo and umoci
(Debian's packages, installed by tools/bazel) read from it."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import pathlib
import re
import shutil
import subprocess
import tarfile

import pytest

from tools.oci import oci

# Built by //tools/oci:test_image; in the runfiles tree beside this file.
IMAGE = pathlib.Path(__file__).absolute().parent / "test_image.tar"


def _members(layer: bytes) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(layer))) as tarred:
        return tarred.getmembers()


def _layout(image: pathlib.Path) -> dict[str, bytes]:
    with tarfile.open(image) as tarred:
        return {m.name: tarred.extractfile(m).read() for m in tarred.getmembers() if m.isfile()}


def _blob(layout: dict[str, bytes], digest: str) -> bytes:
    data = layout[f"blobs/sha256/{digest.split(':')[1]}"]
    assert "sha256:" + hashlib.sha256(data).hexdigest() == digest
    return data


def _head_commit() -> str:
    # The workspace's commit, read like tools/workspace_status.sh does (from the source tree the
    # runfiles point into).
    source = pathlib.Path(__file__).resolve().parent
    run = subprocess.run(["git", "rev-parse", "HEAD"], cwd=source, capture_output=True, text=True)
    return run.stdout.strip() if run.returncode == 0 else "unknown"


def test_layers_are_normalized_and_the_same_bytes_every_time(tmp_path):
    (tmp_path / "bin").mkdir()
    script = tmp_path / "bin" / "run"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o750)
    data = tmp_path / "data.txt"
    data.write_text("x")
    base = tmp_path / "base.tar"
    with tarfile.open(base, "w") as tarred:  # like a distribution tarball: "./" names, owners
        for name, text in (("./", None), ("./etc/", None), ("./etc/os-release", "ID=debian\n")):
            info = tarfile.TarInfo(name)
            info.uid, info.uname, info.mtime = 1000, "builder", 1234567
            if text is None:
                info.type = tarfile.DIRTYPE
                tarred.addfile(info)
            else:
                info.size = len(text)
                tarred.addfile(info, io.BytesIO(text.encode()))
    layers = []
    for name in ("a.tar.gz", "b.tar.gz"):
        oci.write_layer(
            tmp_path / name,
            [("/app/run", script, None), ("app/data.txt", data, 0o600)],
            dirs=["/var/empty"],
            tars=[base],
        )
        layers.append((tmp_path / name).read_bytes())
    assert layers[0] == layers[1]
    members = _members(layers[0])
    assert [m.name for m in members] == [
        "app",
        "app/data.txt",
        "app/run",
        "etc",
        "etc/os-release",
        "var",
        "var/empty",
    ]
    assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and not m.uname for m in members)
    modes = {m.name: m.mode for m in members}
    assert modes["app/run"] == 0o755 and modes["app/data.txt"] == 0o600
    assert modes["var/empty"] == 0o755 and modes["app"] == 0o755


def test_a_path_given_twice_is_an_error(tmp_path):
    source = tmp_path / "f"
    source.write_text("1")
    with pytest.raises(ValueError, match="'etc/f' is in the layer twice"):
        oci.write_layer(tmp_path / "l.tar.gz", [("/etc/f", source, None), ("etc/f", source, None)])
    with pytest.raises(ValueError, match="'etc/f' is a file, but 'etc/f/g' is below it"):
        oci.write_layer(
            tmp_path / "l.tar.gz", [("/etc/f", source, None), ("/etc/f/g", source, None)]
        )


_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def _check_descriptor(descriptor: dict, media_type: str) -> None:
    """The image-spec's descriptor: mediaType, a sha256 digest, an integer size."""
    assert descriptor["mediaType"] == media_type
    assert _DIGEST.fullmatch(descriptor["digest"]), descriptor
    assert isinstance(descriptor["size"], int) and descriptor["size"] > 0


def test_the_rule_built_image_is_a_consistent_oci_layout():
    layout = _layout(IMAGE)
    # Every blob is named by its own digest.
    for name, data in layout.items():
        if name.startswith("blobs/"):
            assert name == "blobs/sha256/" + hashlib.sha256(data).hexdigest()
    assert json.loads(layout["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads(layout["index.json"])
    assert index["mediaType"] == oci.MEDIA_INDEX and index["schemaVersion"] == 2
    (entry,) = index["manifests"]
    _check_descriptor(entry, oci.MEDIA_MANIFEST)
    assert entry["annotations"]["io.containerd.image.name"] == "dockyard/test:latest"
    manifest_bytes = _blob(layout, entry["digest"])
    assert len(manifest_bytes) == entry["size"]
    assert (IMAGE.parent / "test_image.digest").read_text().strip() == entry["digest"]
    manifest = json.loads(manifest_bytes)
    assert manifest["schemaVersion"] == 2 and manifest["mediaType"] == oci.MEDIA_MANIFEST
    config = json.loads(_blob(layout, manifest["config"]["digest"]))
    _check_descriptor(manifest["config"], oci.MEDIA_CONFIG)
    labels = config["config"].pop("Labels")
    assert config["config"] == {
        "Cmd": ["/app/hello.sh"],
        "Env": ["DOCKYARD_FLEET_ROLE=sandbox"],
        "ExposedPorts": {"9090/tcp": {}},
        "User": "1000:1000",
        "WorkingDir": "/app",
    }
    # The source commit comes from Bazel's workspace status (tools/workspace_status.sh).
    assert labels.pop("org.opencontainers.image.revision") == _head_commit()
    assert labels == {"org.opencontainers.image.title": "tools/oci test image"}
    assert (config["os"], config["architecture"]) == ("linux", "amd64")
    layers = [_blob(layout, layer["digest"]) for layer in manifest["layers"]]
    for layer in manifest["layers"]:
        _check_descriptor(layer, oci.MEDIA_LAYER)
    assert config["rootfs"]["type"] == "layers"
    assert len(config["history"]) == len(layers)
    # diff_ids are the digests of the uncompressed layers, bottom first.
    assert config["rootfs"]["diff_ids"] == [
        "sha256:" + hashlib.sha256(gzip.decompress(layer)).hexdigest() for layer in layers
    ]
    assert [m.name for m in _members(layers[1])] == ["app", "app/hello.sh", "etc", "etc/greeting"]
    docker = json.loads(layout["manifest.json"])
    assert docker[0]["RepoTags"] == ["dockyard/test:latest"]
    assert docker[0]["Config"] == "blobs/sha256/" + manifest["config"]["digest"][7:]


def test_the_image_digest_depends_only_on_the_inputs(tmp_path):
    layout = _layout(IMAGE)
    manifest = json.loads(_blob(layout, json.loads(layout["index.json"])["manifests"][0]["digest"]))
    layers = []
    for index, layer in enumerate(manifest["layers"]):
        layers.append(tmp_path / f"layer{index}.tar.gz")
        layers[-1].write_bytes(_blob(layout, layer["digest"]))
    labels = json.loads(_blob(layout, manifest["config"]["digest"]))["config"]["Labels"]
    config = dict(
        cmd=["/app/hello.sh"],
        env=["DOCKYARD_FLEET_ROLE=sandbox"],
        user="1000:1000",
        workdir="/app",
        ports=["9090/tcp"],
        labels=labels,
    )
    first = oci.write_image(tmp_path / "1.tar", layers, "dockyard/test:latest", **config)
    second = oci.write_image(tmp_path / "2.tar", layers, "dockyard/test:latest", **config)
    assert first == second == (IMAGE.parent / "test_image.digest").read_text().strip()
    assert (tmp_path / "1.tar").read_bytes() == IMAGE.read_bytes()
    other = oci.write_image(
        tmp_path / "3.tar", layers, "dockyard/test:latest", **{**config, "user": "0"}
    )
    assert other != first


def test_describe_layer_streams_and_rejects_what_is_not_one_gzip_member(tmp_path):
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as tarred:
        info = tarfile.TarInfo("zeros")
        info.size = 3 << 20  # compresses ~1000x: more than one chunk of output per input chunk
        tarred.addfile(info, io.BytesIO(bytes(info.size)))
    layer = tmp_path / "l.tar.gz"
    layer.write_bytes(gzip.compress(tar.getvalue(), mtime=0))
    described = oci.describe_layer(layer)
    assert described.diff_id == "sha256:" + hashlib.sha256(tar.getvalue()).hexdigest()
    assert described.digest == "sha256:" + hashlib.sha256(layer.read_bytes()).hexdigest()
    assert described.size == layer.stat().st_size
    broken = {
        "truncated": layer.read_bytes()[:-20],
        "not gzip": b"plain tar",
        "two members": layer.read_bytes() * 2,
    }
    for _name, data in broken.items():
        (tmp_path / "bad").write_bytes(data)
        with pytest.raises(ValueError):
            oci.describe_layer(tmp_path / "bad")


def _skopeo(tmp_path: pathlib.Path, *args: str) -> dict:
    # skopeo unpacks an oci-archive under /var/tmp by default: read-only in Bazel's sandbox.
    run = subprocess.run(
        ["skopeo", "--tmpdir", str(tmp_path), *args, f"oci-archive:{IMAGE}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.mark.skipif(
    shutil.which("skopeo") is None,
    reason="skopeo is not installed (tools/bazel installs Debian's skopeo)",
)
def test_skopeo_reads_the_image(tmp_path):
    assert _skopeo(tmp_path, "inspect", "--raw")["mediaType"] == oci.MEDIA_MANIFEST
    config = _skopeo(tmp_path, "inspect", "--config")
    assert config["config"]["Env"] == ["DOCKYARD_FLEET_ROLE=sandbox"]


@pytest.mark.skipif(
    shutil.which("umoci") is None,
    reason="umoci is not installed (tools/bazel installs Debian's umoci)",
)
def test_umoci_unpacks_the_image(tmp_path):
    with tarfile.open(IMAGE) as tarred:
        tarred.extractall(tmp_path / "layout", filter="data")
    subprocess.run(
        [
            "umoci",
            "unpack",
            "--rootless",
            "--image",
            f"{tmp_path / 'layout'}:latest",
            str(tmp_path / "bundle"),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    rootfs = tmp_path / "bundle" / "rootfs"
    assert (rootfs / "etc" / "greeting").read_text() == "dockyard\n"
    assert (rootfs / "app" / "hello.sh").stat().st_mode & 0o111
    assert (rootfs / "var" / "empty").is_dir()
    runtime = json.loads((tmp_path / "bundle" / "config.json").read_text())
    assert runtime["process"]["args"] == ["/app/hello.sh"]
    assert "DOCKYARD_FLEET_ROLE=sandbox" in runtime["process"]["env"]


def test_a_tree_goes_in_with_its_modes_and_symlinks(tmp_path):
    tree = tmp_path / "site"
    (tree / "pkg" / "sub").mkdir(parents=True)
    (tree / "pkg" / "__init__.py").write_text("x = 1\n")
    (tree / "pkg" / "tool").write_text("#!/bin/sh\n")
    (tree / "pkg" / "tool").chmod(0o755)
    (tree / "pkg" / "alias").symlink_to("tool")
    oci.write_layer(tmp_path / "l.tar.gz", [], trees=[("usr/lib/site", tree)])
    members = {m.name: m for m in _members((tmp_path / "l.tar.gz").read_bytes())}
    assert list(members) == [
        "usr",
        "usr/lib",
        "usr/lib/site",
        "usr/lib/site/pkg",
        "usr/lib/site/pkg/__init__.py",
        "usr/lib/site/pkg/alias",
        "usr/lib/site/pkg/sub",
        "usr/lib/site/pkg/tool",
    ]
    assert members["usr/lib/site/pkg/tool"].mode == 0o755
    assert members["usr/lib/site/pkg/__init__.py"].mode & 0o777 == 0o644
    assert members["usr/lib/site/pkg/alias"].issym()
    assert members["usr/lib/site/pkg/alias"].linkname == "tool"
    assert {m.mtime for m in members.values()} == {0}
    with pytest.raises(ValueError, match="not a folder"):
        oci.write_layer(tmp_path / "m.tar.gz", [], trees=[("x", tmp_path / "missing")])
