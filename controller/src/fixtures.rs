//! Simulated node inventories for tests, golden files and benchmarks, built from the MIG tables in
//! `gpu-mig-mps.md` section 4 (the kubelet plugin's simulated backend uses the same tables).
//!
//! ```
//! use tessera_controller::fixtures::{node, GpuModel};
//! let inv = node("gpu-node-1").gpus(GpuModel::H100Sxm5_80gb, 8).build();
//! assert_eq!(inv.spec.gpus.len(), 8);
//! ```

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use tessera_api::{
    GpuInfo, MigPlacement, MigProfileInfo, NodeInventory, NodeInventorySpec,
    inventory::{DeviceHealth, HealthReason, HealthState, MigInfo, NodeInventoryStatus},
};

/// GPU models with published MIG tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuModel {
    H100Sxm5_80gb,
    H200,
    A100Sxm4_80gb,
    B200,
}

/// One row of a `-lgip` table: name, profile id, index, compute slices, memory slices, SMs, CE, DEC, ENC,
/// JPEG, OFA, MiB, max instances.
type Row = (
    &'static str,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u64,
    u32,
);

const H100: [Row; 7] = [
    ("1g.10gb", 19, 0, 1, 1, 16, 1, 1, 0, 1, 0, 9984, 7),
    ("1g.10gb+me", 20, 7, 1, 1, 16, 1, 1, 0, 1, 1, 9984, 1),
    ("1g.20gb", 15, 9, 1, 2, 26, 1, 1, 0, 1, 0, 20096, 4),
    ("2g.20gb", 14, 1, 2, 2, 32, 2, 2, 0, 2, 0, 20096, 3),
    ("3g.40gb", 9, 2, 3, 4, 60, 3, 3, 0, 3, 0, 40448, 2),
    ("4g.40gb", 5, 3, 4, 4, 64, 4, 4, 0, 4, 0, 40448, 1),
    ("7g.80gb", 0, 4, 7, 8, 132, 8, 7, 0, 7, 1, 81152, 1),
];

const H200: [Row; 7] = [
    ("1g.18gb", 19, 0, 1, 1, 16, 1, 1, 0, 1, 0, 16384, 7),
    ("1g.18gb+me", 20, 7, 1, 1, 16, 1, 1, 0, 1, 1, 16384, 1),
    ("1g.35gb", 15, 9, 1, 2, 26, 1, 1, 0, 1, 0, 33024, 4),
    ("2g.35gb", 14, 1, 2, 2, 32, 2, 2, 0, 2, 0, 33024, 3),
    ("3g.71gb", 9, 2, 3, 4, 60, 3, 3, 0, 3, 0, 71168, 2),
    ("4g.71gb", 5, 3, 4, 4, 64, 4, 4, 0, 4, 0, 71168, 1),
    ("7g.141gb", 0, 4, 7, 8, 132, 8, 7, 0, 7, 1, 143104, 1),
];

const A100_80: [Row; 7] = [
    ("1g.10gb", 19, 0, 1, 1, 14, 1, 0, 0, 0, 0, 9728, 7),
    ("1g.10gb+me", 20, 7, 1, 1, 14, 1, 1, 0, 1, 1, 9728, 1),
    ("1g.20gb", 15, 9, 1, 2, 14, 1, 1, 0, 0, 0, 19968, 4),
    ("2g.20gb", 14, 1, 2, 2, 28, 2, 1, 0, 0, 0, 19968, 3),
    ("3g.40gb", 9, 2, 3, 4, 42, 3, 2, 0, 0, 0, 40192, 2),
    ("4g.40gb", 5, 3, 4, 4, 56, 4, 2, 0, 0, 0, 40192, 1),
    ("7g.80gb", 0, 4, 7, 8, 98, 7, 5, 0, 1, 1, 80896, 1),
];

// The 3g/4g/7g engine counts are the section's unverified values ("?").
const B200: [Row; 7] = [
    ("1g.23gb", 19, 0, 1, 1, 18, 2, 1, 0, 1, 0, 20992, 7),
    ("1g.23gb+me", 20, 7, 1, 1, 18, 2, 1, 0, 1, 1, 20992, 1),
    ("1g.45gb", 15, 9, 1, 2, 30, 2, 1, 0, 1, 0, 45312, 4),
    ("2g.45gb", 14, 1, 2, 2, 36, 4, 2, 0, 2, 0, 45312, 3),
    ("3g.90gb", 9, 2, 3, 4, 70, 6, 3, 0, 3, 0, 91136, 2),
    ("4g.90gb", 5, 3, 4, 4, 72, 8, 4, 0, 4, 0, 91136, 1),
    ("7g.180gb", 0, 4, 7, 8, 148, 16, 7, 0, 7, 1, 182784, 1),
];

