#!/bin/sh
echo "bazel coverage is not available in dockyard_rl's offline Bazel 4 build: the coverage tools are not downloaded. Use 'tools/bazel test' without --collect_code_coverage." >&2
exit 1
