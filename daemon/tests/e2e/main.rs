//! The end-to-end tests in one test binary: a private `dbus-daemon`, this package's real
//! `leanstreamd`, the real CLI and the real model, driven through the harness in `tests/`
//! (crate `leanstream-e2e`).
//!
//! Run one module: `cargo test -p leanstreamd --test e2e budget -- --nocapture`.

use std::path::Path;

use leanstream_e2e::{Bus, Daemon, DaemonConfig};

mod budget;
mod contract;
mod daemon;
mod hostile;
mod hostile_load;
mod hostile_users;
mod lifetime;
mod notify;
mod privacy;
mod soak;
mod streaming;
mod structured;

/// Starts this package's `leanstreamd` on `bus`: the binary cargo built for this test, from the
/// same dependency builds as the tests (no second build with other features).
async fn start_daemon(bus: &Bus, cfg: &DaemonConfig) -> anyhow::Result<Daemon> {
    Daemon::start_binary(Path::new(env!("CARGO_BIN_EXE_leanstreamd")), bus, cfg).await
}
