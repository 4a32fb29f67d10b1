//! What the layers report as it happens, through one narrow trait: the state machine, the preparers and
//! the MIG operations call [`sink()`]; the metrics implement [`Sink`] and are installed once at start.
//!
//! This file depends on no other part of the plugin, so every layer can report to it without the
//! metrics reaching back into them. Until [`install`] is called (in tests, in subcommands) reports go
//! nowhere.

use std::{
    fmt::Debug,
    future::Future,
    sync::OnceLock,
    time::{Duration, Instant},
};

use k8s_openapi::api::resource::v1::ResourceClaim;

/// The events the metrics count. Each call is cheap and never fails.
pub trait Sink: Send + Sync {
    /// A claim operation (`prepare`, `unprepare`) ended after `took`, with `error` when it failed.
    fn claim_operation(&self, operation: &'static str, took: Duration, error: Option<&dyn Debug>);
    /// One MIG call (`create_gpu_instance`, `destroy_compute_instance`, ...) returned after `took`.
    fn mig_operation(&self, operation: &'static str, took: Duration);
    /// A device's prepare made (`warm` false) or took (`warm` true) a partition of `kind`.
    fn device_prepared(&self, kind: &'static str, warm: bool, took: Duration);
    /// A prepare of a device kept warm by policy: a hit saving `saved_ms`, or a miss (`None`).
    fn warm_taken(&self, kind: &'static str, saved_ms: Option<u64>);
    /// A warm partition was destroyed for `reason` (`expired`, `in_the_way`).
    fn warm_destroyed(&self, kind: &'static str, reason: &'static str);
    /// A claim this node holds was read from the API server (its `status.reservedFor` names its pods).
    fn claim_seen(&self, claim: &ResourceClaim);
}

static SINK: OnceLock<&'static dyn Sink> = OnceLock::new();

/// Where reports go until a sink is installed.
struct Discard;

impl Sink for Discard {
    fn claim_operation(&self, _: &'static str, _: Duration, _: Option<&dyn Debug>) {}
    fn mig_operation(&self, _: &'static str, _: Duration) {}
    fn device_prepared(&self, _: &'static str, _: bool, _: Duration) {}
    fn warm_taken(&self, _: &'static str, _: Option<u64>) {}
    fn warm_destroyed(&self, _: &'static str, _: &'static str) {}
    fn claim_seen(&self, _: &ResourceClaim) {}
}

/// Sends every later report to `sink`; the first call wins (one process, one registry).
pub fn install(sink: &'static dyn Sink) {
    let _ = SINK.set(sink);
}

/// The process's sink.
pub fn sink() -> &'static dyn Sink {
    SINK.get().copied().unwrap_or(&Discard)
}

/// Runs one claim operation, reporting how long it took and how it ended.
pub async fn claim_operation<T, E: Debug>(
    operation: &'static str,
    run: impl Future<Output = Result<T, E>>,
) -> Result<T, E> {
    let started = Instant::now();
    let result = run.await;
    let error = result.as_ref().err().map(|e| e as &dyn Debug);
    sink().claim_operation(operation, started.elapsed(), error);
    result
}

/// Runs one MIG call, reporting how long it took.
pub fn mig_operation<T>(operation: &'static str, run: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let result = run();
    sink().mig_operation(operation, started.elapsed());
    result
}
