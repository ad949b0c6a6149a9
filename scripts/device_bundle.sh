#!/usr/bin/env bash
# Packs what a GPU machine needs to run kvferry built here into .devbuild/ (git-ignored):
# stripped binaries and the shared libraries its image lacks (cpp-httplib and its codecs,
# spdlog, fmt, xxHash, OpenSSL libcrypto; Debian's UCX when the build links it), and the
# conversation trace when ../shared has it.
# Usage: scripts/device_bundle.sh [BUILD_DIR] [TEST ...]
# BUNDLE_DIR (default .devbuild) is where the binaries go: give each build its own folder
# under .devbuild for an A/B (bench/gpu_refactor_ab.sh); libraries and the trace always go to
# .devbuild/lib and .devbuild/traces.
set -euo pipefail
build=${1:-build}
shift || true
tests=("$@")
[ ${#tests[@]} -eq 0 ] && tests=(nvlink_gpu_test)
out=${BUNDLE_DIR:-.devbuild}
rm -rf "$out" && mkdir -p "$out/tests" .devbuild/lib .devbuild/traces
strip -o "$out/kvferry" "$build/kvferry"
for t in "${tests[@]}"; do strip -o "$out/tests/$t" "$build/tests/$t"; done
for lib in libcpp-httplib.so.0.11 libxxhash.so.0 libspdlog.so.1.10 libfmt.so.9 libcrypto.so.3 libbrotlidec.so.1 libbrotlienc.so.1 \
           libbrotlicommon.so.1; do
  cp -L "/lib/x86_64-linux-gnu/$lib" .devbuild/lib/
done
# A build with UCX (KVFERRY_WITH_UCX) links Debian's libucp & co, which the GPU machine lacks:
# carry them too (scripts/ucx_bundle.sh unpacks them into .devbuild/ucx-debian).
if ldd "$build/kvferry" | grep -q 'libucp'; then
  scripts/ucx_bundle.sh >/dev/null
  cp -a .devbuild/ucx-debian/lib/*.so* .devbuild/lib/
fi
trace=../shared/traces/conversation_trace.jsonl
[ -f "$trace" ] && cp "$trace" .devbuild/traces/
du -sh .devbuild
