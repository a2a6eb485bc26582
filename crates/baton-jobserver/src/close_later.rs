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

/// How long the grandchild waits for us to let go.
const HOLD_AT_MOST_MS: libc::c_int = 10_000;

/// Drops `thing` (whose descriptor is costly to close last) without
/// waiting for the close. Falls back to a plain drop if we cannot fork.
pub fn drop_off_the_exit_path<T: AsFd>(thing: T) {
    // Close-on-exec: no program another thread starts meanwhile keeps the
    // grandchild waiting (forks here exec nothing).
    let pipe = || nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC);
    let (Ok((wait_end, release_end)), Ok((closed_all, closing))) = (pipe(), pipe()) else {
        return;
    };
    let keep = thing.as_fd().as_raw_fd();
    let wait_on = wait_end.as_raw_fd();
    // SAFETY: between fork and _exit the child and grandchild make only
    // async-signal-safe system calls (fork, setsid, close_range,
    // poll, _exit).
    match unsafe { libc::fork() } {
        0 => unsafe {
            if libc::fork() == 0 {
                hold_until_released(wait_on, keep);
            }
            libc::_exit(0)
        },
        -1 => {}
        child => {
            let mut status = 0;
            // SAFETY: waits for the child we just forked, which exits at once.
            unsafe { libc::waitpid(child, &mut status, 0) };
            // End of file once the grandchild has left our process group
            // and closed the rest of our descriptors (`closing` among
            // them): a caller that waits for our group or our output
            // never waits for it.
            drop(closing);
            let mut closed_all = std::fs::File::from(closed_all);
            while let Err(e) = std::io::Read::read(&mut closed_all, &mut [0u8]) {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    break;
                }
            }
        }
    }
    drop(wait_end);
    drop(thing); // the grandchild's copy is the last
    drop(release_end); // the grandchild reads end of file and exits
}

/// The grandchild: closes every descriptor but `wait_on` and `keep`, waits
/// for end of file on `wait_on` (at most [`HOLD_AT_MOST_MS`]), and exits.
///
/// # Safety
/// Only in a freshly forked process.
unsafe fn hold_until_released(wait_on: RawFd, keep: RawFd) -> ! {
    // Out of our process group (and session): a caller that waits for the
    // group, or kills it, never sees it.
    libc::setsid();
    let (low, high) = (wait_on.min(keep) as u32, wait_on.max(keep) as u32);
    if low > 0 {
        close_range(0, low - 1);
    }
    if high > low + 1 {
        close_range(low + 1, high - 1);
    }
    close_range(high + 1, u32::MAX);
    // Not for ever, should a copy of the other end leak somewhere: then
    // whoever closes last pays, which costs time, not correctness.
    let mut fds = [libc::pollfd {
        fd: wait_on,
        events: libc::POLLIN,
        revents: 0,
    }];
    while libc::poll(fds.as_mut_ptr(), 1, HOLD_AT_MOST_MS) < 0
        && *libc::__errno_location() == libc::EINTR
    {}
    libc::_exit(0)
}

/// Closes the descriptors `first..=last`.
unsafe fn close_range(first: u32, last: u32) {
    libc::syscall(libc::SYS_close_range, first, last, 0u32);
}
