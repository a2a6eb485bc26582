//! The broker's side of its files: the private directory around the
//! socket, the lock that keeps two brokers from serving one path, and the
//! stale socket a killed broker leaves. Where the files are is decided in
//! `baton_core::paths`.

use anyhow::{bail, Context, Result};
use nix::fcntl::{Flock, FlockArg};
use std::fs::{self, File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

/// Makes sure the socket's directory exists and only we can use it, without
/// following a symbolic link anyone planted: the last component is made
/// with mkdir (0700), and whatever was there already is judged by lstat.
/// It must be a directory of ours; baton's own directories (`is_default`)
/// and any we just made must also be closed to group and world. Nothing
/// is ever chmod'ed: a directory of ours left open is refused with the
/// command that closes it. A `--socket` in a world-writable directory is
/// refused unless that directory is sticky (as /tmp is), where each name
/// belongs to whoever made it; then a warning says why a private
/// directory is better (docs/security.md).
pub fn prepare_private_dir(dir: &Path, is_default: bool) -> Result<()> {
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)
            .with_context(|| format!("cannot create the directory {}", parent.display()))?;
    }
    let created = match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => true,
        Err(e) if e.kind() == ErrorKind::AlreadyExists => false,
        Err(e) => {
            return Err(e).with_context(|| format!("cannot create the directory {}", dir.display()))
        }
    };
    let meta =
        fs::symlink_metadata(dir).with_context(|| format!("cannot read {}", dir.display()))?;
    let uid = nix::unistd::getuid().as_raw();
    if let Some(problem) =
        baton_core::paths::private_dir_problem(dir, (&meta).into(), uid, is_default || created)
    {
        bail!("{problem}");
    }
    refuse_a_shared_dir_unless_sticky(dir, meta.mode())
}

/// In a directory anyone may write to, anyone may rename our socket away
/// and put theirs in its place, unless the sticky bit keeps each name to
/// its owner.
fn refuse_a_shared_dir_unless_sticky(dir: &Path, mode: u32) -> Result<()> {
    if mode & 0o002 == 0 {
        return Ok(());
    }
    if mode & 0o1000 == 0 {
        bail!(
            "{} is writable by every user and not sticky: anyone could replace the broker's socket there (choose a private --socket directory, or leave --socket out)",
            dir.display()
        );
    }
    crate::log::warn(format_args!(
        "{} is shared with every user: baton refuses names others plant beside its socket (a lock, a mount point), but a private directory is safer (leave --socket out, or name a directory of your own)",
        dir.display()
    ));
    Ok(())
}

/// Makes `path` a directory of ours inside the private directory (the
/// FUSE mount point), or makes sure what is there is one: never through a
/// symbolic link, never someone else's.
pub fn own_subdir(path: &Path) -> Result<()> {
    match fs::DirBuilder::new().mode(0o700).create(path) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e).with_context(|| format!("cannot create {}", path.display())),
    }
    let meta =
        fs::symlink_metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    let uid = nix::unistd::getuid().as_raw();
    match baton_core::paths::private_dir_problem(path, (&meta).into(), uid, false) {
        Some(problem) => bail!("{problem}"),
        None => Ok(()),
    }
}

/// Opens (creating if need be) a file of ours beside the socket, never
/// through a symbolic link (O_NOFOLLOW), and refuses one someone else made
/// there first.
pub fn open_own_file(path: &Path) -> Result<File> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            // ELOOP, or EACCES where the kernel protects sticky directories'
            // links (fs.protected_symlinks): either way, say what is there.
            if fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) {
                anyhow::anyhow!(
                    "{} is a symbolic link: refusing to follow it (remove it, or choose another --socket)",
                    path.display()
                )
            } else {
                anyhow::Error::new(e).context(format!("cannot open {}", path.display()))
            }
        })?;
    let owner = file
        .metadata()
        .with_context(|| format!("cannot read {}", path.display()))?
        .uid();
    let uid = nix::unistd::getuid().as_raw();
    if owner != uid {
        bail!(
            "{} belongs to uid {owner}, not to you (uid {uid}): refusing it (remove it, or choose another --socket)",
            path.display()
        );
    }
    Ok(file)
}

/// An exclusive lock on `<socket>.lock`, held for the broker's lifetime so
/// that two brokers starting at once cannot both decide the socket is stale.
pub struct ServeLock {
    _lock: Flock<File>,
}

pub fn lock_socket(socket: &Path) -> Result<ServeLock> {
    match lock_file(&lock_path(socket), FlockArg::LockExclusiveNonblock) {
        Err(LockError::Busy) => bail!(
            "a broker is already running at {} (see it with: baton status --socket {})",
            socket.display(),
            socket.display()
        ),
        result => Ok(ServeLock {
            _lock: result.map_err(LockError::into_anyhow)?,
        }),
    }
}

/// The lock, waiting for the broker that holds it to let go: a successor
/// (`--replace`) takes it as its predecessor exits.
pub fn lock_socket_when_free(socket: &Path) -> Result<ServeLock> {
    let lock =
        lock_file(&lock_path(socket), FlockArg::LockExclusive).map_err(LockError::into_anyhow)?;
    Ok(ServeLock { _lock: lock })
}

