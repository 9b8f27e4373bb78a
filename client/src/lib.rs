//! LeanStream client library: the D-Bus contract of `leanstreamd` ([`contract`]) for apps to link
//! without the engine.

pub mod contract;
