#!/usr/bin/env python3
"""Builds tessera's image as an OCI image layout tarball (`oci-archive`) without a daemon or a registry.

The root filesystem holds the given binaries under /usr/bin, any further files at the paths given for
them (`--file SRC:DEST`: the simulated NVIDIA driver under /usr/lib/tessera-sim), exactly the shared
libraries `ldd` says all of them load (at the paths the loader looks them up by, as regular files) with the
rest of glibc that NVIDIA's driver libraries load (DRIVER_GLIBC), and an
/etc/passwd and /etc/group with the non-root user the controller runs as: the same paths as
deployments/container/Dockerfile's distroless stage. Deterministic: fixed mtimes and owners, sorted
entries, gzip without a timestamp, so the same inputs give the same digests.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

NONROOT_UID = 65532
BIN_DIR = "usr/bin"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
PASSWD = f"root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:{NONROOT_UID}:{NONROOT_UID}:nonroot:/home/nonroot:/sbin/nologin\n"
GROUP = f"root:x:0:\nnonroot:x:{NONROOT_UID}:\n"


class ImageError(Exception):
    """A failed step, with what to fix."""


@dataclass
class Rootfs:
    """Files of the layer by their path in the image (no leading slash)."""

    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    dirs: dict[str, int] = field(default_factory=dict)

    def add_file(self, path: str, data: bytes, mode: int) -> None:
        self.files[path] = (data, mode)
        parent = os.path.dirname(path)
        while parent:
            self.dirs.setdefault(parent, 0o755)
            parent = os.path.dirname(parent)

    def add_dir(self, path: str, mode: int) -> None:
        self.dirs[path] = mode
        self.add_parents(path)

    def add_parents(self, path: str) -> None:
        parent = os.path.dirname(path)
        while parent:
            self.dirs.setdefault(parent, 0o755)
            parent = os.path.dirname(parent)


LDD_LINE = re.compile(r"^\s*(?:(\S+)\s+=>\s+)?(/\S+)\s+\(0x[0-9a-f]+\)\s*$")


def shared_libraries(binary: Path) -> list[str]:
    """Absolute paths the loader opens for `binary` (its interpreter included), as `ldd` reports them."""
    result = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        text = (result.stdout + result.stderr).strip()
        if "not a dynamic executable" in text:
            return []
        raise ImageError(f"ldd {binary} failed: {text}")
    paths = []
    for line in result.stdout.splitlines():
        if "not found" in line:
            raise ImageError(f"{binary} needs a library this machine lacks: {line.strip()}")
        match = LDD_LINE.match(line)
        if match:
            paths.append(match.group(2))
    return paths


# glibc's libraries that NVIDIA's driver libraries and tools (libcuda, libnvidia-ml, nvidia-smi, the MPS
# daemon) list as NEEDED and tessera's own binaries do not load: the plugin dlopens NVML and runs the MPS
# tools under this image's loader, which must find them. Since glibc 2.34 they are stubs (the code is in
# libc.so.6), but the loader still opens each file a library names.
DRIVER_GLIBC = ("libpthread.so.0", "libdl.so.2", "librt.so.1")


def driver_glibc(libs: Sequence[str]) -> list[str]:
    """The DRIVER_GLIBC libraries of the glibc whose libc.so.6 is among `libs`, from libc's directory."""
    libc = next((lib for lib in libs if os.path.basename(lib) == "libc.so.6"), None)
    if libc is None:
        return []
    out = []
    for name in DRIVER_GLIBC:
        path = os.path.join(os.path.dirname(libc), name)
        if not os.path.isfile(path):
            raise ImageError(f"{path} is missing beside {libc}: NVIDIA's libraries need it (Debian: libc6)")
        out.append(path)
    return out


def layer_tar(rootfs: Rootfs, mtime: int) -> bytes:
    buf = io.BytesIO()
    # USTAR/PAX with numeric owners only: no user names from this machine leak into the layer.
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        entries = [(p, None) for p in rootfs.dirs] + [(p, v) for p, v in rootfs.files.items()]
        for path, value in sorted(entries, key=lambda e: e[0]):
            info = tarfile.TarInfo(path if value is not None else path + "/")
            info.mtime = mtime
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if value is None:
                info.type = tarfile.DIRTYPE
                info.mode = rootfs.dirs[path]
                tar.addfile(info)
            else:
                data, mode = value
                info.size = len(data)
                info.mode = mode
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def gzip_bytes(data: bytes) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=6) as gz:
        gz.write(data)
    return buf.getvalue()


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical_json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def parse_file_arg(value: str) -> tuple[Path, str]:
    """`SRC:DEST` (DEST absolute, in the image) as (source, path in the layer without the leading slash)."""
    src, sep, dest = value.rpartition(":")
    if not sep or not src or not dest.startswith("/"):
        raise argparse.ArgumentTypeError(f"{value!r}: expected SRC:DEST with an absolute DEST")
    rel = os.path.normpath(dest).lstrip("/")
    if not rel or rel == "." or rel.startswith(".."):
        raise argparse.ArgumentTypeError(f"{value!r}: DEST must name a file inside the image")
    return Path(src), rel


