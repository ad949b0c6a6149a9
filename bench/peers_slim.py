#!/usr/bin/env python3
"""Slims the peers' wheels (Mooncake's transfer engine, NIXL) for the GPU machine.

The device machine takes at most 64 MiB of carried files per call, and the two wheels alone are
over 100 MiB (Mooncake's store, NIXL's EP kernels for three torch versions, cloud-storage
plugins, ...). This keeps, of each wheel, the Python packages and the shared objects that the
transfer path loads (the entry modules below and everything they link from the wheel,
followed through ELF DT_NEEDED), drops the rest, and writes a valid wheel of the same name
(RECORD rewritten) that `pip install --no-index --find-links` installs as usual. Libraries
the wheels expect from the system (libibverbs, libnuma, libcurl, ...) are copied from this
machine's Debian packages into `syslibs.tar.xz`; bench/peers_gpu.py puts on the library path only
those the GPU machine lacks.

Usage: bench/peers_slim.py WHEEL_DIR OUT_DIR
  WHEEL_DIR  the wheels from `pip download` (mooncake_transfer_engine*.whl, nixl*.whl)
  OUT_DIR    where the slim wheels and syslibs/ go (e.g. .peers, git-ignored, carried)
Prints what it kept, what it left out, and the total size.
"""

import base64
import fnmatch
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile

# Per wheel (by file-name prefix): the top-level Python packages to keep whole (their .py
# files only) and the shared objects the transfer path loads (globs), whose DT_NEEDED closure
# inside the wheel is kept too.
PLANS = {
    "mooncake_transfer_engine": {
        "packages": ["mooncake"],
        "python_globs": ["mooncake/__init__.py", "mooncake/engine.pyi", "mooncake/py.typed"],
        "entries": ["mooncake/engine.so", "mooncake/nvlink_allocator.so"],
    },
    "nixl": {
        "packages": [],
        "python_globs": ["nixl_cu*/*.py", "nixl/*.py", "nixl_cu*/py.typed"],
        "entries": [
            "nixl*/_bindings*.so",
            "nixl*/_utils*.so",
            "*.libs/nixl/libplugin_UCX*.so*",
            ".*.mesonpy.libs/plugins/libplugin_UCX*.so*",
            "*.libs/ucx/libuct_cuda*.so*",
            "*.libs/ucx/libucm_cuda*.so*",
            "*.libs/ucx/libuct_cma*.so*",
        ],
    },
}

# Provided by every Linux system, the NVIDIA driver, or torch (imported first by
# peers_gpu.py, which loads its CUDA runtime): not looked for.
SYSTEM = {
    "libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
    "ld-linux-x86-64.so.2", "libstdc++.so.6", "libgcc_s.so.1", "libcuda.so.1",
    "libcudart.so.13", "libnvidia-ml.so.1", "libutil.so.1", "libz.so.1",
}


