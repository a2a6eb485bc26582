//! How other threads reach state that one thread owns: the event loop
//! (crate::socket) owns the broker's state (the `Broker`), and every
//! other thread (the gates' sampler, the cluster link, the FUSE control
//! thread, the metrics endpoint, the timers in crate::serve) posts it
//! errands through a [`Mailbox`]: closures the loop runs between two
//! rounds, whose answers come back if the poster waits for them. So the
//! state is never shared, no lock guards it, and what another thread does
//! to it happens at a point of the loop's choosing, as one step.

use mio::{Registry, Token, Waker};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Duration;

/// Work another thread asks of the loop, on its state `S`.
type Errand<S> = Box<dyn FnOnce(&mut S) + Send>;

/// How other threads reach the loop's state `S`. Cheap to clone.
pub struct Mailbox<S> {
    errands: Sender<Errand<S>>,
    waker: Arc<Waker>,
}

impl<S> Clone for Mailbox<S> {
    fn clone(&self) -> Self {
        Mailbox {
            errands: self.errands.clone(),
            waker: self.waker.clone(),
        }
    }
}

/// The loop's side of the mailbox.
pub struct Inbox<S> {
    errands: Receiver<Errand<S>>,
}

/// A mailbox whose errands wake the loop polling `registry`, through
/// `token`.
pub fn mailbox<S>(registry: &Registry, token: Token) -> std::io::Result<(Mailbox<S>, Inbox<S>)> {
    let (errands, inbox) = mpsc::channel();
    let waker = Arc::new(Waker::new(registry, token)?);
    Ok((Mailbox { errands, waker }, Inbox { errands: inbox }))
}

impl<S> Mailbox<S> {
    /// Has the loop run `errand` at its next round; false when the loop
    /// has ended.
    pub fn post(&self, errand: impl FnOnce(&mut S) + Send + 'static) -> bool {
        if self.errands.send(Box::new(errand)).is_err() {
            return false;
        }
        // A waker that fails has a full eventfd: the loop wakes anyway.
        let _ = self.waker.wake();
        true
    }

    /// Runs `errand` on the loop and returns what it returned; None when
    /// the loop has ended. Never call it from the loop's own thread, or
    /// before the loop runs from the thread that will run it.
    pub fn ask<T: Send + 'static>(
        &self,
        errand: impl FnOnce(&mut S) -> T + Send + 'static,
    ) -> Option<T> {
        self.ask_unless(&AtomicBool::new(false), errand)
    }

    /// [`Mailbox::ask`] for a thread that is stopped and joined: it gives
    /// up (None) once `stop` is set, so that whoever joins it never waits on
    /// a loop that is not running (the loop's own thread, joining it).
    pub fn ask_unless<T: Send + 'static>(
        &self,
        stop: &AtomicBool,
        errand: impl FnOnce(&mut S) -> T + Send + 'static,
    ) -> Option<T> {
        let (answer, answered) = mpsc::sync_channel(1);
        let posted = self.post(move |owned| {
            // The asker may have given up: then nobody needs the answer.
            let _ = answer.send(errand(owned));
        });
        if !posted {
            return None;
        }
        loop {
            match answered.recv_timeout(STOP_CHECK) {
                Ok(answer) => return Some(answer),
                Err(RecvTimeoutError::Timeout) if !stop.load(Ordering::Relaxed) => {}
                Err(_) => return None,
            }
        }
    }
}

/// How often a thread waiting on the loop looks at its stop flag: the
/// delay, at most, of joining it while the loop does not run.
const STOP_CHECK: Duration = Duration::from_millis(50);

impl<S> Inbox<S> {
    /// Runs every errand posted so far; how many.
    pub fn run_all(&self, owned: &mut S) -> usize {
        let mut ran = 0;
        while let Ok(errand) = self.errands.try_recv() {
            errand(owned);
            ran += 1;
        }
        ran
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mio::Poll;

    #[test]
    fn an_errand_runs_on_the_loop_and_its_answer_comes_back() {
        let poll = Poll::new().unwrap();
        let (mailbox, inbox) = mailbox::<u32>(poll.registry(), Token(0)).unwrap();
        let asker = std::thread::spawn(move || mailbox.ask(|limit| *limit * 2));
        let mut state = 7;
        while !asker.is_finished() {
            inbox.run_all(&mut state);
            std::thread::yield_now();
        }
        assert_eq!(asker.join().unwrap(), Some(14));
    }

    #[test]
    fn asking_a_loop_that_ended_answers_none() {
        let poll = Poll::new().unwrap();
        let (mailbox, inbox) = mailbox::<u32>(poll.registry(), Token(0)).unwrap();
        drop(inbox);
        assert!(!mailbox.post(|_| {}));
        assert_eq!(mailbox.ask(|limit| *limit), None);
    }

    #[test]
    fn a_stopped_asker_gives_up_on_a_loop_that_does_not_run() {
        let poll = Poll::new().unwrap();
        let (mailbox, _inbox) = mailbox::<u32>(poll.registry(), Token(0)).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let asker = std::thread::spawn(move || mailbox.ask_unless(&stopping, |limit| *limit));
        stop.store(true, Ordering::Relaxed);
        assert_eq!(asker.join().unwrap(), None);
    }

    /// An asker not told to stop waits for as long as the loop takes:
    /// here three of its looks at the stop flag.
    #[test]
    fn an_asker_not_stopped_waits_past_its_looks_at_the_flag() {
        let poll = Poll::new().unwrap();
        let (mailbox, inbox) = mailbox::<u32>(poll.registry(), Token(0)).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let asker = std::thread::spawn(move || mailbox.ask_unless(&stop, |limit| *limit + 1));
        // The errand is posted before the loop runs it, long after.
        std::thread::sleep(STOP_CHECK * 3);
        let mut state = 4;
        while !asker.is_finished() {
            inbox.run_all(&mut state);
            std::thread::yield_now();
        }
        assert_eq!(asker.join().unwrap(), Some(5));
    }

    #[test]
    fn errands_run_in_the_order_posted() {
        let poll = Poll::new().unwrap();
        let (mailbox, inbox) = mailbox::<Vec<u32>>(poll.registry(), Token(0)).unwrap();
        for n in [3, 5, 2] {
            mailbox.post(move |seen| seen.push(n));
        }
        let mut seen = Vec::new();
        assert_eq!(inbox.run_all(&mut seen), 3);
        assert_eq!(seen, [3, 5, 2]);
        assert_eq!(inbox.run_all(&mut seen), 0, "each errand runs once");
    }
}
