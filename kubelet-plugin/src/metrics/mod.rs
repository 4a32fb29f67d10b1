//! Metrics as a sink: the layers report through [`sink`]; [`prometheus`] implements it and serves `/metrics`.

pub mod dcgm;
pub mod prometheus;
pub mod sink;
