//! End-to-end harness: a private `dbus-daemon` (session-bus style config, unix socket in a temp
//! dir), the real `leanstreamd` binary with a temp config, the real model, and clients through
//! the proxies of `leanstream::contract`.
//!
//! The daemon binary: the end-to-end tests (`daemon/tests/e2e`, integration tests of the daemon
//! package) pass the one cargo built for them ([`Daemon::start_binary`]). Elsewhere (the
//! `concurrency` example), [`Daemon::start`] takes `$LEANSTREAMD_BIN` if set, else builds it once
//! per process with `cargo build --profile test --workspace --bins` (the test profile is
//! optimised; an unoptimised forward pass would take minutes) and takes it from the target
//! directory next to the running executable. [`binary_under_test`] lets a test file run against
//! another build (`$LEANSTREAMD_BIN`), e.g. the one before a fix.
//!
//! Other users: the private bus admits every user and its socket's directory is searchable, so
//! a test running as root can connect as another, unprivileged user ([`Bus::connect_as`],
//! [`Client::new_as`], [`unprivileged_users`]): the daemon tells clients apart by uid.

use std::io::{BufRead, BufReader};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use leanstream::contract::{
    GenerateParams, LeanStreamError, ManagerProxy, SessionProxy, StreamEvent,
};

/// The fixture prompt and its 16 greedy ids (exact precision), from an independent numpy
/// reference implementation.
pub const STORY_PROMPT: &str = "Once upon a time, there was a little";
pub const STORY_GREEDY: [u32; 16] = [
    8180, 3365, 20391, 617, 5732, 288, 1238, 281, 260, 2388, 30, 2306, 736, 1129, 685, 288,
];
/// The model's name in the daemon (the file stem).
pub const MODEL: &str = "smollm2";

/// How long one end-to-end test may run. A test that hangs (a deadlock, a stream that never
/// ends) fails with this limit in its message instead of running into CI's overall time limit.
pub const TEST_LIMIT: Duration = Duration::from_secs(600);

/// How long a token stream may take to end ([`read_stream`], [`read_stream_timed`]): far more
/// than the slowest generation the tests ask for.
pub const STREAM_LIMIT: Duration = Duration::from_secs(300);

/// The async runtime every end-to-end test drives its clients on.
pub fn runtime() -> TestRuntime {
    #[allow(clippy::expect_used)]
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    TestRuntime(Some(rt))
}

/// A tokio runtime whose [`TestRuntime::block_on`] gives up after [`TEST_LIMIT`].
#[derive(Debug)]
pub struct TestRuntime(Option<tokio::runtime::Runtime>);

impl TestRuntime {
    /// Runs a test body to completion, or fails once it has run for [`TEST_LIMIT`].
    pub fn block_on<T>(&self, test: impl Future<Output = Result<T>>) -> Result<T> {
        self.block_on_within(TEST_LIMIT, test)
    }

    /// Runs a test body to completion, or fails once it has run for `limit` (for a test whose
    /// length is set from outside, like the soak).
    pub fn block_on_within<T>(
        &self,
        limit: Duration,
        test: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        let Some(rt) = &self.0 else {
            bail!("the test runtime is shut down");
        };
        rt.block_on(async {
            match tokio::time::timeout(limit, test).await {
                Ok(result) => result,
                Err(_) => bail!("the test did not finish within {limit:?}: it hangs"),
            }
        })
    }
}

impl Drop for TestRuntime {
    /// A hung test may leave a blocking read behind; do not wait for it forever.
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_timeout(Duration::from_secs(10));
        }
    }
}

/// The real test model; fails loudly when missing (CI runs `scripts/fetch-model` first).
pub fn real_model() -> PathBuf {
    leanstream_engine::testing::real_model()
}

/// The real model converted to `.lsm` with f16 down columns: with sparsity off the streamed FFN
/// then computes the GGUF's own greedy ids, which the tests compare against
/// ([`leanstream_engine::testing::real_lsm`]).
pub fn real_lsm() -> PathBuf {
    leanstream_engine::testing::real_lsm(leanstream_engine::quant::DType::F16)
}

