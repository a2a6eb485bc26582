//! The processes behind FUSE requests: a request carries the calling
//! thread's id, tokens belong to its process (docs/jobserver.md, "What
//! clients do"), and a pidfd per process tells us when it is gone.

use crate::sys::{self, status_field as field};
use mio::unix::SourceFd;
use mio::{Interest, Registry, Token};
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

/// The process a thread belongs to, from `/proc/<tid>/status` (`Tgid:`).
/// None if the thread is gone.
pub fn process_of(tid: u32) -> Option<u32> {
    field(&sys::status(tid)?, "Tgid:")?.parse().ok()
}

/// Whether a signal is pending that the thread neither blocks nor ignores:
/// one that would interrupt a read of a pipe. SIGKILL when the process is
/// being killed or exits (its other threads get one), SIGUSR1 from the
/// jobserver crate stopping its helper thread.
pub fn signal_pending(tid: u32) -> bool {
    let Some(status) = sys::status(tid) else {
        return false;
    };
    let mask = |name: &str| {
        field(&status, name)
            .and_then(|v| u64::from_str_radix(v, 16).ok())
            .unwrap_or(0)
    };
    let pending = mask("SigPnd:") | mask("ShdPnd:");
    pending & !mask("SigBlk:") & !mask("SigIgn:") != 0
}

/// The process and its ancestors, nearest first, up to (not including)
/// init. Ends early where a process is gone.
pub fn ancestors(pid: u32) -> impl Iterator<Item = u32> {
    std::iter::successors(Some(pid), |&p| parent_of(p)).take_while(|&p| p > 1)
}

/// The parent of `pid`, from `/proc/<pid>/stat`: one short line, where
/// `status` is 1.5 KB. A build's start walks its ancestors, so every
/// `baton run` pays this several times.
fn parent_of(pid: u32) -> Option<u32> {
    Some(sys::stat(pid)?.ppid)
}

/// Thread → process, remembered so that a request costs a /proc read only
/// the first time its thread is seen.
#[derive(Default)]
pub struct Threads {
    process: HashMap<u32, u32>,
}

impl Threads {
    pub fn process_of(&mut self, tid: u32) -> Option<u32> {
        if let Some(&pid) = self.process.get(&tid) {
            return Some(pid);
        }
        let pid = process_of(tid)?;
        self.process.insert(tid, pid);
        Some(pid)
    }

    /// Forgets the threads of a process that exited: their ids may be reused.
    pub fn forget(&mut self, pid: u32) {
        self.process.retain(|_, p| *p != pid);
    }
}

/// Tokens of the event loop's poll from here up are pidfds: `EXITS + pid`
/// (a pid is below 2^22; the loop numbers its connections from below).
pub const EXITS: usize = 1 << 40;

/// The pid whose exit a token of the loop's poll reports, if it is one.
pub fn exited_pid(token: Token) -> Option<u32> {
    token.0.checked_sub(EXITS).map(|pid| pid as u32)
}

/// A pidfd per watched process, registered with the event loop's poll
/// under the token `EXITS + pid`: readable once the process has exited.
pub struct Exits {
    registry: Registry,
    pidfds: HashMap<u32, OwnedFd>,
}

impl Exits {
    pub fn new(registry: Registry) -> Self {
        Exits {
            registry,
            pidfds: HashMap::new(),
        }
    }

    pub fn watch(&mut self, pid: u32) -> io::Result<()> {
        let fd = sys::pidfd_open(pid)?;
        self.registry.register(
            &mut SourceFd(&fd.as_raw_fd()),
            Token(EXITS + pid as usize),
            Interest::READABLE,
        )?;
        self.pidfds.insert(pid, fd);
        Ok(())
    }

