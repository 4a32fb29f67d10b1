//! MIG fragmentation: memory slices that are free but that no placement of a profile can use now.
//!
//! Definitions (the controller's metric and explain's message share them):
//! * a GPU's **memory slices** are its `memory-slice-<k>` counters (dynamic MIG, [`crate::devices`]); a slice
//!   is **free** when no allocated device consumes it;
//! * a **placement** of a profile is one published MIG device: its start and its memory slices; it **fits**
//!   when all its slices are free (the other counters are not looked at: on the GPUs tessera knows only the
//!   media engines of `+me` profiles can run out before the slices do);
//! * the slices **unusable for a profile** are the free slices that no fitting placement of that profile
//!   covers: on an H100 with `1g.10gb` instances at slices 1 and 5, all 6 free slices are unusable for
//!   `3g.40gb` (its placements start at 0 and 4), while for `1g.10gb` only slice 7 is (no `1g.10gb`
//!   placement starts there);
//! * the **profile in demand** on a GPU is the largest (most memory slices) of the profiles pending claims
//!   ask for there: per pending request, the smallest profile of that GPU its class and selectors accept
//!   (the one the allocator's smallest-first order hands out), then the largest of those. With no pending
//!   request for the GPU's MIG devices, the GPU's largest profile stands in (the whole GPU as one instance).

use std::collections::{BTreeMap, BTreeSet};

use super::model::NodeModel;

/// The counter name prefix of a dynamic-MIG GPU's memory slices.
pub const MEMORY_SLICE_COUNTER: &str = "memory-slice-";

/// One published MIG placement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub profile: String,
    pub start: u32,
    /// Memory slices, from `start`.
    pub size: u32,
    /// The device name.
    pub device: String,
}

impl Placement {
    pub fn slices(&self) -> impl Iterator<Item = u32> + '_ {
        self.start..self.start + self.size
    }
}

/// One GPU's memory slices, its published placements and who holds what.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuLayout {
    pub node: String,
    /// `gpu-<index>`.
    pub gpu: String,
    pub memory_slices: u32,
    pub placements: Vec<Placement>,
    /// Taken slices, with the claims (`namespace/name`) holding them; empty where the holder is unknown.
    pub held: BTreeMap<u32, Vec<String>>,
}

/// What one GPU's fragmentation is for the profile in demand there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuFragmentation {
    pub node: String,
    pub gpu: String,
    pub profile: String,
    /// Whether a pending claim asks for `profile` here (else it is the GPU's largest profile).
    pub pending: bool,
    pub free: u32,
    /// Free slices no fitting placement of `profile` covers.
    pub unusable: u32,
}

impl GpuLayout {
    /// The free memory slices.
    pub fn free(&self) -> BTreeSet<u32> {
        (0..self.memory_slices)
            .filter(|k| !self.held.contains_key(k))
            .collect()
    }

    /// Whether every slice of the placement is free.
    pub fn fits(&self, p: &Placement) -> bool {
        p.slices()
            .all(|k| k < self.memory_slices && !self.held.contains_key(&k))
    }