/// The `leanstreamd` binary (see the module docs).
pub fn daemon_binary() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("LEANSTREAMD_BIN") {
            return PathBuf::from(p);
        }
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "--profile", "test", "--workspace", "--bins"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status();
        assert!(
            matches!(status, Ok(s) if s.success()),
            "building leanstreamd failed: {status:?}"
        );
        let bin = built("leanstreamd");
        assert!(bin.is_file(), "no leanstreamd at {}", bin.display());
        bin
    })
    .clone()
}

/// Where cargo put binary `name` of this build: `<target>/<profile>/deps/<test exe>` →
/// `<target>/<profile>/<name>`.
fn built(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    exe.parent()
        .and_then(Path::parent)
        .map(|d| d.join(name))
        .unwrap_or_default()
}

/// The `leanstream` CLI: `$LEANSTREAM_BIN` when set, else the one built beside the daemon (the
/// build in [`daemon_binary`] builds every binary of the workspace).
pub fn cli_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("LEANSTREAM_BIN") {
        return PathBuf::from(p);
    }
    let daemon = daemon_binary();
    let cli = built("leanstream");
    assert!(
        cli.is_file(),
        "no leanstream CLI at {} (daemon at {}); set LEANSTREAM_BIN",
        cli.display(),
        daemon.display()
    );
    cli
}

/// The daemon binary a test runs: `$LEANSTREAMD_BIN` when set, else `built` (the one cargo built
/// for the test). The override runs the tests against another build, e.g. the one before a fix,
/// to show that they fail there.
pub fn binary_under_test(built: &Path) -> PathBuf {
    std::env::var_os("LEANSTREAMD_BIN").map_or_else(|| built.to_path_buf(), PathBuf::from)
}

/// A user of this machine other than root, for tests that need clients of different users.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

/// Two different users other than root from `/etc/passwd` (`nobody` first, then by uid), for
/// tests that need clients of two unprivileged users (the daemon treats root as an admin);
/// `Err(why not)` when this process is not root (it cannot connect as someone else) or there
/// are not two such users. The bus admits only users it can look up, so they must exist.
pub fn unprivileged_users() -> Result<[User; 2], String> {
    // SAFETY: `geteuid` has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not running as root, so it cannot connect as other users".into());
    }
    let passwd = std::fs::read_to_string("/etc/passwd")
        .map_err(|e| format!("cannot read /etc/passwd: {e}"))?;
    let mut users: Vec<User> = passwd
        .lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            let (uid, gid) = (f.get(2)?.parse().ok()?, f.get(3)?.parse().ok()?);
            (uid != 0).then(|| User {
                name: f[0].to_string(),
                uid,
                gid,
            })
        })
        .collect();
    users.sort_by_key(|u| (u.name != "nobody", u.uid));
    users.dedup_by_key(|u| u.uid);
    match users.as_slice() {
        [a, b, ..] => Ok([a.clone(), b.clone()]),
        _ => Err("/etc/passwd has fewer than two users other than root".into()),
    }
}

/// Connects a Unix socket to `socket` as `user`: the calling thread takes the user's uid and
/// gid for the `connect`, which is where the peer's credentials (`SO_PEERCRED`) come from. The
/// thread keeps them: call this on a thread of its own that ends afterwards.
fn connect_socket_as(socket: &Path, user: &User) -> Result<std::os::unix::net::UnixStream> {
    let unchanged = libc::c_long::from(-1i8);
    // SAFETY: raw system calls with integer arguments. Unlike libc's `setresgid`/`setresuid`,
    // which change every thread of the process, the system calls change only the calling
    // thread's credentials (Linux keeps them per thread); the caller's thread ends after the
    // connect, so no other code runs as the user. The gid goes first, while still root.
    let switched = unsafe {
        libc::syscall(
            libc::SYS_setresgid,
            unchanged,
            libc::c_long::from(user.gid),
            unchanged,
        ) == 0
            && libc::syscall(
                libc::SYS_setresuid,
                unchanged,
                libc::c_long::from(user.uid),
                unchanged,
            ) == 0
    };
    if !switched {
        bail!(
            "cannot take uid {} on a thread: {}",
            user.uid,
            std::io::Error::last_os_error()
        );
    }
    std::os::unix::net::UnixStream::connect(socket)
        .with_context(|| format!("connecting to {} as {}", socket.display(), user.name))
}

