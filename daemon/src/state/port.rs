//! What the state owner needs from D-Bus, as a narrow port: who a caller is (and whether it is
//! still on the bus), and serving or withdrawing a session's object. [`BusPort`] is the real
//! one; the state owner's unit tests drive it through a fake, without a bus. Requests and
//! replies travel on channels (`crate::request`), not through the port.

use std::future::Future;

use leanstream::contract::{LeanStreamError, SESSION_PATH_PREFIX};
use zbus::zvariant::OwnedObjectPath;

use crate::arbiter::SessionId;
use crate::service::{SessionObject, Shared};
use crate::typed::Typed;

/// A client (unique bus name) as the bus reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caller {
    /// Its uid.
    pub user: u32,
    /// Root, the daemon's user or the admin group ([`crate::access`]): sees every client in
    /// `Memory()` and may unload what others hold.
    pub admin: bool,
}

/// The state owner's view of the bus.
pub trait Port: Send + Sync + 'static {
    /// Who `client` is. Refused with `AccessDenied` once the name has left the bus: the bus
    /// announces a departure after the name is gone, so a request answered by this call is
    /// either refused or followed by the client's departure.
    fn caller(&self, client: &str) -> impl Future<Output = Result<Caller, LeanStreamError>> + Send;

    /// Serves session `id`'s object and returns its path.
    fn serve_session(
        &self,
        id: SessionId,
    ) -> impl Future<Output = Result<OwnedObjectPath, LeanStreamError>> + Send;

    /// Stops serving session `id`'s object (nothing when it is not served).
    fn withdraw_session(&self, id: SessionId) -> impl Future<Output = ()> + Send;
}

/// The object path of session `id`.
pub fn path_of(id: SessionId) -> OwnedObjectPath {
    // SESSION_PATH_PREFIX is a valid path and `/<digits>` keeps it valid.
    #[allow(clippy::expect_used)]
    OwnedObjectPath::try_from(format!("{SESSION_PATH_PREFIX}/{id}"))
        .expect("broken invariant: a session path is always valid")
}

/// The port on a real bus connection.
pub struct BusPort {
    conn: zbus::Connection,
    /// The bus driver, to ask who a client is; `None` when its proxy could not be built.
    driver: Option<zbus::fdo::DBusProxy<'static>>,
    /// What each session object it serves gets.
    objects: Shared,
}

impl BusPort {
    pub async fn new(conn: zbus::Connection, objects: Shared) -> BusPort {
        let driver = match zbus::fdo::DBusProxy::new(&conn).await {
            Ok(p) => Some(p),
            Err(e) => {
                tracing::error!("no bus driver proxy, clients cannot be checked: {e}");
                None
            }
        };
        BusPort {
            conn,
            driver,
            objects,
        }
    }
}

impl Port for BusPort {
    async fn caller(&self, client: &str) -> Result<Caller, LeanStreamError> {
        let gone = || LeanStreamError::AccessDenied(format!("client {client} has left the bus"));
        let name = zbus::names::BusName::try_from(client).map_err(|_| gone())?;
        let Some(driver) = &self.driver else {
            return Err(LeanStreamError::Internal(
                "the bus driver cannot be asked who the caller is".into(),
            ));
        };
        // Fails once the name has no owner: the same answer as a departed client.
        let user = (driver.get_connection_unix_user(name).await).map_err(|_| gone())?;
        let admin_group = self.objects.params.admin_group.clone();
        // User and group lookups may go through NSS (files, LDAP): off the async workers.
        let admin = tokio::task::spawn_blocking(move || {
            crate::access::privileged(user, admin_group.as_deref())
        })
        .await
        .unwrap_or(false);
        Ok(Caller { user, admin })
    }

    async fn serve_session(&self, id: SessionId) -> Result<OwnedObjectPath, LeanStreamError> {
        let object = Typed::new(SessionObject::new(id, self.objects.clone()));
        let path = path_of(id);
        match self.conn.object_server().at(path.clone(), object).await {
            Ok(_) => Ok(path),
            Err(e) => Err(LeanStreamError::Internal(e.to_string())),
        }
    }

    async fn withdraw_session(&self, id: SessionId) {
        let server = self.conn.object_server();
        if let Err(e) = server.remove::<Typed<SessionObject>, _>(path_of(id)).await {
            tracing::warn!("removing session object {id}: {e}");
        }
    }
}
