"""`nanobind_extension`: a Python extension module built from C++ with nanobind.

    nanobind_extension(
        name = "_dockyard_kernels",        # the module name Python imports
        srcs = ["dockyard_kernels_binding.cc"],
        deps = [":advantages"],           # core cc_libraries, no Python headers
    )

creates `<name>.so` (a shared cc_binary compiled against the venv's Python headers and the
nanobind version the lock pins) and a py_library `<name>` that puts it on sys.path, so Python code
does `import <name>`. Python symbols stay unresolved in the .so: the interpreter provides them at
import time, as with any CPython extension.
"""

def nanobind_extension(name, srcs, deps = [], copts = [], linkopts = [], visibility = None, **kwargs):
    native.cc_binary(
        name = name + ".so",
        srcs = srcs,
        deps = deps + [
            "@dockyard_python//:nanobind",
            "@dockyard_python//:python_headers",
        ],
        copts = ["-fvisibility=hidden"] + copts,
        linkopts = ["-Wl,--gc-sections"] + linkopts,
        linkshared = True,
        linkstatic = True,
        visibility = visibility,
        **kwargs
    )
    native.py_library(
        name = name,
        data = [":" + name + ".so"],
        imports = ["."],
        visibility = visibility,
    )
