//! Built-in GPU models: identity, capacities and MIG geometry of the GPUs tessera knows.
//!
//! The simulated backend builds its fake hardware from these tables, and the NVML backend falls back to them
//! for the one number NVML does not give for a whole GPU on every driver (the SM count). Every figure comes
//! from `gpu-mig-mps.md` section 4; figures the reference marks as unverified carry a `?` comment here too.

use tessera_api::{MigPlacement, MigProfileInfo, inventory::MigInfo};

/// NVML architecture names as NVIDIA's tools print them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Architecture {
    Ampere,
    Hopper,
    Blackwell,
}

impl Architecture {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ampere => "Ampere",
            Self::Hopper => "Hopper",
            Self::Blackwell => "Blackwell",
        }
    }

    /// Hopper and newer apply a MIG mode change at once; Ampere needs a GPU reset (MIG User Guide; NVIDIA's
    /// `supportsMIGModeToggle` is `architecture >= HOPPER`).
    pub fn mig_toggle_without_reset(self) -> bool {
        self >= Self::Hopper
    }
}

/// One GPU-instance profile of a model, as `nvidia-smi mig -lgip` / `-lgipp` print it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MigProfile {
    /// e.g. `3g.40gb`.
    pub name: &'static str,
    /// `NVML_GPU_INSTANCE_PROFILE_*` index.
    pub index: u32,
    /// GI profile ID (`info.id`).
    pub id: u32,
    pub compute_slices: u32,
    pub memory_slices: u32,
    pub multiprocessors: u32,
    pub copy_engines: u32,
    pub decoders: u32,
    pub encoders: u32,
    pub jpeg_engines: u32,
    pub ofa_engines: u32,
    /// `memorySizeMB` (MiB): nvidia-smi's GiB × 1024, since exact driver values are not published.
    pub memory_mib: u64,
    /// `instanceCount`.
    pub instance_count: u32,
    /// First memory slice of each possible placement; each spans `memory_slices`.
    pub placement_starts: &'static [u32],
}

impl MigProfile {
    pub fn placements(&self) -> impl Iterator<Item = MigPlacement> + '_ {
        self.placement_starts.iter().map(|&start| MigPlacement {
            start,
            size: self.memory_slices,
        })
    }

    /// Compute-instance profile ID of the CI spanning the whole GI (C == G). CI profile indices and IDs
    /// coincide (`gpu-mig-mps.md` 2.1), and the `1g` variants (`+me`, double memory) all use the 1-slice CI.
    pub fn full_compute_instance_profile_id(&self) -> u32 {
        match self.compute_slices {
            1 => 0,
            2 => 1,
            3 => 2,
            4 => 3,
            7 => 4,
            8 => 5,
            6 => 6,
            other => other,
        }
    }

    /// Compute-instance profiles a GPU instance of this profile offers, by CI profile index (which is also
    /// the CI profile ID): every `Nc` with N compute slices that fits, as `nvidia-smi mig -lcip` lists them
    /// (`gpu-mig-mps.md` 4.1: a 4g GI has no 3c). Only the one spanning the whole GI
    /// ([`MigProfile::full_compute_instance_profile_id`]) can be created in the simulated hardware.
    pub fn compute_instance_profiles(&self) -> Vec<ComputeInstanceProfile> {
        // CI profile index -> compute slices (nvml.h `NVML_COMPUTE_INSTANCE_PROFILE_*`).
        const SLICES: [(u32, u32); 7] = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 7), (5, 8), (6, 6)];
        let g = self.compute_slices;
        SLICES
            .iter()
            .filter(|&&(_, c)| c <= g && matches!(c, 1 | 2 | 3 | 4 | 7) && !(g == 4 && c == 3))
            .map(|&(index, c)| ComputeInstanceProfile {
                index,
                id: index,
                compute_slices: c,
                instance_count: g / c,
                multiprocessors: self.multiprocessors * c / g,
                name: if c == g {
                    self.name.to_string()
                } else {
                    format!("{c}c.{}", self.name)
                },
            })
            .collect()
    }

    pub fn to_info(&self) -> MigProfileInfo {
        MigProfileInfo {
            name: self.name.to_string(),
            profile_id: self.id,
            profile_index: self.index,
            compute_slices: self.compute_slices,
            memory_slices: self.memory_slices,
            instance_count: self.instance_count,
            memory_mib: self.memory_mib,
            multiprocessors: self.multiprocessors,
            copy_engines: self.copy_engines,
            decoders: self.decoders,
            encoders: self.encoders,
            jpeg_engines: self.jpeg_engines,
            ofa_engines: self.ofa_engines,
            placements: self.placements().collect(),
        }
    }
}

