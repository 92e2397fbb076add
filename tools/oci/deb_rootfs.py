"""A root filesystem tarball from a Debian package lock (deb_lock.py), without root or chroot.

    python3 tools/oci/deb_rootfs.py --lock L.lock.json --out rootfs.tar [--cache DIR]

Run by the `deb_rootfs` repository rule (tools/oci/repositories.bzl) at fetch time:

1. Checks that the lock's distribution is this machine's (a lock for another release cannot be
   fetched through this machine's apt sources).
2. Fetches each package with `apt-get download name=version` (the machine's configured sources;
   no mirror host in the repository) into `--cache` (default ~/.cache/dockyard_rl/debs, shared by
   every output base), and checks its SHA256 against the lock: a mismatch is an error, never
   a warning.
3. Unpacks every package's files (`dpkg-deb --fsys-tarfile`) into ONE tarball with Debian's
   merged /usr (bin, sbin, lib, lib64 are symlinks into usr/; files shipped under them land in
   usr/), writes `var/lib/dpkg/status` (each package's control fields, "install ok installed"),
   and /etc/passwd and /etc/group from base-passwd's masters (what its postinst would copy).

4. Adds reproducible bytecode for the image's Python (compile_python.py), which Debian's
   py3compile would have written.

Maintainer scripts do not run: the result is a set of files, like distroless images. Two
packages shipping the same path with different content is an error (dpkg would need a diversion).
Entry metadata (mtimes, owners) is left to tools/oci/oci.py, which normalizes it.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from deb_lock import distribution  # noqa: E402  (a sibling script, run without a package)

# Debian 12's merged /usr: these top-level folders are symlinks into usr/.
MERGED_USR = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
DEFAULT_CACHE = pathlib.Path.home() / ".cache" / "dockyard_rl" / "debs"


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


_lists_refreshed = False


def _apt_download(spec: str, download_dir: str) -> subprocess.CompletedProcess:
    """`apt-get download spec`; when apt does not know the version and we are root, refreshes
    the package lists once (a fresh machine may have none) and tries again."""
    global _lists_refreshed
    run = subprocess.run(
        ["apt-get", "download", "-qq", spec], cwd=download_dir, capture_output=True, text=True
    )
    if run.returncode != 0 and not _lists_refreshed and os.geteuid() == 0:
        _lists_refreshed = True
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, text=True)
        run = subprocess.run(
            ["apt-get", "download", "-qq", spec], cwd=download_dir, capture_output=True, text=True
        )
    return run


def fetch(package: dict, cache: pathlib.Path) -> pathlib.Path:
    """The package's .deb, downloaded once into `cache` and checked against the lock."""
    path = cache / f"{package['sha256']}.deb"
    if path.is_file() and _sha256(path) == package["sha256"]:
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as download_dir:
        spec = (
            f"{package['name']}:{package['architecture']}={package['version']}"
            if package["architecture"] != "all"
            else f"{package['name']}={package['version']}"
        )
        run = _apt_download(spec, download_dir)
        debs = list(pathlib.Path(download_dir).glob("*.deb"))
        if run.returncode != 0 or len(debs) != 1:
            raise ValueError(
                f"apt-get download {spec} failed: {run.stderr.strip() or run.stdout.strip()}. "
                "If this version is gone from the mirror (Debian replaces stable packages on "
                "updates), regenerate the lock with tools/oci/deb_lock.py; if the package lists "
                "are missing, run `apt-get update`"
            )
        actual = _sha256(debs[0])
        if actual != package["sha256"]:
            raise ValueError(
                f"{spec}: sha256 {actual} is not the lock's {package['sha256']}; refusing it"
            )
        os.replace(debs[0], path)
    return path


def _merged(name: str) -> str:
    """`name` ("./bin/sh") under merged /usr ("usr/bin/sh"), relative, without "./"."""
    name = os.path.normpath("/" + name).lstrip("/")
    top, _, rest = name.partition("/")
    return f"usr/{top}" + (f"/{rest}" if rest else "") if top in MERGED_USR else name


def _control(deb: pathlib.Path) -> str:
    run = subprocess.run(["dpkg-deb", "-f", str(deb)], capture_output=True, text=True, check=True)
    return run.stdout.rstrip("\n")


