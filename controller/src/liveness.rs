//! Whether a node's plugin is alive, judged only from what this controller could observe.
//!
//! A heartbeat counts as renewed when the controller sees its value change, timed by the controller's
//! own monotonic clock. A node has two heartbeat values, either of which renews it: its node Lease's
//! `renewTime` (what current plugins renew every interval) and its NodeInventory's `lastHeartbeatTime`
//! (what plugins of older versions renew, and current ones while an older controller leads; see
//! [`tessera_api::heartbeat`]); the plugin's timestamp is never compared with the controller's clock (the two
//! may disagree, and a cache that stopped updating makes every heartbeat look old). Time during which
//! the controller's view of the NodeInventories was lost (watch failed, not yet re-listed) does not
//! count towards a node's staleness, and nothing is withdrawn while the view is lost.
//!
//! Verdicts, in order:
//! * view lost → [`Verdict::Hold`] for every node: keep what is published, write nothing for it;
//! * no renewal seen for `heartbeat_timeout` of observed time → [`Verdict::Withdraw`];
//! * not ready for less than `not_ready_grace` of observed time → [`Verdict::Hold`] (a restarting plugin
//!   reports not ready until kubelet registers it again; its GPUs did not go anywhere), then
//!   [`Verdict::Withdraw`];
//! * first seen in a (re-)list and not renewed since → [`Verdict::Hold`]: the controller cannot tell a
//!   live heartbeat from a dead one until it changes (at most one heartbeat interval);
//! * otherwise [`Verdict::Publish`].

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use tessera_api::NodeInventory;

/// How current the controller's copy of the NodeInventories is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum View {
    /// Completed its `list`th list (counting from 1) and is watching since.
    Synced { list: u64 },
    /// The watch failed at `since` and has not completed a new list yet.
    Lost { since: Instant },
}

impl Default for View {
    /// A view that was listed once: what a snapshot built by hand (tests, `render`) stands for.
    fn default() -> Self {
        View::Synced { list: 1 }
    }
}

/// What to do with one node's pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Publish the pool the inventory describes.
    Publish,
    /// Leave the pool as it is: neither create, update nor delete its slices.
    Hold,
    /// Delete the pool.
    Withdraw,
}

/// A node's heartbeat values: the inventory's and the node Lease's (compared for equality only).
type Marker = (Option<String>, Option<String>);

#[derive(Clone, Debug)]
struct Seen {
    /// The heartbeat values last seen.
    marker: Marker,
    ready: bool,
    /// When the controller last saw the heartbeat change; for a node first seen in a list, when it was
    /// first seen.
    renewed_at: Instant,
    /// False until a change was seen for a node first seen in a list.
    confirmed: bool,
    /// When the controller first saw `ready: false` (in a row).
    not_ready_since: Option<Instant>,
}

/// Per-node renewal tracking; feed it every snapshot with [`Liveness::observe`].
#[derive(Clone, Debug)]
pub struct Liveness {
    pub heartbeat_timeout: Duration,
    pub not_ready_grace: Duration,
    nodes: BTreeMap<String, Seen>,
    /// Earliest start of the current loss of the view.
    lost_since: Option<Instant>,
    /// The list the last observation came from; `None` before the first one.
    list: Option<u64>,
}

fn inventory_marker(inv: &NodeInventory) -> Option<String> {
    let time = inv.status.as_ref()?.last_heartbeat_time.as_ref()?;
    serde_json::to_string(time).ok()
}

fn is_ready(inv: &NodeInventory) -> bool {
    inv.status.as_ref().is_some_and(|s| s.ready)
}

/// `at` moved forward by the part of `[at, now]` that lies after `lost` (the outage does not count).
fn discount(at: Instant, lost: Instant, now: Instant) -> Instant {
    let observed = lost.saturating_duration_since(at);
    now.checked_sub(observed).unwrap_or(at).max(at)
}

impl Liveness {
    pub fn new(heartbeat_timeout: Duration, not_ready_grace: Duration) -> Self {
        Self {
            heartbeat_timeout,
            not_ready_grace,
            nodes: BTreeMap::new(),
            lost_since: None,
            list: None,
        }
    }

