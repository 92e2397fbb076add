"""Entry point of every `py_pytest_test` target: runs pytest on the test's own file(s).

Bazel passes the test files as arguments (their runfiles paths). Results go to Bazel's
XML_OUTPUT_FILE as JUnit XML, so `bazel test` reports per-test-case results. A file that
collects no test is a failure (pytest exit code 5), never a silent pass.
"""

import os
import sys

import pytest

NO_TESTS_COLLECTED = 5


def main() -> int:
    args = ["-p", "no:cacheprovider", "-v", "-rs", "--color=no"]
    if os.environ.get("XML_OUTPUT_FILE"):
        args.append(f"--junitxml={os.environ['XML_OUTPUT_FILE']}")
    # Bazel's test sharding: run only this shard's share of the test cases.
    exit_code = pytest.main(args + sys.argv[1:])
    if exit_code == NO_TESTS_COLLECTED:
        print(
            "pytest collected no tests: a test target must run at least one test.", file=sys.stderr
        )
    return int(exit_code)


if __name__ == "__main__":
    sys.exit(main())
