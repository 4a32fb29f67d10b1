//! Metrics as a sink: the layers report what happened through [`sink`]; [`prometheus`] turns it into the
//! Prometheus metrics served at `/metrics`.

pub mod prometheus;
pub mod sink;