def build_rootfs(lock: dict, debs: Sequence[pathlib.Path], out: pathlib.Path) -> None:
    """Writes the merged tarball of `debs` (in lock order) with the dpkg status (docstring)."""
    entries: dict[str, tuple[tarfile.TarInfo, bytes | None, str]] = {}
    for package, deb in zip(lock["packages"], debs):
        fsys = subprocess.run(
            ["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(fsys)) as tarred:
            for member in tarred.getmembers():
                name = _merged(member.name)
                if not name or (member.isdir() and name in entries):
                    continue
                data = tarred.extractfile(member).read() if member.isfile() else None
                if member.islnk():
                    member.linkname = _merged(member.linkname)
                if name in entries and not member.isdir():
                    info, old_data, owner = entries[name]
                    same = (info.type, old_data, info.linkname) == (
                        member.type,
                        data,
                        member.linkname,
                    )
                    if not same:
                        raise ValueError(
                            f"{name} is shipped by both {owner} and "
                            f"{package['name']} with different content"
                        )
                    continue
                member.name = name
                entries[name] = (member, data, package["name"])
    for top in MERGED_USR:
        if f"usr/{top}" in entries:
            link = tarfile.TarInfo(top)
            link.type, link.linkname, link.mode = tarfile.SYMTYPE, f"usr/{top}", 0o777
            entries[top] = (link, None, "merged /usr")

    def add_file(name: str, data: bytes, mode: int = 0o644) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(data), mode
        entries[name] = (info, data, "deb_rootfs.py")

    add_bytecode(entries)

    # Each package's control fields with dpkg's Status right after its first line (Package:).
    status = "\n\n".join(
        _control(deb).replace("\n", "\nStatus: install ok installed\n", 1) for deb in debs
    )
    add_file("var/lib/dpkg/status", (status + "\n").encode())
    for name in ("passwd", "group"):
        master = entries.get(f"usr/share/base-passwd/{name}.master")
        if master is not None:
            add_file(f"etc/{name}", master[1])
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tarred:
        for name in sorted(entries):
            info, data, _ = entries[name]
            tarred.addfile(info, io.BytesIO(data) if data is not None else None)


def add_bytecode(entries: dict[str, tuple[tarfile.TarInfo, bytes | None, str]]) -> None:
    """Adds reproducible .pyc files for the image's Python (compile_python.py says why), when
    that Python is the one running this script; otherwise leaves the sources alone."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    folders = [f"usr/lib/{version}", "usr/lib/python3/dist-packages"]
    if f"usr/lib/{version}/os.py" not in entries:
        print(f"deb_rootfs.py: the image's Python is not {version}: no bytecode added")
        return
    with tempfile.TemporaryDirectory() as tmp:
        for name, (info, data, _) in entries.items():
            if info.isfile() and name.endswith(".py") and name.startswith(tuple(folders)):
                path = pathlib.Path(tmp, name)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
        subprocess.run(
            [
                sys.executable,
                str(pathlib.Path(__file__).with_name("compile_python.py")),
                tmp,
                "/",
                *folders,
            ],
            check=True,
        )
        for path in sorted(pathlib.Path(tmp).rglob("*.pyc")):
            name = path.relative_to(tmp).as_posix()
            folder = name.rsplit("/", 1)[0]
            if folder not in entries:
                info = tarfile.TarInfo(folder)
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                entries[folder] = (info, None, "compile_python.py")
            info = tarfile.TarInfo(name)
            data = path.read_bytes()
            info.size, info.mode = len(data), 0o644
            entries[name] = (info, data, "compile_python.py")


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="deb_rootfs.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lock", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--cache", type=pathlib.Path, default=DEFAULT_CACHE)
    args = parser.parse_args(argv)
    try:
        lock = json.loads(args.lock.read_text())
        here = distribution()
        if lock["distribution"] != here:
            raise ValueError(
                f"{args.lock} pins {lock['distribution']} packages, but this "
                f"machine's apt reaches {here}: regenerate the lock here with "
                "tools/oci/deb_lock.py (or build where that release is reachable)"
            )
        if shutil.which("dpkg-deb") is None or shutil.which("apt-get") is None:
            raise ValueError("deb_rootfs needs apt-get and dpkg-deb (a Debian or Ubuntu host)")
        debs = [fetch(package, args.cache) for package in lock["packages"]]
        build_rootfs(lock, debs, args.out)
    except (ValueError, OSError, subprocess.CalledProcessError) as error:
        print(f"deb_rootfs.py: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {len(debs)} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
