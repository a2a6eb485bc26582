//! The broker's side of its files: the private directory around the
//! socket, the lock that keeps two brokers from serving one path, and the
//! stale socket a killed broker leaves. Where the files are is decided in
//! `baton_core::paths`.

use anyhow::{bail, Context, Result};
use nix::fcntl::{Flock, FlockArg};
use std::fs::{self, File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

/// Makes sure the socket's directory exists and only we can use it. A
/// directory we create is made 0700. One that exists must belong to us; we
/// tighten it to 0700 only if it is one of our default directories, since
/// `--socket` may point into a directory the user wants left as it is.
pub fn prepare_private_dir(dir: &Path, is_default: bool) -> Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("cannot create the directory {}", dir.display()))?;
    let meta = fs::metadata(dir).with_context(|| format!("cannot read {}", dir.display()))?;
    let uid = nix::unistd::getuid().as_raw();
    if meta.uid() != uid {
        bail!(
            "{} belongs to uid {}, not to you (uid {uid}): refusing to put the broker's socket there",
            dir.display(),
            meta.uid()
        );
    }
    if is_default && meta.mode() & 0o077 != 0 {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .with_context(|| format!("cannot make {} private (chmod 0700)", dir.display()))?;
    }
    Ok(())
}

/// An exclusive lock on `<socket>.lock`, held for the broker's lifetime so
/// that two brokers starting at once cannot both decide the socket is stale.
pub struct ServeLock {
    _lock: Flock<File>,
}

pub fn lock_socket(socket: &Path) -> Result<ServeLock> {
    let lock_path = lock_path(socket);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&lock_path)
        .with_context(|| format!("cannot open the lock file {}", lock_path.display()))?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(ServeLock { _lock: lock }),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
            bail!(
                "a broker is already running at {} (see it with: baton status --socket {})",
                socket.display(),
                socket.display()
            )
        }
        Err((_, e)) => Err(e).with_context(|| format!("cannot lock {}", lock_path.display())),
    }
}

/// The lock, waiting for the broker that holds it to let go: a successor
/// (`--replace`) takes it as its predecessor exits.
pub fn lock_socket_when_free(socket: &Path) -> Result<ServeLock> {
    let lock_path = lock_path(socket);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&lock_path)
        .with_context(|| format!("cannot open the lock file {}", lock_path.display()))?;
    let lock = Flock::lock(file, FlockArg::LockExclusive)
        .map_err(|(_, e)| e)
        .with_context(|| format!("cannot lock {}", lock_path.display()))?;
    Ok(ServeLock { _lock: lock })
}

fn lock_path(socket: &Path) -> PathBuf {
    let mut name = socket.file_name().unwrap_or_default().to_os_string();
    name.push(".lock");
    socket.with_file_name(name)
}

/// Clears the way for binding `socket`: refuses if a live broker answers
/// there or the path is something other than a socket; removes a stale
/// socket nobody answers on. True if there was one: a broker died here
/// without cleaning up, and its builds may still run (see
/// [`crate::Broker::start_reclaim`]).
pub fn clear_stale_socket(socket: &Path) -> Result<bool> {
    let meta = match fs::symlink_metadata(socket) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("cannot inspect {}", socket.display())),
    };
    if !meta.file_type().is_socket() {
        bail!(
            "{} exists and is not a socket: refusing to replace it (choose another --socket)",
            socket.display()
        );
    }
    match UnixStream::connect(socket) {
        Ok(_) => bail!(
            "a broker is already running at {} (see it with: baton status --socket {})",
            socket.display(),
            socket.display()
        ),
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
            fs::remove_file(socket)
                .with_context(|| format!("cannot remove the stale socket {}", socket.display()))?;
            Ok(true)
        }
        Err(e) => Err(e).with_context(|| {
            format!(
                "cannot tell whether a broker answers at {}",
                socket.display()
            )
        }),
    }
}