/// Placement starts shared by every 7-slice GPU (section 4, "Common geometry").
fn starts(profile: &str, memory_slices: u32) -> Vec<u32> {
    match (memory_slices, profile.split('.').next()) {
        (1, _) => (0..7).collect(),
        (2, Some("1g")) => vec![0, 2, 4, 6],
        (2, _) => vec![0, 2, 4],
        (4, Some("3g")) => vec![0, 4],
        _ => vec![0],
    }
}

impl GpuModel {
    /// Parses the simulated-node-file spelling (`H100-SXM5-80GB`, `H200`, `A100-SXM4-80GB`, `B200`).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "H100-SXM5-80GB" => Some(Self::H100Sxm5_80gb),
            "H200" | "H200-SXM5-141GB" => Some(Self::H200),
            "A100-SXM4-80GB" => Some(Self::A100Sxm4_80gb),
            "B200" | "B200-180GB" => Some(Self::B200),
            _ => None,
        }
    }

    /// (product name, architecture, compute capability, MiB reported by nvidia-smi, SMs, MIG mode can
    /// change without a reset, table)
    fn facts(
        self,
    ) -> (
        &'static str,
        &'static str,
        &'static str,
        u64,
        u32,
        bool,
        &'static [Row; 7],
    ) {
        match self {
            Self::H100Sxm5_80gb => ("NVIDIA H100 80GB HBM3", "Hopper", "9.0", 81559, 132, true, &H100),
            Self::H200 => ("NVIDIA H200", "Hopper", "9.0", 143771, 132, true, &H200),
            Self::A100Sxm4_80gb => (
                "NVIDIA A100-SXM4-80GB",
                "Ampere",
                "8.0",
                81920,
                108,
                false,
                &A100_80,
            ),
            Self::B200 => ("NVIDIA B200", "Blackwell", "10.0", 183359, 148, true, &B200),
        }
    }
}

/// Builds one [`GpuInfo`].
#[derive(Clone, Debug)]
pub struct GpuBuilder {
    model: GpuModel,
    index: u32,
    node: String,
    mig_enabled: bool,
    healthy: bool,
    numa_node: Option<i64>,
}

/// A GPU of `model` at `index`.
pub fn gpu(model: GpuModel, index: u32) -> GpuBuilder {
    GpuBuilder {
        model,
        index,
        node: "node".into(),
        mig_enabled: false,
        healthy: true,
        numa_node: Some(0),
    }
}

