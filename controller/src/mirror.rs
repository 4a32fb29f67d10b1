//! Watches mirrored into reflector stores, and how current each is ([`ViewCell`]): runtime's and webhook's.

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::StreamExt;
use kube::{
    Api,
    runtime::{WatchStreamExt as _, reflector, watcher},
};
use tokio::sync::Notify;

use crate::liveness::View;

/// First delay before listing again after a watch failed.
pub const RELIST_INITIAL_BACKOFF: Duration = Duration::from_millis(500);
/// Longest delay between list attempts: a restarted API server is seen again within this (plus jitter).
pub const RELIST_MAX_BACKOFF: Duration = Duration::from_secs(4);

/// The [`View`] of one watched kind, and a count of the events applied to its store, written by its
/// [`mirror`] task.
#[derive(Clone, Debug)]
pub struct ViewCell {
    view: Arc<Mutex<View>>,
    changes: Arc<std::sync::atomic::AtomicU64>,
    listed: Arc<std::sync::atomic::AtomicBool>,
}

impl ViewCell {
    /// A view not listed yet (lost since `now`).
    pub fn new(now: Instant) -> Self {
        Self {
            view: Arc::new(Mutex::new(View::Lost { since: now })),
            changes: Arc::default(),
            listed: Arc::default(),
        }
    }

    pub fn get(&self) -> View {
        *self.view.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn set(&self, view: View) {
        if let View::Synced { .. } = view {
            self.listed.store(true, std::sync::atomic::Ordering::Release);
        }
        *self.view.lock().unwrap_or_else(|e| e.into_inner()) = view;
    }

    /// True once a list has completed, whatever happened since.
    pub fn listed_once(&self) -> bool {
        self.listed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// How many watch events the store has applied; unchanged means the store is as it was.
    pub fn changes(&self) -> u64 {
        self.changes.load(std::sync::atomic::Ordering::Acquire)
    }

    fn changed(&self) {
        self.changes.fetch_add(1, std::sync::atomic::Ordering::Release);
    }

    /// Marks the view lost, keeping the earliest loss.
    pub(crate) fn lose(&self, now: Instant) {
        let mut v = self.view.lock().unwrap_or_else(|e| e.into_inner());
        if let View::Synced { .. } = *v {
            *v = View::Lost { since: now };
        }
    }
}

/// What the cache of every watched kind drops: managed fields, which nothing in the controller reads.
pub fn drop_managed_fields<K: kube::Resource>(object: &mut K) {
    object.meta_mut().managed_fields = None;
}

/// A delay in `[d/2, d]`: replicas and watches that failed together do not retry together.
fn jittered(d: Duration) -> Duration {
    use std::hash::{BuildHasher, RandomState};
    let r = RandomState::new().hash_one(Instant::now()) % 1000;
    d / 2 + d / 2 * r as u32 / 1000
}

/// Keeps `writer`'s store in step with the objects `api` lists and watches, and `view` with how current
/// it is; wakes `wake` (when given) on every change. A failed watch is started over with a fresh list instead of
/// resumed, so "synced" always means "listed since the failure".
pub async fn mirror<K>(
    kind: &'static str,
    writer: reflector::store::Writer<K>,
    api: Api<K>,
    config: watcher::Config,
    trim: fn(&mut K),
    view: ViewCell,
    wake: Option<Arc<Notify>>,
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Default,
{
    mirror_waking(kind, writer, api, config, trim, view, wake, None).await
}

/// Slices deleted since the loop last cleared the record, by name, and a wake for each. kubelet's start-up wipe is a
/// DeleteCollection that may still be deleting when the controller has written the pool again: a slice
/// written and then deleted never shows in the cache as written, and the loop must not wait for it.
#[derive(Debug, Default)]
pub struct Deletions {
    pub(crate) wake: Notify,
    names: Mutex<BTreeSet<String>>,
}

impl Deletions {
    fn record(&self, name: String) {
        self.names.lock().unwrap_or_else(|e| e.into_inner()).insert(name);
        self.wake.notify_one();
    }

    /// Forgets the names recorded so far.
    pub(crate) fn clear(&self) {
        self.names.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    pub(crate) fn seen(&self, name: &str) -> bool {
        self.names
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(name)
    }
}

/// [`mirror`], which also records in `deleted` each object deleted (the slices kubelet wipes at its start),
/// so the loop can skip its debounce for it.
#[allow(clippy::too_many_arguments)]
pub async fn mirror_waking<K>(
    kind: &'static str,
    mut writer: reflector::store::Writer<K>,
    api: Api<K>,
    config: watcher::Config,
    trim: fn(&mut K),
    view: ViewCell,
    wake: Option<Arc<Notify>>,
    deleted: Option<Arc<Deletions>>,
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Default,
{
    let mut lists = 0u64;
    let mut backoff = RELIST_INITIAL_BACKOFF;
    loop {
        let mut events = std::pin::pin!(watcher(api.clone(), config.clone()).modify(trim));
        while let Some(event) = events.next().await {
            match event {
                Ok(event) => {
                    writer.apply_watcher_event(&event);
                    view.changed();
                    if let (watcher::Event::Delete(gone), Some(deleted)) = (&event, &deleted) {
                        deleted.record(gone.meta().name.clone().unwrap_or_default());
                    }
                    if let watcher::Event::InitDone = event {
                        lists += 1;
                        view.set(View::Synced { list: lists });
                        backoff = RELIST_INITIAL_BACKOFF;
                        if lists > 1 {
                            tracing::info!(kind, "listed again; the view is current");
                        }
                    }
                }
                Err(e) => {
                    view.lose(Instant::now());
                    tracing::warn!(kind, error = %e, retry_in = ?backoff, "watch failed; listing again");
                    wake.iter().for_each(|w| w.notify_one());
                    break;
                }
            }
            wake.iter().for_each(|w| w.notify_one());
        }
        tokio::time::sleep(jittered(backoff)).await;
        backoff = (backoff * 2).min(RELIST_MAX_BACKOFF);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_view_keeps_the_time_of_its_first_failure() {
        let t0 = Instant::now();
        let cell = ViewCell::new(t0);
        cell.set(View::Synced { list: 1 });
        cell.lose(t0 + Duration::from_secs(1));
        cell.lose(t0 + Duration::from_secs(2));
        assert_eq!(
            cell.get(),
            View::Lost {
                since: t0 + Duration::from_secs(1)
            }
        );
        for _ in 0..100 {
            let d = jittered(RELIST_MAX_BACKOFF);
            assert!(d >= RELIST_MAX_BACKOFF / 2 && d <= RELIST_MAX_BACKOFF, "{d:?}");
        }
    }
}
