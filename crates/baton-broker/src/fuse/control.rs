//! The FUSE side's own thread: it learns of processes that exit (pidfds),
//! reservations that run out, blocked readers that a signal would interrupt, and
//! grants caused by socket clients, and acts on each.

use super::fs::{FsShared, KILL_SCAN};
use super::procs;
use crate::log;
use mio::{Events, Poll, Token, Waker};
use std::io::ErrorKind;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// The waker's token; pidfds use `Token(pid)`, and pids are below this.
pub const WAKER: Token = Token(usize::MAX);

/// The running control thread; stopped and joined on drop.
pub struct Control {
    waker: Arc<Waker>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Control {
    pub fn spawn(shared: Arc<FsShared>, poll: Poll, waker: Arc<Waker>) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("baton-fuse".into())
            .spawn(move || run(&shared, poll, &stopping))?;
        Ok(Control {
            waker,
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.waker.wake();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run(shared: &FsShared, mut poll: Poll, stop: &AtomicBool) {
    let mut events = Events::with_capacity(256);
    while !stop.load(Ordering::Relaxed) {
        let timeout = shared.with(|inner, _| {
            // Handed over: nothing to act on until woken (a failed handover).
            inner.control_sleeps_until = if inner.frozen {
                None
            } else {
                inner.next_wakeup()
            };
            inner
                .control_sleeps_until
                .map(|t| t.saturating_duration_since(Instant::now()))
        });
        match poll.poll(&mut events, timeout) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => {
                log::warn(format_args!("the FUSE control loop failed: {e}"));
                return;
            }
        }
        let exited: Vec<u32> = events
            .iter()
            .map(|e| e.token())
            .filter(|&t| t != WAKER)
            .map(|t| t.0 as u32)
            .collect();
        shared.with(|inner, broker| {
            if inner.frozen {
                return;
            }
            for pid in exited {
                let reclaimed = inner.waiters.exited(broker, pid);
                inner.exits.unwatch(pid);
                inner.threads.forget(pid);
                if reclaimed > 0 {
                    log::info(format_args!("reclaimed {reclaimed} token(s) from pid {pid}: it exited holding them (fuse)"));
                }
            }
            inner.waiters.expire(broker, Instant::now());
            if inner.scanned_at.elapsed() >= KILL_SCAN {
                inner.scanned_at = Instant::now();
                let interrupted: Vec<u32> = inner.waiters.blocked_threads().filter(|&tid| procs::signal_pending(tid)).collect();
                for tid in interrupted {
                    inner.waiters.interrupt(broker, tid);
                }
            }
        });
    }
}
