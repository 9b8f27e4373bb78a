//! Which bus to reach `leanstreamd` on: `--bus system|session|ADDRESS`, as the daemon takes it.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// A message bus. The daemon runs on the system bus in production; the session bus and an
/// explicit address (a private `dbus-daemon`) serve development and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Bus {
    /// The system bus (the default).
    #[default]
    System,
    /// The user's session bus (`DBUS_SESSION_BUS_ADDRESS`).
    Session,
    /// A D-Bus address such as `unix:path=/run/leanstream/bus`.
    Address(String),
}

impl FromStr for Bus {
    type Err = Error;

    /// `system`, `session` (any case), or a D-Bus address with a transport prefix
    /// (`unix:path=...`, `unix:abstract=...`, `tcp:host=...`). Anything else is
    /// [`Error::InvalidBus`].
    fn from_str(s: &str) -> Result<Bus> {
        let trimmed = s.trim();
        if trimmed.eq_ignore_ascii_case("system") {
            return Ok(Bus::System);
        }
        if trimmed.eq_ignore_ascii_case("session") {
            return Ok(Bus::Session);
        }
        match zbus::Address::from_str(trimmed) {
            Ok(_) => Ok(Bus::Address(trimmed.to_owned())),
            Err(e) => Err(Error::InvalidBus {
                bus: s.to_owned(),
                reason: e.to_string(),
            }),
        }
    }
}

impl fmt::Display for Bus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Bus::System => f.write_str("system"),
            Bus::Session => f.write_str("session"),
            Bus::Address(a) => f.write_str(a),
        }
    }
}

impl Bus {
    /// Opens a connection to this bus. Fails with [`Error::Connect`] when the bus itself cannot
    /// be reached (no socket, refused, authentication failed); whether `leanstreamd` is on it is
    /// only known at the first call.
    pub async fn connect(&self) -> Result<zbus::Connection> {
        let built = match self {
            Bus::System => zbus::Connection::system().await,
            Bus::Session => zbus::Connection::session().await,
            Bus::Address(a) => match zbus::connection::Builder::address(a.as_str()) {
                Ok(b) => b.build().await,
                Err(e) => Err(e),
            },
        };
        built.map_err(|source| Error::Connect {
            bus: self.to_string(),
            source,
        })
    }

    /// The D-Bus address this bus stands for, as [`Bus::connect`] resolves it: for the system
    /// bus `DBUS_SYSTEM_BUS_ADDRESS`, else `unix:path=/var/run/dbus/system_bus_socket`; for the
    /// session bus `DBUS_SESSION_BUS_ADDRESS`, else `$XDG_RUNTIME_DIR/bus`. `None` when the
    /// variable holds no valid address.
    pub fn resolved_address(&self) -> Option<String> {
        let address = match self {
            Bus::System => zbus::Address::system(),
            Bus::Session => zbus::Address::session(),
            Bus::Address(a) => return Some(a.clone()),
        };
        address.ok().map(|a| a.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_named_buses_in_any_case() {
        assert_eq!("system".parse::<Bus>().ok(), Some(Bus::System));
        assert_eq!("SESSION".parse::<Bus>().ok(), Some(Bus::Session));
        assert_eq!(" System ".parse::<Bus>().ok(), Some(Bus::System));
    }

    #[test]
    fn parses_addresses() {
        for a in [
            "unix:path=/tmp/leanstream-test/bus",
            "unix:abstract=leanstream",
            "tcp:host=127.0.0.1,port=4000",
            "unix:path=/run/dbus/system_bus_socket,guid=0123456789abcdef0123456789abcdef",
        ] {
            assert_eq!(
                a.parse::<Bus>().ok(),
                Some(Bus::Address(a.to_owned())),
                "{a}"
            );
        }
    }

    #[test]
    fn rejects_what_is_neither() {
        for bad in [
            "",
            "sytem",
            "/run/dbus/system_bus_socket",
            "unix:",
            "nosuch:path=/x",
        ] {
            match bad.parse::<Bus>() {
                Err(Error::InvalidBus { bus, .. }) => assert_eq!(bus, bad),
                other => panic!("{bad:?} parsed as {other:?}"),
            }
        }
    }

    #[test]
    fn an_address_resolves_to_itself_and_named_buses_to_an_address() {
        let a = "unix:path=/tmp/x";
        assert_eq!(
            Bus::Address(a.into()).resolved_address().as_deref(),
            Some(a)
        );
        // Whatever the environment says, a valid address is a transport with a colon.
        if let Some(system) = Bus::System.resolved_address() {
            assert!(system.contains(':'), "{system}");
        }
    }

    #[test]
    fn displays_what_it_parsed() {
        for s in ["system", "session", "unix:path=/tmp/x"] {
            let bus: Bus = s.parse().expect("valid bus");
            assert_eq!(bus.to_string(), s);
        }
    }
}
