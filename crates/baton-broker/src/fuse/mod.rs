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
//! - `fs`: the fuser `Filesystem`, served on the event loop, and `Files`,
//!   the state the loop owns for it.
//! - `control`: acting on exits and deadlines, on the event loop.
//! - `keeper`: the process that keeps the mount alive if we are killed.

mod control;
mod fs;
mod keeper;
pub(crate) mod procs;
pub(crate) mod waiters;

pub use fs::FsState;
pub use procs::exited_pid;
pub use waiters::Mode;

use crate::broker::Broker;
use crate::log;
use anyhow::{bail, Context, Result};
use control::Clock;
use fs::{Files, TokenFs};
use fuser::{CallerSession, Config, MountOption, Served, Session, SessionACL};
use mio::Registry;
use nix::errno::Errno;
use nix::sys::statfs::{statfs, FUSE_SUPER_MAGIC};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How the token files serve their waiters (`baton serve`'s options).
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// How a freed token reaches pollers.
    pub mode: Mode,
    /// How long a poll of a file marked `hold` is held at most; zero:
    /// never held (see `waiters`).
    pub hold: Duration,
    /// How long the keeper of a killed broker's mount waits for a new
    /// broker before it lets the mount go, so that builds blocked in it
    /// fail (ENOTCONN) instead of hanging for good (see `keeper`).
    pub orphan_grace: Duration,
}

/// [`Options::orphan_grace`] unless told.
pub const ORPHAN_GRACE: Duration = Duration::from_secs(10);

impl Default for Options {
    fn default() -> Self {
        Options {
            mode: Mode::OneAtATime,
            hold: waiters::HOLD,
            orphan_grace: ORPHAN_GRACE,
        }
    }
}

/// The mounted token filesystem and its [`Files`], owned by the event
/// loop, which serves its session ([`FuseMount::serve_ready`]). Dropping it
/// unmounts.
pub struct FuseMount {
    files: Files,
    clock: Clock,
    session: Option<CallerSession<TokenFs>>,
    path: PathBuf,
    /// The session's /dev/fuse descriptor, for a successor.
    device: OwnedFd,
    keeper: Option<keeper::Keeper>,
}

/// Mounts the token filesystem for the broker at `socket`. Where FUSE is
/// not available, says why in one log line and returns None: builds then
/// use the FIFO bridge.
pub fn mount(socket: &Path, registry: &Registry, options: Options) -> Option<FuseMount> {
    let path = baton_core::paths::fuse_mount_point(socket);
    if let Some(device) = keeper::take(socket) {
        return match adopt_orphan(socket, &path, registry, device, options) {
            Ok(mount) => Some(mount),
            Err(e) => {
                log::warn(format_args!("cannot serve the mount a killed broker left ({e:#}); builds will use the FIFO bridge"));
                None
            }
        };
    }
    match try_mount(socket, &path, registry, options) {
        Ok(mount) => {
            log::info(format_args!("FUSE token files at {}", path.display()));
            Some(mount)
        }
        Err(e) => {
            log::warn(format_args!(
                "no FUSE token files ({e:#}); builds will use the FIFO bridge"
            ));
            None
        }
    }
}

fn try_mount(
    socket: &Path,
    path: &Path,
    registry: &Registry,
    options: Options,
) -> Result<FuseMount> {
    if !Path::new("/dev/fuse").exists() {
        bail!("/dev/fuse does not exist");
    }
    // A mount whose server died answers ENOTCONN to everything, even
    // lstat: unmount it before checking the directory.
    if std::fs::symlink_metadata(path).is_err_and(|e| e.raw_os_error() == Some(libc::ENOTCONN)) {
        clear_stale_mount(path)?;
    }
    crate::paths::own_subdir(path)?;
    clear_stale_mount(path)?;
    let files = new_files(registry, options)?;
    let session = Session::new(TokenFs, path, &config())
        .with_context(|| format!("cannot mount at {}", path.display()))?;
    start(session, files, socket, path, options.orphan_grace)
}

/// Serves the mount a killed broker left, whose descriptor its keeper
/// passed us (see `keeper`).
fn adopt_orphan(
    socket: &Path,
    path: &Path,
    registry: &Registry,
    device: OwnedFd,
    options: Options,
) -> Result<FuseMount> {
    let mut files = new_files(registry, options)?;
    files.take_orphan();
    let session = Session::from_initialized_fd(TokenFs, device, SessionACL::Owner, config());
    log::info(format_args!(
        "FUSE token files at {}: serving the mount a killed broker left",
        path.display()
    ));
    start(session, files, socket, path, options.orphan_grace)
}

