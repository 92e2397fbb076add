"""Bytecode for an image's Python files, written so that the image stays reproducible.

    python3 tools/oci/compile_python.py TREE IMAGE_PATH [FOLDER ...]

Compiles every .py file under TREE/FOLDER (default: all of TREE), a folder that becomes
IMAGE_PATH inside the image, into `__pycache__/*.cpython-3XX.pyc` with the "unchecked-hash"
invalidation mode: the .pyc records a hash of its source instead of its mtime, so it stays valid
although our layers set every mtime to 0, and the same source always gives the same bytes
(PYTHONHASHSEED is fixed for the compiler). Tracebacks name the files by their image path.

Why: the images' Python files otherwise have no bytecode (Debian's maintainer scripts, which
would run py3compile, do not run in deb_rootfs; wheels are installed with --no-compile), so every
sandboxed test run compiled the standard library and pytest in memory, about a second per run.
Files that do not compile (test data written for Python 2, templates named .py) are left as they
are, as py3compile does. Only valid for an image whose Python is the one running this script.
"""

from __future__ import annotations

import compileall
import os
import py_compile
import subprocess
import sys


def compile_tree(tree: str, image_path: str, folders: list[str]) -> None:
    for folder in folders or ["."]:
        source = os.path.normpath(os.path.join(tree, folder))
        if not os.path.isdir(source):
            continue
        compileall.compile_dir(
            source,
            quiet=2,
            workers=1,
            ddir=os.path.normpath(os.path.join(image_path, folder)),
            invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
        )


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    if os.environ.get("PYTHONHASHSEED") != "0":  # frozenset constants' order depends on it
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        return subprocess.run([sys.executable, *sys.argv], env=env, check=False).returncode
    compile_tree(argv[0], argv[1], argv[2:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
