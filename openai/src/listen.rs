//! The listening socket: a loopback TCP port, a Unix socket the endpoint creates (mode 0660,
//! replacing a stale socket file), or the socket systemd passes by socket activation. Each
//! accepted connection carries its [`Peer`]: the TCP address, or the uid and gid of the Unix
//! peer (`SO_PEERCRED`), which [`crate::identity`] maps to a daemon connection.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use axum::extract::connect_info::Connected;
use axum::serve::{IncomingStream, Listener};
use nix::sys::socket::{AddressFamily, SockType, SockaddrLike, SockaddrStorage, getsockname};
use nix::sys::socket::{getsockopt, sockopt};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

use crate::cli::{Listen, check_loopback};

/// Mode of the Unix socket the endpoint creates: its user and group may connect.
pub const SOCKET_MODE: u32 = 0o660;

/// The first fd systemd passes (`SD_LISTEN_FDS_START`).
const LISTEN_FDS_START: RawFd = 3;

/// Who is on the other end of an HTTP connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    /// A TCP client on loopback: anonymous, served under the endpoint's own identity.
    Tcp(SocketAddr),
    /// A Unix-socket client with its credentials at `connect` (`SO_PEERCRED`).
    Unix { uid: u32, gid: u32 },
}

/// A bound listening socket, not yet registered with the async runtime (binding happens before
/// the runtime starts, so that the umask change for the Unix socket affects no other thread).
#[derive(Debug)]
pub enum Bound {
    Tcp(std::net::TcpListener),
    /// The listener and, when the endpoint created the socket file, its path (removed at exit).
    Unix(std::os::unix::net::UnixListener, Option<PathBuf>),
}

impl Bound {
    /// What to print: `127.0.0.1:PORT` (the real port when 0 was asked) or `unix:PATH`.
    pub fn describe(&self) -> String {
        match self {
            Bound::Tcp(l) => l
                .local_addr()
                .map_or_else(|e| format!("tcp (unknown address: {e})"), |a| a.to_string()),
            Bound::Unix(l, path) => match (path, l.local_addr()) {
                (Some(p), _) => format!("unix:{}", p.display()),
                (None, Ok(a)) => a.as_pathname().map_or_else(
                    || "unix:(unnamed)".into(),
                    |p| format!("unix:{}", p.display()),
                ),
                (None, Err(e)) => format!("unix (unknown address: {e})"),
            },
        }
    }

    /// The socket file the endpoint created, to remove at exit (not one systemd owns).
    pub fn created_file(&self) -> Option<PathBuf> {
        match self {
            Bound::Unix(_, path) => path.clone(),
            Bound::Tcp(_) => None,
        }
    }
}

/// Listening failures, each naming what to fix.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("{0}")]
    NotLoopback(String),
    #[error("cannot listen on {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    #[error("{0} is in use by a running server")]
    InUse(PathBuf),
    #[error("socket activation: {0}")]
    Activation(String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> ListenError {
    let what = what.into();
    move |source| ListenError::Io { what, source }
}

/// Binds `listen`, unless systemd passed a socket (then that one, checked the same way).
pub fn bind(listen: &Listen) -> Result<Bound, ListenError> {
    if let Some(fd) = activated_socket()? {
        return adopt(fd);
    }
    match listen {
        Listen::Tcp(addr) => {
            check_loopback(addr.ip()).map_err(ListenError::NotLoopback)?;
            std::net::TcpListener::bind(addr)
                .map(Bound::Tcp)
                .map_err(io_err(addr.to_string()))
        }
        Listen::Unix(path) => bind_unix(path),
    }
}

/// Creates the Unix socket at `path` with mode 0660, replacing a stale socket file (one nobody
/// accepts on); a live one or a file that is not a socket is an error.
fn bind_unix(path: &Path) -> Result<Bound, ListenError> {
    let shown = path.display().to_string();
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(ListenError::InUse(path.to_path_buf()));
            }
            std::fs::remove_file(path).map_err(io_err(format!("removing stale {shown}")))?;
        }
        Ok(_) => return Err(ListenError::NotASocket(path.to_path_buf())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(shown)(e)),
    }
    // The socket file is created with mode 0777 & !umask: bind under a umask that leaves only
    // the owner, so that nobody else can connect before the chmod below.
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let bound = std::os::unix::net::UnixListener::bind(path);
    nix::sys::stat::umask(old);
    let listener = bound.map_err(io_err(shown.clone()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(SOCKET_MODE))
        .map_err(io_err(format!("chmod {shown}")))?;
    Ok(Bound::Unix(listener, Some(path.to_path_buf())))
}

/// The listening socket systemd passed (`LISTEN_PID` is this process, `LISTEN_FDS` = 1), if any.
///
/// Implemented here rather than with a crate: it is a dozen lines of the documented protocol
/// (sd_listen_fds(3)), and the checks that matter (a listening stream socket, loopback for TCP)
/// are ours either way.
fn activated_socket() -> Result<Option<OwnedFd>, ListenError> {
    let (Ok(pid), Ok(fds)) = (std::env::var("LISTEN_PID"), std::env::var("LISTEN_FDS")) else {
        return Ok(None);
    };
    if pid.parse::<u32>().ok() != Some(std::process::id()) {
        return Ok(None);
    }
    match fds.parse::<u32>() {
        Ok(0) => return Ok(None),
        Ok(1) => {}
        _ => {
            return Err(ListenError::Activation(format!(
                "LISTEN_FDS={fds}: expected one socket (one ListenStream= in the .socket unit)"
            )));
        }
    }
    // SAFETY: `fcntl(F_GETFD)` only reads the flags of fd 3; it fails with EBADF if it is closed.
    if unsafe { libc::fcntl(LISTEN_FDS_START, libc::F_GETFD) } < 0 {
        return Err(ListenError::Activation(format!(
            "LISTEN_FDS=1 but fd 3 is not open: {}",
            io::Error::last_os_error()
        )));
    }
    // SAFETY: fd 3 is open (checked above) and systemd handed it to this process (LISTEN_PID);
    // nothing else in the process uses it, and this runs once, at start, so it gets one owner.
    let fd = unsafe { OwnedFd::from_raw_fd(LISTEN_FDS_START) };
    // Not inherited by anything this process might start.
    nix::fcntl::fcntl(
        &fd,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    )
    .map_err(|e| ListenError::Activation(format!("fd 3: {e}")))?;
    Ok(Some(fd))
}

