//! Device metadata (KEP-5304, beta in Kubernetes 1.37): a JSON file per request of a prepared claim that
//! tells the workload what it got — the device's attributes as its ResourceSlice publishes them, plus what
//! only preparing learns (a MIG device's `MIG-` UUID) — without API access. Kubelet has no part in it: the
//! driver writes the file and hands the runtime a bind mount of it, at the path upstream's readers look
//! (`k8s.io/dynamic-resource-allocation/devicemetadata`):
//!
//! * `/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/gpu.tessera.dev-metadata.json`
//!   for a claim the pod names;
//! * `…/resourceclaimtemplates/<pod claim name>/<request>/…` for a claim made from a template (its
//!   `resource.kubernetes.io/pod-claim-name` annotation), whose own name the pod cannot know.
//!
//! The file is a stream of the same `DeviceMetadata` object once per API version, newest first
//! (`metadata.resource.k8s.io/v1beta1`, then `v1alpha1` for 1.36's readers), as upstream's Go helper writes
//! it. The mount rides in the claim's own CDI spec, on every device of the request, so it comes and goes
//! with the spec and needs no CDI file of its own.
//!
//! On the host a claim's files live in `<dir>/<claim UID>/<request>/metadata.json`, `<dir>` being under the
//! plugin's state directory, which the chart mounts at the same path in the plugin's container (the CDI
//! spec names host paths).

use std::{collections::BTreeMap, fs, io, path::PathBuf};

use k8s_openapi::api::resource::v1::DeviceAttribute;
use serde_json::{Value, json};
use tessera_api::{
    DRIVER_NAME, DeviceName, GpuInfo,
    attributes::{self as attr, DriverVersions},
};

use crate::node::cdi::{Durability, Mount, write_atomically};
use crate::node::checkpoint::DeviceDetail;
use crate::node::error::{Error, Result};

/// Where the files appear inside containers.
pub const CONTAINER_DIR: &str = "/var/run/kubernetes.io/dra-device-attributes";
/// The versions each file holds, newest first: readers take the first they know.
pub const VERSIONS: [&str; 2] = [
    "metadata.resource.k8s.io/v1beta1",
    "metadata.resource.k8s.io/v1alpha1",
];
/// The annotation the ResourceClaim controller puts on a claim it made from a pod's template.
pub const POD_CLAIM_NAME_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";
/// Upstream's schema allows this many attributes per device.
const MAX_ATTRIBUTES: usize = 32;

/// The claim a file describes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimIdentity {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// `spec.resourceClaims[].name` of the pod a template-made claim belongs to.
    pub pod_claim_name: Option<String>,
}

/// One prepared device of a request.
#[derive(Clone, Debug, PartialEq)]
pub struct MetadataDevice {
    /// `<request>` or `<request>/<subrequest>`, as the allocation names it.
    pub request: String,
    pub pool: String,
    pub device: String,
    pub attributes: BTreeMap<String, DeviceAttribute>,
}

/// A prepared device's attributes: those its ResourceSlice publishes for it (the controller builds them
/// with the same [`attr::of_gpu`]), less the policy's (`sharingStrategy` aside, which the share's own
/// record names, and `warmSeconds`), plus the `MIG-` UUID of a MIG device, which exists only now.
pub fn attributes(
    gpu: &GpuInfo,
    versions: DriverVersions<'_>,
    device: &DeviceName,
    detail: &DeviceDetail,
) -> BTreeMap<String, DeviceAttribute> {
    let kind = match device {
        DeviceName::Gpu { .. } => attr::TYPE_GPU,
        DeviceName::Mig { .. } => attr::TYPE_MIG,
        DeviceName::SharedGpu { .. } | DeviceName::SharedMig { .. } | DeviceName::ShareSlot { .. } => {
            attr::TYPE_SHARED
        }
    };
    let mut a = attr::of_gpu(gpu, versions, kind, attr::numeric_version);
    if let DeviceName::Mig { profile, start, .. } | DeviceName::SharedMig { profile, start, .. } = device {
        attr::add_mig(&mut a, profile, *start);
    }
    let mig_uuid = match detail {
        DeviceDetail::Gpu { .. } => None,
        DeviceDetail::Mig(m) => m.uuid.as_deref(),
        DeviceDetail::Shared(s) => s.mig.as_ref().and(s.uuid.as_deref()),
    };
    if let Some(uuid) = mig_uuid {
        a.insert(attr::MIG_UUID.into(), attr::string(uuid));
    }
    if let DeviceDetail::Shared(s) = detail
        && let Some(strategy) = &s.strategy
    {
        a.insert(attr::SHARING_STRATEGY.into(), attr::string(strategy));
    }
    a
}

/// The host directory holding every prepared claim's metadata files, and the node's driver versions the
/// attributes name.
#[derive(Clone, Debug)]
pub struct MetadataDir {
    dir: PathBuf,
    driver_version: Option<String>,
    cuda_driver_version: Option<String>,
}