    pub fn unwatch(&mut self, pid: u32) {
        if let Some(fd) = self.pidfds.remove(&pid) {
            let _ = self.registry.deregister(&mut SourceFd(&fd.as_raw_fd()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_ancestors_start_with_us_and_our_parent() {
        let mut up = ancestors(std::process::id());
        assert_eq!(up.next(), Some(std::process::id()));
        assert_eq!(
            up.next(),
            Some(std::os::unix::process::parent_id()).filter(|&p| p > 1)
        );
    }

    #[test]
    fn the_parent_is_read_from_proc() {
        assert_eq!(
            parent_of(std::process::id()),
            Some(std::os::unix::process::parent_id())
        );
        assert_eq!(parent_of(4_000_000_000), None);
    }

    #[test]
    fn a_thread_maps_to_its_process() {
        let me = std::process::id();
        assert_eq!(process_of(me), Some(me));
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            tx.send(unsafe { libc::gettid() } as u32).unwrap();
            let _ = stop_rx.recv();
        });
        let live = rx.recv().unwrap();
        assert_ne!(live, me);
        assert_eq!(Threads::default().process_of(live), Some(me));
        stop_tx.send(()).unwrap();
        t.join().unwrap();
    }

    /// `sleep 600`, stopped: signals sent to it stay pending.
    fn stopped_sleep() -> std::process::Child {
        let child = std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .unwrap();
        let pid = child.id();
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while !sys::stat(pid).is_some_and(|s| s.is_stopped()) {
            assert!(std::time::Instant::now() < deadline, "sleep never stopped");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        child
    }

    /// One signal pending twice, for the thread (tgkill) and for its
    /// process (kill), is pending: the two sets are joined, not set
    /// against each other.
    #[test]
    fn a_signal_pending_for_the_thread_and_for_its_process_is_pending() {
        let mut child = stopped_sleep();
        let pid = child.id() as i32;
        unsafe {
            libc::syscall(libc::SYS_tgkill, pid, pid, libc::SIGTERM);
            libc::kill(pid, libc::SIGTERM);
        }
        let status = sys::status(child.id()).unwrap_or_default();
        let pending = signal_pending(child.id());
        let _ = child.kill();
        let _ = child.wait();
        let term = format!("{:016x}", 1u64 << (libc::SIGTERM - 1));
        assert!(
            field(&status, "SigPnd:") == Some(term.as_str())
                && field(&status, "ShdPnd:") == Some(term.as_str()),
            "SIGTERM pending in both sets: {status}"
        );
        assert!(pending);
    }

    /// The walk up stops below init, which is everyone's ancestor.
    #[test]
    fn our_ancestors_stop_below_init() {
        let up: Vec<u32> = ancestors(std::process::id()).collect();
        assert!(!up.is_empty() && !up.contains(&1), "{up:?}");
    }

    /// A process that exited takes its threads out of the map (their ids
    /// may be reused), and leaves the other processes' threads.
    #[test]
    fn forgetting_a_process_forgets_its_threads_only() {
        let mut threads = Threads::default();
        threads.process.extend([(100, 50), (101, 50), (200, 60)]);
        threads.forget(50);
        assert_eq!(threads.process, HashMap::from([(200, 60)]));
    }

    /// Unwatching a process closes its pidfd: none is left behind per
    /// process that used the files.
    #[test]
    fn unwatching_a_process_lets_go_of_its_pidfd() {
        let poll = mio::Poll::new().unwrap();
        let mut exits = Exits::new(poll.registry().try_clone().unwrap());
        let mut child = std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .unwrap();
        let pid = child.id();
        let watched = exits.watch(pid).is_ok() && exits.pidfds.contains_key(&pid);
        exits.unwatch(pid);
        let left = exits.pidfds.len();
        let _ = child.kill();
        let _ = child.wait();
        assert!(watched);
        assert_eq!(left, 0);
    }

    #[test]
    fn a_signal_is_pending_only_while_it_waits_to_be_delivered() {
        assert!(!signal_pending(std::process::id()));
        // A stopped process keeps a SIGTERM pending until it runs again.
        let mut child = std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .unwrap();
        let pid = child.id();
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        let stopped = || sys::stat(pid).is_some_and(|s| s.is_stopped());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while !stopped() {
            assert!(std::time::Instant::now() < deadline, "sleep never stopped");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        assert!(!signal_pending(pid), "nothing sent yet");
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        let pending = signal_pending(pid);
        let _ = child.kill();
        let _ = child.wait();
        assert!(pending, "a SIGTERM sent to a stopped process is pending");
    }
}
