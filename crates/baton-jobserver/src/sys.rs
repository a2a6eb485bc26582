//! The bridge's door to the system calls no safe wrapper covers: each
//! written once, with its unsafe code, for the modules above to call. (The
//! double fork that takes an inotify watch off `baton run`'s exit path is
//! its own small door: see `close_later`.)

use nix::sys::signal::SigSet;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

/// A descriptor that becomes readable when process `pid` exits.
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the fd was just returned to us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Sends `signal` to process `pid`; one gone since (ESRCH) is ignored: the
/// callers signal processes that may end at any moment.
pub fn signal(pid: u32, signal: i32) {
    // SAFETY: kill(2) takes any pid and signal number.
    unsafe { libc::kill(pid as libc::pid_t, signal) };
}

/// How many bytes wait to be read in a pipe or FIFO (FIONREAD); 0 if the
/// kernel will not say.
pub fn bytes_waiting(pipe: &impl AsFd) -> u32 {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int to the pointer we pass.
    let rc = unsafe { libc::ioctl(pipe.as_fd().as_raw_fd(), libc::FIONREAD, &mut n) };
    if rc < 0 {
        0
    } else {
        n as u32
    }
}

/// Our effective uid.
pub fn effective_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Has `command`'s process, between fork and exec, unblock `blocked` and
/// ask to be killed when we die (PR_SET_PDEATHSIG), so that it dies with
/// us however we die.
pub fn tie_to_us(command: &mut Command, blocked: SigSet) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs between fork and exec and only makes
    // async-signal-safe system calls.
    unsafe {
        command.pre_exec(move || {
            blocked.thread_unblock().map_err(io::Error::from)?;
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            // We may have died before prctl took effect.
            if libc::getppid() != parent {
                libc::_exit(137);
            }
            Ok(())
        });
    }
}

/// Has `command`'s process start a session of its own (setsid) between
/// fork and exec: no terminal's signal reaches it, nor our process group's.
pub fn in_a_session_of_its_own(command: &mut Command) {
    // SAFETY: setsid is async-signal-safe and touches no memory.
    unsafe {
        command.pre_exec(|| match libc::setsid() {
            -1 => Err(io::Error::last_os_error()),
            _ => Ok(()),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pid_descriptor_is_had_for_a_running_process_only() {
        assert!(pidfd_open(std::process::id()).is_ok());
        let mut child = Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let err = pidfd_open(gone).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ESRCH), "{err}");
    }

    #[test]
    fn bytes_waiting_counts_what_was_written_and_not_read() {
        let (read_end, write_end) = nix::unistd::pipe().unwrap();
        assert_eq!(bytes_waiting(&read_end), 0);
        nix::unistd::write(&write_end, b"+++").unwrap();
        assert_eq!(bytes_waiting(&read_end), 3);
    }
}
