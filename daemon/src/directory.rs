//! The node above the session objects. zbus answers `Introspect` on any node with its child
//! nodes, which at `SESSION_PATH_PREFIX` would list every client's open sessions to anyone on
//! the bus. The daemon serves that node itself, with an introspection that lists none: a client
//! learns a session's path only from the `OpenSession` reply that created it.
//!
//! zbus destroys a node left with only the standard interfaces, so the node keeps an empty
//! marker interface while its introspection is replaced.

use leanstream::contract::SESSION_PATH_PREFIX;
use zbus::names::InterfaceName;

/// The marker that keeps the node, and says what it is to a reader of `busctl tree`.
struct SessionDirectory;

#[zbus::interface(name = "io.github.leanstream.LeanStream1.SessionDirectory")]
impl SessionDirectory {}

/// `org.freedesktop.DBus.Introspectable` at the directory: the node's own interfaces only.
struct Opaque;

/// What [`Opaque`] answers.
const DIRECTORY_XML: &str = r#"<!DOCTYPE node PUBLIC "-//freedesktop//DTD D-BUS Object Introspection 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/introspect.dtd">
<node>
  <interface name="org.freedesktop.DBus.Introspectable">
    <method name="Introspect">
      <arg type="s" direction="out"/>
    </method>
  </interface>
  <interface name="io.github.leanstream.LeanStream1.SessionDirectory">
  </interface>
</node>
"#;

#[zbus::interface(name = "org.freedesktop.DBus.Introspectable")]
impl Opaque {
    fn introspect(&self) -> &'static str {
        DIRECTORY_XML
    }
}

/// Serves the session directory on `conn`; call before any session object is served.
pub async fn serve(conn: &zbus::Connection) -> zbus::Result<()> {
    let server = conn.object_server();
    server.at(SESSION_PATH_PREFIX, SessionDirectory).await?;
    let standard = InterfaceName::from_static_str_unchecked("org.freedesktop.DBus.Introspectable");
    server.remove_named(SESSION_PATH_PREFIX, standard).await?;
    server.at(SESSION_PATH_PREFIX, Opaque).await?;
    Ok(())
}
