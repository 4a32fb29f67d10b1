//! The node state's side of warm partitions ([`crate::node::warm`]): keeping what a claim's devices leave at
//! unprepare, handing it to the next claim of the same device, destroying what is in a claim's way or
//! past its window, and finding it again after a restart. Every change of the hardware happens under the
//! GPU's lock, and every warm record changes in the same checkpoint write as the claim record it moves
//! from or to, so a partition never lacks an owner the start-up sweep respects.

use std::{sync::Arc, time::Duration};

use tokio::sync::watch;
use tracing::{info, warn};

use super::{
    Change, ClaimRef, DeviceContext, DevicePreparer, NodeState, Planned, every_until_stopped,
    on_blocking_thread, unix_now,
};
use crate::metrics::sink::sink;
use crate::node::checkpoint::{Checkpoint, ClaimRecord, DeviceRecord, WarmRecord, check_gpu_identity};
use crate::node::error::ClaimError;
use crate::node::warm;

impl NodeState {
    /// Under the claim's GPU locks: lets each planned device take the warm partition of its key (for a MIG
    /// device its ids go into the plan, so the preparer finds the instance and a rollback destroys it), and
    /// destroys the warm partitions in the way of the rest. Returns the keys taken, which leave the
    /// checkpoint in the same write as the claim's first record.
    pub(super) async fn settle_warm(
        self: &Arc<Self>,
        planned: &mut [Planned],
    ) -> Result<Vec<String>, ClaimError> {
        let records = self.journal.read().warm.clone();
        let mut taken = Vec::new();
        for p in planned.iter_mut() {
            let Some(key) = warm::warm_key(&p.ctx.device, &p.record.detail) else {
                continue;
            };
            let kind = warm::kind(&p.record.detail);
            match records.get(&key) {
                Some(w) if !taken.contains(&key) && warm::takes(&p.record.detail, w) => {
                    if matches!(p.record.detail, crate::node::checkpoint::DeviceDetail::Mig(_)) {
                        p.record.detail = w.detail.clone();
                    }
                    p.record.cost_ms = Some(w.cost_ms);
                    p.warm = true;
                    info!(claim = %p.ctx.claim.uid, device = %p.record.device, key, "taking a warm device");
                    sink().warm_taken(kind, Some(w.cost_ms));
                    taken.push(key);
                }
                _ if p.record.warm_seconds.is_some() => sink().warm_taken(kind, None),
                _ => {}
            }
        }
        let in_the_way: Vec<(String, WarmRecord)> = records
            .into_iter()
            .filter(|(key, _)| !taken.contains(key))
            .filter(|(_, w)| planned.iter().any(|p| warm::in_the_way(w, &p.record.detail)))
            .collect();
        for (key, w) in in_the_way {
            info!(key, device = %w.device, "destroying a warm device in the way of a claim's device");
            self.destroy_warm_blocking(w.clone()).await?;
            sink().warm_destroyed(warm::kind(&w.detail), "in_the_way");
            self.commit(Change::DropWarm(key)).await?;
        }
        Ok(taken)
    }

    /// Releases the devices of `record` on a blocking thread (the caller holds their GPUs' locks): what a
    /// device published with `warmSeconds` leaves is kept and returned as warm records, the rest undone.
    pub(super) async fn release_blocking(
        self: &Arc<Self>,
        record: &ClaimRecord,
    ) -> Result<Vec<(String, WarmRecord)>, ClaimError> {
        let (this, record) = (self.clone(), record.clone());
        on_blocking_thread("(release)", move || this.release_devices(&record)).await
    }

