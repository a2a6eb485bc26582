//! The FUSE token file (docs/fuse.md): GNU make ≥ 4.4 and the jobserver
//! crate open `--jobserver-auth=fifo:PATH` by path, and a file we serve
//! answers each read ourselves, so a freed token wakes one poll()ing make
//! instead of all of them (FreeBSD's `make universe`, with hundreds of
//! sub-makes polling one token pipe, spent 88% of its time in the kernel:
//! docs/benchmarks.md).
//!
//! `baton serve` mounts the filesystem at `<socket's dir>/fuse` ([`mount`]);
//! `baton run` makes one file there per build (in baton-jobserver).
//!
//! - `waiters`: who waits, reservations for notified pollers (pure).
//! - `procs`: thread → process, pidfds, pending-SIGKILL checks.
//! - `fs`: the fuser `Filesystem`.
//! - `control`: the thread acting on exits, timeouts and socket grants.

mod control;
mod fs;
pub(crate) mod procs;
pub(crate) mod waiters;

pub use waiters::Mode;

use crate::broker::{Broker, Transport};
use crate::log;
use anyhow::{bail, Context, Result};
use control::{Control, WAKER};
use fs::{Shared, TokenFs};
use fuser::{BackgroundSession, Config, MountOption, Session};
use mio::{Poll, Waker};
use nix::errno::Errno;
use nix::sys::statfs::{statfs, FUSE_SUPER_MAGIC};
use std::io::ErrorKind;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

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
    let path = baton_core::paths::fuse_mount_point(socket);
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