enum LockError {
    Busy,
    Other(anyhow::Error),
}

impl LockError {
    fn into_anyhow(self) -> anyhow::Error {
        match self {
            LockError::Busy => anyhow::anyhow!("the lock is held"),
            LockError::Other(e) => e,
        }
    }
}

/// Locks the file at `path`, and makes sure it is still the file at
/// `path` once locked: a broker that stops cleanly removes its lock file
/// while it holds it, and whoever locked the removed file must not think
/// it owns the new one.
fn lock_file(path: &Path, how: FlockArg) -> Result<Flock<File>, LockError> {
    loop {
        // Never through a link someone planted, and only a file of ours.
        let file = open_own_file(path).map_err(LockError::Other)?;
        let lock = match Flock::lock(file, how) {
            Ok(lock) => lock,
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => return Err(LockError::Busy),
            Err((_, e)) => {
                return Err(LockError::Other(
                    anyhow::Error::from(e).context(format!("cannot lock {}", path.display())),
                ))
            }
        };
        let held = lock.metadata().map(|m| (m.dev(), m.ino()));
        let named = fs::symlink_metadata(path).map(|m| (m.dev(), m.ino()));
        if let (Ok(held), Ok(named)) = (held, named) {
            if held == named {
                return Ok(lock);
            }
        }
    }
}

fn lock_path(socket: &Path) -> PathBuf {
    baton_core::paths::beside(socket, ".lock")
}

/// Where the broker at `socket` waits for its successor (`serve --replace`).
pub fn handover_socket(socket: &Path) -> PathBuf {
    beside(socket, ".handover")
}

/// Where the FUSE keeper of the broker at `socket` hands the /dev/fuse
/// descriptor on.
pub fn keeper_socket(socket: &Path) -> PathBuf {
    beside(socket, ".fuse-keeper")
}

/// `socket`'s name with `suffix`, in its directory.
fn beside(socket: &Path, suffix: &str) -> PathBuf {
    let mut name = socket.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    socket.with_file_name(name)
}

/// After a clean stop: removes every file the broker at `socket` and the
/// builds that used it leave in its directory, but its log. Called while
/// the lock is held (the lock file goes last; see [`lock_file`]). Never
/// after a handover or a crash: the next broker needs the dead one's
/// socket file and FUSE keeper to take its builds back.
pub fn remove_leftovers(socket: &Path) {
    let _ = fs::remove_dir(baton_core::paths::fuse_mount_point(socket));
    for path in [
        handover_socket(socket),
        keeper_socket(socket),
        baton_core::paths::probes_path(socket),
    ] {
        let _ = fs::remove_file(path);
    }
    remove_autostart_lock(socket);
    let _ = fs::remove_file(lock_path(socket));
}

