#!/usr/bin/env python3
"""Writes the real node's images as OCI archives, so the node never pulls.

- `pause.tar`, `registry.k8s.io/pause:3.10-tessera`: Kubernetes' pause program (built statically from
  build/pause/linux/pause.c) as /pause, the sandbox image containerd's config names.
- `busybox.tar`, `tessera.dev/e2e/busybox:1`: a static busybox as /bin/busybox and a link per applet.
- `cuda-probe.tar`, `tessera.dev/e2e/cuda-probe:1`: a glibc image, what the real node's workload pods run
  (`imagePullPolicy: Never`): the CUDA probe (e2e/images/cuda-probe.c, dynamically linked) at
  /usr/local/bin/cuda-probe, this machine's glibc runtime, and the static busybox for `sh`. The libraries
  are those the loader opens for the probe and for the driver's files given with `--driver-file` (the
  simulated driver's libcuda.so.1, libnvidia-ml.so.1, nvidia-smi, ...), `ldd`'s closure of their NEEDED
  entries, each a regular file at the path the loader looks it up by (`/lib/x86_64-linux-gnu/libc.so.6`,
  `/lib64/ld-linux-x86-64.so.2`), as in tessera's own image (e2e/tools/image/oci_image.py). The driver's
  files themselves are not in the image: the CDI spec mounts them from the node's driver root, at
  /usr/lib/x86_64-linux-gnu (an empty directory here) or, for a GKE-style driver root, /usr/local/nvidia/lib64,
  which no loader searches by default. The image has Ubuntu's loader configuration (/etc/ld.so.conf including
  /etc/ld.so.conf.d/*.conf, and x86_64-linux-gnu.conf) but no /etc/ld.so.cache: tessera's CDI hook
  (`update-ldcache`) builds the container's cache with the driver's directories in it, so dlopen("libcuda.so.1")
  finds them through the cache with no LD_LIBRARY_PATH, wherever the driver root put them.

Each is one layer; containerd's `ctr images import` reads the `io.containerd.image.name` annotation. The
gzip, digests and the OCI layout come from e2e/tools/image/oci_image.py's helpers, so both are
deterministic.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "image"))
from oci_image import ImageError, canonical_json, gzip_bytes, sha256, shared_libraries, write_oci_layout  # noqa: E402

PAUSE_REF = "registry.k8s.io/pause:3.10-tessera"
BUSYBOX_REF = "tessera.dev/e2e/busybox:1"
CUDA_PROBE_REF = "tessera.dev/e2e/cuda-probe:1"
# Where the driver's libraries are mounted (the host's path under the driver root; a default directory of
# the loader's search on Debian/Ubuntu x86_64).
DRIVER_LIBRARY_DIR = "usr/lib/x86_64-linux-gnu"
# Ubuntu's loader configuration (libc-bin, libc6); no cache: the CDI hook makes the container's.
LOADER_CONFIG = {
    "etc/ld.so.conf": b"include /etc/ld.so.conf.d/*.conf\n",
    "etc/ld.so.conf.d/libc.conf": b"/usr/local/lib\n",
    "etc/ld.so.conf.d/x86_64-linux-gnu.conf": b"/usr/local/lib/x86_64-linux-gnu\n/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n",
}


def layer(files: dict[str, bytes], links: dict[str, str], dirs: list[str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in sorted(dirs):
            info = tarfile.TarInfo(d + "/")
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        for path, data in sorted(files.items()):
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
        for path, target in sorted(links.items()):
            info = tarfile.TarInfo(path)
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
            tar.addfile(info)
    return buf.getvalue()


def archive(out: Path, ref: str, layer_tar: bytes, config: dict) -> None:
    layer_gz = gzip_bytes(layer_tar)
    image_config = canonical_json(
        {
            "architecture": "amd64",
            "os": "linux",
            "created": "1970-01-01T00:00:00Z",
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": [sha256(layer_tar)]},
        }
    )
    # ctr names the imported image after io.containerd.image.name (the OCI ref.name alone is only a tag).
    write_oci_layout(
        out,
        layer_gz,
        image_config,
        manifest_annotations={},
        index_annotations={"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref},
    )


def applets(busybox: Path) -> list[str]:
    out = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=True).stdout
    return [a for a in out.split() if a and a != "busybox"]


def glibc_runtime(elfs: list[Path]) -> dict[str, bytes]:
    """The shared libraries (the loader included) `ldd` says each file needs, by their path in the image."""
    files: dict[str, bytes] = {}
    for elf in elfs:
        for lib in shared_libraries(elf):
            files[lib.lstrip("/")] = Path(lib).resolve().read_bytes()
    return files


def cuda_probe_layer(probe: Path, busybox: Path, driver_files: list[Path]) -> bytes:
    files = glibc_runtime([probe, *driver_files])
    if not any(Path(p).name.startswith("ld-linux") for p in files):
        raise ImageError(f"{probe} has no dynamic loader: the probe must be dynamically linked against glibc")
    files["usr/local/bin/cuda-probe"] = probe.read_bytes()
    files.update(LOADER_CONFIG)
    files["bin/busybox"] = busybox.read_bytes()
    links = {f"bin/{a}": "busybox" for a in applets(busybox)}
    dirs = {"bin", "tmp", "dev", "proc", "sys", "etc", "etc/ld.so.conf.d", "usr", "usr/bin", "usr/lib", DRIVER_LIBRARY_DIR,
            "usr/local", "usr/local/bin"}
    for path in files:
        parent = Path(path).parent
        while str(parent) != ".":
            dirs.add(str(parent))
            parent = parent.parent
    return layer(files, links, sorted(dirs))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pause", type=Path, required=True, help="static pause binary")
    parser.add_argument("--busybox", type=Path, required=True, help="static busybox binary")
    parser.add_argument("--cuda-probe", type=Path, required=True, help="the CUDA probe, dynamically linked (gcc ... -ldl)")
    parser.add_argument(
        "--driver-file",
        type=Path,
        action="append",
        default=[],
        help="a driver library or program whose NEEDED libraries the probe image carries (repeatable)",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for pause.tar, busybox.tar and cuda-probe.tar")
    args = parser.parse_args(argv)
    for binary in (args.pause, args.busybox):
        kind = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
        if "=>" in kind:
            print(f"error: {binary} is dynamically linked; the images carry no libraries", file=sys.stderr)
            return 1
    args.out.mkdir(parents=True, exist_ok=True)
    archive(
        args.out / "pause.tar",
        PAUSE_REF,
        layer({"pause": args.pause.read_bytes()}, {}, []),
        {"Entrypoint": ["/pause"], "User": "65535:65535"},
    )
    links = {f"bin/{a}": "busybox" for a in applets(args.busybox)}
    archive(
        args.out / "busybox.tar",
        BUSYBOX_REF,
        layer({"bin/busybox": args.busybox.read_bytes()}, links, ["bin", "tmp", "dev", "proc", "sys", "etc"]),
        {"Cmd": ["/bin/sh"], "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "WorkingDir": "/"},
    )
    try:
        probe_layer = cuda_probe_layer(args.cuda_probe, args.busybox, args.driver_file)
    except ImageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    archive(
        args.out / "cuda-probe.tar",
        CUDA_PROBE_REF,
        probe_layer,
        {
            "Cmd": ["/usr/local/bin/cuda-probe"],
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "WorkingDir": "/",
        },
    )
    print(
        f"wrote {args.out / 'pause.tar'} ({PAUSE_REF}), {args.out / 'busybox.tar'} ({BUSYBOX_REF}) and "
        f"{args.out / 'cuda-probe.tar'} ({CUDA_PROBE_REF})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
