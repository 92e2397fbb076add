#!/usr/bin/env bash
# Bazel's workspace status (.bazelrc: --workspace_status_command): the commit the OCI images are
# labelled with (org.opencontainers.image.revision). STABLE_ keys invalidate only the actions
# that read them: the final step of each image.
echo "STABLE_GIT_COMMIT $(git rev-parse HEAD 2>/dev/null || echo unknown)"
