#!/usr/bin/env bash
# Packs what a GPU machine needs to run kvferry built here into .devbuild/ (git-ignored):
# stripped binaries and the shared libraries its image lacks (cpp-httplib and its codecs,
# spdlog, fmt, xxHash). Usage: scripts/device_bundle.sh [BUILD_DIR] [TEST ...]
set -euo pipefail
build=${1:-build}
shift || true
tests=("$@")
[ ${#tests[@]} -eq 0 ] && tests=(nvlink_gpu_test)
out=.devbuild
rm -rf "$out" && mkdir -p "$out/lib" "$out/tests"
strip -o "$out/kvferry" "$build/kvferry"
for t in "${tests[@]}"; do strip -o "$out/tests/$t" "$build/tests/$t"; done
for lib in libcpp-httplib.so.0.11 libxxhash.so.0 libspdlog.so.1.10 libfmt.so.9 libbrotlidec.so.1 libbrotlienc.so.1 \
           libbrotlicommon.so.1; do
  cp -L "/lib/x86_64-linux-gnu/$lib" "$out/lib/"
done
du -sh "$out"
