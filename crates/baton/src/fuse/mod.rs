//! The FUSE token file (issue 4): GNU make ≥ 4.4 and the jobserver crate
//! open `--jobserver-auth=fifo:PATH` by path, and a file we serve answers
//! each read ourselves, so a freed token wakes one poll()ing make instead
//! of all of them (seed 003: hundreds of sub-makes polling one pipe, 88%
//! system time).
//!
//! `baton serve` mounts the filesystem at `<socket's dir>/fuse` ([`mount`]);
//! `baton run` makes one file there per build ([`build_file`]).
//!
//! - `waiters`: who waits, reservations for notified pollers (pure).
//! - `procs`: thread → process, pidfds, pending-SIGKILL checks.
//! - `fs`: the fuser `Filesystem`.
//! - `control`: the thread acting on exits, timeouts and socket grants.

mod control;
mod fs;
mod procs;
mod waiters;

pub use waiters::Mode;

use crate::broker::{Broker, Transport};
use crate::{log, paths};
use anyhow::{bail, Context, Result};
use control::{Control, WAKER};
use fs::{Shared, TokenFs};
use fuser::{BackgroundSession, Config, MountOption, Session};
use mio::{Poll, Waker};
use nix::errno::Errno;
use nix::sys::statfs::{statfs, FUSE_SUPER_MAGIC};
use std::fs::OpenOptions;
use std::io::ErrorKind;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Where the broker serving `socket` mounts its token files.
pub fn mount_point(socket: &Path) -> PathBuf {
    paths::private_dir(socket).join("fuse")
}

/// The mounted token filesystem. Dropping it unmounts.
pub struct FuseMount {
    control: Option<Control>,
    session: Option<BackgroundSession>,
    path: PathBuf,
}

/// Mounts the token filesystem for the broker at `socket`. Where FUSE is
/// not available, says why in one log line and returns None: builds then
/// use the FIFO bridge.
pub fn mount(socket: &Path, broker: Arc<Mutex<Broker>>, mode: Mode) -> Option<FuseMount> {
    let path = mount_point(socket);
    match try_mount(&path, broker, mode) {
        Ok(mount) => {
            log::info(format_args!("FUSE token files at {}", path.display()));
            Some(mount)
        }
        Err(e) => {
            log::warn(format_args!("no FUSE token files ({e:#}); builds will use the FIFO bridge"));
            None
        }
    }
}

fn try_mount(path: &Path, broker: Arc<Mutex<Broker>>, mode: Mode) -> Result<FuseMount> {
    if !Path::new("/dev/fuse").exists() {
        bail!("/dev/fuse does not exist");
    }
    clear_stale_mount(path)?;
    std::fs::DirBuilder::new().mode(0o700).create(path).or_else(|e| if e.kind() == ErrorKind::AlreadyExists { Ok(()) } else { Err(e) })
        .with_context(|| format!("cannot create {}", path.display()))?;

    let poll = Poll::new().context("cannot create an event loop")?;
    let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
    let exits = procs::Exits::new(poll.registry().try_clone()?);
    let shared = Arc::new(Shared::new(broker.clone(), waiters::Waiters::new(mode), exits, waker.clone()));

    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName("baton".into()),
        MountOption::Subtype("baton".into()),
        MountOption::NoSuid,
        MountOption::NoDev,
        MountOption::NoExec,
    ];
    let session = Session::new(TokenFs(shared.clone()), path, &config)
        .and_then(Session::spawn)
        .with_context(|| format!("cannot mount at {}", path.display()))?;

    // Grants socket clients cause for FUSE waiters wake the control thread;
    // the FUSE threads deliver their own (see fs::delivering_here).
    let hook_waker = waker.clone();
    broker.lock().expect("broker lock").on_grants(Transport::Fuse, move || {
        if !fs::delivering_here() {
            let _ = hook_waker.wake();
        }
    });
    let control = Control::spawn(shared, poll, waker).context("cannot start the FUSE thread")?;
    Ok(FuseMount { control: Some(control), session: Some(session), path: path.to_path_buf() })
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        drop(self.control.take());
        // Lazily: builds may still hold the files open. Their next read
        // fails once we exit and the connection closes.
        detach(&self.path);
        drop(self.session.take());
    }
}

/// A broker killed without unmounting leaves a dead mount (ENOTCONN) at
/// its mount point; we hold the socket's lock, so no live broker uses it.
fn clear_stale_mount(path: &Path) -> Result<()> {
    let stale = match statfs(path) {
        Ok(fs) => fs.filesystem_type() == FUSE_SUPER_MAGIC,
        Err(Errno::ENOTCONN) => true,
        Err(_) => false,
    };
    if stale {
        log::info(format_args!("unmounting a stale FUSE mount at {}", path.display()));
        detach(path);
    }
    Ok(())
}

/// Unmounts lazily: umount2 as root, else the setuid fusermount3.
fn detach(path: &Path) {
    let Ok(cpath) = std::ffi::CString::new(path.as_os_str().as_bytes()) else { return };
    // SAFETY: umount2 reads a NUL-terminated path.
    if unsafe { libc::umount2(cpath.as_ptr(), libc::MNT_DETACH) } == 0 {
        return;
    }
    let _ = std::process::Command::new("fusermount3").arg("-uz").arg(path).stderr(std::process::Stdio::null()).status();
}

/// A build's token file; removed on drop.
#[derive(Debug)]
pub struct BuildFile {
    path: PathBuf,
}

impl BuildFile {
    /// What to put after `--jobserver-auth=fifo:`.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for BuildFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Makes a token file for one build in the FUSE mount of the broker at
/// `socket`, named after our pid and `label` so that `ls` and `baton
/// status` tell builds apart. None if that broker has no FUSE mount (the
/// caller then uses the FIFO bridge).
///
/// # Errors
/// The mount exists but the file cannot be created there.
pub fn build_file(socket: &Path, label: &str) -> Result<Option<BuildFile>> {
    let dir = mount_point(socket);
    if !statfs(&dir).is_ok_and(|fs| fs.filesystem_type() == FUSE_SUPER_MAGIC) {
        return Ok(None);
    }
    let path = dir.join(file_name(std::process::id(), label));
    let create = || OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path);
    // A file of the same name was left by a killed run with our pid.
    let created = create().or_else(|e| if e.kind() == ErrorKind::AlreadyExists { std::fs::remove_file(&path).and_then(|_| create()) } else { Err(e) });
    created.with_context(|| format!("cannot create the token file {}", path.display()))?;
    Ok(Some(BuildFile { path }))
}

/// `<pid>-<label>`, with the label reduced to characters safe in a path
/// and in MAKEFLAGS (which splits on spaces).
fn file_name(pid: u32, label: &str) -> String {
    let safe: String = label.chars().take(80).map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '_' }).collect();
    format!("{pid}-{safe}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn build_file_names_are_safe_in_makeflags() {
        assert_eq!(super::file_name(42, "baton run -- make -C a/b"), "42-baton_run_--_make_-C_a_b");
    }
}
