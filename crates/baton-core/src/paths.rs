//! Where a broker's files are, in one place for the broker, the client
//! library, the jobserver bridge and the command line.
//!
//! The socket is chosen by whoever asks (`--socket`), else the environment
//! (`$BATON_SOCKET`), else the per-user runtime directory. Every other file
//! of a broker (its lock, the jobserver FIFOs, the FUSE mount) lives in the
//! socket's directory, so one path names a whole broker.

use std::path::{Path, PathBuf};

/// `explicit` (a `--socket` option) if given, else [`default_socket_path`].
pub fn socket_path(explicit: Option<PathBuf>) -> PathBuf {
    explicit.unwrap_or_else(default_socket_path)
}

/// Where the broker's socket is when nobody says otherwise:
/// `$BATON_SOCKET`, else `$XDG_RUNTIME_DIR/baton/socket`, else
/// `/tmp/baton-$UID/socket`.
pub fn default_socket_path() -> PathBuf {
    default_socket().0
}

/// [`default_socket_path`], and which rule chose it (`$BATON_SOCKET`,
/// `$XDG_RUNTIME_DIR`, or `/tmp/baton-$UID`), for `baton config`.
pub fn default_socket() -> (PathBuf, &'static str) {
    if let Some(p) = std::env::var_os("BATON_SOCKET").filter(|p| !p.is_empty()) {
        return (PathBuf::from(p), "$BATON_SOCKET");
    }
    standard_socket()
}

/// Where the socket is when neither `--socket` nor `$BATON_SOCKET` says:
/// the one brokers and builds meet at unless told otherwise.
pub fn standard_socket_path() -> PathBuf {
    standard_socket().0
}

fn standard_socket() -> (PathBuf, &'static str) {
    if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR").filter(|p| !p.is_empty()) {
        return (
            Path::new(&dir).join("baton").join("socket"),
            "$XDG_RUNTIME_DIR",
        );
    }
    // SAFETY: getuid cannot fail and touches no memory.
    let uid = unsafe { libc::getuid() };
    (
        PathBuf::from(format!("/tmp/baton-{uid}/socket")),
        "/tmp/baton-$UID",
    )
}

/// Whether [`socket_path`] with `explicit` falls back to a directory baton
/// picks itself (and may therefore make private), rather than one the user
/// named.
pub fn is_chosen_by_baton(explicit: Option<&Path>) -> bool {
    explicit.is_none() && std::env::var_os("BATON_SOCKET").is_none_or(|v| v.is_empty())
}

/// The directories baton picks itself for the socket's: `$XDG_RUNTIME_DIR/baton`
/// where that is set, else `/tmp/baton-$UID`. Whoever finds one of these
/// holds it to [`private_dir_problem`]'s strict rule (docs/security.md).
pub fn is_default_private_dir(dir: &Path) -> bool {
    // SAFETY: getuid cannot fail and touches no memory.
    let uid = unsafe { libc::getuid() };
    let tmp = PathBuf::from(format!("/tmp/baton-{uid}"));
    let xdg = std::env::var_os("XDG_RUNTIME_DIR")
        .filter(|p| !p.is_empty())
        .map(|d| Path::new(&d).join("baton"));
    dir == tmp || xdg.is_some_and(|x| dir == x)
}

/// What `lstat` says of a directory meant to hold a broker's files.
#[derive(Debug, Clone, Copy)]
pub struct DirFacts {
    /// It is a symbolic link (whatever it points at).
    pub is_symlink: bool,
    /// It is a directory.
    pub is_dir: bool,
    /// Its owner's uid.
    pub owner: u32,
    /// Its mode bits (permissions, sticky bit).
    pub mode: u32,
}

impl From<&std::fs::Metadata> for DirFacts {
    /// From `symlink_metadata` (lstat), never `metadata`, which follows a link.
    fn from(meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        DirFacts {
            is_symlink: meta.file_type().is_symlink(),
            is_dir: meta.is_dir(),
            owner: meta.uid(),
            mode: meta.mode(),
        }
    }
}

/// Why `dir` may not hold the broker of user `me`, if it may not: a
/// symbolic link (someone could point it elsewhere later), not a directory,
/// owned by someone else, or, when `private` (baton's own directories),
/// open to the group or the world. None: it will do.
pub fn private_dir_problem(dir: &Path, facts: DirFacts, me: u32, private: bool) -> Option<String> {
    let dir = dir.display();
    if facts.is_symlink {
        return Some(format!(
            "{dir} is a symbolic link, which anyone who owns it could point elsewhere: refusing it (remove it, or choose another --socket)"
        ));
    }
    if !facts.is_dir {
        return Some(format!(
            "{dir} is not a directory: refusing it (remove it, or choose another --socket)"
        ));
    }
    if facts.owner != me {
        return Some(format!(
            "{dir} belongs to uid {}, not to you (uid {me}): refusing to use a broker there (someone else made it; remove it as root, or choose another --socket)",
            facts.owner
        ));
    }
    if private && facts.mode & 0o077 != 0 {
        return Some(format!(
            "{dir} is open to other users (mode {:04o}): refusing to use a broker there (if it is yours: chmod 700 {dir})",
            facts.mode & 0o7777
        ));
    }
    None
}

