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
#   .devbuild/tools/        the measuring tools bench/ucx_netns_ab.sh --ceilings needs, from
#                           Debian 12: bin/ holds ucx_perftest and ucx_info (ucx-utils; they
#                           load UCX from ucx-debian/lib), iperf3, jq and GNU time; lib/ the
#                           libraries of theirs an Ubuntu 24.04 image may lack (libiperf0,
#                           libsctp1, libjq1, libonig5, libgomp1; libcrypto.so.3 only when
#                           .devbuild/lib lacks it, scripts/device_bundle.sh puts it there).
#                           iproute2/bin/ip is Debian's `ip` for a machine without one: a
#                           wrapper that starts it through the dynamic loader with its own
#                           libraries (iproute2/lib), so that nothing `ip netns exec` runs
#                           inherits them. bench/gpu_ucx_netns.sh uses all of it.
#
# Usage: scripts/ucx_bundle.sh [PATH/TO/libucx_cu13-*.whl]
# Each UCX folder holds lib/ (LD_LIBRARY_PATH) and lib/ucx/ (UCX_MODULE_DIR); only the shared
# objects UCX loads are kept (by soname), stripped. At the end `ldd` checks that every tool
# resolves with LD_LIBRARY_PATH=tools/lib:ucx-debian/lib:.devbuild/lib (exit 1 naming what does
# not). .devbuild/ is git-ignored.
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
# The measuring tools, unpacked apart from UCX's packages.
tools="$root/tools"
rm -rf "$tools" && mkdir -p "$tools/bin" "$tools/lib" "$tools/iproute2/bin" "$tools/iproute2/lib" \
  "$tools/iproute2/libexec" "$tmp/t"
(cd "$tmp/t" && apt-get download -q -o APT::Sandbox::User=root ucx-utils iperf3 libiperf0 libsctp1 \
   jq libjq1 libonig5 libgomp1 time iproute2 libbpf1 libelf1 libmnl0 libbsd0 libmd0 libcap2 >/dev/null)
for deb in "$tmp"/t/*.deb; do dpkg -x "$deb" "$tmp/tx"; done
tx="$tmp/tx"
for tool in ucx_perftest ucx_info iperf3 jq time; do
  install -m 755 "$tx/usr/bin/$tool" "$tools/bin/"
done
for so in libiperf.so.0 libsctp.so.1 libjq.so.1 libonig.so.5 libgomp.so.1; do
  cp -L "$tx/usr/lib/x86_64-linux-gnu/$so" "$tools/lib/"
done
[[ -e "$root/lib/libcrypto.so.3" ]] || cp -L /lib/x86_64-linux-gnu/libcrypto.so.3 "$tools/lib/"
install -m 755 "$tx/bin/ip" "$tools/iproute2/libexec/ip"
for so in libbpf.so.1 libelf.so.1 libmnl.so.0 libbsd.so.0 libmd.so.0 libcap.so.2; do
  cp -L "$(find "$tx" -name "$so" | head -1)" "$tools/iproute2/lib/"
done
cat >"$tools/iproute2/bin/ip" <<'WRAP'
#!/bin/sh
# Debian 12's ip with its own libraries, passed to the loader rather than through the
# environment, so that commands run by `ip netns exec` keep the caller's LD_LIBRARY_PATH.
d="$(dirname "$(readlink -f "$0")")/.."
exec /lib64/ld-linux-x86-64.so.2 --library-path "$d/lib" "$d/libexec/ip" "$@"
WRAP
chmod 755 "$tools/iproute2/bin/ip"
strip --strip-unneeded "$tools"/bin/* "$tools"/lib/*.so.* "$tools"/iproute2/libexec/ip \
  "$tools"/iproute2/lib/*.so.* 2>/dev/null || true

# Every library of a tool must come from the bundle, except glibc's and those every Ubuntu
# 24.04 image has (libgcc_s, libstdc++, zlib); `ldd` prints one line per library it resolves.
os_libs='^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|librt|libpthread|libresolv|libgcc_s|'
os_libs+='libstdc\+\+|libz)\.so'
unbundled() {  # LIBRARY_PATH FILE...
  local path="$1" f
  shift
  for f in "$@"; do
    LD_LIBRARY_PATH="$path" ldd "$f" | awk -v f="$f" -v root="$root/" -v os_libs="$os_libs" '
      { name = $1; sub(/.*\//, "", name) }
      name ~ os_libs { next }
      $3 == "not" || index($3, root) != 1 { print f ": " $1 " => " $3 }'
  done
}
missing="$(unbundled "$tools/lib:$debian/lib:$debian/lib/ucx:$root/lib" "$tools"/bin/* \
             "$debian"/lib/*.so.* "$debian"/lib/ucx/*.so.*
           unbundled "$tools/iproute2/lib" "$tools/iproute2/libexec/ip")"
du -sh "$root"/ucx-* "$tools"
if [[ -n "$missing" ]]; then
  echo "ucx_bundle.sh: libraries the bundle lacks (resolved outside $root):" >&2
  echo "$missing" >&2
  exit 1
fi