/// A private bus: `dbus-daemon` with a session-style config on a socket in a temp dir.
#[derive(Debug)]
pub struct Bus {
    child: Child,
    pub address: String,
    /// The bus's socket.
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Bus {
    pub fn start() -> Result<Bus> {
        let dir = tempfile::tempdir()?;
        // Other users reach the socket through the directory (search only: they list nothing).
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o711),
        )?;
        let conf = dir.path().join("bus.conf");
        std::fs::write(
            &conf,
            format!(
                r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={}/bus</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <!-- Every user may connect (a session bus admits only its own): tests connect as others. -->
    <allow user="*"/>
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
  <!-- The largest message the bus passes on: the daemon holds one incoming message in memory
       before it can refuse it, so this bounds that part of its fixed overhead. -->
  <limit name="max_message_size">1048576</limit>
</busconfig>
"#,
                dir.path().display()
            ),
        )?;
        let mut child = Command::new("dbus-daemon")
            .arg(format!("--config-file={}", conf.display()))
            .args(["--nofork", "--print-address"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting dbus-daemon")?;
        let stdout = child.stdout.take().context("dbus-daemon stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let address = line.trim().to_string();
        if address.is_empty() {
            bail!("dbus-daemon printed no address");
        }
        Ok(Bus {
            child,
            address,
            socket: dir.path().join("bus"),
            _dir: dir,
        })
    }

    /// A new client connection (its own unique name).
    pub async fn connect(&self) -> Result<zbus::Connection> {
        Ok(zbus::connection::Builder::address(self.address.as_str())?
            .build()
            .await?)
    }

    /// A new client connection of `user` (see [`unprivileged_users`]): the bus, and the
    /// daemon asking it, see that user's uid. This process must be root.
    pub async fn connect_as(&self, user: &User) -> Result<zbus::Connection> {
        let (socket, who) = (self.socket.clone(), user.clone());
        let stream = std::thread::spawn(move || connect_socket_as(&socket, &who))
            .join()
            .map_err(|_| anyhow::anyhow!("the thread connecting as {} panicked", user.name))??;
        stream.set_nonblocking(true)?;
        let stream = tokio::net::UnixStream::from_std(stream)?;
        Ok(zbus::connection::Builder::unix_stream(stream)
            .user_id(user.uid)
            .build()
            .await?)
    }
}

impl Drop for Bus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Daemon settings a test may change.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    pub budget: String,
    pub max_sessions: usize,
    pub max_context: usize,
    pub max_tokens: usize,
    pub max_prompt_bytes: usize,
    /// A `.lsm` file to serve as the model (`smollm2.lsm`, which wins over the `.gguf`).
    pub lsm: Option<PathBuf>,
    /// More TOML appended to the config file, e.g. a `[models.smollm2]` table.
    pub extra: String,
    /// `[engine] precision`: `exact` (the default) or `fast`.
    pub precision: &'static str,
    /// The daemon's stderr (its log) goes to a file, read with [`Daemon::log`], instead of the
    /// test's stderr. Default false.
    pub capture_log: bool,
    /// `[engine] keep_alive`: 0 by default here, so that a model unloads at its last close and
    /// the tests of the budget see its memory come back (the daemon's own default is 300 s).
    pub keep_alive: i64,
    /// More environment for the daemon (e.g. systemd's `NOTIFY_SOCKET`).
    pub env: Vec<(String, String)>,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            budget: "512MiB".into(),
            max_sessions: 16,
            max_context: 256,
            max_tokens: 64,
            max_prompt_bytes: 4096,
            lsm: None,
            extra: String::new(),
            precision: "exact",
            capture_log: false,
            keep_alive: 0,
            env: Vec::new(),
        }
    }
}

