//! `tessera_claim_device_info`: which pod holds which DCGM entity, so dcgm-exporter's `DCGM_FI_*` series
//! can be given pods in PromQL.
//!
//! dcgm-exporter attributes series to pods only for claims of NVIDIA's driver, `gpu.nvidia.com`
//! (`internal/pkg/transformation/const.go` `DRAGPUDriverName`; `kubernetes.go` skips every other driver's
//! claim), so on a tessera node its series carry no pod. This series names, for every device of every
//! prepared claim and every pod the claim is reserved for, the DCGM entity the device lives on, with the
//! label names dcgm-exporter's GPU series use (`internal/pkg/rendermetrics/render_metrics.go`):
//!
//! | Label | Value |
//! |---|---|
//! | `namespace`, `pod` | the claim's namespace and a pod of its `status.reservedFor` (one sample per pod; empty when none is known yet) |
//! | `claim`, `request`, `device` | as on the other per-claim gauges (`device` is tessera's name, `gpu-0`; dcgm-exporter's `device` is `nvidia0`) |
//! | `UUID` | the physical GPU's `GPU-…` UUID: dcgm-exporter writes the parent GPU's UUID on a MIG instance's series too |
//! | `GPU_I_ID` | the MIG GPU instance id (NVML's, as dcgm-exporter's `GPU_I_ID`); empty for a whole GPU or a share of one, which dcgm-exporter's series then match by having no `GPU_I_ID` |
//! | `mig_uuid` | the `MIG-…` UUID of a MIG device (or of the MIG device a share runs on); empty otherwise |
//! | `sharing` | the share's strategy (`MPS`, `TimeSlicing`); empty for a device of the claim's own |
//!
//! `container` is not among them: kubelet's prepare call and the claim name no container (the pod's spec
//! does, and the plugin reads no pods).
//!
//! A shared GPU is one DCGM entity under several claims: its series matches several samples here, one per
//! pod. The chart's recording rules (`deployments/prometheus/tessera-dcgm.rules.yaml`) count the pods on
//! each entity so that a sum over pods never counts the GPU more than once.

use prometheus_client::{
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::gauge::ConstGauge,
};

use crate::node::checkpoint::{Checkpoint, DeviceDetail, MigDetail, Phase};

/// One sample of `tessera_claim_device_info`: a pod of a claim holding a device on a DCGM entity.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ClaimDeviceInfo {
    pub namespace: String,
    pub pod: String,
    pub claim: String,
    pub request: String,
    pub device: String,
    /// The physical GPU's UUID, dcgm-exporter's `UUID`.
    pub gpu_uuid: String,
    /// dcgm-exporter's `GPU_I_ID`: the MIG GPU instance's id, for a MIG device or a share of one.
    pub gpu_instance: Option<u32>,
    pub mig_uuid: Option<String>,
    pub sharing: Option<String>,
}

impl ClaimDeviceInfo {
    fn labels(&self) -> Vec<(&'static str, String)> {
        vec![
            ("namespace", self.namespace.clone()),
            ("pod", self.pod.clone()),
            ("claim", self.claim.clone()),
            ("request", self.request.clone()),
            ("device", self.device.clone()),
            ("UUID", self.gpu_uuid.clone()),
            (
                "GPU_I_ID",
                self.gpu_instance.map(|gi| gi.to_string()).unwrap_or_default(),
            ),
            ("mig_uuid", self.mig_uuid.clone().unwrap_or_default()),
            ("sharing", self.sharing.clone().unwrap_or_default()),
        ]
    }
}

