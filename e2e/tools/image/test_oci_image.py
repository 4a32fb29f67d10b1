"""Checks the OCI archive `make image` wrote (IMAGE_ARCHIVE, default target/image/tessera.tar) as a runtime
would read it: the layout, every digest and size, the config, and both binaries and the simulated driver's
nvidia-smi started from the unpacked root filesystem in a chroot, where nothing of this machine's libraries
is visible.

    python3 -m unittest discover -s e2e/tools/image -v
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import unittest
from pathlib import Path

import oci_image

REPO = Path(__file__).resolve().parents[3]
ARCHIVE = Path(os.environ.get("IMAGE_ARCHIVE", REPO / "target/image/tessera.tar"))
# tessera-cdi-hook is statically linked (the container runtime runs it on the host): it adds no library.
BINARIES = ("tessera-controller", "tessera-kubelet-plugin", "tessera-cdi-hook")
# The simulated driver (e2e/scripts/build-image.sh --file), where the plugin looks for it:
# <exe dir>/../lib/tessera-sim (kubelet-plugin/src/gpu/sim_driver_root.rs).
SIM_DIR = "usr/lib/tessera-sim"
SIM_DRIVER = (
    "libnvidia_ml.so",
    "libcuda.so",
    "libnvidia_ptxjitcompiler.so",
    "libnvidia_nvvm.so",
    "nvidia-smi",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)


def blob_name(digest: str) -> str:
    algo, hex_digest = digest.split(":", 1)
    return f"blobs/{algo}/{hex_digest}"


class Layout:
    """The archive's members, read once."""

    def __init__(self, archive: Path) -> None:
        with tarfile.open(archive) as tar:
            self.members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
        self.index = json.loads(self.members["index.json"])
        self.manifest_descriptor = self.index["manifests"][0]
        self.manifest = json.loads(self.members[blob_name(self.manifest_descriptor["digest"])])
        self.config = json.loads(self.members[blob_name(self.manifest["config"]["digest"])])
        self.layer_gz = self.members[blob_name(self.manifest["layers"][0]["digest"])]