/// One compute-instance profile inside a GPU instance (`nvmlComputeInstanceProfileInfo_t`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComputeInstanceProfile {
    /// `NVML_COMPUTE_INSTANCE_PROFILE_*` index.
    pub index: u32,
    /// CI profile ID (equal to the index on every GPU with published captures).
    pub id: u32,
    pub compute_slices: u32,
    /// How many fit in the GPU instance.
    pub instance_count: u32,
    pub multiprocessors: u32,
    /// `3g.40gb` for the CI spanning the GI, `1c.3g.40gb` for a smaller one (nvidia-smi's names).
    pub name: String,
}

/// A GPU model tessera can simulate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuModel {
    /// Name used in simulated node files, e.g. `H100-SXM5-80GB`.
    pub name: &'static str,
    /// `nvmlDeviceGetName`, e.g. `NVIDIA H100 80GB HBM3`.
    pub product_name: &'static str,
    pub brand: &'static str,
    pub architecture: Architecture,
    pub compute_capability: &'static str,
    /// Total memory as nvidia-smi prints it (MiB).
    pub memory_mib: u64,
    pub multiprocessors: u32,
    /// PCI device id (the high half of NVML's `pciDeviceId`; vendor 0x10de).
    pub pci_device_id: u16,
    pub compute_slices: u32,
    pub memory_slices: u32,
    /// GI profiles in NVML index order, the order discovery enumerates them.
    pub mig_profiles: &'static [MigProfile],
}

impl GpuModel {
    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib * 1024 * 1024
    }

    pub fn profile_by_id(&self, id: u32) -> Option<&'static MigProfile> {
        self.mig_profiles.iter().find(|p| p.id == id)
    }

    pub fn profile_by_name(&self, name: &str) -> Option<&'static MigProfile> {
        self.mig_profiles.iter().find(|p| p.name == name)
    }

    pub fn mig_info(&self, enabled: bool) -> MigInfo {
        MigInfo {
            enabled,
            mode_toggle_without_reset: self.architecture.mig_toggle_without_reset(),
            memory_slices: self.memory_slices,
            compute_slices: self.compute_slices,
            profiles: self.mig_profiles.iter().map(MigProfile::to_info).collect(),
        }
    }
}

const ONE_SLICE: &[u32] = &[0, 1, 2, 3, 4, 5, 6];
const DOUBLE_MEMORY: &[u32] = &[0, 2, 4, 6];
const TWO_SLICE: &[u32] = &[0, 2, 4];
const THREE_SLICE: &[u32] = &[0, 4];
const WHOLE: &[u32] = &[0];

// Shorthand so each table row reads like the reference table: name, idx, id, C, M, SM, CE, DEC, ENC, JPEG,
// OFA, MiB, max, placement starts.
#[allow(clippy::too_many_arguments)]
const fn p(
    name: &'static str,
    index: u32,
    id: u32,
    compute_slices: u32,
    memory_slices: u32,
    multiprocessors: u32,
    copy_engines: u32,
    decoders: u32,
    encoders: u32,
    jpeg_engines: u32,
    ofa_engines: u32,
    memory_mib: u64,
    instance_count: u32,
    placement_starts: &'static [u32],
) -> MigProfile {
    MigProfile {
        name,
        index,
        id,
        compute_slices,
        memory_slices,
        multiprocessors,
        copy_engines,
        decoders,
        encoders,
        jpeg_engines,
        ofa_engines,
        memory_mib,
        instance_count,
        placement_starts,
    }
}

// gpu-mig-mps.md 4.1 (capture).
const A100_40GB_PROFILES: &[MigProfile] = &[
    p("1g.5gb", 0, 19, 1, 1, 14, 1, 0, 0, 0, 0, 4864, 7, ONE_SLICE),
    p("2g.10gb", 1, 14, 2, 2, 28, 2, 1, 0, 0, 0, 9856, 3, TWO_SLICE),
    p("3g.20gb", 2, 9, 3, 4, 42, 3, 2, 0, 0, 0, 19968, 2, THREE_SLICE),
    p("4g.20gb", 3, 5, 4, 4, 56, 4, 2, 0, 0, 0, 19968, 1, WHOLE),
    p("7g.40gb", 4, 0, 7, 8, 98, 7, 5, 0, 1, 1, 40192, 1, WHOLE),
    p("1g.5gb+me", 7, 20, 1, 1, 14, 1, 1, 0, 1, 1, 4864, 1, ONE_SLICE),
    p("1g.10gb", 9, 15, 1, 2, 14, 1, 1, 0, 0, 0, 9856, 4, DOUBLE_MEMORY),
];

