#!/usr/bin/env bash
# Installs the Debian packages kvferry builds and tests with, skipping those already present.
# Needs root (or passwordless sudo) only when something is missing.
set -euo pipefail
pkgs=(cmake g++ make pkg-config libasio-dev libcpp-httplib-dev libssl-dev nlohmann-json3-dev libcli11-dev libspdlog-dev
      libfmt-dev libxxhash-dev libgtest-dev iperf3 clang-format
      libucx-dev ucx-utils iproute2  # the UCX transport; its tests and bench/ucx_netns.sh
      clang libclang-rt-14-dev  # clang and its libFuzzer runtime: scripts/fuzz.sh
      # the Python package (python/), for Debian's /usr/bin/python3: its headers, pybind11,
      # numpy, pytest, and what `pip install --no-build-isolation .` uses
      python3-dev pybind11-dev python3-numpy python3-pytest python3-setuptools python3-wheel
      python3-pip python3-venv
      python3-torch)  # the example model of python/kvferry/examples (docs/real-model.md)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "kvferry: installing missing packages: ${missing[*]}" >&2
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
