#!/usr/bin/env bash
# Bazel's workspace status (.bazelrc): the commit the binaries are built from, for --version
# (//server:build_commit). "-dirty" when the tree has changes not committed; "unknown" outside git.
commit=$(git rev-parse --short=12 HEAD 2>/dev/null) || commit=unknown
if [ "$commit" != unknown ] && ! git diff --quiet HEAD 2>/dev/null; then commit="$commit-dirty"; fi
echo "STABLE_SHARDSERVE_COMMIT $commit"