fn fnv(s: &str) -> u32 {
    s.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

impl GpuBuilder {
    pub fn mig_enabled(mut self, enabled: bool) -> Self {
        self.mig_enabled = enabled;
        self
    }

    pub fn unhealthy(mut self) -> Self {
        self.healthy = false;
        self
    }

    pub fn numa_node(mut self, numa: i64) -> Self {
        self.numa_node = Some(numa);
        self
    }

    /// Node name folded into the UUID, so GPUs of different nodes differ.
    pub fn on_node(mut self, node: &str) -> Self {
        self.node = node.to_string();
        self
    }

    pub fn build(self) -> GpuInfo {
        let (product, arch, cc, mib, sms, toggle, table) = self.model.facts();
        const BUSES: [u32; 8] = [0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb];
        let bus = BUSES[self.index as usize % 8] + 0x100 * (self.index / 8);
        let profiles = table
            .iter()
            .map(
                |&(name, id, idx, c, m, sm, ce, dec, enc, jpeg, ofa, mem, max)| MigProfileInfo {
                    name: name.into(),
                    profile_id: id,
                    profile_index: idx,
                    compute_slices: c,
                    memory_slices: m,
                    instance_count: max,
                    memory_mib: mem,
                    multiprocessors: sm,
                    copy_engines: ce,
                    decoders: dec,
                    encoders: enc,
                    jpeg_engines: jpeg,
                    ofa_engines: ofa,
                    placements: starts(name, m)
                        .into_iter()
                        .map(|start| MigPlacement { start, size: m })
                        .collect(),
                },
            )
            .collect();
        GpuInfo {
            index: self.index,
            minor: self.index,
            uuid: format!(
                "GPU-{:08x}-{:04x}-4000-8000-{:012x}",
                fnv(&self.node),
                self.index,
                bus
            ),
            product_name: product.into(),
            brand: "Nvidia".into(),
            architecture: arch.into(),
            cuda_compute_capability: cc.into(),
            memory_bytes: mib << 20,
            multiprocessors: sms,
            pci_bus_id: format!("0000:{bus:02x}:00.0"),
            pcie_root: Some(format!("pci0000:{:02x}", bus - 1)),
            numa_node: self.numa_node,
            mig: Some(MigInfo {
                enabled: self.mig_enabled,
                mode_toggle_without_reset: toggle,
                memory_slices: 8,
                compute_slices: 7,
                profiles,
            }),
            healthy: self.healthy,
        }
    }
}

/// Builds a [`NodeInventory`].
#[derive(Clone, Debug)]
pub struct NodeBuilder {
    name: String,
    gpus: Vec<GpuInfo>,
    ready: bool,
    heartbeat: Option<DateTime<Utc>>,
}

/// An inventory for node `name`, ready with a heartbeat at the Unix epoch plus one day (tests pass their
/// own `now`; see [`NodeBuilder::heartbeat_at`]).
pub fn node(name: &str) -> NodeBuilder {
    NodeBuilder {
        name: name.into(),
        gpus: vec![],
        ready: true,
        heartbeat: Some(fixed_time()),
    }
}

/// The health entry a plugin reports for GPU `gpu` failing with `reason` (and the XID, for an XID).
pub fn sick(gpu: u32, reason: HealthReason, xid: Option<u32>) -> DeviceHealth {
    DeviceHealth {
        gpu,
        state: HealthState::Unhealthy,
        reason: Some(reason),
        xid,
        message: Some("injected".into()),
        ..Default::default()
    }
}

/// The heartbeat time fixtures use by default.
pub fn fixed_time() -> DateTime<Utc> {
    DateTime::from_timestamp(86_400, 0).expect("a valid timestamp")
}

impl NodeBuilder {
    /// Appends `count` GPUs of `model` (MIG off, NUMA node by halves).
    pub fn gpus(mut self, model: GpuModel, count: u32) -> Self {
        for _ in 0..count {
            let index = self.gpus.len() as u32;
            let numa = i64::from(index >= 4);
            self.gpus
                .push(gpu(model, index).on_node(&self.name).numa_node(numa).build());
        }
        self
    }

    /// Appends `count` GPUs of `model` with MIG mode on.
    pub fn mig_gpus(mut self, model: GpuModel, count: u32) -> Self {
        for _ in 0..count {
            let index = self.gpus.len() as u32;
            let numa = i64::from(index >= 4);
            self.gpus.push(
                gpu(model, index)
                    .on_node(&self.name)
                    .numa_node(numa)
                    .mig_enabled(true)
                    .build(),
            );
        }
        self
    }

    /// Appends a prepared GPU (its index should be the next one).
    pub fn gpu(mut self, gpu: GpuInfo) -> Self {
        self.gpus.push(gpu);
        self
    }

    pub fn not_ready(mut self) -> Self {
        self.ready = false;
        self
    }

    pub fn heartbeat_at(mut self, at: DateTime<Utc>) -> Self {
        self.heartbeat = Some(at);
        self
    }

    pub fn build(self) -> NodeInventory {
        let mut inv = NodeInventory::new(
            &self.name,
            NodeInventorySpec {
                node_name: self.name.clone(),
                backend: "simulated".into(),
                driver_version: Some("580.159.03".into()),
                cuda_driver_version: Some("13.0".into()),
                gpus: self.gpus,
            },
        );
        inv.status = Some(NodeInventoryStatus {
            ready: self.ready,
            last_heartbeat_time: self.heartbeat.map(|t| Time(crate::time::to_k8s_time(t))),
            gpu_count: inv.spec.gpus.len() as u32,
            message: None,
            health: vec![],
            conditions: vec![],
        });
        inv
    }
}
