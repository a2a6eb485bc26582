//! Closing an inotify instance waits for the kernel to retire its watch:
//! `fsnotify_destroy_group` waits for the mark reaper, which waits for an
//! SRCU grace period. On a 250 Hz kernel that is often 10–20 ms, and a
//! process's exit closes its descriptors the same way, so `baton run`'s
//! caller (make, a script, a benchmark) would wait that long after the
//! build had ended: more than `baton run`'s whole start-up.
//!
//! [`drop_off_the_exit_path`] gives the last reference to a grandchild
//! nobody waits for: it holds its copy until ours is closed, then exits,
//! and its exit pays for the grace period. It is reparented to init (or
//! the nearest subreaper), which reaps it; it keeps no other descriptor,
//! so no pipe, terminal or broker connection of ours outlives us.

use std::os::fd::{AsFd, AsRawFd, RawFd};

/// Drops `thing` (whose descriptor is costly to close last) without
/// waiting for the close. Falls back to a plain drop if we cannot fork.
pub fn drop_off_the_exit_path<T: AsFd>(thing: T) {
    let Ok((wait_end, release_end)) = nix::unistd::pipe() else { return };
    let keep = thing.as_fd().as_raw_fd();
    let wait_on = wait_end.as_raw_fd();
    // SAFETY: between fork and _exit the child and grandchild make only
    // async-signal-safe system calls (fork, setpgid, setsid, close_range,
    // read, _exit).
    match unsafe { libc::fork() } {
        0 => unsafe {
            let grandchild = libc::fork();
            if grandchild == 0 {
                hold_until_released(wait_on, keep);
            }
            // Out of our process group before we return (the grandchild's
            // own setsid may not have run yet): a caller that waits for
            // the group, or kills it, never sees it.
            libc::setpgid(grandchild, grandchild);
            libc::_exit(0)
        },
        -1 => {}
        child => {
            let mut status = 0;
            // SAFETY: waits for the child we just forked, which exits at once.
            unsafe { libc::waitpid(child, &mut status, 0) };
        }
    }
    drop(wait_end);
    drop(thing); // the grandchild's copy is the last
    drop(release_end); // the grandchild reads end of file and exits
}

/// The grandchild: closes every descriptor but `wait_on` and `keep`, waits
/// for end of file on `wait_on`, and exits.
///
/// # Safety
/// Only in a freshly forked process.
unsafe fn hold_until_released(wait_on: RawFd, keep: RawFd) -> ! {
    // Out of our session too: a terminal's hang-up is not for it.
    libc::setsid();
    let (low, high) = (wait_on.min(keep) as u32, wait_on.max(keep) as u32);
    if low > 0 {
        close_range(0, low - 1);
    }
    if high > low + 1 {
        close_range(low + 1, high - 1);
    }
    close_range(high + 1, u32::MAX);
    let mut byte = 0u8;
    loop {
        let n = libc::read(wait_on, (&raw mut byte).cast(), 1);
        if n >= 0 || *libc::__errno_location() != libc::EINTR {
            break;
        }
    }
    libc::_exit(0)
}

/// Closes the descriptors `first..=last`.
unsafe fn close_range(first: u32, last: u32) {
    libc::syscall(libc::SYS_close_range, first, last, 0u32);
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::io::Read;
    use std::os::fd::OwnedFd;

    /// The descriptor is closed for us at once, but its file lives on in
    /// the grandchild until we let go: a pipe's read end shows both.
    #[test]
    fn the_grandchild_holds_the_file_until_we_let_go_then_closes_it() {
        let (read, write) = nix::unistd::pipe().unwrap();
        let held_elsewhere: OwnedFd = write;
        drop_off_the_exit_path(held_elsewhere);
        // Every copy of the write end is gone once the grandchild exits:
        // the read end sees end of file. (The minute only bounds a hang,
        // should a copy leak.)
        let mut fds = [PollFd::new(read.as_fd(), PollFlags::POLLIN)];
        assert_eq!(poll(&mut fds, PollTimeout::try_from(60_000).unwrap()).unwrap(), 1, "a copy of the write end is still open");
        let mut rest = Vec::new();
        std::fs::File::from(read).read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty());
    }
}