/// Whether a broker run by uid `owner` may be trusted by user `me`: our
/// own, or root's (who could read our memory anyway), or the one
/// `$BATON_BROKER_UID` names.
pub fn trusts_broker_of(owner: u32, me: u32) -> bool {
    trusts_broker_named(owner, me, named_broker_uid())
}

/// `$BATON_BROKER_UID`: the uid, as this process sees it, of a broker it
/// is told to use although it is neither its own nor root's: the host's
/// broker seen from a user namespace whose map lacks the broker's uid (the
/// kernel then says 65534, the overflow uid, for it and for every other
/// unmapped uid: the socket the operator bound in is what is trusted), or
/// a CI runner's broker shared with the jobs it starts (docs/containers.md).
pub fn named_broker_uid() -> Option<u32> {
    std::env::var("BATON_BROKER_UID").ok()?.trim().parse().ok()
}

fn trusts_broker_named(owner: u32, me: u32, named: Option<u32>) -> bool {
    owner == me || owner == 0 || named == Some(owner)
}

/// The directory holding the socket, and the broker's other files (the lock,
/// jobserver FIFOs, the FUSE mount).
pub fn private_dir(socket: &Path) -> PathBuf {
    match socket.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Where the broker serving `socket` mounts its FUSE token files.
pub fn fuse_mount_point(socket: &Path) -> PathBuf {
    private_dir(socket).join("fuse")
}

/// The lock `baton run` takes while it starts a broker for `socket`.
pub fn autostart_lock_path(socket: &Path) -> PathBuf {
    beside(socket, ".autostart")
}

/// Where `baton run` keeps what it learnt of build tools' jobserver
/// support (a cache: a broker that stops cleanly removes it).
pub fn probes_path(socket: &Path) -> PathBuf {
    private_dir(socket).join("probes")
}

/// The socket's path with `suffix` added to its file name.
pub fn beside(socket: &Path, suffix: &str) -> PathBuf {
    let mut name = socket.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    socket.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broker_s_files_sit_beside_its_socket() {
        assert_eq!(
            private_dir(Path::new("/run/u/baton/socket")),
            Path::new("/run/u/baton")
        );
        assert_eq!(private_dir(Path::new("socket")), Path::new("."));
        assert_eq!(
            fuse_mount_point(Path::new("/run/u/baton/socket")),
            Path::new("/run/u/baton/fuse")
        );
        assert_eq!(
            autostart_lock_path(Path::new("/run/u/baton/socket")),
            Path::new("/run/u/baton/socket.autostart")
        );
        assert_eq!(
            probes_path(Path::new("/run/u/baton/socket")),
            Path::new("/run/u/baton/probes")
        );
    }

    fn facts(owner: u32, mode: u32) -> DirFacts {
        DirFacts {
            is_symlink: false,
            is_dir: true,
            owner,
            mode,
        }
    }

    #[test]
    fn only_a_private_directory_of_ours_will_do() {
        let dir = Path::new("/tmp/baton-7");
        assert_eq!(private_dir_problem(dir, facts(7, 0o700), 7, true), None);
        assert!(private_dir_problem(dir, facts(8, 0o700), 7, true)
            .unwrap()
            .contains("belongs to uid 8"));
        assert!(private_dir_problem(dir, facts(7, 0o777), 7, true)
            .unwrap()
            .contains("mode 0777"));
        assert_eq!(private_dir_problem(dir, facts(7, 0o755), 7, false), None);
        let link = DirFacts {
            is_symlink: true,
            ..facts(7, 0o777)
        };
        assert!(private_dir_problem(dir, link, 7, false)
            .unwrap()
            .contains("symbolic link"));
    }

    #[test]
    fn a_broker_of_ours_or_root_s_is_trusted() {
        assert!(trusts_broker_of(7, 7));
        assert!(trusts_broker_of(0, 7));
        assert!(!trusts_broker_of(8, 7));
    }

    #[test]
    fn a_broker_uid_named_is_trusted_too() {
        assert!(trusts_broker_named(65534, 7, Some(65534)));
        assert!(!trusts_broker_named(65533, 7, Some(65534)));
        assert!(trusts_broker_named(0, 7, Some(65534)));
    }

    #[test]
    fn an_explicit_path_wins() {
        assert_eq!(socket_path(Some("/x/s".into())), Path::new("/x/s"));
        assert!(!is_chosen_by_baton(Some(Path::new("/x/s"))));
    }
}