    /// Records what a snapshot shows at `now` (the controller's monotonic clock): the inventories and
    /// each node's Lease renew time (by node name), both as current as `view`.
    pub fn observe(
        &mut self,
        inventories: &[NodeInventory],
        leases: &BTreeMap<String, String>,
        view: View,
        now: Instant,
    ) {
        let list = match view {
            View::Lost { since } => {
                self.lost_since = Some(self.lost_since.map_or(since, |s| s.min(since)));
                return;
            }
            View::Synced { list } => list,
        };
        if let Some(lost) = self.lost_since.take() {
            for seen in self.nodes.values_mut() {
                seen.renewed_at = discount(seen.renewed_at, lost, now);
                seen.not_ready_since = seen.not_ready_since.map(|t| discount(t, lost, now));
            }
        }
        // Objects first seen right after a list were there before it: their heartbeat may be old.
        let from_a_list = self.list != Some(list);
        self.list = Some(list);
        let mut present = BTreeMap::new();
        for inv in inventories {
            let name = inv.spec.node_name.clone();
            let marker = (inventory_marker(inv), leases.get(&name).cloned());
            let ready = is_ready(inv);
            let seen = match self.nodes.remove(&name) {
                None => Seen {
                    marker,
                    ready,
                    renewed_at: now,
                    confirmed: !from_a_list,
                    not_ready_since: (!ready).then_some(now),
                },
                Some(mut seen) => {
                    if seen.marker != marker {
                        seen.marker = marker;
                        seen.renewed_at = now;
                        seen.confirmed = true;
                    }
                    seen.ready = ready;
                    seen.not_ready_since = match (ready, seen.not_ready_since) {
                        (true, _) => None,
                        (false, None) => Some(now),
                        (false, since) => since,
                    };
                    seen
                }
            };
            present.insert(name, seen);
        }
        self.nodes = present;
    }

    /// The verdict for `node` at `now`; a node never observed is withdrawn (it has no inventory).
    pub fn verdict(&self, node: &str, now: Instant) -> Verdict {
        if self.lost_since.is_some() {
            return Verdict::Hold;
        }
        let Some(seen) = self.nodes.get(node) else {
            return Verdict::Withdraw;
        };
        if now.saturating_duration_since(seen.renewed_at) >= self.heartbeat_timeout {
            return Verdict::Withdraw;
        }
        if let Some(since) = seen.not_ready_since {
            return if now.saturating_duration_since(since) < self.not_ready_grace {
                Verdict::Hold
            } else {
                Verdict::Withdraw
            };
        }
        if seen.confirmed {
            Verdict::Publish
        } else {
            Verdict::Hold
        }
    }

    /// True while the view is lost.
    pub fn view_lost(&self) -> bool {
        self.lost_since.is_some()
    }
}

#[cfg(test)]
mod tests {
    use chrono::{DateTime, Utc};

    use super::*;
    use crate::fixtures::{GpuModel, fixed_time, node};

    const TIMEOUT: Duration = Duration::from_secs(40);
    const GRACE: Duration = Duration::from_secs(30);

    fn beat(at: DateTime<Utc>) -> Vec<NodeInventory> {
        vec![
            node("a")
                .gpus(GpuModel::H100Sxm5_80gb, 1)
                .heartbeat_at(at)
                .build(),
        ]
    }

