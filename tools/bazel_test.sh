#!/usr/bin/env bash
# Tests of tools/bazel's choice of Bazel, with fake Bazels on a controlled PATH (the install path
# itself is exercised by CI on a machine without Bazel).
set -euo pipefail
unset DOCKYARD_TOOLS_BAZEL_ACTIVE BAZEL BAZEL_REAL

script="$(readlink -f tools/bazel)"
fakes="$TEST_TMPDIR/fakes"
mkdir -p "$fakes"
# The system tools tools/bazel checks for, so that it does not try to install them.
for tool in bwrap git g++ patch skopeo umoci podman runc npm readlink dirname id awk env cat timeout; do
  real="$(command -v "$tool" || true)"
  if [[ -n "$real" ]]; then ln -sf "$real" "$fakes/$tool"; else printf '#!/bin/sh\n' > "$fakes/$tool"; chmod +x "$fakes/$tool"; fi
done

fail() { echo "FAIL: $*" >&2; exit 1; }

# 1. No Bazel and installing forbidden: a clear error naming what is missing.
if out="$(PATH="$fakes" DOCKYARD_NO_INSTALL=1 /bin/bash "$script" version 2>&1)"; then
  fail "expected failure without Bazel, got: $out"
fi
grep -q "missing bazel-bootstrap" <<<"$out" || fail "unclear error: $out"

# 2. A Bazel on PATH is used, from the workspace root, with the arguments unchanged (Bazel 4).
cat > "$fakes/bazel" <<'FAKE'
#!/bin/bash
if [[ "$1" == "--version" ]]; then echo "bazel 4.2.3"; exit 0; fi
echo "cwd=$PWD args=$*"
FAKE
chmod +x "$fakes/bazel"
out="$(cd / && PATH="$fakes" /bin/bash "$script" test //... --config=cuda)"
[[ "$out" == "cwd=$(dirname "$(dirname "$script")") args=test //... --config=cuda" ]] || fail "bazel 4: $out"

# 3. Bazel >= 7 gets --config=bzlmod right after the command name.
sed -i 's/bazel 4.2.3/bazel 7.4.1/' "$fakes/bazel"
out="$(PATH="$fakes" /bin/bash "$script" build //cc:all)"
[[ "$out" == *"args=build --config=bzlmod //cc:all" ]] || fail "bazel 7: $out"

# 4. $BAZEL wins over PATH.
printf '#!/bin/bash\necho chosen\n' > "$TEST_TMPDIR/mybazel"; chmod +x "$TEST_TMPDIR/mybazel"
out="$(BAZEL="$TEST_TMPDIR/mybazel" PATH="$fakes" /bin/bash "$script" info)"
[[ "$out" == "chosen" ]] || fail "BAZEL override: $out"

# 5. Bazel's own launcher runs a workspace's tools/bazel with BAZEL_REAL set (as Debian's
#    /usr/bin/bazel does): tools/bazel must then run BAZEL_REAL, not call the launcher again.
cat > "$fakes/bazel" <<FAKE
#!/bin/bash
export BAZEL_REAL="$TEST_TMPDIR/real_bazel"
exec /bin/bash "$script" "\$@"
FAKE
printf '#!/bin/bash\necho "real $*"\n' > "$TEST_TMPDIR/real_bazel"; chmod +x "$TEST_TMPDIR/real_bazel"
out="$(PATH="$fakes" timeout 20 /bin/bash "$script" test //...)" || fail "launcher loop: $out"
[[ "$out" == "real test //..." ]] || fail "launcher: $out"

echo "tools/bazel: all 5 checks passed"
