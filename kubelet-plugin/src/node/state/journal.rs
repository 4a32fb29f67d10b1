//! The checkpoint as the node state holds it: the version last written to disk, which is all that readers
//! ever see, and group commit of changes to it.
//!
//! Every prepare and unprepare writes the whole checkpoint file (one fsync each, see
//! [`crate::node::checkpoint`]). Claims on different GPUs prepare in parallel, so at concurrency 8 up to 8 writes
//! queue for the one file. Group commit turns that queue into one write: a change is queued, then its
//! caller takes the writer lock; if a writer before it already wrote the change (together with its own),
//! the caller is done, otherwise it becomes the writer for everything queued so far. A change is reported
//! done only once a file that contains it was renamed into place, so memory never claims more than the
//! disk, exactly as with one write per change.
//!
//! Changes are data ([`Change`]), not closures, so a writer can apply other callers' changes, and a failed
//! write drops the whole batch (each of its callers gets the error) without undoing anything in memory.

use std::{
    collections::HashMap,
    io,
    sync::{Mutex, MutexGuard},
};

use crate::node::checkpoint::{Checkpoint, CheckpointStore, ClaimRecord, WarmRecord};
use crate::node::error::{Error, Result};

/// One change to the checkpoint. Changes of different claims commute; changes of one claim are applied
/// in the order they were queued (which the GPU locks make the order of the calls).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Change {
    /// Insert or replace a claim's record.
    Put(ClaimRecord),
    /// Drop a claim's record; one that is already gone is no change.
    Remove(String),
    /// Note why a claim's rollback failed, if its record is still there.
    MarkFailed { uid: String, reason: String },
    /// Drop a claim's record and keep what its devices left warm, in one write: a crash leaves either the
    /// claim's record or the warm ones, so the partitions always have an owner.
    Release {
        uid: String,
        warm: Vec<(String, WarmRecord)>,
    },
    /// Insert a claim's record and drop the warm records its devices take, in one write.
    Take { record: ClaimRecord, warm: Vec<String> },
    /// Drop a warm record (destroyed); one that is already gone is no change.
    DropWarm(String),
}

impl Change {
    fn apply(self, checkpoint: &mut Checkpoint) {
        match self {
            Self::Put(record) => {
                checkpoint.claims.insert(record.uid.clone(), record);
            }
            Self::Remove(uid) => {
                checkpoint.claims.remove(&uid);
            }
            Self::MarkFailed { uid, reason } => {
                if let Some(r) = checkpoint.claims.get_mut(&uid) {
                    r.recovery_error = Some(reason);
                }
            }
            Self::Release { uid, warm } => {
                checkpoint.claims.remove(&uid);
                checkpoint.warm.extend(warm);
            }
            Self::Take { record, warm } => {
                for key in &warm {
                    checkpoint.warm.remove(key);
                }
                checkpoint.claims.insert(record.uid.clone(), record);
            }
            Self::DropWarm(key) => {
                checkpoint.warm.remove(&key);
            }
        }
    }
}

/// How a batch's write ended, kept for the callers of the batch that are still waiting for the writer lock.
/// `io::Error` is not `Clone`, so a failure is kept as its kind and text and rebuilt for each caller.
type Outcome = Result<(), (io::ErrorKind, String)>;

#[derive(Default)]
struct Queue {
    last_seq: u64,
    pending: Vec<(u64, Change)>,
    done: HashMap<u64, Outcome>,
}

/// The checkpoint file and the version of it on disk.
pub(crate) struct Journal {
    store: CheckpointStore,
    durable: Mutex<Checkpoint>,
    queue: Mutex<Queue>,
    /// Held by the one caller writing the file. Never held by readers, so a read never waits for an fsync.
    writer: Mutex<()>,
}

impl Journal {
    pub(crate) fn new(store: CheckpointStore, checkpoint: Checkpoint) -> Self {
        Self {
            store,
            durable: Mutex::new(checkpoint),
            queue: Mutex::new(Queue::default()),
            writer: Mutex::new(()),
        }
    }

    pub(crate) fn store(&self) -> &CheckpointStore {
        &self.store
    }

