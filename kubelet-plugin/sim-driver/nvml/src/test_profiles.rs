//! Test hook (added by helper B for issue 21's profile test): GPU-instance profiles a test adds to one GPU
//! on top of its model's table, to stand for a driver newer than every binding's profile count (R575+
//! knows `NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX`, index 0x11, which nvml-wrapper-sys's
//! `NVML_GPU_INSTANCE_PROFILE_COUNT` of 17 stops short of). No simulated model has such a profile: the
//! references give no real GPU's numbers for one.
//!
//! The profiles are read from `K/test-gi-profiles` when it exists (never in a driver root the plugin's
//! tooling installs), one per line, whitespace-separated:
//!
//! ```text
//! <kernel gpu> <index> <id> <name> <compute slices> <memory slices> <SMs> <MiB> <instance count> <starts,…>
//! <kernel gpu> <index> INVALID_ARGUMENT
//! ```
//!
//! Only enumeration answers them (`nvmlDeviceGetGpuInstanceProfileInfo[V]`,
//! `nvmlDeviceGetGpuInstancePossiblePlacements_v2`); creating an instance of one is not supported. The
//! second form makes both profile-info calls answer INVALID_ARGUMENT at that index, below the last one, as a
//! driver may for an index it leaves unused (review N12: NVIDIA's DRA driver skips such an index and goes on,
//! `cmd/gpu-kubelet-plugin/nvlib.go`:552-554, where the `nvml.h` note would end the enumeration there).

use std::path::Path;

use tessera_gpu_api::models::MigProfile;

/// The file in the kernel directory.
pub(crate) const FILE: &str = "test-gi-profiles";

fn parse(line: &str) -> Option<(u32, MigProfile)> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let [gpu, index, id, name, c, m, sms, mib, count, starts] = f.as_slice() else {
        return None;
    };
    let starts: Vec<u32> = starts.split(',').map(str::parse).collect::<Result<_, _>>().ok()?;
    // Leaked: a test's few profiles live as long as the process, as the model tables do.
    let profile = MigProfile {
        name: Box::leak(name.to_string().into_boxed_str()),
        index: index.parse().ok()?,
        id: id.parse().ok()?,
        compute_slices: c.parse().ok()?,
        memory_slices: m.parse().ok()?,
        multiprocessors: sms.parse().ok()?,
        copy_engines: 0,
        decoders: 0,
        encoders: 0,
        jpeg_engines: 0,
        ofa_engines: 0,
        memory_mib: mib.parse().ok()?,
        instance_count: count.parse().ok()?,
        placement_starts: Box::leak(starts.into_boxed_slice()),
    };
    Some((gpu.parse().ok()?, profile))
}

fn extra(kernel: &Path, gpu: u32) -> Vec<MigProfile> {
    std::fs::read_to_string(kernel.join(FILE))
        .unwrap_or_default()
        .lines()
        .filter_map(parse)
        .filter(|(g, _)| *g == gpu)
        .map(|(_, p)| p)
        .collect()
}

/// Whether a test made `gpu`'s profile index `index` answer INVALID_ARGUMENT.
pub(crate) fn refused(kernel: &Path, gpu: u32, index: u32) -> bool {
    std::fs::read_to_string(kernel.join(FILE))
        .unwrap_or_default()
        .lines()
        .any(|line| {
            matches!(
                line.split_whitespace().collect::<Vec<_>>().as_slice(),
                [g, i, "INVALID_ARGUMENT"] if g.parse() == Ok(gpu) && i.parse() == Ok(index)
            )
        })
}

/// The test profile of `gpu` at NVML index `index`, if a test added one.
pub(crate) fn by_index(kernel: &Path, gpu: u32, index: u32) -> Option<&'static MigProfile> {
    let p = extra(kernel, gpu).into_iter().find(|p| p.index == index)?;
    Some(Box::leak(Box::new(p)))
}

/// The test profile of `gpu` with profile ID `id`, if a test added one.
pub(crate) fn by_id(kernel: &Path, gpu: u32, id: u32) -> Option<&'static MigProfile> {
    let p = extra(kernel, gpu).into_iter().find(|p| p.id == id)?;
    Some(Box::leak(Box::new(p)))
}
