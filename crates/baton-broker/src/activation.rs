//! Socket activation: systemd (or `systemd-socket-activate`) binds the
//! socket, starts `baton serve` on the first connection and passes the
//! listening socket as file descriptor 3, naming us in `LISTEN_PID` and the
//! count in `LISTEN_FDS` (sd_listen_fds(3)).

use anyhow::{bail, Context, Result};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;

/// The first descriptor passed: 0, 1 and 2 are the standard streams.
const SD_LISTEN_FDS_START: RawFd = 3;

/// The listening socket passed to this process, and the path it is bound
/// to; None when the process was started without one.
///
/// # Errors
/// The descriptor passed is not a Unix socket bound to a path.
pub fn inherited_listener() -> Result<Option<(UnixListener, PathBuf)>> {
    if !passed_to_us() {
        return Ok(None);
    }
    // Children (none today) must not take the descriptor for theirs.
    for var in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
        std::env::remove_var(var);
    }
    // SAFETY: the one who started us handed descriptor 3 over to us
    // (LISTEN_PID is our pid); nothing else in this process owns it.
    let listener = unsafe { UnixListener::from_raw_fd(SD_LISTEN_FDS_START) };
    let addr = listener
        .local_addr()
        .context("the socket passed by socket activation (descriptor 3) is not a Unix socket (check ListenStream= in baton.socket)")?;
    let Some(path) = addr.as_pathname() else {
        bail!(
            "the socket passed by socket activation has no path (ListenStream= must name a file)"
        );
    };
    set_cloexec(SD_LISTEN_FDS_START)?;
    Ok(Some((listener, path.to_path_buf())))
}

fn passed_to_us() -> bool {
    names_us(
        std::env::var("LISTEN_PID").ok().as_deref(),
        std::env::var("LISTEN_FDS").ok().as_deref(),
        std::process::id(),
    )
}

/// Whether `LISTEN_PID` and `LISTEN_FDS` pass at least one socket to the
/// process `pid` (a parent's variables, inherited, name the parent).
fn names_us(listen_pid: Option<&str>, listen_fds: Option<&str>, pid: u32) -> bool {
    let named = listen_pid.and_then(|p| p.parse::<u32>().ok());
    let fds = listen_fds.and_then(|n| n.parse::<u32>().ok());
    named == Some(pid) && fds.is_some_and(|n| n >= 1)
}

fn set_cloexec(fd: RawFd) -> Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, FdFlag};
    // SAFETY: fd is the listener we just took; it outlives this call.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    fcntl(fd, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))
        .context("cannot set close-on-exec on the passed socket")?;
    Ok(())
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_listen_pid_no_socket_was_passed() {
        if std::env::var_os("LISTEN_PID").is_none() {
            assert!(!passed_to_us());
        }
    }

    /// One socket or more, passed to this very pid: anything else (none
    /// passed, or variables inherited from a parent that was passed them)
    /// is not ours.
    #[test]
    fn a_socket_is_ours_only_when_passed_to_our_pid() {
        assert!(names_us(Some("42"), Some("1"), 42));
        assert!(names_us(Some("42"), Some("2"), 42));
        assert!(!names_us(Some("42"), Some("0"), 42), "none passed");
        assert!(!names_us(Some("41"), Some("1"), 42), "our parent's");
        assert!(!names_us(None, Some("1"), 42));
        assert!(!names_us(Some("42"), None, 42));
        assert!(!names_us(Some("42"), Some("x"), 42));
    }

    /// The listener passed is not handed on to anything we start.
    #[test]
    fn the_passed_socket_is_made_close_on_exec() {
        let mut fds = [0; 2];
        // SAFETY: a pipe without O_CLOEXEC, both ends closed below.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let flags = |fd| unsafe { libc::fcntl(fd, libc::F_GETFD) };
        assert_eq!(flags(fds[0]) & libc::FD_CLOEXEC, 0);
        set_cloexec(fds[0]).unwrap();
        assert_eq!(flags(fds[0]) & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
        for fd in fds {
            // SAFETY: ours to close.
            unsafe { libc::close(fd) };
        }
    }
}