/// Takes over the mount a predecessor broker handed us (crate::handover):
/// its /dev/fuse descriptor and its token files, as they stand.
pub fn adopt(
    socket: &Path,
    broker: &Broker,
    registry: &Registry,
    device: OwnedFd,
    state: FsState,
    options: Options,
) -> Result<FuseMount> {
    let path = baton_core::paths::fuse_mount_point(socket);
    let mut files = new_files(registry, options)?;
    let session = Session::from_initialized_fd(TokenFs, device, SessionACL::Owner, config());
    // Checked before anything starts: inconsistent files leave no keeper
    // and no unmount behind.
    files
        .adopt(state, broker, &session.notifier())
        .map_err(|e| anyhow::anyhow!("the predecessor's token files are inconsistent: {e}"))?;
    log::info(format_args!(
        "FUSE token files at {} taken over",
        path.display()
    ));
    start(session, files, socket, &path, options.orphan_grace)
}

/// New token files, whose pidfds go into the loop's poll (`registry`).
fn new_files(registry: &Registry, options: Options) -> Result<Files> {
    let exits = procs::Exits::new(registry.try_clone()?);
    Ok(Files::new(
        waiters::Waiters::new(options.mode, options.hold),
        exits,
    ))
}

fn config() -> Config {
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName("baton".into()),
        MountOption::Subtype("baton".into()),
        MountOption::NoSuid,
        MountOption::NoDev,
        MountOption::NoExec,
    ];
    config
}

fn start(
    session: Session<TokenFs>,
    files: Files,
    socket: &Path,
    path: &Path,
    orphan_grace: Duration,
) -> Result<FuseMount> {
    let device = session
        .as_fd()
        .try_clone_to_owned()
        .context("cannot duplicate the FUSE descriptor")?;
    let keeper = keeper::Keeper::spawn(socket, device.as_raw_fd(), orphan_grace)
        .inspect_err(|e| log::warn(format_args!("no keeper for the FUSE mount ({e:#}): if this broker is killed, FUSE-style builds fail")))
        .ok();
    let session = session
        .into_caller_session()
        .context("cannot serve the FUSE device from the event loop")?;
    let clock = Clock::new().context("cannot create the token files' timer")?;
    Ok(FuseMount {
        files,
        clock,
        session: Some(session),
        path: path.to_path_buf(),
        device,
        keeper,
    })
}

impl FuseMount {
    /// Serves every request the kernel has waiting, on the calling thread
    /// (the event loop's), with the files and `broker` lent to them.
    /// False once the session has ended (the mount is gone).
    pub fn serve_ready(&mut self, broker: &mut Broker) -> bool {
        let Some(session) = self.session.as_mut() else {
            return false;
        };
        match fs::lend(&mut self.files, broker, || session.serve_ready()) {
            Ok(Served::AllWaiting) => true,
            Ok(Served::Ended) => {
                log::warn(format_args!(
                    "the FUSE token files at {} were unmounted: builds using them fail",
                    self.path.display()
                ));
                self.session = None;
                false
            }
            Err(e) => {
                log::warn(format_args!(
                    "the FUSE session failed ({e}): the token files serve no more"
                ));
                self.session = None;
                false
            }
        }
    }

    /// The descriptor the event loop watches for requests.
    pub fn source(&self) -> Option<RawFd> {
        self.session.as_ref().map(|s| s.as_fd().as_raw_fd())
    }

    /// The descriptor the event loop watches for the files' deadlines.
    pub fn clock(&self) -> RawFd {
        self.clock.fd()
    }

    /// Acts on what the files watch (see `control`): the processes in
    /// `exited`, and the deadlines if `clock_fired`.
    pub fn act(&mut self, broker: &mut Broker, exited: &[u32], clock_fired: bool) {
        if clock_fired {
            self.clock.fired();
        }
        control::act(&mut self.files, broker, exited);
    }

    /// Arms the clock for the files' next deadline; after any round that
    /// touched them.
    pub fn plan(&mut self) {
        self.clock.plan(&self.files);
    }

    /// Delivers the grants filed for the files' readers and pollers.
    pub fn settle(&mut self, broker: &mut Broker) {
        self.files.settle(broker);
    }

    /// The files' state for a successor (see `Files::hand_over`).
    pub fn hand_over(&mut self, broker: &mut Broker) -> FsState {
        self.files.hand_over(broker)
    }

    pub fn dismiss_keeper(&mut self) {
        if let Some(keeper) = self.keeper.take() {
            keeper.dismiss();
        }
    }

    pub fn device(&self) -> RawFd {
        self.device.as_raw_fd()
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        self.dismiss_keeper();
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
        log::info(format_args!(
            "unmounting a stale FUSE mount at {}",
            path.display()
        ));
        detach(path);
    }
    Ok(())
}

/// Unmounts lazily: umount2 as root, else the setuid fusermount3.
fn detach(path: &Path) {
    if crate::sys::detach_mount(path) {
        return;
    }
    let _ = std::process::Command::new("fusermount3")
        .arg("-uz")
        .arg(path)
        .stderr(std::process::Stdio::null())
        .status();
}
