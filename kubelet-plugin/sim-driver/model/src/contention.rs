//! SM contention between the busy MPS clients of one GPU: what part of the GPU's SMs a client's kernels
//! get, so a probe of a burstable share sees its ceiling alone and less beside busy neighbours.
//!
//! What NVIDIA documents (`../shared/reference/gpu-sharing-performance.md` §3.1, from the MPS
//! documentation; `gpu-mig-mps.md` §7): `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` is a ceiling, not a
//! reservation; a client's kernels never run on more than its percentage of the SMs; the percentages of a
//! server's clients may sum past 100 %, and then the clients compete for the SMs, the hardware scheduler
//! filling what one leaves idle. How the SMs are divided among competing clients is not documented; the
//! model divides them by weighted max-min fairness (water-filling), the weights being the clients'
//! percentages: a client that wants less than its part keeps what it wants and the rest is shared again.
//! Two rules are strict, so a client never looks better off than on a real GPU: no client gets more than
//! its percentage (or its demand), and the clients together never get more than the whole GPU.

use std::path::Path;

use tessera_api::DeviceName;
use tessera_gpu_api::Result;

use crate::load::{self, LoadEntry};

/// One busy MPS client: what it would use of the GPU alone and its MPS thread limit, both in percent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Client {
    /// Percent of the GPU's SMs its work would keep busy with the GPU to itself.
    pub demand: f64,
    /// Its active thread percentage.
    pub limit: f64,
}

/// The part of the GPU's SMs (0–1) each of `clients` gets, in order (see the module comment).
pub fn sm_shares(clients: &[Client]) -> Vec<f64> {
    let caps: Vec<f64> = clients
        .iter()
        .map(|c| c.demand.min(c.limit).clamp(0.0, 100.0))
        .collect();
    let mut share = vec![0.0; clients.len()];
    let mut open: Vec<usize> = (0..clients.len()).filter(|&i| caps[i] > 0.0).collect();
    let mut left = 100.0;
    // Each round settles at least one client at its cap, or settles all of them.
    while !open.is_empty() {
        let weight: f64 = open
            .iter()
            .map(|&i| clients[i].limit.max(f64::MIN_POSITIVE))
            .sum();
        let fair = |i: usize| left * clients[i].limit.max(f64::MIN_POSITIVE) / weight;
        let (capped, rest): (Vec<usize>, Vec<usize>) = open.iter().partition(|&&i| caps[i] <= fair(i));
        if capped.is_empty() {
            for &i in &rest {
                share[i] = fair(i);
            }
            break;
        }
        for &i in &capped {
            share[i] = caps[i];
            left -= caps[i];
        }
        open = rest;
    }
    share.into_iter().map(|s| (s / 100.0).clamp(0.0, 1.0)).collect()
}

/// What a busy MPS context sees: its part of the SMs and how many busy clients (itself included) share
/// the GPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ContextShare {
    pub share: f64,
    pub busy_clients: usize,
}

