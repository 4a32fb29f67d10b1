#!/usr/bin/env python3
"""Writes the real node's two images as OCI archives, so the node never pulls.

- `pause.tar`, `registry.k8s.io/pause:3.10-tessera`: Kubernetes' pause program (built statically from
  build/pause/linux/pause.c) as /pause, the sandbox image containerd's config names.
- `busybox.tar`, `tessera.dev/e2e/busybox:1`: a static busybox as /bin/busybox and a link per applet, what
  the e2e workload pods run (`imagePullPolicy: Never`).

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
from oci_image import canonical_json, gzip_bytes, sha256, write_oci_layout  # noqa: E402

PAUSE_REF = "registry.k8s.io/pause:3.10-tessera"
BUSYBOX_REF = "tessera.dev/e2e/busybox:1"


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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pause", type=Path, required=True, help="static pause binary")
    parser.add_argument("--busybox", type=Path, required=True, help="static busybox binary")
    parser.add_argument("--out", type=Path, required=True, help="directory for pause.tar and busybox.tar")
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
    print(f"wrote {args.out / 'pause.tar'} ({PAUSE_REF}) and {args.out / 'busybox.tar'} ({BUSYBOX_REF})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