/// Removes `baton run`'s start-up lock unless a `baton run` holds it now
/// (it is starting the next broker).
fn remove_autostart_lock(socket: &Path) {
    let path = baton_core::paths::autostart_lock_path(socket);
    let Ok(file) = File::open(&path) else {
        return;
    };
    if let Ok(_free) = Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        let _ = fs::remove_file(&path);
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handover_and_keeper_sockets_sit_beside_the_broker_socket() {
        let socket = Path::new("/run/user/1000/baton/sock");
        assert_eq!(
            handover_socket(socket),
            Path::new("/run/user/1000/baton/sock.handover")
        );
        assert_eq!(
            keeper_socket(socket),
            Path::new("/run/user/1000/baton/sock.fuse-keeper")
        );
    }
    use std::os::unix::net::UnixListener;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A directory of this test's own, removed with everything in it when
    /// the test ends.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> Self {
            static NEXT: AtomicU32 = AtomicU32::new(0);
            let dir = std::env::temp_dir().join(format!(
                "baton-paths-test-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            fs::DirBuilder::new().mode(0o700).create(&dir).unwrap();
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_private_dir_that_exists_already_is_accepted_again() {
        let tmp = TempDir::new();
        let dir = tmp.0.join("a/sock");
        prepare_private_dir(&dir, true).unwrap();
        assert!(dir.is_dir());
        prepare_private_dir(&dir, true).unwrap();
        prepare_private_dir(&dir, false).unwrap();
    }

    /// baton's own directory, there already but open to the group or
    /// the world, is refused (with the chmod that closes it), not used:
    /// others could replace the socket in it. A `--socket`'s directory
    /// that was there already is the user's to choose.
    #[test]
    fn a_default_dir_left_open_to_others_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = TempDir::new();
        let dir = tmp.0.join("baton");
        fs::create_dir(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        let err = prepare_private_dir(&dir, true).unwrap_err();
        assert!(err.to_string().contains("chmod 700"), "{err}");
        prepare_private_dir(&dir, false).unwrap();
    }

    /// A socket that answers, but not as a stream (a datagram socket:
    /// connect fails with EPROTOTYPE), is not taken for a stale one and
    /// stays where it is.
    #[test]
    fn a_socket_that_refuses_for_another_reason_is_not_removed() {
        let tmp = TempDir::new();
        let socket = tmp.0.join("sock");
        let _datagram = std::os::unix::net::UnixDatagram::bind(&socket).unwrap();
        let err = clear_stale_socket(&socket).unwrap_err();
        assert!(err.to_string().contains("cannot tell"), "{err}");
        assert!(socket.exists());
    }

    #[test]
    fn a_world_writable_dir_is_refused_unless_sticky() {
        let dir = Path::new("/some/dir");
        assert!(refuse_a_shared_dir_unless_sticky(dir, 0o40700).is_ok());
        assert!(refuse_a_shared_dir_unless_sticky(dir, 0o40755).is_ok());
        let err = refuse_a_shared_dir_unless_sticky(dir, 0o40777).unwrap_err();
        assert!(err.to_string().contains("not sticky"), "{err}");
        assert!(refuse_a_shared_dir_unless_sticky(dir, 0o41777).is_ok());
    }

    #[test]
    fn no_socket_at_the_path_is_nothing_stale() {
        let tmp = TempDir::new();
        assert!(!clear_stale_socket(&tmp.0.join("sock")).unwrap());
    }

    #[test]
    fn a_socket_nobody_listens_on_is_removed_as_stale() {
        let tmp = TempDir::new();
        let socket = tmp.0.join("sock");
        drop(UnixListener::bind(&socket).unwrap());
        assert!(socket.exists());
        assert!(clear_stale_socket(&socket).unwrap());
        assert!(!socket.exists());
    }

    #[test]
    fn a_live_socket_or_a_file_is_not_cleared() {
        let tmp = TempDir::new();
        let socket = tmp.0.join("sock");
        let _live = UnixListener::bind(&socket).unwrap();
        let err = clear_stale_socket(&socket).unwrap_err();
        assert!(err.to_string().contains("already running"), "{err}");
        let file = tmp.0.join("file");
        fs::write(&file, "").unwrap();
        let err = clear_stale_socket(&file).unwrap_err();
        assert!(err.to_string().contains("not a socket"), "{err}");
        assert!(socket.exists() && file.exists());
    }

    /// A path that cannot be looked at (here: under a regular file) is an
    /// error, not "nothing there".
    #[test]
    fn what_cannot_be_looked_at_is_not_taken_for_nothing() {
        let tmp = TempDir::new();
        let file = tmp.0.join("file");
        fs::write(&file, "").unwrap();
        let err = clear_stale_socket(&file.join("sock")).unwrap_err();
        assert!(err.to_string().contains("cannot inspect"), "{err}");
    }

    #[test]
    fn the_mount_point_is_made_ours_or_refused_if_it_is_a_link_or_a_file() {
        let tmp = TempDir::new();
        let mount = tmp.0.join("fuse");
        own_subdir(&mount).unwrap();
        let meta = fs::symlink_metadata(&mount).unwrap();
        assert!(meta.is_dir());
        assert_eq!(meta.mode() & 0o777, 0o700);
        own_subdir(&mount).unwrap();
        let elsewhere = tmp.0.join("elsewhere");
        fs::create_dir(&elsewhere).unwrap();
        let link = tmp.0.join("link");
        std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
        assert!(own_subdir(&link).is_err(), "never through a link");
        let file = tmp.0.join("plain");
        fs::write(&file, "").unwrap();
        assert!(own_subdir(&file).is_err(), "a file is no mount point");
        let long = tmp.0.join("x".repeat(300));
        let err = own_subdir(&long).unwrap_err();
        assert!(err.to_string().contains("cannot create"), "{err}");
        let err = prepare_private_dir(&long, false).unwrap_err();
        assert!(
            err.to_string().contains("cannot create the directory"),
            "{err}"
        );
    }

    #[test]
    fn a_file_of_ours_is_never_opened_through_a_link() {
        let tmp = TempDir::new();
        let target = tmp.0.join("target");
        fs::write(&target, "").unwrap();
        let link = tmp.0.join("sock.lock");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = open_own_file(&link).unwrap_err();
        assert!(err.to_string().contains("is a symbolic link"), "{err}");
        open_own_file(&tmp.0.join("mine")).unwrap();
    }

    #[test]
    fn the_autostart_lock_is_removed_unless_a_baton_run_holds_it() {
        let tmp = TempDir::new();
        let socket = tmp.0.join("sock");
        let lock = baton_core::paths::autostart_lock_path(&socket);
        fs::write(&lock, "").unwrap();
        let held = Flock::lock(File::open(&lock).unwrap(), FlockArg::LockExclusiveNonblock)
            .map_err(|(_, e)| e)
            .unwrap();
        remove_autostart_lock(&socket);
        assert!(lock.exists(), "a baton run holds it");
        drop(held);
        remove_autostart_lock(&socket);
        assert!(!lock.exists());
        remove_autostart_lock(&socket);
    }
}
