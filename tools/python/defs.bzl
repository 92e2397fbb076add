"""Project macros for Python targets. They only add defaults to the native rules.

- Every target under python/ can import `dockyard_rl...` (dep on //python:import_root).
- `py_pytest_test`: one test target per test file, run by pytest (tools/python/pytest_main.py),
  which also fails the target when its processes leave shared-memory segments in /dev/shm.
"""

_IMPORT_ROOT = "//python:import_root"
_PYTEST_MAIN = "//tools/python:pytest_main.py"

# pytest_main.py fails a target that leaves shared-memory segments behind; this finds them.
_SHM_CHECK = "//python/dockyard_rl/utils:shared_memory"

def _with_import_root(deps):
    return deps if _IMPORT_ROOT in deps else deps + [_IMPORT_ROOT]

def _with_shm_check(deps):
    package, name = _SHM_CHECK[2:].split(":")
    spellings = [_SHM_CHECK]
    if native.package_name() == package:
        spellings += [":" + name, name]
    for spelling in spellings:
        if spelling in deps:
            return deps
    return deps + [_SHM_CHECK]

def py_library(name, deps = [], **kwargs):
    native.py_library(name = name, deps = _with_import_root(deps), **kwargs)

def py_binary(name, deps = [], **kwargs):
    native.py_binary(name = name, deps = _with_import_root(deps), python_version = "PY3", **kwargs)

def py_pytest_test(name, srcs, size, deps = [], args = [], **kwargs):
    """A py_test that runs pytest on `srcs` (one test file per target, by convention).

    Args:
      name: target name, `<module>_test` after the file it tests.
      srcs: the test file(s).
      size: Bazel test size (small | medium | large | enormous); required so timeouts are explicit.
      deps: libraries under test.
      args: extra pytest arguments.
      **kwargs: passed to py_test (data, tags, env, shard_count, ...).
    """
    native.py_test(
        name = name,
        srcs = srcs + [_PYTEST_MAIN],
        main = _PYTEST_MAIN,
        size = size,
        python_version = "PY3",
        deps = _with_import_root(_with_shm_check(deps)),
        args = ["$(rootpath {})".format(src) for src in srcs] + args,
        **kwargs
    )