class TheImageArchive(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        if not ARCHIVE.is_file():
            raise AssertionError(f"no image archive at {ARCHIVE}: run `make image` (or set IMAGE_ARCHIVE)")
        cls.layout = Layout(ARCHIVE)
        cls.rootfs = Path(tempfile.mkdtemp(prefix="tessera-rootfs-"))
        # mkdtemp's 0700 would keep the non-root user out of its own root directory.
        cls.rootfs.chmod(0o755)
        with tarfile.open(fileobj=io.BytesIO(gzip.decompress(cls.layout.layer_gz))) as layer:
            layer.extractall(cls.rootfs, filter="fully_trusted")

    @classmethod
    def tearDownClass(cls) -> None:
        shutil.rmtree(cls.rootfs, ignore_errors=True)

    def test_is_an_oci_layout_whose_index_names_one_amd64_manifest_with_its_reference(self) -> None:
        self.assertEqual(json.loads(self.layout.members["oci-layout"]), {"imageLayoutVersion": "1.0.0"})
        self.assertEqual(self.layout.index["schemaVersion"], 2)
        self.assertEqual(len(self.layout.index["manifests"]), 1)
        descriptor = self.layout.manifest_descriptor
        self.assertEqual(descriptor["mediaType"], oci_image.MEDIA_MANIFEST)
        self.assertEqual(descriptor["platform"], {"architecture": "amd64", "os": "linux"})
        self.assertTrue(descriptor["annotations"]["org.opencontainers.image.ref.name"])

    def test_every_blob_is_named_by_its_sha256_and_every_descriptor_has_the_blobs_size(self) -> None:
        blobs = {n: b for n, b in self.layout.members.items() if n.startswith("blobs/")}
        for name, data in blobs.items():
            self.assertEqual(name, "blobs/sha256/" + hashlib.sha256(data).hexdigest(), name)
        descriptors = [self.layout.manifest_descriptor, self.layout.manifest["config"], *self.layout.manifest["layers"]]
        for d in descriptors:
            self.assertIn(blob_name(d["digest"]), blobs, d)
            self.assertEqual(len(blobs[blob_name(d["digest"])]), d["size"], d)
        self.assertEqual(len(blobs), len(descriptors), "a blob no descriptor names")

    def test_the_configs_diff_id_is_the_digest_of_the_uncompressed_layer(self) -> None:
        rootfs = self.layout.config["rootfs"]
        self.assertEqual(rootfs["type"], "layers")
        self.assertEqual(rootfs["diff_ids"], [oci_image.sha256(gzip.decompress(self.layout.layer_gz))])
        self.assertEqual(self.layout.manifest["layers"][0]["mediaType"], oci_image.MEDIA_LAYER)
        self.assertEqual(self.layout.manifest["config"]["mediaType"], oci_image.MEDIA_CONFIG)

    def test_the_config_runs_the_controller_as_the_non_root_user_with_labels(self) -> None:
        config = self.layout.config["config"]
        self.assertEqual(config["User"], "65532:65532")
        self.assertEqual(config["Entrypoint"], ["/usr/bin/tessera-controller"])
        labels = config["Labels"]
        for key in ("title", "version", "source", "description"):
            self.assertTrue(labels.get(f"org.opencontainers.image.{key}"), key)
        passwd = (self.rootfs / "etc/passwd").read_text()
        self.assertIn("nonroot:x:65532:65532:", passwd)

    def test_the_rootfs_holds_both_binaries_the_simulated_driver_and_only_the_libraries_they_load(self) -> None:
        programs = [f"usr/bin/{n}" for n in BINARIES] + [f"{SIM_DIR}/{n}" for n in SIM_DRIVER]
        for path in programs:
            self.assertTrue(os.access(self.rootfs / path, os.X_OK), path)
        files = {str(p.relative_to(self.rootfs)) for p in self.rootfs.rglob("*") if p.is_file()}
        wanted = set(programs) | {"etc/passwd", "etc/group"}
        for path in programs:
            wanted |= {lib.lstrip("/") for lib in oci_image.shared_libraries(self.rootfs / path)}
        wanted |= {lib.lstrip("/") for lib in oci_image.driver_glibc(sorted("/" + f for f in wanted))}
        self.assertEqual(files, wanted)
        self.assertTrue(any("ld-linux" in f for f in files), files)

    def run_in_rootfs(self, user: str, *argv: str, preload: str | None = None) -> subprocess.CompletedProcess:
        """Runs a program of the image in a chroot of its rootfs; without root, through the rootfs's own
        loader and libraries (which still proves the image carries every library the binary loads).
        `preload`: a library of the image (absolute path in it) loaded first, as LD_PRELOAD."""
        env = {"PATH": "/usr/bin"}
        if os.geteuid() == 0 and shutil.which("chroot"):
            cmd = [shutil.which("chroot"), f"--userspec={user}", str(self.rootfs), *argv]
            if preload:
                env["LD_PRELOAD"] = preload
        else:
            loader = next(self.rootfs.glob("lib64/ld-linux-*.so.*"))
            lib_dirs = sorted(
                {str(p.parent) for p in self.rootfs.rglob("*.so*") if p.parent not in (loader.parent, self.rootfs / SIM_DIR)}
            )
            cmd = [str(loader), "--inhibit-cache", "--library-path", ":".join(lib_dirs)]
            if preload:
                cmd += ["--preload", str(self.rootfs) + preload]
            cmd += [str(self.rootfs) + argv[0], *argv[1:]]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)

    def test_both_binaries_print_their_help_in_a_chroot_of_the_rootfs_and_the_controller_as_non_root(self) -> None:
        for name, user in (("tessera-controller", "65532:65532"), ("tessera-kubelet-plugin", "0:0")):
            run = self.run_in_rootfs(user, f"/usr/bin/{name}", "--help")
            self.assertEqual(run.returncode, 0, f"{name}: {run.stderr}")
            self.assertIn(f"Usage: {name}", run.stdout)
        crds = self.run_in_rootfs("65532:65532", "/usr/bin/tessera-controller", "crds")
        self.assertEqual(crds.returncode, 0, crds.stderr)
        self.assertIn("name: nodeinventories.gpu.tessera.dev", crds.stdout)

    def test_the_simulated_nvidia_smi_runs_in_a_chroot_and_loads_the_images_libnvidia_ml_without_a_kernel(self) -> None:
        smi = f"/{SIM_DIR}/nvidia-smi"
        # The image's libnvidia_ml.so is only the plugin's source for driver roots, under its built name: not
        # on the loader's path as libnvidia-ml.so.1, so nvidia-smi alone does not find it (NVIDIA's exit 12).
        alone = self.run_in_rootfs("0:0", smi)
        self.assertEqual(alone.returncode, 12, f"{alone.stdout}{alone.stderr}")
        self.assertIn("couldn't find libnvidia-ml.so", alone.stdout)
        # Preloaded, its soname libnvidia-ml.so.1 answers nvidia-smi's dlopen; nvmlInit finds no simulated
        # kernel (no tessera-sim/kernel.json above it) and says what NVIDIA's says without a kernel module.
        run = self.run_in_rootfs("0:0", smi, preload=f"/{SIM_DIR}/libnvidia_ml.so")
        self.assertEqual(run.returncode, 9, f"{run.stdout}{run.stderr}")
        self.assertIn("couldn't communicate with the NVIDIA driver", run.stdout)

    def test_the_glibc_libraries_nvidias_libraries_need_are_beside_libc_and_load_under_the_images_loader(self) -> None:
        libc = next(self.rootfs.glob("**/libc.so.6"))
        for name in oci_image.DRIVER_GLIBC:
            lib = libc.parent / name
            self.assertTrue(lib.is_file(), f"{name} is not beside {libc.relative_to(self.rootfs)}")
            # Loaded before the plugin by the image's own loader (in a chroot when root): a library the
            # loader cannot load is reported as "cannot be preloaded" and skipped.
            run = self.run_in_rootfs("0:0", "/usr/bin/tessera-kubelet-plugin", "--version", preload="/" + str(lib.relative_to(self.rootfs)))
            self.assertEqual(run.returncode, 0, f"{name}: {run.stderr}")
            self.assertNotIn("cannot be preloaded", run.stderr, name)
            self.assertIn("tessera-kubelet-plugin", run.stdout, name)

    def test_building_again_from_the_same_binaries_gives_the_same_manifest_digest(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            again = Path(tmp) / "again.tar"
            labels = self.layout.config["config"]["Labels"]
            summary = oci_image.build_archive(
                [self.rootfs / "usr/bin" / n for n in BINARIES],
                again,
                self.layout.manifest_descriptor["annotations"]["org.opencontainers.image.ref.name"],
                labels["org.opencontainers.image.version"],
                int(os.environ.get("SOURCE_DATE_EPOCH", "0")),
                labels["org.opencontainers.image.source"],
                [(self.rootfs / SIM_DIR / n, f"/{SIM_DIR}/{n}") for n in SIM_DRIVER],
            )
            self.assertEqual(summary["manifest_digest"], self.layout.manifest_descriptor["digest"])


class BadInput(unittest.TestCase):
    def test_a_missing_binary_is_an_error_naming_it_and_the_build_to_run(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            missing = Path(tmp) / "tessera-controller"
            with self.assertRaises(oci_image.ImageError) as err:
                oci_image.build_archive([missing], Path(tmp) / "out.tar", "t:dev", "dev", 0, "src")
            self.assertIn(str(missing), str(err.exception))
            self.assertIn("cargo build --release", str(err.exception))
            self.assertFalse((Path(tmp) / "out.tar").exists())

    def test_a_file_needs_an_absolute_destination_inside_the_image(self) -> None:
        self.assertEqual(oci_image.parse_file_arg("a/b:c:/usr/lib/x/y"), (Path("a/b:c"), "usr/lib/x/y"))
        for bad in ("nvidia-smi", "nvidia-smi:usr/bin/nvidia-smi", "nvidia-smi:/", "nvidia-smi:/..", ":/x"):
            with self.assertRaises(argparse.ArgumentTypeError, msg=bad):
                oci_image.parse_file_arg(bad)


if __name__ == "__main__":
    unittest.main()