// gpu-mig-mps.md 4.2 (capture; the 1g.20gb row is inferred there).
const A100_80GB_PROFILES: &[MigProfile] = &[
    p("1g.10gb", 0, 19, 1, 1, 14, 1, 0, 0, 0, 0, 9728, 7, ONE_SLICE),
    p("2g.20gb", 1, 14, 2, 2, 28, 2, 1, 0, 0, 0, 19968, 3, TWO_SLICE),
    p("3g.40gb", 2, 9, 3, 4, 42, 3, 2, 0, 0, 0, 40192, 2, THREE_SLICE),
    p("4g.40gb", 3, 5, 4, 4, 56, 4, 2, 0, 0, 0, 40192, 1, WHOLE),
    p("7g.80gb", 4, 0, 7, 8, 98, 7, 5, 0, 1, 1, 80896, 1, WHOLE),
    p("1g.10gb+me", 7, 20, 1, 1, 14, 1, 1, 0, 1, 1, 9728, 1, ONE_SLICE),
    p("1g.20gb", 9, 15, 1, 2, 14, 1, 1, 0, 0, 0, 19968, 4, DOUBLE_MEMORY),
];

// gpu-mig-mps.md 4.3 (capture); 1g.20gb/2g.20gb MiB is "~20096" there.
const H100_80GB_PROFILES: &[MigProfile] = &[
    p("1g.10gb", 0, 19, 1, 1, 16, 1, 1, 0, 1, 0, 9984, 7, ONE_SLICE),
    p("2g.20gb", 1, 14, 2, 2, 32, 2, 2, 0, 2, 0, 20096, 3, TWO_SLICE),
    p("3g.40gb", 2, 9, 3, 4, 60, 3, 3, 0, 3, 0, 40448, 2, THREE_SLICE),
    p("4g.40gb", 3, 5, 4, 4, 64, 4, 4, 0, 4, 0, 40448, 1, WHOLE),
    p("7g.80gb", 4, 0, 7, 8, 132, 8, 7, 0, 7, 1, 81152, 1, WHOLE),
    p("1g.10gb+me", 7, 20, 1, 1, 16, 1, 1, 0, 1, 1, 9984, 1, ONE_SLICE),
    p("1g.20gb", 9, 15, 1, 2, 26, 1, 1, 0, 1, 0, 20096, 4, DOUBLE_MEMORY),
];

// gpu-mig-mps.md 4.4 (profile rows captured; placements inferred equal to H100).
const H200_141GB_PROFILES: &[MigProfile] = &[
    p("1g.18gb", 0, 19, 1, 1, 16, 1, 1, 0, 1, 0, 16384, 7, ONE_SLICE),
    p("2g.35gb", 1, 14, 2, 2, 32, 2, 2, 0, 2, 0, 33024, 3, TWO_SLICE),
    p("3g.71gb", 2, 9, 3, 4, 60, 3, 3, 0, 3, 0, 71168, 2, THREE_SLICE),
    p("4g.71gb", 3, 5, 4, 4, 64, 4, 4, 0, 4, 0, 71168, 1, WHOLE),
    p("7g.141gb", 4, 0, 7, 8, 132, 8, 7, 0, 7, 1, 143104, 1, WHOLE),
    p("1g.18gb+me", 7, 20, 1, 1, 16, 1, 1, 0, 1, 1, 16384, 1, ONE_SLICE),
    p("1g.35gb", 9, 15, 1, 2, 26, 1, 1, 0, 1, 0, 33024, 4, DOUBLE_MEMORY),
];

