//! The command line: `leanstream-openai --bus ADDRESS|system|session --listen ADDRESS`.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use clap::Parser;
use leanstream::Bus;

/// An OpenAI-compatible HTTP endpoint for leanstreamd, on a loopback TCP port or a Unix socket.
#[derive(Parser, Debug, Clone)]
#[command(name = "leanstream-openai", version)]
pub struct Args {
    /// Bus of the daemon: `system`, `session`, or a D-Bus address (`unix:path=...`).
    #[arg(long, default_value = "system", value_parser = parse_bus)]
    pub bus: Bus,
    /// Where to serve HTTP: `127.0.0.1:PORT` (any 127.0.0.0/8 address, or `[::1]:PORT`; port 0
    /// picks a free one) or `unix:PATH`. A socket passed by systemd socket activation
    /// (`LISTEN_FDS`) replaces it.
    #[arg(long, value_parser = parse_listen)]
    pub listen: Listen,
    /// Serve HTTP callers of another user over the Unix socket under this endpoint's own
    /// identity when it cannot take theirs (it lacks CAP_SETUID/CAP_SETGID); without it they are
    /// refused with 403. The daemon then counts them all as this endpoint's user.
    #[arg(long)]
    pub share_identity: bool,
}

/// Where the endpoint listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listen {
    /// A loopback TCP address.
    Tcp(SocketAddr),
    /// A Unix socket path.
    Unix(PathBuf),
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Tcp(addr) => write!(f, "{addr}"),
            Listen::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

fn parse_bus(s: &str) -> Result<Bus, String> {
    s.parse().map_err(|e: leanstream::Error| e.to_string())
}

/// `unix:PATH`, or a socket address that must be loopback: the endpoint has no authentication
/// of its own, so it never listens where another machine could reach it.
pub fn parse_listen(s: &str) -> Result<Listen, String> {
    if let Some(path) = s.strip_prefix("unix:") {
        if path.is_empty() {
            return Err("unix: needs a socket path, e.g. unix:/run/leanstream/openai.sock".into());
        }
        return Ok(Listen::Unix(PathBuf::from(path)));
    }
    let addr = match s.strip_prefix("localhost:") {
        Some(port) => port
            .parse::<u16>()
            .map(|p| SocketAddr::from(([127, 0, 0, 1], p)))
            .map_err(|e| format!("invalid port in {s:?}: {e}"))?,
        None => s.parse::<SocketAddr>().map_err(|_| {
            format!("{s:?} is neither unix:PATH nor an address like 127.0.0.1:8080 or [::1]:8080")
        })?,
    };
    check_loopback(addr.ip()).map(|()| Listen::Tcp(addr))
}

/// Refuses any address but 127.0.0.0/8 and ::1 (an IPv4-mapped loopback `::ffff:127.x` too).
pub fn check_loopback(ip: IpAddr) -> Result<(), String> {
    let loopback = match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    };
    if loopback {
        Ok(())
    } else {
        Err(format!(
            "refusing to listen on {ip}: not a loopback address (127.0.0.0/8 or ::1). The \
             endpoint has no authentication; serve other machines through a proxy that has"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_addresses_are_accepted() {
        for ok in ["127.0.0.1:8080", "127.1.2.3:0", "[::1]:9", "localhost:80"] {
            assert!(
                matches!(parse_listen(ok), Ok(Listen::Tcp(_))),
                "{ok}: {:?}",
                parse_listen(ok)
            );
        }
        assert_eq!(
            parse_listen("unix:/tmp/x.sock"),
            Ok(Listen::Unix("/tmp/x.sock".into()))
        );
    }

    #[test]
    fn other_addresses_are_refused_with_the_reason() {
        for bad in [
            "0.0.0.0:8080",
            "192.168.1.2:80",
            "[::]:80",
            "10.0.0.1:1",
            "[fe80::1]:8",
        ] {
            let err = parse_listen(bad).expect_err(bad);
            assert!(err.contains("not a loopback address"), "{bad}: {err}");
        }
        for bad in ["8080", "unix:", "localhost", "host:80"] {
            assert!(parse_listen(bad).is_err(), "{bad}");
        }
    }
}
