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
    }

    #[test]
    fn an_explicit_path_wins() {
        assert_eq!(socket_path(Some("/x/s".into())), Path::new("/x/s"));
        assert!(!is_chosen_by_baton(Some(Path::new("/x/s"))));
    }
}