/// The part of the SMs a busy MPS context with thread limit `limit` (percent) gets on the device named
/// `device` (tessera's name, as `TESSERA_DEVICE` gives it), beside the other busy MPS clients of the GPU
/// in the synthetic load of `kernel_dir` (`simulate load --mps-client` with a utilization above 0). The
/// context's own kernels saturate its limit; loads of `own_claim` (`TESSERA_CLAIM`) are this client and
/// are not counted again. The SMs are the GPU's, so on a whole GPU every MPS client of its shared devices
/// competes; on a MIG device only the clients of that MIG device.
pub fn context_share(
    kernel_dir: &Path,
    device: &str,
    own_claim: Option<&str>,
    limit: f64,
) -> Result<ContextShare> {
    let own: Option<DeviceName> = device.parse().ok();
    let same_sms = |l: &LoadEntry| match (&own, l.device.parse::<DeviceName>()) {
        (Some(DeviceName::SharedMig { .. } | DeviceName::Mig { .. }), _) => l.device == device,
        (Some(own), Ok(other)) => {
            other.gpu() == own.gpu()
                && !matches!(other, DeviceName::SharedMig { .. } | DeviceName::Mig { .. })
        }
        _ => false,
    };
    let mut clients = vec![Client { demand: limit, limit }];
    clients.extend(
        load::snapshot(kernel_dir)?
            .iter()
            .filter(|l| l.mps_client && l.utilization_percent > 0 && same_sms(l))
            .filter(|l| own_claim.is_none() || l.claim.as_deref() != own_claim)
            .map(|l| Client {
                demand: f64::from(l.utilization_percent),
                limit: f64::from(l.active_thread_percentage.unwrap_or(100)),
            }),
    );
    Ok(ContextShare {
        share: sm_shares(&clients)[0],
        busy_clients: clients.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn busy(limit: f64) -> Client {
        Client { demand: limit, limit }
    }

    fn rounded(shares: Vec<f64>) -> Vec<f64> {
        shares
            .into_iter()
            .map(|s| (s * 1000.0).round() / 1000.0)
            .collect()
    }

    #[test]
    fn a_lone_busy_client_gets_its_limit_and_never_more() {
        assert_eq!(sm_shares(&[busy(80.0)]), [0.8]);
        assert_eq!(sm_shares(&[busy(100.0)]), [1.0]);
        assert_eq!(
            sm_shares(&[Client {
                demand: 100.0,
                limit: 30.0
            }]),
            [0.3]
        );
        assert_eq!(
            sm_shares(&[Client {
                demand: 10.0,
                limit: 30.0
            }]),
            [0.1]
        );
    }

    #[test]
    fn busy_clients_whose_limits_sum_past_the_gpu_share_it_in_proportion_to_their_limits() {
        assert_eq!(sm_shares(&[busy(80.0), busy(80.0)]), [0.5, 0.5]);
        assert_eq!(rounded(sm_shares(&[busy(90.0), busy(60.0)])), [0.6, 0.4]);
        let three = sm_shares(&[busy(100.0), busy(50.0), busy(50.0)]);
        assert!((three.iter().sum::<f64>() - 1.0).abs() < 1e-9, "{three:?}");
    }

    #[test]
    fn limits_that_fit_the_gpu_are_each_met_in_full() {
        assert_eq!(sm_shares(&[busy(30.0), busy(70.0)]), [0.3, 0.7]);
        assert_eq!(sm_shares(&[busy(25.0), busy(25.0)]), [0.25, 0.25]);
    }

    #[test]
    fn what_a_light_client_leaves_goes_to_the_busy_one_up_to_its_limit() {
        // 20 % of demand keeps its 20; the other takes the 80 left, which is its limit.
        assert_eq!(
            sm_shares(&[
                busy(80.0),
                Client {
                    demand: 20.0,
                    limit: 80.0
                }
            ]),
            [0.8, 0.2]
        );
        // An idle client takes nothing.
        assert_eq!(
            sm_shares(&[
                busy(80.0),
                Client {
                    demand: 0.0,
                    limit: 80.0
                }
            ]),
            [0.8, 0.0]
        );
    }

    fn client_load(device: &str, claim: &str, util: u32, limit: Option<u32>) -> LoadEntry {
        LoadEntry {
            device: device.into(),
            claim: Some(claim.into()),
            utilization_percent: util,
            mps_client: true,
            active_thread_percentage: limit,
            ..LoadEntry::default()
        }
    }

    #[test]
    fn a_context_competes_with_the_other_busy_mps_clients_of_its_gpu_and_not_with_its_own_claims_load() {
        let dir = tempfile::tempdir().unwrap();
        let alone = context_share(dir.path(), "gpu-0-shared", Some("ns/a"), 80.0).unwrap();
        assert_eq!(
            alone,
            ContextShare {
                share: 0.8,
                busy_clients: 1
            }
        );
        load::set(dir.path(), client_load("gpu-0-shared", "ns/a", 80, Some(80))).unwrap();
        assert_eq!(
            context_share(dir.path(), "gpu-0-shared", Some("ns/a"), 80.0).unwrap(),
            alone,
            "its own claim's load is itself"
        );
        load::set(dir.path(), client_load("gpu-1-shared", "ns/c", 90, Some(90))).unwrap();
        load::set(
            dir.path(),
            client_load("gpu-0-mig-3g-40gb-4-shared", "ns/d", 90, None),
        )
        .unwrap();
        assert_eq!(
            context_share(dir.path(), "gpu-0-shared", Some("ns/a"), 80.0).unwrap(),
            alone,
            "another GPU's clients and a MIG device's have other SMs"
        );
        load::set(dir.path(), client_load("gpu-0-shared", "ns/b", 80, Some(80))).unwrap();
        let b = context_share(dir.path(), "gpu-0-shared", Some("ns/b"), 80.0).unwrap();
        let a = context_share(dir.path(), "gpu-0-shared", Some("ns/a"), 80.0).unwrap();
        assert_eq!(
            (a, b),
            (
                ContextShare {
                    share: 0.5,
                    busy_clients: 2
                },
                ContextShare {
                    share: 0.5,
                    busy_clients: 2
                }
            )
        );
        let mig = context_share(dir.path(), "gpu-0-mig-3g-40gb-4-shared", Some("ns/e"), 100.0).unwrap();
        assert_eq!(
            mig,
            ContextShare {
                share: 0.5,
                busy_clients: 2
            }
        );
    }
}