    /// The placements of `profile`.
    pub fn placements_of<'a>(&'a self, profile: &'a str) -> impl Iterator<Item = &'a Placement> + 'a {
        self.placements.iter().filter(move |p| p.profile == profile)
    }

    /// Memory slices of `profile` here, if the GPU publishes it.
    pub fn size_of(&self, profile: &str) -> Option<u32> {
        self.placements_of(profile).map(|p| p.size).next()
    }

    /// The profiles published here, smallest first (memory slices, then name).
    pub fn profiles(&self) -> Vec<(&str, u32)> {
        let set: BTreeSet<(u32, &str)> = self
            .placements
            .iter()
            .map(|p| (p.size, p.profile.as_str()))
            .collect();
        set.into_iter().map(|(s, p)| (p, s)).collect()
    }

    /// The largest profile published here (most memory slices; of equals, the plain one before `+me`).
    pub fn largest_profile(&self) -> Option<&str> {
        self.profiles()
            .into_iter()
            .max_by_key(|(p, s)| (*s, !p.contains('+'), std::cmp::Reverse(*p)))
            .map(|(p, _)| p)
    }

    /// Free slices that no fitting placement of `profile` covers.
    pub fn unusable_for(&self, profile: &str) -> BTreeSet<u32> {
        let usable: BTreeSet<u32> = self
            .placements_of(profile)
            .filter(|p| self.fits(p))
            .flat_map(Placement::slices)
            .collect();
        self.free().difference(&usable).copied().collect()
    }

    /// The placement of `profile` that the fewest claims block, with those claims (fewest slices taken
    /// first among equals, then the lowest start).
    pub fn cheapest_to_free<'a>(&'a self, profile: &'a str) -> Option<(&'a Placement, Vec<String>)> {
        self.placements_of(profile)
            .map(|p| {
                let mut claims: Vec<String> = p
                    .slices()
                    .filter_map(|k| self.held.get(&k))
                    .flatten()
                    .cloned()
                    .collect();
                claims.sort();
                claims.dedup();
                let taken = p.slices().filter(|k| self.held.contains_key(k)).count();
                (p, claims, taken)
            })
            .min_by_key(|(p, claims, taken)| (claims.len(), *taken, p.start))
            .map(|(p, claims, _)| (p, claims))
    }

    /// The fragmentation for `profile` (which `pending` says is asked for), or for the GPU's largest
    /// profile when `profile` is `None` or not published here.
    pub fn fragmentation(&self, profile: Option<&str>) -> Option<GpuFragmentation> {
        let (profile, pending) = match profile.filter(|p| self.size_of(p).is_some()) {
            Some(p) => (p, true),
            None => (self.largest_profile()?, false),
        };
        Some(GpuFragmentation {
            node: self.node.clone(),
            gpu: self.gpu.clone(),
            profile: profile.to_string(),
            pending,
            free: self.free().len() as u32,
            unusable: self.unusable_for(profile).len() as u32,
        })
    }
}

/// The dynamic-MIG GPUs of a node as explain models it: one per counter set with memory-slice counters,
/// its placements from the devices consuming them, the slices taken from the counters left.
pub fn layouts_of_model(model: &NodeModel<'_>) -> Vec<GpuLayout> {
    let mut out = Vec::new();
    for (pool, sets) in &model.available {
        for (set, counters) in sets {
            let slice_of = |name: &str| name.strip_prefix(MEMORY_SLICE_COUNTER)?.parse::<u32>().ok();
            let slices: Vec<(u32, &String)> = counters
                .keys()
                .filter_map(|name| Some((slice_of(name)?, name)))
                .collect();
            if slices.is_empty() {
                continue;
            }
            let mut layout = GpuLayout {
                node: model.name.clone(),
                gpu: set.strip_suffix("-counters").unwrap_or(set).to_string(),
                memory_slices: slices.iter().map(|(k, _)| k + 1).max().unwrap_or(0),
                ..Default::default()
            };
            for (k, name) in &slices {
                let left = &counters[*name];
                if left.compare(&crate::cel::Quantity::from_int(1)).is_lt() {
                    let holders = model
                        .charged_by
                        .get(&(pool.clone(), set.clone(), (*name).clone()))
                        .cloned()
                        .unwrap_or_default();
                    layout.held.insert(*k, holders);
                }
            }
            for dev in model
                .devices
                .iter()
                .filter(|d| (&d.id.0, &d.id.1) == (&pool.0, &pool.1))
            {
                let Some(profile) = dev.device.attributes.as_ref().and_then(|a| {
                    a.get(tessera_api::attributes::MIG_PROFILE)
                        .or_else(|| a.get(&format!("{}/profile", dev.id.0)))
                        .and_then(|v| v.string.clone())
                }) else {
                    continue;
                };
                let taken: BTreeSet<u32> = dev
                    .device
                    .consumes_counters
                    .iter()
                    .flatten()
                    .filter(|c| &c.counter_set == set)
                    .flat_map(|c| c.counters.keys().filter_map(|n| slice_of(n)))
                    .collect();
                let (Some(start), Some(end)) = (taken.first(), taken.last()) else {
                    continue;
                };
                layout.placements.push(Placement {
                    profile,
                    start: *start,
                    size: end - start + 1,
                    device: dev.name().to_string(),
                });
            }
            out.push(layout);
        }
    }
    out
}