// gpu-mig-mps.md 4.5: rows 1g/1g+me/1g.45gb/2g captured; placements assumed equal to H100.
const B200_180GB_PROFILES: &[MigProfile] = &[
    p("1g.23gb", 0, 19, 1, 1, 18, 2, 1, 0, 1, 0, 20992, 7, ONE_SLICE),
    p("2g.45gb", 1, 14, 2, 2, 36, 4, 2, 0, 2, 0, 45312, 3, TWO_SLICE),
    // Unverified (`?` in the reference): CE 6, DEC 3, ENC 0, JPEG 3, OFA 0.
    p("3g.90gb", 2, 9, 3, 4, 70, 6, 3, 0, 3, 0, 91136, 2, THREE_SLICE),
    // Unverified (`?` in the reference): CE 8, DEC 4, ENC 0, JPEG 4, OFA 0.
    p("4g.90gb", 3, 5, 4, 4, 72, 8, 4, 0, 4, 0, 91136, 1, WHOLE),
    // Unverified (`?` in the reference): CE 16, DEC 7, ENC 0, JPEG 7, OFA 1.
    p("7g.180gb", 4, 0, 7, 8, 148, 16, 7, 0, 7, 1, 182784, 1, WHOLE),
    p("1g.23gb+me", 7, 20, 1, 1, 18, 2, 1, 0, 1, 1, 20992, 1, ONE_SLICE),
    p("1g.45gb", 9, 15, 1, 2, 30, 2, 1, 0, 1, 0, 45312, 4, DOUBLE_MEMORY),
];

/// Every model tessera knows, in the order error messages list them.
pub const MODELS: &[GpuModel] = &[
    GpuModel {
        name: "A100-SXM4-40GB",
        product_name: "NVIDIA A100-SXM4-40GB",
        brand: "Nvidia",
        architecture: Architecture::Ampere,
        compute_capability: "8.0",
        memory_mib: 40537,
        multiprocessors: 108,
        pci_device_id: 0x20B0,
        compute_slices: 7,
        memory_slices: 8,
        mig_profiles: A100_40GB_PROFILES,
    },
    GpuModel {
        name: "A100-SXM4-80GB",
        product_name: "NVIDIA A100-SXM4-80GB",
        brand: "Nvidia",
        architecture: Architecture::Ampere,
        compute_capability: "8.0",
        memory_mib: 81920,
        multiprocessors: 108,
        pci_device_id: 0x20B2,
        compute_slices: 7,
        memory_slices: 8,
        mig_profiles: A100_80GB_PROFILES,
    },
    GpuModel {
        name: "H100-SXM5-80GB",
        product_name: "NVIDIA H100 80GB HBM3",
        brand: "Nvidia",
        architecture: Architecture::Hopper,
        compute_capability: "9.0",
        // Not in the reference; the value nvidia-smi commonly prints for an H100 SXM5 80GB.
        memory_mib: 81559,
        multiprocessors: 132,
        pci_device_id: 0x2330,
        compute_slices: 7,
        memory_slices: 8,
        mig_profiles: H100_80GB_PROFILES,
    },
    GpuModel {
        name: "H200-SXM-141GB",
        product_name: "NVIDIA H200",
        brand: "Nvidia",
        architecture: Architecture::Hopper,
        compute_capability: "9.0",
        memory_mib: 143771,
        multiprocessors: 132,
        pci_device_id: 0x2335,
        compute_slices: 7,
        memory_slices: 8,
        mig_profiles: H200_141GB_PROFILES,
    },
    GpuModel {
        name: "B200",
        product_name: "NVIDIA B200",
        brand: "Nvidia",
        architecture: Architecture::Blackwell,
        compute_capability: "10.0",
        // ? Not in the reference; the value nvidia-smi commonly prints for a B200 (unverified).
        memory_mib: 183359,
        multiprocessors: 148,
        pci_device_id: 0x2901,
        compute_slices: 7,
        memory_slices: 8,
        mig_profiles: B200_180GB_PROFILES,
    },
];

/// The model named `name` (simulated node file spelling).
pub fn model(name: &str) -> Option<&'static GpuModel> {
    MODELS.iter().find(|m| m.name == name)
}

/// The model with PCI device id `device_id`, for NVML fallbacks.
pub fn model_by_pci_device_id(device_id: u16) -> Option<&'static GpuModel> {
    MODELS.iter().find(|m| m.pci_device_id == device_id)
}

