//! What the token files act on by themselves, on the event loop: processes
//! that exit holding tokens (their pidfds, in the loop's poll under
//! [`procs::EXITS`]), reservations that run out, and blocked readers that a
//! signal would interrupt ([`Clock`], a timerfd in the loop's poll, armed
//! for the next of those). No thread of its own: the loop acts when one of
//! them turns readable.

use super::fs::{Files, KILL_SCAN};
use super::procs;
use crate::broker::Broker;
use crate::log;
use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::time::Instant;

/// The timer the loop polls for the token files' deadlines.
pub struct Clock {
    timer: TimerFd,
    /// When it fires next; None: disarmed.
    armed: Option<Instant>,
}

impl Clock {
    pub fn new() -> std::io::Result<Self> {
        let timer = TimerFd::new(
            ClockId::CLOCK_MONOTONIC,
            TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC,
        )?;
        Ok(Clock { timer, armed: None })
    }

    /// The descriptor the loop polls: readable when the timer fires.
    pub fn fd(&self) -> RawFd {
        self.timer.as_fd().as_raw_fd()
    }

    /// Arms the timer for the next time `files` must act, if that is
    /// sooner than it is armed for: a later one is seen to when it fires
    /// early and finds nothing to do.
    pub fn plan(&mut self, files: &Files) {
        let Some(due) = files.next_wakeup() else {
            return;
        };
        let now = Instant::now();
        if self.armed.is_some_and(|armed| armed > now && armed <= due) {
            return;
        }
        // A relative one-shot; at least a nanosecond, as zero disarms.
        let after = due
            .saturating_duration_since(now)
            .max(std::time::Duration::from_nanos(1));
        match self.timer.set(
            Expiration::OneShot(TimeSpec::from_duration(after)),
            TimerSetTimeFlags::empty(),
        ) {
            Ok(()) => self.armed = Some(due),
            Err(e) => log::warn(format_args!("cannot arm the token files' timer: {e}")),
        }
    }

    /// The timer fired: it is disarmed until planned again.
    pub fn fired(&mut self) {
        self.armed = None;
        // Reads the expiry count, so that the descriptor is quiet again.
        let mut count = [0u8; 8];
        let _ = nix::unistd::read(&self.timer, &mut count);
    }
}

/// Acts on processes that exited, reservations that ran out, and blocked
/// readers with a signal pending.
pub fn act(files: &mut Files, broker: &mut Broker, exited: &[u32]) {
    for &pid in exited {
        let reclaimed = files.waiters.exited(broker, pid);
        files.exits.unwatch(pid);
        files.threads.forget(pid);
        if reclaimed > 0 {
            log::info(format_args!(
                "reclaimed {reclaimed} token(s) from pid {pid}: it exited holding them (fuse)"
            ));
        }
    }
    files.waiters.expire(broker, Instant::now());
    if files.scanned_at.elapsed() >= KILL_SCAN {
        files.scanned_at = Instant::now();
        let interrupted: Vec<u32> = files
            .waiters
            .blocked_threads()
            .filter(|&tid| procs::signal_pending(tid))
            .collect();
        for tid in interrupted {
            files.waiters.interrupt(broker, tid);
        }
    }
    files.settle(broker);
}
