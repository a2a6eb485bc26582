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
    let pid = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|p| p.parse::<u32>().ok());
    let fds = std::env::var("LISTEN_FDS")
        .ok()
        .and_then(|n| n.parse::<u32>().ok());
    pid == Some(std::process::id()) && fds.is_some_and(|n| n >= 1)
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
}
