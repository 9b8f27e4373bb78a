//! `leanstream`: the LeanStream command line. The daemon commands (`models`, `load`, `unload`,
//! `generate`, `chat`, `status`) talk D-Bus to `leanstreamd`; the offline tools (`run`,
//! `perplexity`, `convert`, `calibrate`, `bench`, `synth`) run the engine in-process and need the default `offline` feature.
//!
//! Exit status: 0 success, 1 failure, 2 bad arguments, 3 the daemon cannot be reached.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use leanstream::Bus;

mod daemon_cmds;
#[cfg(feature = "offline")]
mod offline;
mod table;

#[derive(Parser, Debug)]
#[command(
    name = "leanstream",
    version,
    about = "LeanStream on-device LLM inference"
)]
struct Cli {
    /// Bus of the daemon: `system`, `session`, or a D-Bus address (`unix:path=...`).
    #[arg(long, global = true, default_value = "system", value_parser = parse_bus)]
    bus: Bus,
    #[command(subcommand)]
    command: Command,
}

fn parse_bus(s: &str) -> Result<Bus, String> {
    s.parse().map_err(|e: leanstream::Error| e.to_string())
}

#[derive(Subcommand, Debug)]
enum Command {
    #[command(flatten)]
    Daemon(daemon_cmds::DaemonCommand),
    /// Generate text in-process (no daemon).
    #[cfg(feature = "offline")]
    Run(offline::run::RunArgs),
    /// Show what a memory budget keeps resident and streams, and what it reads per token.
    #[cfg(feature = "offline")]
    Plan(offline::plan::PlanArgs),
    /// Teacher-forced perplexity of a text file.
    #[cfg(feature = "offline")]
    Perplexity(offline::perplexity::PerplexityArgs),
    /// Convert a GGUF file or safetensors directory into a LeanStream `.lsm` file.
    #[cfg(feature = "offline")]
    Convert(offline::convert::ConvertArgs),
    /// Compare the pipeline modes (dense, mmap, on-demand, prefetch, leanstream) at several
    /// neuron-cache budgets.
    #[cfg(feature = "offline")]
    Bench(offline::bench::BenchArgs),
    /// Calibrate a `.lsm` file: activation thresholds, neuron statistics, predictors.
    #[cfg(feature = "offline")]
    Calibrate(offline::calibrate::CalibrateArgs),
    /// Write a synthetic `.lsm` file with a real model's shapes (e.g. Llama-2-7B) and seeded
    /// random weights with planted activation statistics, for scale runs.
    #[cfg(feature = "offline")]
    Synth(offline::synth::SynthArgs),
}

fn main() -> ExitCode {
    #[cfg(feature = "offline")]
    leanstream_engine::alloc::configure();
    let cli = Cli::parse();
    match cli.command {
        Command::Daemon(command) => daemon_cmds::run(&cli.bus, command),
        #[cfg(feature = "offline")]
        Command::Run(args) => offline_exit(offline::run::run(args)),
        #[cfg(feature = "offline")]
        Command::Plan(args) => offline_exit(offline::plan::run(args)),
        #[cfg(feature = "offline")]
        Command::Perplexity(args) => offline_exit(offline::perplexity::run(args)),
        #[cfg(feature = "offline")]
        Command::Convert(args) => offline_exit(offline::convert::run(args)),
        #[cfg(feature = "offline")]
        Command::Bench(args) => offline_exit(offline::bench::run(args)),
        #[cfg(feature = "offline")]
        Command::Calibrate(args) => offline_exit(offline::calibrate::run(args)),
        #[cfg(feature = "offline")]
        Command::Synth(args) => offline_exit(offline::synth::run(args)),
    }
}

#[cfg(feature = "offline")]
fn offline_exit(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("leanstream: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