/// Names of every known model, comma separated, for error messages.
pub fn known_model_names() -> String {
    MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_placements(model: &GpuModel) -> Vec<(&'static str, MigPlacement)> {
        model
            .mig_profiles
            .iter()
            .flat_map(|p| p.placements().map(move |pl| (p.name, pl)))
            .collect()
    }

    #[test]
    fn the_h100_table_yields_the_25_placements_of_the_reference() {
        let h100 = model("H100-SXM5-80GB").unwrap();
        let placements = all_placements(h100);
        assert_eq!(placements.len(), 25);
        let count = |name: &str| placements.iter().filter(|(n, _)| *n == name).count();
        assert_eq!(
            [
                count("1g.10gb"),
                count("1g.10gb+me"),
                count("1g.20gb"),
                count("2g.20gb"),
                count("3g.40gb"),
                count("4g.40gb"),
                count("7g.80gb")
            ],
            [7, 7, 4, 3, 2, 1, 1]
        );
        let starts = |name: &str| -> Vec<u32> {
            placements
                .iter()
                .filter(|(n, _)| *n == name)
                .map(|(_, p)| p.start)
                .collect()
        };
        assert_eq!(starts("1g.20gb"), [0, 2, 4, 6]);
        assert_eq!(starts("2g.20gb"), [0, 2, 4]);
        assert_eq!(starts("3g.40gb"), [0, 4]);
        assert_eq!(
            h100.profile_by_name("7g.80gb")
                .unwrap()
                .placements()
                .collect::<Vec<_>>(),
            [MigPlacement { start: 0, size: 8 }]
        );
    }

    #[test]
    fn every_model_has_the_common_seven_slice_geometry() {
        for m in MODELS {
            assert_eq!(all_placements(m).len(), 25, "{}", m.name);
            for prof in m.mig_profiles {
                assert!(
                    prof.placement_starts.len() as u32 >= prof.instance_count,
                    "{}",
                    prof.name
                );
                for pl in prof.placements() {
                    assert!(
                        pl.start + pl.size <= m.memory_slices,
                        "{} {} {pl:?}",
                        m.name,
                        prof.name
                    );
                }
                assert!(prof.compute_slices <= m.compute_slices);
                assert!(
                    prof.multiprocessors <= m.multiprocessors,
                    "{} {}",
                    m.name,
                    prof.name
                );
                assert!(prof.memory_mib < m.memory_mib, "{} {}", m.name, prof.name);
            }
            let ids: Vec<u32> = m.mig_profiles.iter().map(|p| p.id).collect();
            assert_eq!(
                ids,
                [19, 14, 9, 5, 0, 20, 15],
                "{} profile ids in index order",
                m.name
            );
        }
    }

    #[test]
    fn product_names_and_architectures_match_what_nvml_reports() {
        let m = |n| model(n).unwrap();
        assert_eq!(m("H100-SXM5-80GB").product_name, "NVIDIA H100 80GB HBM3");
        assert_eq!(m("H200-SXM-141GB").product_name, "NVIDIA H200");
        assert_eq!(m("A100-SXM4-80GB").product_name, "NVIDIA A100-SXM4-80GB");
        assert_eq!(m("B200").product_name, "NVIDIA B200");
        assert_eq!(m("A100-SXM4-40GB").architecture, Architecture::Ampere);
        assert!(!m("A100-SXM4-40GB").architecture.mig_toggle_without_reset());
        assert!(m("H200-SXM-141GB").architecture.mig_toggle_without_reset());
        assert_eq!(m("B200").compute_capability, "10.0");
        assert_eq!(model_by_pci_device_id(0x2901).unwrap().name, "B200");
        assert!(model("H100").is_none());
    }

    #[test]
    fn compute_instance_profiles_are_those_that_fit_the_gpu_instance() {
        let a100 = model("A100-SXM4-40GB").unwrap();
        let cis = |n| {
            a100.profile_by_name(n)
                .unwrap()
                .compute_instance_profiles()
                .into_iter()
                .map(|c| (c.compute_slices, c.instance_count))
                .collect::<Vec<_>>()
        };
        assert_eq!(cis("3g.20gb"), [(1, 3), (2, 1), (3, 1)]);
        assert_eq!(cis("4g.20gb"), [(1, 4), (2, 2), (4, 1)]);
        assert_eq!(cis("7g.40gb"), [(1, 7), (2, 3), (3, 2), (4, 1), (7, 1)]);
        let full = a100.profile_by_name("3g.20gb").unwrap();
        let last = full.compute_instance_profiles().pop().unwrap();
        assert_eq!(
            (last.id, last.multiprocessors, last.name.as_str()),
            (full.full_compute_instance_profile_id(), 42, "3g.20gb")
        );
    }

    #[test]
    fn full_compute_instances_use_the_ci_profile_with_the_gis_slice_count() {
        let h100 = model("H100-SXM5-80GB").unwrap();
        let ci = |n| {
            h100.profile_by_name(n)
                .unwrap()
                .full_compute_instance_profile_id()
        };
        assert_eq!(
            [ci("1g.10gb"), ci("1g.10gb+me"), ci("1g.20gb"), ci("2g.20gb")],
            [0, 0, 0, 1]
        );
        assert_eq!([ci("3g.40gb"), ci("4g.40gb"), ci("7g.80gb")], [2, 3, 4]);
    }
}