/// Takes a socket passed by systemd: a listening stream socket, Unix or loopback TCP.
fn adopt(fd: OwnedFd) -> Result<Bound, ListenError> {
    let bad = |what: &str| ListenError::Activation(format!("fd 3 is {what}"));
    let stream = getsockopt(&fd, sockopt::SockType).map_err(|_| bad("not a socket"))?;
    if stream != SockType::Stream {
        return Err(bad("not a stream socket (use ListenStream=)"));
    }
    if !getsockopt(&fd, sockopt::AcceptConn).unwrap_or(false) {
        return Err(bad("not listening"));
    }
    let addr: SockaddrStorage =
        getsockname(fd.as_raw_fd()).map_err(|e| bad(&format!("without an address ({e})")))?;
    match addr.family() {
        Some(AddressFamily::Unix) => {
            let listener = std::os::unix::net::UnixListener::from(fd);
            Ok(Bound::Unix(listener, None))
        }
        Some(AddressFamily::Inet | AddressFamily::Inet6) => {
            let listener = std::net::TcpListener::from(fd);
            let local = listener
                .local_addr()
                .map_err(io_err("the activated TCP socket"))?;
            check_loopback(local.ip()).map_err(ListenError::NotLoopback)?;
            Ok(Bound::Tcp(listener))
        }
        other => Err(bad(&format!("of an unsupported family {other:?}"))),
    }
}

/// A TCP listener whose connections carry a [`Peer::Tcp`].
#[derive(Debug)]
pub struct TcpPeers(pub TcpListener);

/// A Unix listener whose connections carry the peer's credentials; a connection whose
/// credentials cannot be read is dropped.
#[derive(Debug)]
pub struct UnixPeers(pub UnixListener);

/// Waits a little after a failed `accept` (out of fds: let connections close) before retrying.
async fn accept_failed(e: io::Error) {
    tracing::warn!("accept failed: {e}");
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
}

impl Listener for TcpPeers {
    type Io = TcpStream;
    type Addr = Peer;

    async fn accept(&mut self) -> (TcpStream, Peer) {
        loop {
            match self.0.accept().await {
                Ok((stream, addr)) => {
                    // Token chunks are small writes that should leave at once.
                    let _ = stream.set_nodelay(true);
                    return (stream, Peer::Tcp(addr));
                }
                Err(e) => accept_failed(e).await,
            }
        }
    }

    fn local_addr(&self) -> io::Result<Peer> {
        self.0.local_addr().map(Peer::Tcp)
    }
}

impl Listener for UnixPeers {
    type Io = UnixStream;
    type Addr = Peer;

    async fn accept(&mut self) -> (UnixStream, Peer) {
        loop {
            match self.0.accept().await {
                Ok((stream, _)) => match stream.peer_cred() {
                    Ok(cred) => {
                        let peer = Peer::Unix {
                            uid: cred.uid(),
                            gid: cred.gid(),
                        };
                        return (stream, peer);
                    }
                    Err(e) => tracing::warn!("dropping a connection without credentials: {e}"),
                },
                Err(e) => accept_failed(e).await,
            }
        }
    }

    fn local_addr(&self) -> io::Result<Peer> {
        Ok(Peer::Unix {
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
        })
    }
}

impl Connected<IncomingStream<'_, TcpPeers>> for Peer {
    fn connect_info(stream: IncomingStream<'_, TcpPeers>) -> Peer {
        *stream.remote_addr()
    }
}

impl Connected<IncomingStream<'_, UnixPeers>> for Peer {
    fn connect_info(stream: IncomingStream<'_, UnixPeers>) -> Peer {
        *stream.remote_addr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_socket_gets_mode_0660_and_replaces_a_stale_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("api.sock");
        let first = bind_unix(&path).expect("bind");
        let mode = std::fs::metadata(&path)
            .expect("socket")
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o660);
        // Live: refused.
        assert!(matches!(bind_unix(&path), Err(ListenError::InUse(_))));
        // Stale (nobody accepts any more): replaced.
        drop(first);
        let second = bind_unix(&path).expect("rebind over the stale socket");
        assert_eq!(second.created_file().as_deref(), Some(path.as_path()));
        drop(second);
        std::fs::remove_file(&path).expect("remove");
        // Not a socket: left alone.
        std::fs::write(&path, b"data").expect("write");
        assert!(matches!(bind_unix(&path), Err(ListenError::NotASocket(_))));
        assert_eq!(std::fs::read(&path).expect("still there"), b"data");
    }

    #[test]
    fn non_loopback_tcp_is_refused_at_bind() {
        let listen = Listen::Tcp("0.0.0.0:0".parse().expect("addr"));
        assert!(matches!(bind(&listen), Err(ListenError::NotLoopback(_))));
    }
}
