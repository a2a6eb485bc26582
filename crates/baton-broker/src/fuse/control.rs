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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::{ClientMeta, Transport};
    use crate::fuse::fs::{FsState, TokenFs};
    use crate::fuse::procs::Exits;
    use crate::fuse::waiters::{Mode, Waiters, HOLD};
    use std::time::Duration;

    /// Token files as a successor receives them: this process polled a
    /// handle and has a token reserved on it for `left`. The notifier that
    /// would wake it is a session's on /dev/null: nobody is woken here.
    fn files_with_a_reservation(poll: &mio::Poll, broker: &mut Broker, left: Duration) -> Files {
        let pid = std::process::id();
        let client = broker.connect(ClientMeta::new(pid, "poller".into(), Transport::Fuse));
        let state: FsState = serde_json::from_value(serde_json::json!({
            "waiters": {
                "mode": "OneAtATime",
                "processes": [[pid, client]],
                "polled": [{"fh": 1, "client": client, "kernel_handle": 1, "queued": false,
                            "reserved_for": {"secs": left.as_secs(), "nanos": left.subsec_nanos()}}],
            },
            "files": [[2, "make"]],
            "next_ino": 3,
            "handles": [[1, 2]],
            "next_fh": 2,
        }))
        .unwrap();
        let nowhere = std::fs::File::open("/dev/null").unwrap().into();
        let session = fuser::Session::from_initialized_fd(
            TokenFs,
            nowhere,
            fuser::SessionACL::Owner,
            fuser::Config::default(),
        );
        let exits = Exits::new(poll.registry().try_clone().unwrap());
        let mut files = Files::new(Waiters::new(Mode::OneAtATime, HOLD), exits);
        files.adopt(state, broker, &session.notifier()).unwrap();
        files
    }

    /// The clock is armed for the files' next deadline, and armed again
    /// when one comes sooner than it is armed for (a reservation made
    /// while a poll is held for a second): a reservation nobody reads must
    /// pass on when it runs out, not when the later deadline comes.
    #[test]
    fn the_clock_is_armed_again_for_a_sooner_deadline() {
        let poll = mio::Poll::new().unwrap();
        let mut broker = Broker::new(2).unwrap();
        let mut clock = Clock::new().unwrap();
        let late = files_with_a_reservation(&poll, &mut broker, Duration::from_secs(3600));
        clock.plan(&late);
        assert!(late.next_wakeup().is_some());
        assert_eq!(clock.armed, late.next_wakeup());
        let soon = files_with_a_reservation(&poll, &mut broker, Duration::from_millis(50));
        clock.plan(&soon);
        assert_eq!(clock.armed, soon.next_wakeup(), "armed for the sooner one");
    }
}
