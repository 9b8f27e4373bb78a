//! Whose identity a request reaches the daemon with.
//!
//! The daemon tells clients apart by the uid of their bus connection (the bus reads it with
//! `SO_PEERCRED` when the connection is made): per-user session limits, `Memory()` privacy and
//! shared prompt caches all follow it. So that an HTTP caller on the Unix socket keeps its own
//! identity, the endpoint reads the caller's uid and gid (`SO_PEERCRED` of the HTTP connection)
//! and talks to the daemon over a bus connection *made as that user*:
//!
//! - a caller with the endpoint's own uid uses the endpoint's connection;
//! - for another uid, when the endpoint has CAP_SETUID and CAP_SETGID (it runs as root, or with
//!   those ambient capabilities), a dedicated OS thread takes the caller's uid, gid and groups
//!   with the raw `setresuid`/`setresgid`/`setgroups` system calls — which on Linux change only
//!   the calling thread, unlike glibc's wrappers that change every thread of the process —,
//!   connects the bus socket (so the bus sees the caller's credentials), switches back and ends.
//!   The connection then authenticates (EXTERNAL) as that uid. Connections are cached per uid
//!   (at most [`MAX_USERS`], least recently used dropped first);
//! - without those capabilities (or on a bus that is not a Unix socket), another uid is served
//!   under the endpoint's identity only with `--share-identity`, else refused with 403.
//!
//! TCP callers are anonymous: they all share the endpoint's identity.

use std::ffi::CString;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Mutex;

use leanstream::{Bus, Client};

use crate::error::ApiError;
use crate::listen::Peer;

/// How many other users' bus connections are kept open.
pub const MAX_USERS: usize = 64;

/// Linux capability numbers (linux/capability.h).
const CAP_SETGID: u32 = 6;
const CAP_SETUID: u32 = 7;

/// Where the bus's socket is, for connecting to it as another user.
#[derive(Clone, Debug)]
enum BusSocket {
    Path(PathBuf),
    Abstract(Vec<u8>),
}

/// Whether, and why not, the endpoint can connect to the bus as another user.
#[derive(Clone, Debug)]
enum Switching {
    Possible(BusSocket),
    /// Why it cannot (for the log and the 403).
    Impossible(String),
}

/// The daemon connections of the endpoint: its own, and one per other user it serves.
#[derive(Debug)]
pub struct Identities {
    own: Client,
    own_uid: u32,
    switching: Switching,
    share_identity: bool,
    /// Other users' clients, most recently used last.
    users: Mutex<Vec<(u32, Client)>>,
}

impl Identities {
    /// Connects to `bus` as the endpoint's own user and works out whether it can serve other
    /// users as themselves.
    pub async fn connect(bus: &Bus, share_identity: bool) -> leanstream::Result<Identities> {
        let own = Client::connect(bus).await?;
        Ok(Identities {
            own,
            own_uid: nix::unistd::geteuid().as_raw(),
            switching: switching(bus),
            share_identity,
            users: Mutex::new(Vec::new()),
        })
    }

    /// The endpoint's own client (for `/health`).
    pub fn own(&self) -> &Client {
        &self.own
    }

    /// A one-line account of the identity policy, for the start-up log.
    pub fn describe(&self) -> String {
        match (&self.switching, self.share_identity) {
            (Switching::Possible(_), _) => format!(
                "Unix-socket callers reach the daemon as their own uid (this endpoint is uid {})",
                self.own_uid
            ),
            (Switching::Impossible(why), true) => format!(
                "Unix-socket callers of other uids share this endpoint's identity (uid {}): {why}",
                self.own_uid
            ),
            (Switching::Impossible(why), false) => format!(
                "Unix-socket callers of other uids are refused (403): {why}; \
                 --share-identity serves them as uid {}",
                self.own_uid
            ),
        }
    }