impl MetadataDir {
    /// `driver_version` and `cuda_driver_version` as the node's inventory reports them.
    pub fn new(
        dir: impl Into<PathBuf>,
        driver_version: Option<String>,
        cuda_driver_version: Option<String>,
    ) -> Self {
        Self {
            dir: dir.into(),
            driver_version,
            cuda_driver_version,
        }
    }

    /// A prepared device's attributes ([`attributes`]) on this node.
    pub fn attributes_of(
        &self,
        gpu: &GpuInfo,
        device: &DeviceName,
        detail: &DeviceDetail,
    ) -> BTreeMap<String, DeviceAttribute> {
        let versions = DriverVersions {
            driver: self.driver_version.as_deref(),
            cuda_driver: self.cuda_driver_version.as_deref(),
        };
        attributes(gpu, versions, device, detail)
    }

    /// The directory of one claim's files.
    pub fn claim_dir(&self, claim_uid: &str) -> PathBuf {
        self.dir.join(claim_uid)
    }

    /// Writes one file per request of `devices` (each atomically, so a restarted plugin or a container
    /// never reads half of one) and returns, per request as the allocation names it, the mount that shows
    /// it to the request's containers. Writing again replaces the files: a retried prepare is the same.
    pub fn write(
        &self,
        claim: &ClaimIdentity,
        devices: &[MetadataDevice],
    ) -> Result<BTreeMap<String, Mount>> {
        let mut by_request: BTreeMap<&str, Vec<&MetadataDevice>> = BTreeMap::new();
        for d in devices {
            by_request.entry(d.request.as_str()).or_default().push(d);
        }
        let mut mounts = BTreeMap::new();
        for (request, devices) in by_request {
            let base = base_request(request);
            let dir = self.claim_dir(&claim.uid).join(base);
            let path = dir.join("metadata.json");
            let err = |source| Error::WriteDeviceMetadata {
                path: path.clone(),
                source,
            };
            fs::create_dir_all(&dir).map_err(err)?;
            let stream = document_stream(claim, request, &devices);
            write_atomically(
                &dir.join(".metadata.json.tmp"),
                &path,
                stream.as_bytes(),
                Durability::ProcessCrash,
            )
            .map_err(err)?;
            mounts.insert(
                request.to_string(),
                Mount {
                    host_path: path.display().to_string(),
                    container_path: container_path(claim, base),
                    options: ["ro", "nosuid", "nodev", "bind"].map(String::from).to_vec(),
                },
            );
        }
        Ok(mounts)
    }

    /// Removes a claim's files; files already gone are success (unprepare is idempotent).
    pub fn remove(&self, claim_uid: &str) -> Result<()> {
        let path = self.claim_dir(claim_uid);
        match fs::remove_dir_all(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(Error::RemoveDeviceMetadata { path, source }),
        }
    }

    /// UIDs of the claims with files here (a missing directory has none), for the start-up sweep.
    pub fn claim_uids(&self) -> Result<Vec<String>> {
        let entries = match fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => {
                return Err(Error::ListDeviceMetadata {
                    path: self.dir.clone(),
                    source,
                });
            }
        };
        let mut uids = entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect::<Vec<_>>();
        uids.sort();
        Ok(uids)
    }
}

/// The request a file is named by: `<request>` of `<request>/<subrequest>`.
fn base_request(request: &str) -> &str {
    request.split_once('/').map_or(request, |(base, _)| base)
}

/// The file's path inside the container.
pub fn container_path(claim: &ClaimIdentity, base_request: &str) -> String {
    let file = format!("{DRIVER_NAME}-metadata.json");
    match claim.pod_claim_name.as_deref().filter(|n| !n.is_empty()) {
        Some(pod_claim) => {
            format!("{CONTAINER_DIR}/resourceclaimtemplates/{pod_claim}/{base_request}/{file}")
        }
        None => format!(
            "{CONTAINER_DIR}/resourceclaims/{}/{base_request}/{file}",
            claim.name
        ),
    }
}

/// The file's content: one `DeviceMetadata` object per version of [`VERSIONS`], one per line.
fn document_stream(claim: &ClaimIdentity, request: &str, devices: &[&MetadataDevice]) -> String {
    let devices: Vec<Value> = devices
        .iter()
        .map(|d| {
            // The schema's limit; tessera's devices carry fewer, so this only guards a future attribute.
            let attributes: BTreeMap<&String, &DeviceAttribute> =
                d.attributes.iter().take(MAX_ATTRIBUTES).collect();
            json!({
                "driver": DRIVER_NAME,
                "pool": d.pool,
                "name": d.device,
                "attributes": attributes,
            })
        })
        .collect();
    let mut out = String::new();
    for version in VERSIONS {
        let mut object = json!({
            "kind": "DeviceMetadata",
            "apiVersion": version,
            "metadata": {
                "name": claim.name,
                "namespace": claim.namespace,
                "uid": claim.uid,
                "generation": 1,
            },
            "requests": [{"name": request, "devices": devices}],
        });
        if let Some(pod_claim) = &claim.pod_claim_name {
            object["podClaimName"] = json!(pod_claim);
        }
        out.push_str(&object.to_string());
        out.push('\n');
    }
    out
}
