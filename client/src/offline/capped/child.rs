//! One child of the capped bench: a command run in its own memory cgroup, cold, with a time
//! limit, and what it reported.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::{MemoryCgroup, Outcome, drop_caches};

/// What one child reported.
pub(crate) struct ChildRun {
    pub outcome: Outcome,
    pub stdout: String,
    pub stderr: String,
    pub read_bytes: u64,
    pub peak: Option<u64>,
}

/// Runs `cmd` in a fresh cgroup capped at `cap` bytes, cold, with a time limit.
pub(crate) fn run_capped(
    cmd: &mut Command,
    cap: u64,
    timeout: Duration,
) -> anyhow::Result<ChildRun> {
    drop_caches()?;
    let name = format!("leanstream-bench-{}", std::process::id());
    let cg = MemoryCgroup::create(&name, cap)?;
    cg.enter_on_spawn(cmd);
    let out_path = std::env::temp_dir().join(format!("{name}.out"));
    let err_path = std::env::temp_dir().join(format!("{name}.err"));
    let child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path)?)
        .stderr(std::fs::File::create(&err_path)?)
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))?;
    let pid = child.id() as libc::pid_t;
    let start = Instant::now();
    let (status, usage, timed_out) = loop {
        let mut status = 0;
        // SAFETY: an all-zero rusage is a valid value for wait4 to overwrite.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `pid` is our child; status and usage point to valid locals.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid {
            break (status, usage, false);
        }
        if r < 0 {
            bail!("waiting for {cmd:?}: {}", std::io::Error::last_os_error());
        }
        if start.elapsed() > timeout {
            // SAFETY: kill(2) on our own child, which has not been reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            // SAFETY: as above; blocks until the killed child is reaped.
            unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
            break (status, usage, true);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    let _ = std::fs::remove_file(&out_path);
    let _ = std::fs::remove_file(&err_path);
    let killed = libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL;
    let outcome = if timed_out {
        Outcome::Timeout
    } else if killed || cg.oom_kills() > 0 {
        Outcome::Killed
    } else if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
        Outcome::Completed
    } else {
        Outcome::Failed
    };
    Ok(ChildRun {
        outcome,
        stdout,
        stderr,
        // ru_inblock counts 512-byte blocks read from storage (page faults and O_DIRECT).
        read_bytes: usage.ru_inblock as u64 * 512,
        peak: cg.peak_bytes(),
    })
}
