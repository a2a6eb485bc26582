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
//! - `keeper`: the process that keeps the mount alive if we are killed.

mod control;
mod fs;
mod keeper;
pub(crate) mod procs;
pub(crate) mod waiters;

pub use fs::FsState;
pub use waiters::Mode;

use crate::broker::{Broker, Transport};
use crate::log;
use anyhow::{bail, Context, Result};
use control::{Control, WAKER};
use fs::{FsShared, TokenFs};
use fuser::{BackgroundSession, Config, MountOption, Session, SessionACL};
use mio::{Poll, Waker};
use nix::errno::Errno;
use nix::sys::statfs::{statfs, FUSE_SUPER_MAGIC};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
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

/// The mounted token filesystem. Dropping it unmounts.
pub struct FuseMount {
    control: Option<Control>,
    session: Option<BackgroundSession>,
    path: PathBuf,
    shared: Arc<FsShared>,
    /// The session's /dev/fuse descriptor, for a successor.
    device: OwnedFd,
    /// Tells the FUSE thread, frozen for a handover, to go on.
    go_on: Option<Sender<bool>>,
    keeper: Option<keeper::Keeper>,
}

/// Mounts the token filesystem for the broker at `socket`. Where FUSE is
/// not available, says why in one log line and returns None: builds then
/// use the FIFO bridge.
pub fn mount(socket: &Path, broker: Arc<Mutex<Broker>>, options: Options) -> Option<FuseMount> {
    let path = baton_core::paths::fuse_mount_point(socket);
    if let Some(device) = keeper::take(socket) {
        return match adopt_orphan(socket, &path, broker, device, options) {
            Ok(mount) => Some(mount),
            Err(e) => {
                log::warn(format_args!("cannot serve the mount a killed broker left ({e:#}); builds will use the FIFO bridge"));
                None
            }
        };
    }
    match try_mount(socket, &path, broker, options) {
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
    broker: Arc<Mutex<Broker>>,
    options: Options,
) -> Result<FuseMount> {
    if !Path::new("/dev/fuse").exists() {
        bail!("/dev/fuse does not exist");
    }
    // A dead mount (a broker killed with its keeper) answers lstat with
    // ENOTCONN: a mount point, not a link; it is cleared first.
    if std::fs::symlink_metadata(path).is_err_and(|e| e.raw_os_error() == Some(libc::ENOTCONN)) {
        clear_stale_mount(path)?;
    }
    // Checked by lstat before anything else: a link planted here would
    // have us unmount, then mount over, whatever it points at.
    crate::paths::own_subdir(path)?;
    clear_stale_mount(path)?;
    let (poll, waker, shared) = new_shared(broker.clone(), options)?;
    let session = Session::new(TokenFs(shared.clone()), path, &config())
        .with_context(|| format!("cannot mount at {}", path.display()))?;
    start(
        session,
        socket.to_path_buf(),
        path,
        broker,
        (poll, waker, shared),
        options.orphan_grace,
    )
}

/// Serves the mount of a broker that was killed, whose keeper passed us
/// the descriptor: its state is lost, so files, handles and what each
/// process holds start afresh (docs/fuse.md, "When the broker dies").
fn adopt_orphan(
    socket: &Path,
    path: &Path,
    broker: Arc<Mutex<Broker>>,
    device: OwnedFd,
    options: Options,
) -> Result<FuseMount> {
    let (poll, waker, shared) = new_shared(broker.clone(), options)?;
    shared.take_orphan();
    let session =
        Session::from_initialized_fd(TokenFs(shared.clone()), device, SessionACL::Owner, config());
    log::info(format_args!(
        "FUSE token files at {}: serving the mount a killed broker left",
        path.display()
    ));
    start(
        session,
        socket.to_path_buf(),
        path,
        broker,
        (poll, waker, shared),
        options.orphan_grace,
    )
}

/// Serves the mount a predecessor broker handed over (crate::handover):
/// its /dev/fuse descriptor and its token files' state.
pub fn adopt(
    socket: &Path,
    broker: Arc<Mutex<Broker>>,
    device: OwnedFd,
    state: FsState,
    options: Options,
) -> Result<FuseMount> {
    let path = baton_core::paths::fuse_mount_point(socket);
    let (poll, waker, shared) = new_shared(broker.clone(), options)?;
    let session =
        Session::from_initialized_fd(TokenFs(shared.clone()), device, SessionACL::Owner, config());
    shared
        .adopt(state, &session.notifier())
        .map_err(|e| anyhow::anyhow!("the predecessor's token files are inconsistent: {e}"))?;
    log::info(format_args!(
        "FUSE token files at {} taken over",
        path.display()
    ));
    start(
        session,
        socket.to_path_buf(),
        &path,
        broker,
        (poll, waker, shared),
        options.orphan_grace,
    )
}

fn new_shared(
    broker: Arc<Mutex<Broker>>,
    options: Options,
) -> Result<(Poll, Arc<Waker>, Arc<FsShared>)> {
    let poll = Poll::new().context("cannot create an event loop")?;
    let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
    let exits = procs::Exits::new(poll.registry().try_clone()?);
    let shared = Arc::new(FsShared::new(
        broker,
        waiters::Waiters::new(options.mode, options.hold),
        exits,
        waker.clone(),
    ));
    Ok((poll, waker, shared))
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
    socket: PathBuf,
    path: &Path,
    broker: Arc<Mutex<Broker>>,
    (poll, waker, shared): (Poll, Arc<Waker>, Arc<FsShared>),
    orphan_grace: Duration,
) -> Result<FuseMount> {
    let device = session
        .as_fd()
        .try_clone_to_owned()
        .context("cannot duplicate the FUSE descriptor")?;
    let keeper = keeper::Keeper::spawn(&socket, device.as_raw_fd(), orphan_grace)
        .inspect_err(|e| log::warn(format_args!("no keeper for the FUSE mount ({e:#}): if this broker is killed, FUSE-style builds fail")))
        .ok();
    let session = session.spawn().context("cannot start the FUSE thread")?;

    // Grants socket clients cause for FUSE waiters wake the control thread;
    // the FUSE threads deliver their own (see fs::delivering_here).
    let hook_waker = waker.clone();
    broker
        .lock()
        .expect("broker lock")
        .on_grants(Transport::Fuse, move || {
            if !fs::delivering_here() {
                let _ = hook_waker.wake();
            }
        });
    let control =
        Control::spawn(shared.clone(), poll, waker).context("cannot start the FUSE thread")?;
    Ok(FuseMount {
        control: Some(control),
        session: Some(session),
        path: path.to_path_buf(),
        shared,
        device,
        go_on: None,
        keeper,
    })
}

impl FuseMount {
    /// Freezes the token files for a successor and returns their state;
    /// from now on every FUSE request waits in the kernel for whoever
    /// reads the session next (see `FsShared::ask_handover`).
    pub fn freeze(&mut self) -> Result<FsState> {
        let (state, go_on) = self.shared.ask_handover();
        self.go_on = Some(go_on);
        // A lookup of this name reaches the FUSE thread between two
        // requests; the kernel does not cache the ENOENT it gets.
        let _ = std::fs::metadata(self.path.join(fs::HANDOVER_NAME));
        state
            .recv_timeout(Duration::from_secs(30))
            .context("the FUSE thread did not hand over its state")
    }

    /// A handover failed: the FUSE thread goes on serving.
    pub fn thaw(&mut self) {
        if let Some(go_on) = self.go_on.take() {
            let _ = go_on.send(true);
        }
    }

    /// A successor holds the descriptor now: the keeper may go.
    pub fn dismiss_keeper(&mut self) {
        if let Some(keeper) = self.keeper.take() {
            keeper.dismiss();
        }
    }

    /// The session's /dev/fuse descriptor.
    pub fn device(&self) -> RawFd {
        self.device.as_raw_fd()
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        self.dismiss_keeper();
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
    let Ok(cpath) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return;
    };
    // SAFETY: umount2 reads a NUL-terminated path.
    if unsafe { libc::umount2(cpath.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) } == 0 {
        return;
    }
    let _ = std::process::Command::new("fusermount3")
        .arg("-uz")
        .arg(path)
        .stderr(std::process::Stdio::null())
        .status();
}