/// A list of slice numbers as `1, 3, 5-7`.
pub fn slice_list(slices: &BTreeSet<u32>) -> String {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &k in slices {
        match runs.last_mut() {
            Some((_, end)) if *end + 1 == k => *end = k,
            _ => runs.push((k, k)),
        }
    }
    runs.iter()
        .map(|(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An H100's placements (memory slices 0-7), as dynamic MIG publishes them.
    fn h100(node: &str, gpu: &str) -> GpuLayout {
        let mut placements = Vec::new();
        let table: [(&str, u32, &[u32]); 6] = [
            ("1g.10gb", 1, &[0, 1, 2, 3, 4, 5, 6]),
            ("1g.20gb", 2, &[0, 2, 4, 6]),
            ("2g.20gb", 2, &[0, 2, 4]),
            ("3g.40gb", 4, &[0, 4]),
            ("4g.40gb", 4, &[0]),
            ("7g.80gb", 8, &[0]),
        ];
        for (profile, size, starts) in table {
            for &start in starts {
                placements.push(Placement {
                    profile: profile.into(),
                    start,
                    size,
                    device: format!("{gpu}-mig-{profile}-{start}"),
                });
            }
        }
        GpuLayout {
            node: node.into(),
            gpu: gpu.into(),
            memory_slices: 8,
            placements,
            held: BTreeMap::new(),
        }
    }

    fn holding(mut gpu: GpuLayout, claim: &str, slices: std::ops::Range<u32>) -> GpuLayout {
        for k in slices {
            gpu.held.entry(k).or_default().push(claim.into());
        }
        gpu
    }

    #[test]
    fn two_1g_instances_in_each_half_leave_six_free_slices_that_no_3g_placement_can_use() {
        let gpu = holding(holding(h100("n", "gpu-0"), "ns/a", 1..2), "ns/b", 5..6);
        let f = gpu.fragmentation(Some("3g.40gb")).unwrap();
        assert_eq!((f.free, f.unusable, f.pending), (6, 6, true));
        assert_eq!(slice_list(&gpu.unusable_for("3g.40gb")), "0, 2-4, 6-7");
        assert!(gpu.unusable_for("1g.10gb").contains(&7), "no 1g.10gb starts at 7");
        assert_eq!(gpu.unusable_for("1g.10gb").len(), 1);
    }

    #[test]
    fn free_slices_a_fitting_placement_covers_are_usable_and_the_rest_are_not() {
        // 1g at slice 1: 3g@4 still fits (slices 4-7); 0, 2 and 3 are free but no 3g placement takes them.
        let gpu = holding(h100("n", "gpu-0"), "ns/a", 1..2);
        assert_eq!(slice_list(&gpu.unusable_for("3g.40gb")), "0, 2-3");
        let f = gpu.fragmentation(Some("3g.40gb")).unwrap();
        assert_eq!((f.free, f.unusable), (7, 3));
    }

    #[test]
    fn without_demand_the_largest_profile_stands_in_so_an_idle_gpu_is_not_fragmented() {
        let idle = h100("n", "gpu-0");
        let f = idle.fragmentation(None).unwrap();
        assert_eq!(
            (f.profile.as_str(), f.pending, f.free, f.unusable),
            ("7g.80gb", false, 8, 0)
        );
        let used = holding(h100("n", "gpu-0"), "ns/a", 7..8);
        let f = used.fragmentation(Some("5g.60gb")).unwrap();
        assert_eq!(
            (f.profile.as_str(), f.pending, f.unusable),
            ("7g.80gb", false, 7),
            "a profile the GPU does not publish is no demand for it"
        );
    }

    #[test]
    fn the_placement_to_free_is_the_one_the_fewest_claims_block() {
        let gpu = holding(
            holding(holding(h100("n", "gpu-0"), "ns/a", 0..1), "ns/b", 2..3),
            "ns/c",
            5..6,
        );
        let (p, claims) = gpu.cheapest_to_free("3g.40gb").unwrap();
        assert_eq!((p.start, claims), (4, vec!["ns/c".to_string()]));
    }
}