    /// The checkpoint as on disk. Hold the guard briefly: a writer waits for it to publish a batch.
    pub(crate) fn read(&self) -> MutexGuard<'_, Checkpoint> {
        // A panic while holding the lock cannot leave the checkpoint half-changed: changes are made on a copy.
        self.durable.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies `change` and returns once a checkpoint file containing it is in place. Blocks for the write
    /// (an fsync): call it off the async runtime ([`tokio::task::spawn_blocking`]).
    pub(crate) fn commit(&self, change: Change) -> Result<()> {
        let seq = {
            let mut q = self.lock_queue();
            q.last_seq += 1;
            let seq = q.last_seq;
            q.pending.push((seq, change));
            seq
        };
        let _writer = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let batch = {
            let mut q = self.lock_queue();
            if let Some(outcome) = q.done.remove(&seq) {
                return outcome.map_err(|(kind, text)| self.write_error(kind, text));
            }
            // Not written yet, so still pending: this caller writes it, with everything queued behind it.
            std::mem::take(&mut q.pending)
        };
        if !batch.iter().any(|(s, _)| *s == seq) {
            // Only if a writer panicked between taking its batch and publishing the outcome.
            self.lock_queue().pending.extend(batch);
            return Err(self.write_error(
                io::ErrorKind::Interrupted,
                "the write that held this change was interrupted; retry".into(),
            ));
        }
        let mut next = self.read().clone();
        let before = next.clone();
        let seqs: Vec<u64> = batch.iter().map(|(s, _)| *s).collect();
        for (_, change) in batch {
            change.apply(&mut next);
        }
        // Removing a record that was never written (a whole GPU whose prepare failed) changes nothing.
        let result = if next == before {
            Ok(())
        } else {
            self.store.save(&next)
        };
        let outcome: Outcome = match &result {
            Ok(()) => {
                *self.read() = next;
                Ok(())
            }
            Err(Error::WriteCheckpoint { source, .. }) => Err((source.kind(), source.to_string())),
            Err(other) => Err((io::ErrorKind::Other, other.to_string())),
        };
        let mut q = self.lock_queue();
        for s in seqs.into_iter().filter(|s| *s != seq) {
            q.done.insert(s, outcome.clone());
        }
        result
    }

    /// Writes `checkpoint` as a whole and makes it the durable version (start-up recovery and re-adoption,
    /// which rebuild the checkpoint rather than change one claim). Changes queued meanwhile are applied on
    /// top of it by their own writer.
    pub(crate) fn replace(&self, checkpoint: Checkpoint) -> Result<()> {
        let _writer = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        self.store.save(&checkpoint)?;
        *self.read() = checkpoint;
        Ok(())
    }

    fn write_error(&self, kind: io::ErrorKind, text: String) -> Error {
        Error::WriteCheckpoint {
            path: self.store.path().to_path_buf(),
            source: io::Error::new(kind, text),
        }
    }

    fn lock_queue(&self) -> MutexGuard<'_, Queue> {
        // The queue is only pushed to and drained whole; a panic elsewhere cannot leave it inconsistent.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, thread};

    use super::*;
    use crate::node::checkpoint::{Loaded, Phase};

    fn record(uid: &str) -> ClaimRecord {
        ClaimRecord {
            uid: uid.into(),
            namespace: "ns".into(),
            name: format!("claim-{uid}"),
            phase: Phase::PrepareCompleted,
            devices: Vec::new(),
            recovery_error: None,
            completed_at: None,
        }
    }

    fn journal_in(dir: &std::path::Path) -> Journal {
        Journal::new(
            CheckpointStore::new(dir),
            Checkpoint {
                boot_id: "b".into(),
                ..Default::default()
            },
        )
    }

    #[test]
    fn concurrent_commits_all_reach_the_file_and_the_durable_view() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Arc::new(journal_in(dir.path()));
        let threads: Vec<_> = (0..16)
            .map(|i| {
                let j = journal.clone();
                thread::spawn(move || j.commit(Change::Put(record(&format!("u{i}")))))
            })
            .collect();
        for t in threads {
            t.join().unwrap().unwrap();
        }
        let Loaded::Current(on_disk) = journal.store().load("b").unwrap() else {
            panic!("the checkpoint should be of this boot");
        };
        assert_eq!(on_disk.claims.len(), 16);
        assert_eq!(*journal.read(), on_disk);
    }

    #[test]
    fn changes_of_one_claim_apply_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let journal = journal_in(dir.path());
        journal.commit(Change::Put(record("u1"))).unwrap();
        journal
            .commit(Change::MarkFailed {
                uid: "u1".into(),
                reason: "busy".into(),
            })
            .unwrap();
        assert_eq!(
            journal.read().claims["u1"].recovery_error.as_deref(),
            Some("busy")
        );
        journal.commit(Change::Remove("u1".into())).unwrap();
        assert!(journal.read().claims.is_empty());
    }

    #[test]
    fn a_change_that_changes_nothing_writes_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let journal = journal_in(dir.path());
        journal.commit(Change::Remove("never-written".into())).unwrap();
        assert_eq!(journal.store().load("b").unwrap(), Loaded::Missing);
    }

    #[test]
    fn a_failed_write_reports_the_file_and_leaves_the_durable_view_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        // The checkpoint's directory is a file, so the write fails.
        let blocker = dir.path().join("state");
        std::fs::write(&blocker, b"").unwrap();
        let journal = journal_in(&blocker);
        let err = journal.commit(Change::Put(record("u1"))).unwrap_err().to_string();
        assert!(err.contains("checkpoint.json"), "{err}");
        assert!(journal.read().claims.is_empty());
    }
}