/// The file in the daemon's directory its stderr goes to with [`DaemonConfig::capture_log`].
const LOG_FILE: &str = "leanstreamd.log";

/// A running `leanstreamd` on a [`Bus`], with a model directory holding the real model as
/// `smollm2.gguf` (a hard link, or a copy across file systems) and, outside it, a file an escape symlink points at.
#[derive(Debug)]
pub struct Daemon {
    pub child: Child,
    pub dir: tempfile::TempDir,
}

impl Daemon {
    /// Starts [`daemon_binary`] on `bus` with `cfg`, once it serves the contract.
    pub async fn start(bus: &Bus, cfg: &DaemonConfig) -> Result<Daemon> {
        Self::start_binary(&daemon_binary(), bus, cfg).await
    }

    /// Starts the `leanstreamd` at `binary` on `bus` with `cfg`, once it serves the contract.
    /// The daemon's own integration tests pass `CARGO_BIN_EXE_leanstreamd`: cargo builds that
    /// binary with the tests, from the same dependency builds.
    pub async fn start_binary(binary: &Path, bus: &Bus, cfg: &DaemonConfig) -> Result<Daemon> {
        let dir = tempfile::tempdir()?;
        let models = dir.path().join("models");
        std::fs::create_dir(&models)?;
        // A real file: a symlink resolving outside the directory is refused by design.
        let target = models.join(format!("{MODEL}.gguf"));
        let source = real_model().canonicalize()?;
        if std::fs::hard_link(&source, &target).is_err() {
            std::fs::copy(&source, &target)?;
        }
        if let Some(lsm) = &cfg.lsm {
            let target = models.join(format!("{MODEL}.lsm"));
            if std::fs::hard_link(lsm, &target).is_err() {
                std::fs::copy(lsm, &target)?;
            }
        }
        std::fs::write(dir.path().join("outside.gguf"), b"not a model")?;
        std::os::unix::fs::symlink(dir.path().join("outside.gguf"), models.join("escape.gguf"))?;
        let conf = dir.path().join("leanstreamd.toml");
        // The tests' clients are mostly one user (root), and per-client limits count a user's
        // connections together: unless a test sets its own, a user may have every session.
        let per_user = if cfg.extra.contains("max_sessions_per_client") {
            String::new()
        } else {
            format!("max_sessions_per_client = {}\n", cfg.max_sessions)
        };
        std::fs::write(
            &conf,
            format!(
                "[models]\ndir = \"{}\"\n[memory]\nbudget = \"{}\"\n[engine]\nprecision = \"{}\"\n\
                 keep_alive = {}\n[limits]\nmax_sessions = {}\nmax_context = {}\nmax_tokens = {}\nmax_prompt_bytes = {}\n{}{}\n",
                models.display(),
                cfg.budget,
                cfg.precision,
                cfg.keep_alive,
                cfg.max_sessions,
                cfg.max_context,
                cfg.max_tokens,
                cfg.max_prompt_bytes,
                per_user,
                cfg.extra
            ),
        )?;
        let stderr = if cfg.capture_log {
            Stdio::from(std::fs::File::create(dir.path().join(LOG_FILE))?)
        } else {
            Stdio::inherit()
        };
        let child = Command::new(binary)
            .arg("--bus")
            .arg(&bus.address)
            .arg("--config")
            .arg(&conf)
            .env("RUST_LOG", "info")
            .envs(cfg.env.iter().cloned())
            .env_remove("JOURNAL_STREAM")
            .stdin(Stdio::null())
            .stderr(stderr)
            .spawn()
            .context("starting leanstreamd")?;
        let daemon = Daemon { child, dir };
        // Wait until the name is on the bus.
        let conn = bus.connect().await?;
        let dbus = zbus::fdo::DBusProxy::new(&conn).await?;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let name = leanstream::contract::BUS_NAME.try_into()?;
            if dbus.name_has_owner(name).await? {
                return Ok(daemon);
            }
            if Instant::now() > deadline {
                bail!("leanstreamd did not take its bus name within 20 s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) -> Result<()> {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()?;
        if !status.success() {
            bail!("kill -TERM failed");
        }
        Ok(())
    }

    /// Links the real model into the model directory as `NAME.gguf` (a hard link, or a copy
    /// across file systems): another model as far as the daemon knows.
    pub fn add_model(&self, name: &str) -> Result<()> {
        let target = self.dir.path().join("models").join(format!("{name}.gguf"));
        let source = real_model().canonicalize()?;
        if std::fs::hard_link(&source, &target).is_err() {
            std::fs::copy(&source, &target)?;
        }
        Ok(())
    }

    /// What the daemon has logged so far, when started with [`DaemonConfig::capture_log`].
    pub fn log(&self) -> Result<String> {
        let path = self.dir.path().join(LOG_FILE);
        std::fs::read_to_string(&path)
            .with_context(|| format!("{} (is `capture_log` set?)", path.display()))
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The daemon's resident set size (`VmRSS` of `/proc/<pid>/status`), in bytes.
    pub fn rss_bytes(&self) -> Result<u64> {
        rss_bytes_of(self.pid())
    }

    /// Waits for the process to exit (at most `timeout`).
    pub fn wait(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.try_wait()? {
                return Ok(s);
            }
            if Instant::now() > deadline {
                bail!("leanstreamd did not exit within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// The resident set size of process `pid` (`VmRSS` of `/proc/<pid>/status`), in bytes.
pub fn rss_bytes_of(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .context("no VmRSS line")?
        .trim()
        .parse::<u64>()?;
    Ok(kib * 1024)
}

/// The memory report once every unloaded model's memory has been handed back: the ledger
/// keeps a model being dropped (mode `unloading`) until it is really gone, a few milliseconds
/// after the unload. Waits at most 10 s.
pub async fn settled_memory(client: &Client) -> Result<leanstream::contract::MemoryReport> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let report = client.manager.memory().await?;
        if !report.models.iter().any(|m| m.mode == "unloading") {
            return Ok(report);
        }
        if Instant::now() > deadline {
            bail!("a model is still unloading after 10 s: {:?}", report.models);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A client: its own connection, the manager proxy.
pub struct Client {
    pub conn: zbus::Connection,
    pub manager: ManagerProxy<'static>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("name", &self.conn.unique_name())
            .finish()
    }
}

impl Client {
    pub async fn new(bus: &Bus) -> Result<Client> {
        let conn = bus.connect().await?;
        let manager = ManagerProxy::new(&conn).await?;
        Ok(Client { conn, manager })
    }

    /// A client of `user` ([`Bus::connect_as`]).
    pub async fn new_as(bus: &Bus, user: &User) -> Result<Client> {
        let conn = bus.connect_as(user).await?;
        let manager = ManagerProxy::new(&conn).await?;
        Ok(Client { conn, manager })
    }

    /// Opens a session and returns its proxy.
    pub async fn open(&self, context: u32) -> Result<SessionProxy<'static>, LeanStreamError> {
        let path = self
            .manager
            .open_session(MODEL, context)
            .await
            .map_err(LeanStreamError::from)?;
        session_proxy(&self.conn, path).await
    }
}

/// A session proxy for `path` on `conn`.
pub async fn session_proxy(
    conn: &zbus::Connection,
    path: zbus::zvariant::OwnedObjectPath,
) -> Result<SessionProxy<'static>, LeanStreamError> {
    Ok(SessionProxy::builder(conn).path(path)?.build().await?)
}

/// Greedy settings for `n` tokens.
pub fn greedy(n: u32) -> GenerateParams {
    GenerateParams {
        max_tokens: n,
        ..GenerateParams::default()
    }
}

/// The events of a finished stream, read on a blocking thread.
#[derive(Debug, Default)]
pub struct Stream {
    pub ids: Vec<u32>,
    pub text: String,
    /// The text of each token event, in order.
    pub tokens: Vec<String>,
    /// The sentence marks (with the `sentences` option), in order.
    pub sentences: Vec<String>,
    /// The last event (`done` or `error`), if any.
    pub end: Option<StreamEvent>,
}

/// Reads a token stream to EOF (at most [`STREAM_LIMIT`]).
pub async fn read_stream(fd: zbus::zvariant::OwnedFd) -> Result<Stream> {
    Ok(read_stream_timed(fd).await?.0)
}

/// Reads a token stream to EOF line by line, noting when each token event arrived (for
/// latency measurements: time to first token, decode rate). Fails when the stream has not
/// ended within [`STREAM_LIMIT`].
pub async fn read_stream_timed(fd: zbus::zvariant::OwnedFd) -> Result<(Stream, Vec<Instant>)> {
    let fd: OwnedFd = fd.into();
    let read = tokio::task::spawn_blocking(move || {
        let mut reader = BufReader::new(std::fs::File::from(fd));
        let mut text = String::new();
        let mut arrivals = Vec::new();
        let mut line = String::new();
        while reader.read_line(&mut line)? > 0 {
            let now = Instant::now();
            if let Ok(StreamEvent::Token { .. }) = serde_json::from_str(line.trim_end()) {
                arrivals.push(now);
            }
            text.push_str(&line);
            line.clear();
        }
        let stream = parse_stream(&text)?;
        Ok((stream, arrivals))
    });
    match tokio::time::timeout(STREAM_LIMIT, read).await {
        Ok(joined) => joined?,
        Err(_) => bail!("the token stream did not end within {STREAM_LIMIT:?}"),
    }
}

/// Parses the JSON lines of a stream.
pub fn parse_stream(text: &str) -> Result<Stream> {
    let mut s = Stream::default();
    for line in text.lines() {
        let event: StreamEvent =
            serde_json::from_str(line).with_context(|| format!("bad stream line {line:?}"))?;
        match event {
            StreamEvent::Token { id, text } => {
                if s.end.is_some() {
                    bail!("a token after the end of the stream");
                }
                s.ids.push(id);
                s.text.push_str(&text);
                s.tokens.push(text);
            }
            StreamEvent::Sentence { text } => {
                if s.end.is_some() {
                    bail!("a sentence after the end of the stream");
                }
                s.sentences.push(text);
            }
            end => {
                if s.end.is_some() {
                    bail!("two end events");
                }
                s.end = Some(end)
            }
        }
    }
    Ok(s)
}

/// Greedy generation of `n` tokens from `prompt` on a fresh session of `client`.
pub async fn generate_once(client: &Client, prompt: &str, n: u32) -> Result<Stream> {
    let session = client.open(128).await?;
    let fd = session.generate(prompt, &greedy(n)).await?;
    let out = read_stream(fd).await?;
    session.close().await?;
    Ok(out)
}

/// The error name of a failed call (`ModelNotFound`, …), or a description of a success.
pub fn error_name<T: std::fmt::Debug>(r: Result<T, zbus::Error>) -> String {
    match r.map_err(LeanStreamError::from) {
        Ok(v) => format!("ok: {v:?}"),
        Err(LeanStreamError::ModelNotFound(_)) => "ModelNotFound".into(),
        Err(LeanStreamError::InvalidArgument(_)) => "InvalidArgument".into(),
        Err(LeanStreamError::OverBudget(_)) => "OverBudget".into(),
        Err(LeanStreamError::Busy(_)) => "Busy".into(),
        Err(LeanStreamError::AccessDenied(_)) => "AccessDenied".into(),
        Err(LeanStreamError::InvalidModel(_)) => "InvalidModel".into(),
        Err(LeanStreamError::Cancelled(_)) => "Cancelled".into(),
        Err(LeanStreamError::Internal(m)) => format!("Internal: {m}"),
        Err(LeanStreamError::ZBus(e)) => format!("ZBus: {e}"),
    }
}