    /// The client to serve `peer` with.
    pub async fn client_for(&self, peer: &Peer) -> Result<Client, ApiError> {
        let (uid, gid) = match *peer {
            Peer::Tcp(_) => return Ok(self.own.clone()),
            Peer::Unix { uid, .. } if uid == self.own_uid => return Ok(self.own.clone()),
            Peer::Unix { uid, gid } => (uid, gid),
        };
        let socket = match &self.switching {
            Switching::Possible(socket) => socket.clone(),
            Switching::Impossible(_) if self.share_identity => return Ok(self.own.clone()),
            Switching::Impossible(why) => {
                return Err(ApiError::identity(format!(
                    "this endpoint cannot reach the daemon as uid {uid} ({why}) and does not \
                     share its own identity (--share-identity)"
                )));
            }
        };
        if let Some(client) = self.cached(uid) {
            return Ok(client);
        }
        let client = connect_as(socket, uid, gid).await.map_err(|e| {
            tracing::warn!("connecting to the bus as uid {uid}: {e}");
            ApiError::unavailable(format!(
                "cannot connect to the daemon's bus as uid {uid}: {e}"
            ))
        })?;
        Ok(self.remember(uid, client))
    }

    fn cached(&self, uid: u32) -> Option<Client> {
        let mut users = self.users.lock().unwrap_or_else(|e| e.into_inner());
        let at = users.iter().position(|(u, _)| *u == uid)?;
        let entry = users.remove(at);
        let client = entry.1.clone();
        users.push(entry);
        Some(client)
    }

    /// Keeps `client` for `uid` (or the one a concurrent request stored first).
    fn remember(&self, uid: u32, client: Client) -> Client {
        let mut users = self.users.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, existing)) = users.iter().find(|(u, _)| *u == uid) {
            return existing.clone();
        }
        if users.len() >= MAX_USERS {
            // Requests still running hold clones: their connection lives until they end.
            users.remove(0);
        }
        users.push((uid, client.clone()));
        client
    }
}

/// Whether this process may connect as another user, and to which socket.
fn switching(bus: &Bus) -> Switching {
    if let Err(why) = has_setid_capabilities() {
        return Switching::Impossible(why);
    }
    let Some(address) = bus.resolved_address() else {
        return Switching::Impossible(format!("the {bus} bus has no valid address"));
    };
    let parsed = match address.parse::<zbus::Address>() {
        Ok(parsed) => parsed,
        Err(e) => return Switching::Impossible(format!("bus address {address:?}: {e}")),
    };
    use zbus::address::transport::{Transport, UnixSocket};
    match parsed.transport() {
        Transport::Unix(unix) => match unix.path() {
            UnixSocket::File(path) => Switching::Possible(BusSocket::Path(path.clone())),
            UnixSocket::Abstract(name) => {
                use std::os::unix::ffi::OsStrExt;
                Switching::Possible(BusSocket::Abstract(name.as_bytes().to_vec()))
            }
            other => Switching::Impossible(format!("bus socket {other} is not connectable")),
        },
        _ => Switching::Impossible(format!(
            "the bus address {address} is not a Unix socket, whose peer credentials carry the uid"
        )),
    }
}

/// Ok when the effective capabilities hold CAP_SETUID and CAP_SETGID (from /proc/self/status).
fn has_setid_capabilities() -> Result<(), String> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("cannot read /proc/self/status: {e}"))?;
    let effective = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .ok_or("no CapEff line in /proc/self/status")?;
    let has = |cap: u32| effective & (1 << cap) != 0;
    if has(CAP_SETUID) && has(CAP_SETGID) {
        Ok(())
    } else {
        Err("it lacks CAP_SETUID and CAP_SETGID".into())
    }
}

/// A bus connection of `uid`: the socket connected from a thread with the user's credentials,
/// then authenticated as that uid.
async fn connect_as(socket: BusSocket, uid: u32, gid: u32) -> Result<Client, String> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(format!("connect-as-{uid}"))
        .spawn(move || {
            let _ = tx.send(connect_socket_as(&socket, uid, gid));
        })
        .map_err(|e| format!("cannot start a thread: {e}"))?;
    let stream = rx
        .await
        .map_err(|_| "the connecting thread died".to_string())??;
    stream
        .set_nonblocking(true)
        .map_err(|e| format!("set_nonblocking: {e}"))?;
    let stream = tokio::net::UnixStream::from_std(stream).map_err(|e| e.to_string())?;
    let connection = zbus::connection::Builder::unix_stream(stream)
        .user_id(uid)
        .build()
        .await
        .map_err(|e| format!("D-Bus handshake: {e}"))?;
    Client::from_connection(connection)
        .await
        .map_err(|e| e.to_string())
}