def build_rootfs(binaries: list[Path], files: Sequence[tuple[Path, str]] = ()) -> Rootfs:
    """`binaries` go to /usr/bin under their names, each of `files` (source, path in the image) to its path;
    all of them mode 0755 with the libraries they load."""
    rootfs = Rootfs()
    placed = [(binary, f"{BIN_DIR}/{binary.name}") for binary in binaries]
    placed += [(src, dest.lstrip("/")) for src, dest in files]
    for src, dest in placed:
        if not src.is_file():
            raise ImageError(f"{src} does not exist: build it first (cargo build --release)")
        if dest in rootfs.files:
            raise ImageError(f"two files for /{dest}")
        rootfs.add_file(dest, src.read_bytes(), 0o755)
    libs = [lib for src, _ in placed for lib in shared_libraries(src)]
    for lib in libs + driver_glibc(libs):
        # The file itself under the name the loader asks for: the image needs no symlinks or ld.so.cache.
        rootfs.add_file(lib.lstrip("/"), Path(lib).resolve().read_bytes(), 0o755)
    rootfs.add_file("etc/passwd", PASSWD.encode(), 0o644)
    rootfs.add_file("etc/group", GROUP.encode(), 0o644)
    rootfs.add_dir("tmp", 0o1777)
    rootfs.add_dir("home/nonroot", 0o755)
    return rootfs


def image_config(layer_diff_id: str, entrypoint: str, version: str, created: str, source: str) -> dict:
    return {
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "config": {
            # The controller's user; the plugin's DaemonSet sets runAsUser: 0 because NVML and the device
            # nodes need root.
            "User": f"{NONROOT_UID}:{NONROOT_UID}",
            "Entrypoint": [f"/{BIN_DIR}/{entrypoint}"],
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "WorkingDir": "/",
            "Labels": {
                "org.opencontainers.image.title": "tessera",
                "org.opencontainers.image.description": "tessera DRA driver for NVIDIA GPUs: "
                "tessera-controller and tessera-kubelet-plugin",
                "org.opencontainers.image.version": version,
                "org.opencontainers.image.source": source,
            },
        },
        "rootfs": {"type": "layers", "diff_ids": [layer_diff_id]},
        "history": [{"created": created, "created_by": "e2e/tools/image/oci_image.py"}],
    }


def write_oci_layout(
    out: Path,
    layer_gz: bytes,
    config: bytes,
    manifest_annotations: dict[str, str],
    index_annotations: dict[str, str],
    mtime: int = 0,
) -> str:
    """Writes a one-layer, amd64 OCI image layout as a tarball at `out` (atomically); returns the manifest's
    digest. Shared by tessera's image and the real node's pause and busybox images."""
    manifest = canonical_json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": {"mediaType": MEDIA_CONFIG, "digest": sha256(config), "size": len(config)},
            "layers": [{"mediaType": MEDIA_LAYER, "digest": sha256(layer_gz), "size": len(layer_gz)}],
            **({"annotations": manifest_annotations} if manifest_annotations else {}),
        }
    )
    index = canonical_json(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": MEDIA_MANIFEST,
                    "digest": sha256(manifest),
                    "size": len(manifest),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": index_annotations,
                }
            ],
        }
    )
    blobs = {sha256(b).split(":")[1]: b for b in (layer_gz, config, manifest)}
    members = [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index)]
    members += [(f"blobs/sha256/{h}", b) for h, b in sorted(blobs.items())]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("blobs/", "blobs/sha256/"):
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, mtime
            tar.addfile(info)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, mtime
            tar.addfile(info, io.BytesIO(data))
    # A reader never sees half an archive under the final name.
    os.replace(tmp, out)
    return sha256(manifest)


def build_archive(
    binaries: list[Path],
    out: Path,
    ref: str,
    version: str,
    mtime: int,
    source: str,
    files: Sequence[tuple[Path, str]] = (),
) -> dict:
    """Writes the OCI layout tarball to `out`; returns sizes and digests. `files`: (source, path in the
    image) beyond /usr/bin's binaries."""
    created = "1970-01-01T00:00:00Z" if mtime == 0 else _rfc3339(mtime)
    layer = layer_tar(build_rootfs(binaries, files), mtime)
    layer_gz = gzip_bytes(layer)
    config = canonical_json(image_config(sha256(layer), "tessera-controller", version, created, source))
    manifest = write_oci_layout(
        out,
        layer_gz,
        config,
        manifest_annotations={"org.opencontainers.image.version": version},
        index_annotations={"org.opencontainers.image.ref.name": ref},
        mtime=mtime,
    )
    return {
        "archive": str(out),
        "archive_bytes": out.stat().st_size,
        "layer_bytes": len(layer),
        "layer_gzip_bytes": len(layer_gz),
        "manifest_digest": manifest,
    }


def _rfc3339(epoch: int) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", action="append", type=Path, required=True, help="binary for /usr/bin (repeat)")
    parser.add_argument(
        "--file",
        action="append",
        type=parse_file_arg,
        default=[],
        metavar="SRC:DEST",
        help="another file at absolute path DEST in the image, mode 0755, with the libraries it loads (repeat)",
    )
    parser.add_argument("--out", type=Path, required=True, help="OCI archive to write (.tar)")
    parser.add_argument("--ref", default="tessera:dev", help="org.opencontainers.image.ref.name in index.json")
    parser.add_argument("--version", default="dev", help="org.opencontainers.image.version label")
    parser.add_argument("--source", default="https://github.com/tessera/tessera")
    args = parser.parse_args(argv)
    mtime = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    try:
        summary = build_archive(args.binary, args.out, args.ref, args.version, mtime, args.source, args.file)
    except ImageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
