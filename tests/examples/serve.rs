//! Runs a command against the real daemon: starts a private bus and `leanstreamd` serving the
//! real model as `smollm2` (the test harness's daemon), runs the command with
//! `LEANSTREAM_BUS` set to the bus's address and `LEANSTREAM_MODEL` to the model's name, stops
//! both, and exits with the command's status. The Python, C and C++ clients' tests and the
//! OpenAI endpoint's SDK test run through it:
//!
//! ```sh
//! cargo run --profile test -p leanstream-e2e --example serve -- python3 -m pytest python/tests
//! ```
//!
//! `SERVE_EXTRA` adds TOML to the daemon's configuration (e.g. a `[models.smollm2]` table).

use anyhow::{Context, Result, bail};
use leanstream_e2e::{Bus, Daemon, DaemonConfig, runtime};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((program, rest)) = args.split_first() else {
        bail!("usage: serve COMMAND [ARGS...]");
    };
    let bus = Bus::start()?;
    let cfg = DaemonConfig {
        max_tokens: 256,
        // The daemon's default: a client that opens a session per request does not reload.
        keep_alive: 300,
        extra: std::env::var("SERVE_EXTRA").unwrap_or_default(),
        ..DaemonConfig::default()
    };
    let rt = runtime();
    let daemon = rt.block_on(Daemon::start(&bus, &cfg))?;
    let status = std::process::Command::new(program)
        .args(rest)
        .env("LEANSTREAM_BUS", &bus.address)
        .env("LEANSTREAM_MODEL", "smollm2")
        .status()
        .with_context(|| format!("running {program}"))?;
    daemon.terminate()?;
    drop(daemon);
    drop(rt);
    drop(bus);
    std::process::exit(status.code().unwrap_or(1));
}
