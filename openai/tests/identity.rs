//! Callers on the Unix socket keep their own identity at the daemon: two HTTP callers of
//! different uids are two clients to it (its per-user session limit tells them apart), and an
//! endpoint that cannot take their uid refuses them unless told to share its own.
//!
//! Needs root and two unprivileged users (`leanstream_e2e::unprivileged_users`); skips otherwise.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use common::*;
use serde_json::json;

/// Connects to the endpoint's socket as `user`, from a thread that takes the user's ids (the
/// raw system calls change only that thread) and ends.
async fn connect_as(path: &Path, user: &User) -> Result<tokio::net::UnixStream> {
    let (path, uid, gid) = (path.to_owned(), user.uid, user.gid);
    let stream = std::thread::spawn(move || -> std::io::Result<std::os::unix::net::UnixStream> {
        let unchanged = libc::c_long::from(-1i8);
        let no_groups: [libc::gid_t; 0] = [];
        // SAFETY: raw system calls with integer arguments (and an empty group list); they change
        // this thread's credentials only, and the thread ends after the connect.
        let ok = unsafe {
            libc::syscall(libc::SYS_setgroups, 0 as libc::c_long, no_groups.as_ptr()) == 0
                && libc::syscall(
                    libc::SYS_setresgid,
                    unchanged,
                    libc::c_long::from(gid),
                    unchanged,
                ) == 0
                && libc::syscall(
                    libc::SYS_setresuid,
                    unchanged,
                    libc::c_long::from(uid),
                    unchanged,
                ) == 0
        };
        if !ok {
            return Err(std::io::Error::last_os_error());
        }
        std::os::unix::net::UnixStream::connect(path)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the connecting thread panicked"))??;
    stream.set_nonblocking(true)?;
    Ok(tokio::net::UnixStream::from_std(stream)?)
}

/// The uid of the bus connection that owns each daemon session.
async fn session_owners(bus: &Bus) -> Result<Vec<u32>> {
    let conn = bus.connect().await?;
    let dbus = zbus::fdo::DBusProxy::new(&conn).await?;
    let mut uids = Vec::new();
    for s in daemon_sessions(bus).await? {
        let name = zbus::names::BusName::try_from(s.client.as_str())?;
        uids.push(dbus.get_connection_unix_user(name).await?);
    }
    Ok(uids)
}

fn users_or_skip() -> Option<[User; 2]> {
    match leanstream_e2e::unprivileged_users() {
        Ok(users) => Some(users),
        Err(why) => {
            eprintln!("skipped: {why}");
            None
        }
    }
}

#[test]
fn callers_of_different_uids_are_different_clients() -> Result<()> {
    let Some([a, b]) = users_or_skip() else {
        return Ok(());
    };
    let bus = Bus::start()?;
    let rt = runtime();
    let cfg = DaemonConfig {
        max_context: 2048,
        max_tokens: 1024,
        // One session per user: a second concurrent request of the same uid is Busy.
        extra: "max_sessions_per_client = 1".into(),
        ..DaemonConfig::default()
    };
    let _daemon = rt.block_on(Daemon::start(&bus, &cfg))?;
    let dir = tempfile::tempdir()?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711))?;
    let path = dir.path().join("openai.sock");
    let endpoint = Endpoint::start(&bus.address, &format!("unix:{}", path.display()), &[])?;
    // In production the socket's group admits callers; here every test user may connect.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))?;
    rt.block_on(async {
        let long = json!({"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
                          "max_tokens": 1000, "temperature": 0, "stream": true});
        let mut streaming = send_on(
            connect_as(&path, &a).await?,
            "POST",
            "/v1/completions",
            Some(&long),
        )
        .await?;
        assert_eq!(streaming.status, 200);
        let first = streaming.next_bytes().await?.context("no first chunk")?;
        assert!(!String::from_utf8_lossy(&first).contains("[DONE]"));
        // The daemon sees the session as user a's.
        assert_eq!(session_owners(&bus).await?, vec![a.uid]);

        // User a again, concurrently: its per-user limit refuses it (429 busy).
        let again = send_on(
            connect_as(&path, &a).await?,
            "POST",
            "/v1/chat/completions",
            Some(&chat_body("Hi", 4)),
        )
        .await?;
        let status = again.status;
        let body = again.json().await?;
        assert_eq!(status, 429, "{body}");
        assert_eq!(body["error"]["code"], "busy", "{body}");

        // User b, concurrently: a client of its own, served.
        let other = send_on(
            connect_as(&path, &b).await?,
            "POST",
            "/v1/chat/completions",
            Some(&chat_body("Hi", 4)),
        )
        .await?;
        let status = other.status;
        let body = other.json().await?;
        assert_eq!(status, 200, "{body}");

        // Root, the endpoint's own user: served too.
        let (status, body) = post(
            &endpoint.target,
            "/v1/chat/completions",
            &chat_body("Hi", 4),
        )
        .await?;
        assert_eq!(status, 200, "{body}");

        // The served requests' sessions close just after their replies: wait for that.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let owners = session_owners(&bus).await?;
            if owners == vec![a.uid] {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                bail!("only user a's generation should be running, found sessions of {owners:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        drop(streaming);
        no_sessions_within(&bus, Duration::from_secs(5)).await?;
        Ok(())
    })
}

#[test]
fn an_endpoint_without_setuid_refuses_other_uids_unless_sharing() -> Result<()> {
    let Some([user, _]) = users_or_skip() else {
        return Ok(());
    };
    let bus = Bus::start()?;
    let rt = runtime();
    let cfg = DaemonConfig {
        max_context: 2048,
        max_tokens: 1024,
        ..DaemonConfig::default()
    };
    let _daemon = rt.block_on(Daemon::start(&bus, &cfg))?;
    // The endpoint runs as `user` (no capabilities); this test, root, calls it.
    let dir = tempfile::tempdir()?;
    std::os::unix::fs::chown(dir.path(), Some(user.uid), Some(user.gid))?;
    let strict_path = dir.path().join("strict.sock");
    let shared_path = dir.path().join("shared.sock");
    let strict = Endpoint::start_as(
        &bus.address,
        &format!("unix:{}", strict_path.display()),
        &[],
        Some(&user),
    )?;
    let shared = Endpoint::start_as(
        &bus.address,
        &format!("unix:{}", shared_path.display()),
        &["--share-identity"],
        Some(&user),
    )?;
    rt.block_on(async {
        let (status, body) =
            post(&strict.target, "/v1/chat/completions", &chat_body("Hi", 4)).await?;
        assert_eq!(status, 403, "{body}");
        assert_eq!(body["error"]["type"], "permission_error", "{body}");
        assert_eq!(body["error"]["code"], "identity_unavailable", "{body}");
        let (status, _) = get(&strict.target, "/v1/models").await?;
        assert_eq!(status, 403);
        let (status, _) = get(&strict.target, "/health").await?;
        assert_eq!(status, 200, "health needs no identity");

        // Shared: served under the endpoint's identity, the daemon sees its user.
        let long = json!({"model": MODEL, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 1000,
                          "temperature": 0, "stream": true});
        let mut streaming = send(&shared.target, "POST", "/v1/completions", Some(&long)).await?;
        assert_eq!(streaming.status, 200);
        streaming.next_bytes().await?.context("no first chunk")?;
        let owners = session_owners(&bus).await?;
        drop(streaming);
        assert_eq!(owners, vec![user.uid]);
        let (status, body) =
            post(&shared.target, "/v1/chat/completions", &chat_body("Hi", 4)).await?;
        assert_eq!(status, 200, "{body}");
        no_sessions_within(&bus, Duration::from_secs(5)).await?;
        Ok(())
    })
}