/// The supplementary groups of `uid`'s user with primary group `gid` (only `gid` for a uid
/// without a passwd entry).
fn groups_of(uid: u32, gid: u32) -> Vec<libc::gid_t> {
    use nix::unistd::{Gid, Uid, User, getgrouplist};
    let user = User::from_uid(Uid::from_raw(uid)).ok().flatten();
    let groups = user
        .and_then(|u| CString::new(u.name).ok())
        .and_then(|name| getgrouplist(&name, Gid::from_raw(gid)).ok());
    match groups {
        Some(groups) => groups.into_iter().map(Gid::as_raw).collect(),
        None => vec![gid],
    }
}

/// The calling thread's credentials, as the raw system calls set them (`-1`: unchanged).
struct ThreadIds {
    uid: libc::c_long,
    gid: libc::c_long,
    groups: Vec<libc::gid_t>,
}

/// Sets the calling thread's effective uid and gid and its groups. Raw system calls: they change
/// this thread only (glibc's wrappers would change every thread of the process).
fn set_thread_ids(ids: &ThreadIds) -> std::io::Result<()> {
    let unchanged: libc::c_long = -1;
    // SAFETY: raw system calls with integer arguments and a pointer to `groups.len()` gids that
    // lives across the call; they touch only the calling thread's credentials. Groups and gid
    // go first, while the thread still has CAP_SETGID.
    let ok = unsafe {
        libc::syscall(
            libc::SYS_setgroups,
            ids.groups.len() as libc::c_long,
            ids.groups.as_ptr(),
        ) == 0
            && libc::syscall(libc::SYS_setresgid, unchanged, ids.gid, unchanged) == 0
            && libc::syscall(libc::SYS_setresuid, unchanged, ids.uid, unchanged) == 0
    };
    if ok {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Connects `socket` with the credentials of `uid`/`gid`, on the calling thread (a dedicated
/// thread that ends afterwards), and switches the thread back.
fn connect_socket_as(socket: &BusSocket, uid: u32, gid: u32) -> Result<UnixStream, String> {
    let original = ThreadIds {
        uid: nix::unistd::geteuid().as_raw().into(),
        gid: nix::unistd::getegid().as_raw().into(),
        groups: nix::unistd::getgroups()
            .map_err(|e| format!("getgroups: {e}"))?
            .into_iter()
            .map(nix::unistd::Gid::as_raw)
            .collect(),
    };
    let user = ThreadIds {
        uid: uid.into(),
        gid: gid.into(),
        groups: groups_of(uid, gid),
    };
    set_thread_ids(&user).map_err(|e| format!("cannot take uid {uid} on a thread: {e}"))?;
    let connected = match socket {
        BusSocket::Path(path) => UnixStream::connect(path),
        BusSocket::Abstract(name) => {
            use std::os::linux::net::SocketAddrExt;
            std::os::unix::net::SocketAddr::from_abstract_name(name)
                .and_then(|addr| UnixStream::connect_addr(&addr))
        }
    };
    // Back to the endpoint's own identity: the uid first (regaining the capabilities that a
    // switch away from root drops), then gid and groups. The thread ends right after, so even
    // a failed switch back leaves no other code running as the user.
    let restore = |ids: &ThreadIds| -> std::io::Result<()> {
        let unchanged: libc::c_long = -1;
        // SAFETY: as in `set_thread_ids`: the calling thread's credentials only.
        let ok = unsafe { libc::syscall(libc::SYS_setresuid, unchanged, ids.uid, unchanged) == 0 };
        if !ok {
            return Err(std::io::Error::last_os_error());
        }
        set_thread_ids(ids)
    };
    if let Err(e) = restore(&original) {
        tracing::warn!("switching the connecting thread back: {e}");
    }
    connected.map_err(|e| format!("connecting the bus socket as uid {uid}: {e}"))
}
