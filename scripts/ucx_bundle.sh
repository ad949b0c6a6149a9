#!/usr/bin/env bash
# Packs the UCX libraries a GPU machine without UCX needs to run kvferry's `ucx` transport,
# for bench/gpu_ucx_run.sh:
#
#   .devbuild/ucx-debian/   Debian's UCX 1.13 (libucx0, no CUDA) and its few dependencies
#                           (libnuma1, libibverbs1, librdmacm1, libnl-3-200, libnl-route-3-200,
#                           ibverbs-providers), unpacked with `apt-get download` + `dpkg -x`
#   .devbuild/ucx-cuda/     with a wheel path: UCX with CUDA from PyPI's libucx-cu13 (get it
#                           with `pip download libucx-cu13 --no-deps -d /work/wheels`), with
#                           its ucx_info and ucx_perftest in bin/
#
# Usage: scripts/ucx_bundle.sh [PATH/TO/libucx_cu13-*.whl]
# Each folder holds lib/ (LD_LIBRARY_PATH) and lib/ucx/ (UCX_MODULE_DIR); only the shared
# objects UCX loads are kept (by soname), stripped. .devbuild/ is git-ignored.
set -euo pipefail
wheel="${1:-}"
root=.devbuild
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

debian="$root/ucx-debian"
rm -rf "$debian" && mkdir -p "$debian/lib/ucx"
(cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root libucx0 libnuma1 libibverbs1 librdmacm1 libnl-3-200 \
   libnl-route-3-200 ibverbs-providers >/dev/null)
for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$tmp/x"; done
lib="$tmp/x/usr/lib/x86_64-linux-gnu"
for so in "$lib"/*.so.[0-9]* "$tmp"/x/lib/x86_64-linux-gnu/*.so.[0-9]*; do
  [[ -L "$so" ]] && cp -L "$so" "$debian/lib/$(basename "$so")"
done
for so in "$lib"/ucx/*.so.0; do cp -L "$so" "$debian/lib/ucx/"; done
# ibverbs providers (libmlx5 and friends) and their driver files, for RDMA NICs.
[[ -d "$lib/libibverbs" ]] && cp -rL "$lib/libibverbs" "$debian/lib/"
[[ -d "$tmp/x/etc/libibverbs.d" ]] && cp -r "$tmp/x/etc/libibverbs.d" "$debian/"
strip --strip-unneeded "$debian"/lib/*.so.* "$debian"/lib/ucx/*.so.* 2>/dev/null || true

if [[ -n "$wheel" ]]; then
  cuda="$root/ucx-cuda"
  rm -rf "$cuda" && mkdir -p "$cuda/lib/ucx"
  python3 -m zipfile -e "$wheel" "$tmp/w"
  for so in "$tmp"/w/libucx/lib/*.so.0; do cp -L "$so" "$cuda/lib/"; done
  for so in "$tmp"/w/libucx/lib/ucx/libuct_*.so.0 "$tmp"/w/libucx/lib/ucx/libucm_*.so.0 \
            "$tmp"/w/libucx/lib/ucx/libucx_perftest_*.so.0; do
    [[ -e "$so" ]] && cp -L "$so" "$cuda/lib/ucx/"
  done
  # Its ucx_info and ucx_perftest, for bench/gpu_ucx_diag.sh (run with LD_LIBRARY_PATH=lib).
  mkdir -p "$cuda/bin"
  for tool in ucx_info ucx_perftest; do
    [[ -e "$tmp/w/libucx/bin/$tool" ]] && install -m 755 "$tmp/w/libucx/bin/$tool" "$cuda/bin/"
  done
  # Libraries the wheel vendors (auditwheel-renamed: the .so files above name them as they are).
  [[ -d "$tmp/w/libucx_cu13.libs" ]] && cp "$tmp"/w/libucx_cu13.libs/* "$cuda/lib/"
  strip --strip-unneeded "$cuda"/lib/*.so* "$cuda"/lib/ucx/*.so* "$cuda"/bin/* 2>/dev/null || true
fi
du -sh "$root"/ucx-*
