//! A memory cgroup for one benchmark row: the whole child process — heap, file pages it brings
//! in, page tables — is charged to it, and the kernel reclaims or kills inside the cap, as on a
//! board where the service gets a fixed slice of memory.
//!
//! Both hierarchies exist in the wild: cgroup v2 (`memory.max`, `memory.peak`,
//! `memory.events`), what current boards and distributions run, and v1's memory controller
//! (`memory.limit_in_bytes`, `memory.max_usage_in_bytes`, `memory.oom_control`), what older
//! images and some VMs (our development machines) still mount. v2 is used where its memory
//! controller can be enabled; otherwise v1; otherwise the error says what was tried.

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// Which hierarchy a cgroup lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

/// A memory cgroup of its own, removed when dropped (after its processes exited).
#[derive(Debug)]
pub struct MemoryCgroup {
    dir: PathBuf,
    version: Version,
}

/// Where the memory controller is mounted: (v2 mount, v1 memory mount), from mountinfo.
fn mounts(mountinfo: &str) -> (Option<PathBuf>, Option<PathBuf>) {
    let (mut v2, mut v1) = (None, None);
    for line in mountinfo.lines() {
        // "... mount_point options - fstype source super_options"
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let point = left.split_whitespace().nth(4);
        let mut right = right.split_whitespace();
        let fstype = right.next();
        let supers = right.nth(1).unwrap_or("");
        match (fstype, point) {
            (Some("cgroup2"), Some(p)) if v2.is_none() => v2 = Some(PathBuf::from(p)),
            (Some("cgroup"), Some(p)) if supers.split(',').any(|o| o == "memory") => {
                v1 = Some(PathBuf::from(p))
            }
            _ => {}
        }
    }
    (v2, v1)
}

fn write(path: &Path, value: &str) -> anyhow::Result<()> {
    fs::write(path, value).with_context(|| format!("writing `{value}` to {}", path.display()))
}

fn read_u64(path: &Path) -> Option<u64> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

impl MemoryCgroup {
    /// Creates cgroup `name` capped at `limit` bytes (swap off where the controller has it).
    pub fn create(name: &str, limit: u64) -> anyhow::Result<MemoryCgroup> {
        let info = fs::read_to_string("/proc/self/mountinfo").context("reading mountinfo")?;
        let (v2, v1) = mounts(&info);
        let mut tried = Vec::new();
        if let Some(root) = v2 {
            match Self::create_v2(&root, name, limit) {
                Ok(cg) => return Ok(cg),
                Err(e) => tried.push(format!("cgroup v2 at {}: {e:#}", root.display())),
            }
        } else {
            tried.push("no cgroup v2 mount".into());
        }
        if let Some(root) = v1 {
            match Self::create_v1(&root, name, limit) {
                Ok(cg) => return Ok(cg),
                Err(e) => tried.push(format!("cgroup v1 memory at {}: {e:#}", root.display())),
            }
        } else {
            tried.push("no cgroup v1 memory controller mounted".into());
        }
        bail!(
            "cannot create a memory cgroup (needs root, or a delegated cgroup): {}",
            tried.join("; ")
        )
    }

    fn create_v2(root: &Path, name: &str, limit: u64) -> anyhow::Result<MemoryCgroup> {
        let controllers = fs::read_to_string(root.join("cgroup.controllers"))?;
        if !controllers.split_whitespace().any(|c| c == "memory") {
            bail!("the memory controller is not available");
        }
        let subtree = fs::read_to_string(root.join("cgroup.subtree_control"))?;
        if !subtree.split_whitespace().any(|c| c == "memory") {
            write(&root.join("cgroup.subtree_control"), "+memory")?;
        }
        let dir = root.join(name);
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let cg = MemoryCgroup {
            dir,
            version: Version::V2,
        };
        write(&cg.dir.join("memory.max"), &limit.to_string())?;
        if cg.dir.join("memory.swap.max").exists() {
            write(&cg.dir.join("memory.swap.max"), "0")?;
        }
        Ok(cg)
    }

    fn create_v1(root: &Path, name: &str, limit: u64) -> anyhow::Result<MemoryCgroup> {
        let dir = root.join(name);
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let cg = MemoryCgroup {
            dir,
            version: Version::V1,
        };
        write(&cg.dir.join("memory.limit_in_bytes"), &limit.to_string())?;
        // memsw (memory + swap) may only be set at or above the memory limit.
        let memsw = cg.dir.join("memory.memsw.limit_in_bytes");
        if memsw.exists() {
            write(&memsw, &limit.to_string())?;
        }
        Ok(cg)
    }

    /// Makes `cmd`'s process join this cgroup before it executes, so that everything it ever
    /// allocates is charged here.
    pub fn enter_on_spawn(&self, cmd: &mut Command) {
        let procs = self.dir.join("cgroup.procs");
        // SAFETY: the closure runs in the forked child before exec; it only opens and writes a
        // file (async-signal-safe system calls behind std's File), allocating nothing shared with
        // the parent's threads beyond what was captured.
        unsafe {
            cmd.pre_exec(move || fs::write(&procs, "0"));
        }
    }

    /// The most memory charged to the cgroup at once (`None` where the kernel does not say:
    /// v2 before Linux 5.19).
    pub fn peak_bytes(&self) -> Option<u64> {
        match self.version {
            Version::V2 => read_u64(&self.dir.join("memory.peak")),
            Version::V1 => read_u64(&self.dir.join("memory.max_usage_in_bytes")),
        }
    }

    /// Processes the kernel's OOM killer killed in this cgroup.
    pub fn oom_kills(&self) -> u64 {
        let file = match self.version {
            Version::V2 => "memory.events",
            Version::V1 => "memory.oom_control",
        };
        fs::read_to_string(self.dir.join(file))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("oom_kill "))
                    .and_then(|n| n.trim().parse().ok())
            })
            .unwrap_or(0)
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let _ = fs::remove_dir(&self.dir);
    }
}

/// Drops the page cache (all of it, after a sync), so that a row starts cold. Needs root; the
/// error says so.
pub fn drop_caches() -> anyhow::Result<()> {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    write(Path::new("/proc/sys/vm/drop_caches"), "3")
        .context("dropping the page cache needs root (/proc/sys/vm/drop_caches)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_both_hierarchies_in_mountinfo() {
        let info = "\
35 24 0:30 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
36 24 0:31 / /sys/fs/cgroup/cpu rw,nosuid - cgroup cgroup rw,cpu,cpuacct
37 24 0:32 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
";
        let (v2, v1) = mounts(info);
        assert_eq!(v2, Some(PathBuf::from("/sys/fs/cgroup/unified")));
        assert_eq!(v1, Some(PathBuf::from("/sys/fs/cgroup/memory")));
    }

    #[test]
    fn a_v2_only_system_has_no_v1_memory() {
        let info = "30 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert_eq!(mounts(info), (Some(PathBuf::from("/sys/fs/cgroup")), None));
    }
}