def needed(path):
    """DT_NEEDED entries of an ELF file (empty for anything else)."""
    try:
        out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True,
                             check=False).stdout
    except FileNotFoundError:
        sys.exit("peers_slim: readelf not found (Debian package binutils)")
    names = []
    for line in out.splitlines():
        if "(NEEDED)" in line and "[" in line:
            names.append(line.split("[", 1)[1].split("]", 1)[0])
    return names


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim(wheel, plan, out_dir, work):
    root = os.path.join(work, os.path.basename(wheel))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(root)
        names = [n for n in z.namelist() if not n.endswith("/")]
    by_base = {}
    for n in names:
        by_base.setdefault(os.path.basename(n), []).append(n)
    keep, missing = set(), set()
    for pattern in plan["python_globs"]:
        keep.update(n for n in names if fnmatch.fnmatch(n, pattern))
    for pkg in plan["packages"]:
        keep.update(n for n in names if n.startswith(pkg + "/") and n.endswith(".py")
                    and n.count("/") == 1)
    todo = [n for pattern in plan["entries"] for n in names if fnmatch.fnmatch(n, pattern)]
    if not todo:
        sys.exit(f"peers_slim: {wheel}: none of {plan['entries']} found")
    while todo:
        n = todo.pop()
        if n in keep:
            continue
        keep.add(n)
        for lib in needed(os.path.join(root, n)):
            if lib in by_base:
                todo.extend(by_base[lib])
            elif lib not in SYSTEM:
                missing.add(lib)
    dist_info = [n for n in names if n.split("/")[0].endswith(".dist-info")]
    meta = [n for n in dist_info if os.path.basename(n) in ("METADATA", "WHEEL")]
    record = next(n for n in dist_info if os.path.basename(n) == "RECORD")
    out = os.path.join(out_dir, os.path.basename(wheel))
    lines = []
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for n in sorted(keep) + meta:
            with open(os.path.join(root, n), "rb") as f:
                data = f.read()
            info = zipfile.ZipInfo(n, date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if n.endswith(".so") or ".so." in n else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
            lines.append(record_line(n, data))
        lines.append(f"{record},,")
        z.writestr(record, "\n".join(lines) + "\n")
    kept_bytes = sum(os.path.getsize(os.path.join(root, n)) for n in keep)
    print(f"{os.path.basename(wheel)}: kept {len(keep)} of {len(names)} files "
          f"({kept_bytes / 1e6:.1f} MB unpacked), wheel {os.path.getsize(wheel) / 1e6:.1f} -> "
          f"{os.path.getsize(out) / 1e6:.1f} MB")
    return missing


def copy_syslibs(missing, out_dir):
    """Copies each library the wheels expect from the system, and what it links, from this
    machine's loader cache into OUT_DIR/syslibs."""
    cache = {}
    for line in subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True,
                               check=True).stdout.splitlines()[1:]:
        parts = line.strip().split(" => ")
        if len(parts) == 2 and "x86-64" in parts[0]:
            cache.setdefault(parts[0].split(" ")[0], parts[1])
    dest = os.path.join(out_dir, "syslibs")
    os.makedirs(dest, exist_ok=True)
    todo, done, absent = sorted(missing), set(), []
    while todo:
        lib = todo.pop()
        if lib in done or lib in SYSTEM:
            continue
        done.add(lib)
        if lib not in cache:
            absent.append(lib)
            continue
        shutil.copy(os.path.realpath(cache[lib]), os.path.join(dest, lib))
        todo.extend(needed(cache[lib]))
    # The mlx5 verbs provider is loaded by libibverbs at run time, not linked.
    for provider in ("libmlx5.so.1",):
        if provider in cache and provider not in done:
            shutil.copy(os.path.realpath(cache[provider]), os.path.join(dest, provider))
    if absent:
        print("peers_slim: not on this machine (install them and run again, or the GPU "
              "machine must have them): " + ", ".join(absent))
    count = len(os.listdir(dest))
    # One xz archive: a third of the size, which counts against the carry limit.
    archive = dest + ".tar.xz"
    subprocess.run(["tar", "-cJf", archive, "-C", out_dir, "syslibs"], check=True)
    shutil.rmtree(dest)
    print(f"syslibs.tar.xz: {count} libraries, {os.path.getsize(archive) / 1e6:.1f} MB")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    wheel_dir, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    work = os.path.join(out_dir, ".work")
    shutil.rmtree(work, ignore_errors=True)
    missing = set()
    found = False
    for name in sorted(os.listdir(wheel_dir)):
        if not name.endswith(".whl"):
            continue
        plan = next((p for prefix, p in PLANS.items() if name.startswith(prefix)), None)
        if plan is None:
            print(f"peers_slim: {name}: not a peer this script knows, copied as it is")
            shutil.copy(os.path.join(wheel_dir, name), out_dir)
            continue
        found = True
        missing |= slim(os.path.join(wheel_dir, name), plan, out_dir, work)
    shutil.rmtree(work, ignore_errors=True)
    if not found:
        sys.exit(f"peers_slim: no Mooncake or NIXL wheel in {wheel_dir}")
    copy_syslibs(missing, out_dir)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out_dir) for f in fs)
    print(f"total in {out_dir}: {total / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
