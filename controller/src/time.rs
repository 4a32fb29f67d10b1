//! Kubernetes timestamps (jiff) from the controller's chrono times.

use chrono::{DateTime, Utc};

/// Converts a chrono time to a Kubernetes timestamp (jiff).
pub fn to_k8s_time(t: DateTime<Utc>) -> k8s_openapi::jiff::Timestamp {
    k8s_openapi::jiff::Timestamp::new(t.timestamp(), t.timestamp_subsec_nanos() as i32).unwrap_or_default()
}