/// The DCGM entity of a prepared device: parent GPU UUID, GPU instance id and MIG UUID. None for a MIG
/// device whose ids are not recorded yet, or a record older than the parent UUID it would need (no DCGM
/// series could be matched to it).
fn entity(detail: &DeviceDetail) -> Option<(String, Option<u32>, Option<String>)> {
    let mig = |m: &MigDetail, uuid: Option<&String>| -> Option<(String, Option<u32>, Option<String>)> {
        Some((
            m.gpu_uuid.clone()?,
            Some(m.gpu_instance?),
            m.uuid.clone().or_else(|| uuid.cloned()),
        ))
    };
    match detail {
        DeviceDetail::Gpu { uuid, .. } => Some((uuid.clone(), None, None)),
        DeviceDetail::Mig(m) => mig(m, None),
        DeviceDetail::Shared(s) => match &s.mig {
            Some(m) => {
                let (gpu_uuid, gi, mig_uuid) = mig(m, s.uuid.as_ref())?;
                Some((s.gpu_uuid.clone().unwrap_or(gpu_uuid), gi, mig_uuid))
            }
            None => Some((s.gpu_uuid.clone().or_else(|| s.uuid.clone())?, None, None)),
        },
    }
}

/// One sample per pod of every device of every prepared claim in `checkpoint`; `pods_of` names the pods a
/// claim (by UID) is reserved for. A claim being prepared or unprepared has none: its device is not the
/// claim's yet, or not any more.
pub fn claim_device_info(
    checkpoint: &Checkpoint,
    pods_of: impl Fn(&str) -> Vec<String>,
) -> Vec<ClaimDeviceInfo> {
    let mut out = Vec::new();
    for record in checkpoint
        .claims
        .values()
        .filter(|r| r.phase == Phase::PrepareCompleted)
    {
        let mut pods = pods_of(&record.uid);
        if pods.is_empty() {
            pods.push(String::new());
        }
        for device in &record.devices {
            let Some((gpu_uuid, gpu_instance, mig_uuid)) = entity(&device.detail) else {
                tracing::debug!(device = %device.device, "no GPU UUID recorded: left out of tessera_claim_device_info");
                continue;
            };
            let sharing = match &device.detail {
                DeviceDetail::Shared(s) => Some(s.strategy.clone().unwrap_or_default()),
                _ => None,
            };
            for pod in &pods {
                out.push(ClaimDeviceInfo {
                    namespace: record.namespace.clone(),
                    pod: pod.clone(),
                    claim: record.name.clone(),
                    request: device.request.clone(),
                    device: device.device.clone(),
                    gpu_uuid: gpu_uuid.clone(),
                    gpu_instance,
                    mig_uuid: mig_uuid.clone(),
                    sharing: sharing.clone(),
                });
            }
        }
    }
    out.sort();
    out
}

