//! What the endpoint's integration tests share: the endpoint binary started against the test
//! daemon, and a minimal HTTP/1 client (hyper's) over TCP or a Unix socket.

#![allow(dead_code)]

mod http;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

pub use http::*;
pub use leanstream_e2e::{Bus, Daemon, DaemonConfig, MODEL, User, runtime};

/// The `leanstream-openai` binary, running until dropped.
#[derive(Debug)]
pub struct Endpoint {
    child: Child,
    pub target: Target,
}

impl Endpoint {
    /// Starts the endpoint on `bus` listening on `listen` (`127.0.0.1:0` for a free port), with
    /// `extra` arguments, once it says where it listens.
    pub fn start(bus: &str, listen: &str, extra: &[&str]) -> Result<Endpoint> {
        Endpoint::start_as(bus, listen, extra, None)
    }

    /// [`Endpoint::start`] as another user (this process must be root).
    pub fn start_as(
        bus: &str,
        listen: &str,
        extra: &[&str],
        user: Option<&User>,
    ) -> Result<Endpoint> {
        use std::os::unix::process::CommandExt;
        let mut command = Command::new(env!("CARGO_BIN_EXE_leanstream-openai"));
        command
            .args(["--bus", bus, "--listen", listen])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        if let Some(user) = user {
            command.uid(user.uid).gid(user.gid);
        }
        let mut child = command.spawn().context("starting leanstream-openai")?;
        let stdout = child.stdout.take().context("stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let Some(address) = line.trim().strip_prefix("listening on ") else {
            let status = child.wait()?;
            bail!("leanstream-openai did not start ({status}): {line:?}");
        };
        let target = match address.strip_prefix("unix:") {
            Some(path) => Target::Unix(path.into()),
            None => Target::Tcp(address.parse()?),
        };
        Ok(Endpoint { child, target })
    }

    /// Starts it on a free loopback port against the test bus.
    pub fn tcp(bus: &Bus) -> Result<Endpoint> {
        Endpoint::start(&bus.address, "127.0.0.1:0", &[])
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
