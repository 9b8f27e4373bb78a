//! `leanstreamd`: the LeanStream D-Bus service (docs/architecture.md).
//!
//! Layout: [`config`] (raw config → validated params), [`access`] (who sees what in `Memory()`), [`models`] (names resolve only inside the
//! model directory), [`arbiter`] (the memory budget, a pure state machine), [`memory`] (what the
//! state owner needs from it), [`loader`] (a model in the configured mode, with its sparse
//! pipeline and neuron cache), [`scheduler`] (the thread that decides who runs next and runs the generations), [`state`] (the one task owning the state), [`service`]
//! (the thin D-Bus objects), [`typed`] (their argument types checked first), [`directory`] (the
//! node above the sessions, listing none), [`daemon`] (wiring, startup order and shutdown). Freed memory is
//! handed back through [`leanstream_engine::alloc`].

mod access;
mod arbiter;
mod calls;
mod catalog;
mod checks;
mod config;
mod counters;
mod daemon;
mod directory;
#[cfg(feature = "cuda")]
mod gpu;
mod loader;
mod models;
mod request;
mod scheduler;
mod service;
mod state;
#[cfg(test)]
mod testing;
mod typed;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// LeanStream inference daemon.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Bus to serve on: `system`, `session`, or a D-Bus address (e.g. `unix:path=/run/x`).
    #[arg(long, default_value = "system")]
    bus: String,
    /// Configuration file (TOML). The default file may be missing; an explicit one must exist.
    #[arg(long)]
    config: Option<PathBuf>,
}

fn main() -> ExitCode {
    leanstream_engine::alloc::configure();
    let args = Args::parse();
    daemon::init_logging();
    let (path, explicit) = match &args.config {
        Some(p) => (p.clone(), true),
        None => (PathBuf::from(config::DEFAULT_CONFIG), false),
    };
    let params = match config::Params::load(&path, explicit) {
        Ok(p) => p,
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    match daemon::main(params, &args.bus) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}