/// Writes `tessera_claim_device_info`, value 1 per sample.
pub fn encode(encoder: &mut DescriptorEncoder<'_>, info: &[ClaimDeviceInfo]) -> Result<(), std::fmt::Error> {
    let one = ConstGauge::new(1.0);
    let mut metric = encoder.encode_descriptor(
        "tessera_claim_device_info",
        "A pod of a claim holding a device, and the DCGM entity it is on (dcgm-exporter's UUID and GPU_I_ID), 1.",
        None,
        one.metric_type(),
    )?;
    for i in info {
        one.encode(metric.encode_family(&i.labels())?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::checkpoint::{ClaimRecord, DeviceRecord, SharedDetail};
    use prometheus_client::{collector::Collector, registry::Registry};
    use tessera_api::MigPlacement;

    const GPU0: &str = "GPU-00000000-0000-4000-8000-000000000000";

    fn claim(uid: &str, detail: DeviceDetail) -> ClaimRecord {
        ClaimRecord {
            uid: uid.into(),
            namespace: "team".into(),
            name: format!("claim-{uid}"),
            phase: Phase::PrepareCompleted,
            devices: vec![DeviceRecord {
                request: "gpu".into(),
                pool: "node-a".into(),
                device: "gpu-0".into(),
                share_id: None,
                cdi_device_ids: vec![],
                detail,
                warm_seconds: None,
                cost_ms: None,
            }],
            recovery_error: None,
            completed_at: None,
        }
    }

    fn mig(gi: Option<u32>) -> MigDetail {
        MigDetail {
            gpu_uuid: Some(GPU0.into()),
            gpu_instance: gi,
            compute_instance: gi.map(|_| 0),
            uuid: gi.map(|gi| format!("MIG-{gi}")),
            ..MigDetail::planned(0, "1g.10gb".into(), MigPlacement { start: 0, size: 1 })
        }
    }

    fn shared(mig: Option<MigDetail>) -> SharedDetail {
        SharedDetail {
            gpu: 0,
            gpu_uuid: Some(GPU0.into()),
            uuid: Some(GPU0.into()),
            mig,
            strategy: Some("MPS".into()),
            mps_pipe_dir: None,
            limits: Default::default(),
        }
    }

    fn checkpoint(records: Vec<ClaimRecord>) -> Checkpoint {
        let mut c = Checkpoint::default();
        for r in records {
            c.claims.insert(r.uid.clone(), r);
        }
        c
    }

    #[test]
    fn a_mig_device_and_a_share_of_one_name_the_parent_gpu_and_the_gpu_instance_as_dcgm_exporter_does() {
        let c = checkpoint(vec![
            claim("m", DeviceDetail::Mig(mig(Some(3)))),
            claim("s", DeviceDetail::Shared(shared(Some(mig(Some(5)))))),
        ]);
        let info = claim_device_info(&c, |_| vec!["p".into()]);
        let of = |claim: &str| info.iter().find(|i| i.claim == claim).unwrap();
        assert_eq!(
            (
                of("claim-m").gpu_uuid.as_str(),
                of("claim-m").gpu_instance,
                of("claim-m").mig_uuid.as_deref()
            ),
            (GPU0, Some(3), Some("MIG-3"))
        );
        assert_eq!(
            (
                of("claim-s").gpu_uuid.as_str(),
                of("claim-s").gpu_instance,
                of("claim-s").sharing.as_deref()
            ),
            (GPU0, Some(5), Some("MPS"))
        );
    }

    #[test]
    fn a_claim_reserved_for_two_pods_gives_one_sample_per_pod_and_a_half_made_mig_device_none() {
        let c = checkpoint(vec![
            claim("w", DeviceDetail::Shared(shared(None))),
            claim("half", DeviceDetail::Mig(mig(None))),
        ]);
        let info = claim_device_info(&c, |uid| match uid {
            "w" => vec!["a".into(), "b".into()],
            _ => vec!["c".into()],
        });
        let pods: Vec<_> = info.iter().map(|i| (i.claim.as_str(), i.pod.as_str())).collect();
        assert_eq!(pods, [("claim-w", "a"), ("claim-w", "b")]);
        assert_eq!(info[0].gpu_instance, None);
    }

    #[test]
    fn the_info_series_renders_with_dcgm_exporters_label_names() {
        #[derive(Debug)]
        struct Fixed(Vec<ClaimDeviceInfo>);
        impl Collector for Fixed {
            fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
                encode(&mut encoder, &self.0)
            }
        }
        let c = checkpoint(vec![claim(
            "g",
            DeviceDetail::Gpu {
                gpu: 0,
                uuid: GPU0.into(),
                minor: 0,
            },
        )]);
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Fixed(claim_device_info(&c, |_| vec!["p".into()]))));
        let text = tessera_api::metrics::render(&registry);
        // The exact line the Prometheus test in e2e/bench/dcgmjoin serves as the plugin's page.
        assert!(
            text.contains(&format!(
                "tessera_claim_device_info{{namespace=\"team\",pod=\"p\",claim=\"claim-g\",request=\"gpu\",device=\"gpu-0\",UUID=\"{GPU0}\",GPU_I_ID=\"\",mig_uuid=\"\",sharing=\"\"}} 1.0\n"
            )),
            "{text}"
        );
        assert!(text.contains("# TYPE tessera_claim_device_info gauge"), "{text}");
    }
}