    fn release_devices(&self, record: &ClaimRecord) -> Result<Vec<(String, WarmRecord)>, ClaimError> {
        let now = unix_now();
        let mut kept = Vec::new();
        for d in record.devices.iter().rev() {
            let (preparer, ctx) = self.recorded_context(record, d)?;
            let window = d.warm_seconds.filter(|s| *s > 0);
            let Some(detail) = preparer.release(&ctx, &d.detail, window.is_some())? else {
                continue;
            };
            match warm::warm_key(&ctx.device, &detail) {
                Some(key) => {
                    let until = now + window.unwrap_or_default();
                    info!(claim = %record.uid, device = %d.device, key, until, "kept warm");
                    kept.push((
                        key,
                        WarmRecord {
                            device: d.device.clone(),
                            detail,
                            until,
                            cost_ms: d.cost_ms.unwrap_or_default(),
                        },
                    ));
                }
                // Kept, but under no key a claim could find it by: nothing would ever take it.
                None => preparer.destroy_warm(&ctx, &detail)?,
            }
        }
        Ok(kept)
    }

    /// At start: registers every warm record of a checkpoint of this boot with its preparer, and drops
    /// those whose GPU index now names another GPU (their partition is not on it).
    pub(super) fn restore_warm(&self, checkpoint: &mut Checkpoint) {
        checkpoint.warm.retain(|key, w| {
            let current = self.gpus.get(&w.detail.gpu()).map(|g| g.uuid.as_str());
            match check_gpu_identity(&w.detail, current) {
                Ok(_) => true,
                Err(why) => {
                    warn!(key, reason = %why, "dropping a warm record of a GPU this node no longer has there");
                    false
                }
            }
        });
        for (key, w) in &checkpoint.warm {
            match self.warm_context(w) {
                Ok((preparer, ctx)) => preparer.restore_warm(&ctx, &w.detail),
                Err(e) => warn!(key, error = %e, "cannot restore a warm device"),
            }
        }
    }

    /// Destroys warm partition `w` on a blocking thread; the caller holds its GPU's lock.
    async fn destroy_warm_blocking(self: &Arc<Self>, w: WarmRecord) -> Result<(), ClaimError> {
        let this = self.clone();
        on_blocking_thread("(warm device)", move || {
            let (preparer, ctx) = this.warm_context(&w)?;
            preparer.destroy_warm(&ctx, &w.detail)
        })
        .await
    }

    /// The preparer and a context of a warm record's device: no claim holds it, so the claim is a name only.
    fn warm_context(&self, w: &WarmRecord) -> Result<(Arc<dyn DevicePreparer>, DeviceContext), ClaimError> {
        let claim = ClaimRef {
            namespace: String::new(),
            name: "(warm)".into(),
            uid: "warm".into(),
        };
        let record = DeviceRecord {
            request: String::new(),
            pool: self.node_name.clone(),
            device: w.device.clone(),
            share_id: None,
            cdi_device_ids: Vec::new(),
            detail: w.detail.clone(),
            warm_seconds: None,
            cost_ms: None,
        };
        self.context_of(claim, &record)
    }

    /// Destroys the warm partitions whose window ended, each under its GPU's lock; one that cannot be
    /// destroyed keeps its record and is tried again next time.
    pub async fn expire_warm(self: &Arc<Self>) {
        if self.refused().is_some() {
            return;
        }
        let expired = warm::expired(&self.journal.read().warm, unix_now());
        for key in expired {
            let Some(gpu) = self.journal.read().warm.get(&key).map(|w| w.detail.gpu()) else {
                continue;
            };
            let _guard = self.lock_gpus(std::iter::once(gpu)).await;
            // A claim may have taken it while this waited for the GPU.
            let Some(w) = self.journal.read().warm.get(&key).cloned() else {
                continue;
            };
            match self.destroy_warm_blocking(w.clone()).await {
                Ok(()) => {
                    info!(key, device = %w.device, "destroyed a warm device whose window ended");
                    sink().warm_destroyed(warm::kind(&w.detail), "expired");
                    if let Err(e) = self.commit(Change::DropWarm(key.clone())).await {
                        warn!(key, error = %e, "could not drop the record of a destroyed warm device");
                    }
                }
                Err(e) => warn!(key, error = %e,
                    "could not destroy a warm device whose window ended; trying again"),
            }
        }
    }

    /// Runs [`NodeState::expire_warm`] every `every` until `stop` turns true.
    pub async fn expire_warm_periodically(self: Arc<Self>, every: Duration, stop: watch::Receiver<bool>) {
        every_until_stopped(every, stop, || self.expire_warm()).await
    }
}
