//! The client crate's integration tests in one test binary (one link of the CLI's dependency tree
//! instead of four): argument parsing, the offline subcommands on the real model, the client and
//! CLI against a mock daemon on a private bus, the wire signatures and `run`'s benchmark flags.
//!
//! Run one module: `cargo test -p leanstream --test integration daemon_roundtrip`.

mod support;

mod cli_args;
mod cli_bench_flags;
mod cli_generate;
mod cli_offline;
mod daemon_roundtrip;
mod wire_signatures;
