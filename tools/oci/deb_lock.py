"""Pins the Debian packages of an image: a short wanted list -> the full closure, hash-locked.

    python3 tools/oci/deb_lock.py ubuntu-base/sandbox_packages.in \\
        ubuntu-base/sandbox_packages.lock.json

The wanted list names packages one per line (`#` comments). The closure is what apt would install
on an EMPTY system with `--no-install-recommends` (apt's own resolver, run against an empty dpkg
status and an empty download cache, so nothing installed on this machine hides a dependency).
Each package's version, architecture, size and SHA256 come from `apt-cache show`, i.e. from the
package lists of the sources this machine's apt is configured with: no mirror host is written
into the repository. The lock also records the distribution (/etc/os-release), so a lock made on
another release is refused at fetch time instead of mixing releases.

Essential packages are not pulled in implicitly (an image is not a bootable system): list the
ones the image needs (bash, coreutils, ...). Maintainer scripts never run (the rootfs is
assembled by unpacking; see deb_rootfs.py), so packages that only work after their postinst
(e.g. ca-certificates' bundle) need care.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence

_URI_LINE = re.compile(r"^'(?P<url>[^']+)' (?P<file>\S+) (?P<size>\d+)")


def read_wanted(path: pathlib.Path) -> list[str]:
    names = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    names = [name for name in names if name]
    if not names:
        raise ValueError(f"{path}: no packages listed")
    return names


def distribution() -> str:
    """ "<ID> <VERSION_ID>" of this machine (e.g. "debian 12"), the lock's release."""
    fields = dict(
        line.split("=", 1)
        for line in pathlib.Path("/etc/os-release").read_text().splitlines()
        if "=" in line
    )
    return f"{fields.get('ID', '').strip(chr(34))} {fields.get('VERSION_ID', '').strip(chr(34))}"


def resolve(wanted: Sequence[str], architecture: str) -> list[tuple[str, str]]:
    """(package, version) of the closure, in apt's install order."""
    with tempfile.TemporaryDirectory() as empty:
        (pathlib.Path(empty) / "archives" / "partial").mkdir(parents=True)
        run = subprocess.run(
            [
                "apt-get",
                "install",
                "--print-uris",
                "-qq",
                "--no-install-recommends",
                "-o",
                "Dir::State::status=/dev/null",
                "-o",
                f"Dir::Cache::archives={empty}/archives/",
                "-o",
                f"APT::Architecture={architecture}",
                *wanted,
            ],
            capture_output=True,
            text=True,
        )
    if run.returncode != 0:
        raise ValueError(
            f"apt cannot resolve {' '.join(wanted)}: {run.stderr.strip()} (run "
            "`apt-get update` first if the package lists are missing)"
        )
    closure = []
    for line in run.stdout.splitlines():
        match = _URI_LINE.match(line)
        if match:
            # name_version_arch.deb; the version's epoch ("1:") is %3a in the file name.
            name, version, _ = match["file"].removesuffix(".deb").split("_")
            closure.append((name, version.replace("%3a", ":")))
    if not closure:
        raise ValueError(f"apt resolved {' '.join(wanted)} to nothing: {run.stdout[:500]}")
    return closure


def package_record(name: str, version: str) -> dict[str, str | int]:
    """The lock entry of name=version from apt's package lists."""
    run = subprocess.run(
        ["apt-cache", "show", "--no-all-versions", f"{name}={version}"],
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        raise ValueError(f"apt-cache show {name}={version}: {run.stderr.strip()}")
    fields: dict[str, str] = {}
    for line in run.stdout.split("\n\n")[0].splitlines():
        if line and not line[0].isspace() and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return {
        "name": fields["Package"],
        "version": fields["Version"],
        "architecture": fields["Architecture"],
        "size": int(fields["Size"]),
        "sha256": fields["SHA256"],
    }


def make_lock(wanted: Sequence[str], architecture: str) -> dict:
    packages = [package_record(name, version) for name, version in resolve(wanted, architecture)]
    return {
        "distribution": distribution(),
        "architecture": architecture,
        "wanted": list(wanted),
        "packages": sorted(packages, key=lambda p: p["name"]),
    }


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="deb_lock.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("wanted", type=pathlib.Path, help="the wanted list (.in)")
    parser.add_argument("lock", type=pathlib.Path, help="the lock file to write (.lock.json)")
    parser.add_argument("--architecture", default="amd64")
    args = parser.parse_args(argv)
    try:
        lock = make_lock(read_wanted(args.wanted), args.architecture)
    except (ValueError, OSError) as error:
        print(f"deb_lock.py: {error}", file=sys.stderr)
        return 1
    text = json.dumps(lock, indent=1, sort_keys=True) + "\n"
    tmp = args.lock.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, args.lock)
    print(f"wrote {args.lock}: {len(lock['packages'])} packages for {lock['distribution']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