    fn no_leases() -> BTreeMap<String, String> {
        BTreeMap::new()
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// A liveness that has seen node `a` renew once at `t0 + 1 s`.
    fn live(t0: Instant) -> Liveness {
        let mut l = Liveness::new(TIMEOUT, GRACE);
        l.observe(&beat(fixed_time()), &no_leases(), View::Synced { list: 1 }, t0);
        l.observe(
            &beat(fixed_time() + chrono::Duration::seconds(10)),
            &no_leases(),
            View::Synced { list: 1 },
            t0 + secs(1),
        );
        l
    }

    #[test]
    fn a_heartbeat_is_judged_by_when_the_controller_saw_it_change_not_by_its_timestamp() {
        let t0 = Instant::now();
        let mut l = Liveness::new(TIMEOUT, GRACE);
        // A timestamp an hour in the past (skewed plugin clock) that keeps changing is live.
        let old = fixed_time() - chrono::Duration::hours(1);
        l.observe(&beat(old), &no_leases(), View::Synced { list: 1 }, t0);
        l.observe(
            &beat(old + chrono::Duration::seconds(10)),
            &no_leases(),
            View::Synced { list: 1 },
            t0 + secs(10),
        );
        assert_eq!(l.verdict("a", t0 + secs(49)), Verdict::Publish);
        // Unchanged for the whole timeout, measured from when the change was seen: withdrawn.
        assert_eq!(l.verdict("a", t0 + secs(50)), Verdict::Withdraw);
    }

    #[test]
    fn items_1_and_2_time_without_a_view_does_not_count_and_nothing_is_withdrawn_meanwhile() {
        let t0 = Instant::now();
        let mut l = live(t0);
        // The watch breaks 10 s after the last renewal; the API server is away for 60 s.
        l.observe(
            &beat(fixed_time()),
            &no_leases(),
            View::Lost { since: t0 + secs(11) },
            t0 + secs(12),
        );
        assert_eq!(
            l.verdict("a", t0 + secs(70)),
            Verdict::Hold,
            "no withdrawal on a lost view"
        );
        // Re-listed at t0+71 s with the same (stale) heartbeat: 10 s of observed age so far, 30 s left.
        let stale = beat(fixed_time() + chrono::Duration::seconds(10));
        l.observe(&stale, &no_leases(), View::Synced { list: 2 }, t0 + secs(71));
        assert_eq!(l.verdict("a", t0 + secs(71)), Verdict::Publish);
        assert_eq!(l.verdict("a", t0 + secs(100)), Verdict::Publish);
        assert_eq!(l.verdict("a", t0 + secs(101)), Verdict::Withdraw);
    }

    #[test]
    fn a_heartbeat_that_changed_during_the_outage_is_a_renewal_seen_at_the_relist() {
        let t0 = Instant::now();
        let mut l = live(t0);
        l.observe(
            &[],
            &no_leases(),
            View::Lost { since: t0 + secs(5) },
            t0 + secs(6),
        );
        l.observe(
            &beat(fixed_time() + chrono::Duration::seconds(90)),
            &no_leases(),
            View::Synced { list: 2 },
            t0 + secs(95),
        );
        assert_eq!(l.verdict("a", t0 + secs(134)), Verdict::Publish);
        assert_eq!(l.verdict("a", t0 + secs(135)), Verdict::Withdraw);
    }

    #[test]
    fn item_3_a_restarting_plugin_that_reports_not_ready_keeps_its_pool_through_the_grace() {
        let t0 = Instant::now();
        let mut l = live(t0);
        let not_ready = vec![
            node("a")
                .gpus(GpuModel::H100Sxm5_80gb, 1)
                .heartbeat_at(fixed_time() + chrono::Duration::seconds(20))
                .not_ready()
                .build(),
        ];
        l.observe(&not_ready, &no_leases(), View::Synced { list: 1 }, t0 + secs(2));
        assert_eq!(l.verdict("a", t0 + secs(2)), Verdict::Hold);
        assert_eq!(l.verdict("a", t0 + secs(31)), Verdict::Hold);
        // Registered again: publishing resumes.
        l.observe(
            &beat(fixed_time() + chrono::Duration::seconds(30)),
            &no_leases(),
            View::Synced { list: 1 },
            t0 + secs(4),
        );
        assert_eq!(l.verdict("a", t0 + secs(4)), Verdict::Publish);
        // Not ready for longer than the grace: withdrawn even while heartbeating.
        l.observe(&not_ready, &no_leases(), View::Synced { list: 1 }, t0 + secs(5));
        let renewed = vec![
            node("a")
                .gpus(GpuModel::H100Sxm5_80gb, 1)
                .heartbeat_at(fixed_time() + chrono::Duration::seconds(40))
                .not_ready()
                .build(),
        ];
        l.observe(&renewed, &no_leases(), View::Synced { list: 1 }, t0 + secs(30));
        assert_eq!(l.verdict("a", t0 + secs(34)), Verdict::Hold);
        assert_eq!(l.verdict("a", t0 + secs(35)), Verdict::Withdraw);
    }

    #[test]
    fn a_node_first_seen_in_a_list_is_held_until_its_heartbeat_changes_or_the_timeout_passes() {
        let t0 = Instant::now();
        let mut l = Liveness::new(TIMEOUT, GRACE);
        l.observe(&beat(fixed_time()), &no_leases(), View::Synced { list: 1 }, t0);
        assert_eq!(l.verdict("a", t0 + secs(39)), Verdict::Hold);
        assert_eq!(l.verdict("a", t0 + secs(40)), Verdict::Withdraw);
        // A node that appears while watching was just written: live at once.
        let mut both = beat(fixed_time());
        both.push(node("b").gpus(GpuModel::H200, 1).build());
        l.observe(&both, &no_leases(), View::Synced { list: 1 }, t0 + secs(41));
        assert_eq!(l.verdict("b", t0 + secs(41)), Verdict::Publish);
        assert_eq!(l.verdict("gone", t0), Verdict::Withdraw);
    }

    fn lease(renewed: &str) -> BTreeMap<String, String> {
        [("a".to_string(), renewed.to_string())].into()
    }

    #[test]
    fn a_node_whose_lease_renews_is_alive_while_its_inventory_heartbeat_stands_still() {
        let t0 = Instant::now();
        let mut l = Liveness::new(TIMEOUT, GRACE);
        let inventory = beat(fixed_time());
        l.observe(&inventory, &lease("r1"), View::Synced { list: 1 }, t0);
        for i in 1..=10u64 {
            let renewed = format!("r{}", i + 1);
            l.observe(
                &inventory,
                &lease(&renewed),
                View::Synced { list: 1 },
                t0 + secs(10 * i),
            );
        }
        assert_eq!(l.verdict("a", t0 + secs(139)), Verdict::Publish);
        // The Lease stops renewing: withdrawn one timeout after its last renewal was seen.
        assert_eq!(l.verdict("a", t0 + secs(140)), Verdict::Withdraw);
    }

    #[test]
    fn either_heartbeat_renews_a_node_so_old_and_new_plugins_mix_during_an_upgrade() {
        let t0 = Instant::now();
        let mut l = Liveness::new(TIMEOUT, GRACE);
        l.observe(&beat(fixed_time()), &no_leases(), View::Synced { list: 1 }, t0);
        // An old plugin: the inventory heartbeat changes, there is no Lease.
        let later = beat(fixed_time() + chrono::Duration::seconds(10));
        l.observe(&later, &no_leases(), View::Synced { list: 1 }, t0 + secs(10));
        assert_eq!(l.verdict("a", t0 + secs(49)), Verdict::Publish);
        // Upgraded: the new plugin's Lease appears and renews; the inventory heartbeat stops changing.
        l.observe(&later, &lease("r1"), View::Synced { list: 1 }, t0 + secs(45));
        l.observe(&later, &lease("r2"), View::Synced { list: 1 }, t0 + secs(55));
        assert_eq!(l.verdict("a", t0 + secs(94)), Verdict::Publish);
        assert_eq!(l.verdict("a", t0 + secs(95)), Verdict::Withdraw);
    }

    #[test]
    fn a_lease_seen_first_in_a_list_holds_the_pool_until_it_renews() {
        let t0 = Instant::now();
        let mut l = Liveness::new(TIMEOUT, GRACE);
        l.observe(&beat(fixed_time()), &lease("r1"), View::Synced { list: 1 }, t0);
        assert_eq!(l.verdict("a", t0 + secs(5)), Verdict::Hold);
        l.observe(
            &beat(fixed_time()),
            &lease("r2"),
            View::Synced { list: 1 },
            t0 + secs(10),
        );
        assert_eq!(l.verdict("a", t0 + secs(10)), Verdict::Publish);
    }
}
