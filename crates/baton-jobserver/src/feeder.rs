//! Feeding a build's FIFO from the pool: the rules (`plan`, pure and
//! tested on their own) and the `Feeder` that carries them out over the
//! broker connection.

use crate::{log, Fifo};
use baton_client::{Client, Error as ClientError};
use baton_core::protocol::{Reply, Request};
use std::time::{Duration, Instant};

/// What the feeder should do, from what it sees. Pure, so the rules are
/// tested on their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Plan {
    /// Bytes in the FIFO beyond what we put in: written by a client that
    /// gave back more than it took. Taken out and thrown away.
    pub discard: u32,
    /// Tokens the build wrote back: back to the pool.
    pub give_back: u32,
    /// Ask the pool for one more token.
    pub ask: bool,
}

/// What the feeder sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Seen {
    /// Bytes in the FIFO.
    pub queued: u32,
    /// Bytes in the return pipe (pipe style).
    pub returned: u32,
    /// Pool tokens the build has beyond CMD's own: in the FIFO or in use.
    pub lent: u32,
    /// The token we put in last is still there, unread.
    pub fresh: bool,
    /// A request for one more token is waiting at the pool.
    pub pending: bool,
    /// At most this many may be lent.
    pub max_lent: u32,
}

pub fn plan(seen: Seen) -> Plan {
    let total = seen.queued + seen.returned;
    let discard = total.saturating_sub(seen.lent);
    // Whatever was discarded, the fresh token can only be in the FIFO.
    let fresh = seen.queued.min(total - discard).min(u32::from(seen.fresh));
    let give_back = total - discard - fresh;
    // Giving a token back withdraws a pending request first (the protocol
    // allows nothing else while ACQUIRE waits), so the build asks again.
    let waiting = seen.pending && give_back == 0;
    Plan { discard, give_back, ask: !waiting && fresh == 0 && seen.lent - give_back < seen.max_lent }
}

/// How long a token may wait unread in the FIFO before it goes back to the
/// pool for others (and we queue for it again). Doubles while nobody else
/// wants it, up to the maximum, so an idle build costs a couple of round
/// trips per second at most.
pub const IDLE_FIRST: Duration = Duration::from_millis(100);
pub const IDLE_MAX: Duration = Duration::from_millis(1600);

/// Moves tokens between the pool and the build's FIFO.
pub struct Feeder {
    fifo: Fifo,
    /// Pool tokens the build has beyond CMD's own: in the FIFO or in use.
    lent: u32,
    max_lent: u32,
    /// An ACQUIRE 1 is waiting at the broker.
    pending: bool,
    /// The token we put in last has not been read yet.
    fresh: bool,
    /// Since when a token has waited unread in the FIFO.
    bait_since: Option<Instant>,
    idle_wait: Duration,
    warned_extra: bool,
    /// A bmake build aborted and the tokens put in before were taken out.
    stopper_placed: bool,
}

impl Feeder {
    /// Whether a request of ours waits at the broker (its reply is ours
    /// to read).
    pub fn is_waiting(&self) -> bool {
        self.pending
    }

    /// What to watch for the build's reads and writes.
    pub fn event_fds(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        self.fifo.event_fds()
    }

    /// The build touched its FIFO: note what it did (see [`Fifo::drain_events`]).
    pub fn on_fifo_event(&mut self) {
        self.fifo.drain_events();
    }

    /// Gives an idle token back if its time has come, then steps.
    pub fn tend(&mut self, client: &mut Client) -> Result<(), ClientError> {
        // An abort token waits unread on purpose.
        if self.fifo.bmake_abort().is_none() {
            self.on_idle(client)?;
        }
        self.step(client)
    }

    pub fn new(fifo: Fifo, max_lent: u32) -> Self {
        Feeder { fifo, lent: 0, max_lent, pending: false, fresh: false, bait_since: None, idle_wait: IDLE_FIRST, warned_extra: false, stopper_placed: false }
    }

    /// Brings the FIFO in line with the plan for what is in it now.
    pub fn step(&mut self, client: &mut Client) -> Result<(), ClientError> {
        if let Some(stopper) = self.fifo.bmake_abort() {
            return self.wind_down(client, stopper);
        }
        if self.fifo.keeps_bmake_returns() {
            return self.fill(client);
        }
        let queued = self.fifo.queued();
        if queued == 0 {
            self.fresh = false; // the build took it
        }
        let returned = self.fifo.returned();
        let seen = Seen { queued, returned, lent: self.lent, fresh: self.fresh, pending: self.pending, max_lent: self.max_lent };
        let plan = plan(seen);
        if plan.discard > 0 {
            self.discard(plan.discard);
        }
        if plan.give_back > 0 {
            // RELEASE is not allowed while ACQUIRE waits: withdraw it, and
            // queue again below, behind whoever the token goes to.
            if self.pending {
                self.cancel(client)?;
            }
            let taken = self.fifo.take(plan.give_back);
            if taken > 0 {
                client.release(taken)?;
                self.lent -= taken;
            }
        }
        // A cancel that raced with a grant left a fresh token: enough. A
        // command that never opened the FIFO (not a jobserver client) would
        // only sit on the token. And the build reads the FIFO too: a token
        // it wrote back may be in use again before we could take it out, so
        // the cap is checked against what is lent now, not the plan's look.
        if plan.ask && self.lent < self.max_lent && !self.pending && !self.fresh && self.fifo.in_use() {
            client.send(&Request::Acquire(1))?;
            self.pending = true;
        }
        self.note_bait();
        Ok(())
    }

    /// bmake's shape of the fifo style. bmake does not wait on its pipe:
    /// after an empty read it looks again only when one of its own jobs
    /// ends, so a token must be there when it looks, as in its own pipe,
    /// which its top make fills at the start. So every token the build may
    /// have waits in its FIFO, asked for one at a time at the pool's queue,
    /// and a token it gives back stays there for its next job. A token left
    /// unread for the idle time still goes back to the pool (`on_idle`).
    fn fill(&mut self, client: &mut Client) -> Result<(), ClientError> {
        let extra = self.fifo.queued().saturating_sub(self.lent);
        if extra > 0 {
            self.discard(extra);
        }
        if self.lent < self.max_lent && !self.pending {
            client.send(&Request::Acquire(1))?;
            self.pending = true;
        }
        self.note_bait();
        Ok(())
    }

    /// A bmake build aborted. The abort token is never a token: it only
    /// ever sits in the build's own FIFO, as in bmake's own pipe, and the
    /// pool never sees it. Tokens put in before the abort are taken out
    /// (a sub-make would otherwise start a job past it), tokens that come
    /// back go to the pool, and none go in: bmake starts no job after an
    /// abort, and its readers drain the pipe. Tokens a sub-make drained
    /// stay counted as the build's until it ends, when they all go back,
    /// so the pool is never promised a token the build might still use.
    fn wind_down(&mut self, client: &mut Client, stopper: u8) -> Result<(), ClientError> {
        self.withdraw(client)?;
        let unread = if self.stopper_placed { 0 } else { self.fifo.queued() };
        let back = self.fifo.take(self.fifo.returned() + unread).min(self.lent);
        if back > 0 {
            client.release(back)?;
            self.lent -= back;
        }
        self.stopper_placed = true;
        // A reader took it and puts it back (through us, in the pipe
        // style): until then, one for the next reader.
        if self.fifo.queued() == 0 {
            self.fifo.put_byte(stopper).map_err(|e| ClientError::Protocol(e.to_string()))?;
        }
        self.fresh = false;
        self.bait_since = None;
        Ok(())
    }

    fn discard(&mut self, n: u32) {
        let taken = self.fifo.take(n);
        if taken > 0 && !self.warned_extra {
            self.warned_extra = true;
            log::warn(format_args!(
                "the build wrote {taken} token(s) into its jobserver that it never took; they were thrown away"
            ));
        }
    }

    /// Takes the broker's answer to our pending request.
    pub fn on_reply(&mut self, reply: Reply) -> Result<(), ClientError> {
        match reply {
            Reply::Granted { tokens, .. } => {
                self.pending = false;
                self.fresh = true;
                self.lent += tokens;
                (0..tokens).try_for_each(|_| self.fifo.put()).map_err(|e| ClientError::Protocol(e.to_string()))?;
                Ok(())
            }
            other => Err(ClientError::Protocol(format!("unexpected {other:?}"))),
        }
    }

    /// Withdraws a pending request, if any, before the build's tokens are
    /// given back (the protocol allows nothing but CANCEL while one waits).
    pub fn withdraw(&mut self, client: &mut Client) -> Result<(), ClientError> {
        if self.pending {
            self.cancel(client)?;
        }
        Ok(())
    }

    /// Withdraws the pending request; a grant that won the race is kept.
    fn cancel(&mut self, client: &mut Client) -> Result<(), ClientError> {
        client.send(&Request::Cancel)?;
        loop {
            match client.read_reply()? {
                Reply::Cancelled { .. } => break,
                reply => self.on_reply(reply)?,
            }
        }
        self.pending = false;
        Ok(())
    }

    fn note_bait(&mut self) {
        match (self.fifo.queued() > 0, self.bait_since) {
            (true, None) => self.bait_since = Some(Instant::now()),
            (false, Some(_)) => {
                // The build took it: it is busy, so start idling afresh.
                self.bait_since = None;
                self.idle_wait = IDLE_FIRST;
            }
            _ => {}
        }
    }

    /// How long until an unread token should go back to the pool.
    pub fn idle_timeout(&self) -> Option<Duration> {
        let since = self.bait_since?;
        // A bmake build asks while tokens wait unread (see `fill`).
        (!self.pending || self.fifo.keeps_bmake_returns()).then(|| self.idle_wait.saturating_sub(since.elapsed()))
    }

    /// A token sat unread too long: give it back, so a build that waits
    /// elsewhere gets its turn; `step` then queues for one again, within the
    /// cap. If nobody else wants it, it comes straight back, and we wait
    /// twice as long before trying again.
    fn on_idle(&mut self, client: &mut Client) -> Result<(), ClientError> {
        if self.idle_timeout() != Some(Duration::ZERO) {
            return Ok(());
        }
        self.bait_since = None;
        self.fresh = false;
        self.withdraw(client)?;
        // The build may have read it since we looked: then nothing goes
        // back, and asking for another here would exceed the cap.
        if self.fifo.take(1) == 1 {
            client.release(1)?;
            self.lent -= 1;
            self.idle_wait = (self.idle_wait * 2).min(IDLE_MAX);
        } else {
            self.idle_wait = IDLE_FIRST;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(queued: u32, lent: u32, fresh: bool, pending: bool) -> Seen {
        Seen { queued, returned: 0, lent, fresh, pending, max_lent: 3 }
    }

    #[test]
    fn tokens_in_the_return_pipe_all_go_back() {
        let s = Seen { queued: 1, returned: 2, lent: 3, fresh: true, pending: false, max_lent: 3 };
        assert_eq!(plan(s), Plan { give_back: 2, ..Plan::default() });
        // Ten bytes written to W by a client that took one token.
        let s = Seen { queued: 0, returned: 10, lent: 1, fresh: false, pending: false, max_lent: 3 };
        assert_eq!(plan(s), Plan { discard: 9, give_back: 1, ask: true });
    }

    #[test]
    fn asks_for_a_token_when_the_fifo_is_empty() {
        assert_eq!(plan(seen(0, 0, false, false)), Plan { ask: true, ..Plan::default() });
        assert_eq!(plan(seen(0, 2, false, false)), Plan { ask: true, ..Plan::default() });
    }

    #[test]
    fn respects_the_cap_and_a_pending_request() {
        assert_eq!(plan(seen(0, 3, false, false)), Plan::default());
        assert_eq!(plan(seen(0, 1, false, true)), Plan::default());
    }

    #[test]
    fn keeps_the_fresh_token_and_asks_for_nothing_more() {
        assert_eq!(plan(seen(1, 1, true, false)), Plan::default());
    }

    #[test]
    fn tokens_written_back_go_to_the_pool_and_the_build_queues_again() {
        assert_eq!(plan(seen(1, 2, false, false)), Plan { give_back: 1, ask: true, ..Plan::default() });
        assert_eq!(plan(seen(3, 3, true, false)), Plan { give_back: 2, ..Plan::default() });
        // At the cap, giving one back makes room to ask again.
        assert_eq!(plan(seen(1, 3, false, false)), Plan { give_back: 1, ask: true, ..Plan::default() });
        // A pending request is withdrawn to give back, then made again.
        assert_eq!(plan(seen(1, 2, false, true)), Plan { give_back: 1, ask: true, ..Plan::default() });
    }

    #[test]
    fn bytes_beyond_what_was_lent_are_thrown_away() {
        // Lent 1, which is in use; the client wrote 10 bytes it never took.
        assert_eq!(plan(seen(10, 1, false, false)), Plan { discard: 9, give_back: 1, ask: true });
        assert_eq!(plan(seen(10, 0, false, false)), Plan { discard: 10, ask: true, ..Plan::default() });
    }

    /// The broker's side of the feeder's connection, played by a thread:
    /// it grants every ACQUIRE at once and notes every request after
    /// HELLO and the most tokens the connection ever held.
    struct PlayedBroker {
        dir: std::path::PathBuf,
        thread: std::thread::JoinHandle<(String, u32)>,
    }

    impl PlayedBroker {
        fn start(name: &str) -> (PlayedBroker, Client) {
            use std::io::{BufRead, BufReader, Write};
            let dir = std::env::temp_dir().join(format!("baton-feeder-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let socket = dir.join("socket");
            let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
            let thread = std::thread::spawn(move || {
                let (stream, _) = listener.accept().unwrap();
                let (mut requests, mut held, mut most) = (String::new(), 0u32, 0u32);
                for (i, line) in BufReader::new(&stream).lines().enumerate() {
                    let line = line.unwrap();
                    let reply = match line.split_once(' ') {
                        _ if i == 0 => "OK 1 1 8".to_string(),
                        Some(("ACQUIRE", n)) => {
                            held += n.parse::<u32>().unwrap();
                            format!("GRANTED {n} {held}")
                        }
                        Some(("RELEASE", n)) => {
                            held -= n.parse::<u32>().unwrap();
                            format!("RELEASED {n} {held}")
                        }
                        _ if line == "CANCEL" => "CANCELLED 0".to_string(),
                        _ => panic!("unexpected request {line:?}"),
                    };
                    if i > 0 {
                        requests.push_str(&line);
                        requests.push('\n');
                    }
                    most = most.max(held);
                    (&stream).write_all(format!("{reply}\n").as_bytes()).unwrap();
                }
                (requests, most)
            });
            let client = Client::connect(&socket, "feeder test").unwrap();
            (PlayedBroker { dir, thread }, client)
        }

        /// Every request after HELLO, and the most tokens held at once;
        /// `client` must be dropped first.
        fn finish(self) -> (String, u32) {
            let seen = self.thread.join().unwrap();
            let _ = std::fs::remove_dir_all(&self.dir);
            seen
        }
    }

    /// bmake does not wait on its pipe: its fifo style is filled to the
    /// cap, one request at a time, and a token bmake gives back stays for
    /// its next job instead of going back to the pool.
    #[test]
    fn a_bmake_fifo_is_filled_to_the_cap_and_keeps_what_bmake_gives_back() {
        use std::io::{Read, Write};
        let (broker, mut client) = PlayedBroker::start("bmake-fill");
        let mut fifo = Fifo::create(&broker.dir).unwrap();
        let (read, write) = fifo.open_both_ends().unwrap();
        fifo.sort_bmake_returns();
        let mut feeder = Feeder::new(fifo, 3);
        for _ in 0..4 {
            feeder.step(&mut client).unwrap();
            if feeder.is_waiting() {
                let reply = client.read_reply().unwrap();
                feeder.on_reply(reply).unwrap();
            }
        }
        assert_eq!((feeder.fifo.queued(), feeder.is_waiting()), (3, false));
        let (mut bmake_read, mut bmake_write) = (std::fs::File::from(read), std::fs::File::from(write));
        let mut token = [0u8];
        bmake_read.read_exact(&mut token).unwrap();
        bmake_write.write_all(&token).unwrap();
        feeder.on_fifo_event();
        feeder.step(&mut client).unwrap();
        assert_eq!(feeder.fifo.queued(), 3, "the token bmake gave back was taken out");
        drop(client);
        let (requests, most) = broker.finish();
        assert_eq!((requests.as_str(), most), ("ACQUIRE 1\nACQUIRE 1\nACQUIRE 1\n", 3));
    }

    /// Regression: the idle timer came due just as the build read the
    /// token; the feeder gave nothing back and asked for one more anyway,
    /// one past `--max`. The broker's side is played by the test, to see
    /// every request the feeder sends.
    #[test]
    fn a_token_read_as_its_idle_time_comes_does_not_break_the_cap() {
        use std::io::Read;
        let (broker, mut client) = PlayedBroker::start("idle");
        let mut feeder = Feeder::new(Fifo::create(&broker.dir).unwrap(), 1);
        let mut build = std::fs::File::open(feeder.fifo.path()).unwrap();
        feeder.on_fifo_event();
        feeder.pending = true;
        feeder.on_reply(Reply::Granted { tokens: 1, held: 2 }).unwrap();
        feeder.note_bait();
        // Unread for longer than the feeder waits before giving it back ...
        feeder.bait_since = Some(Instant::now() - IDLE_MAX * 2);
        // ... and read by the build just before the feeder looks.
        build.read_exact(&mut [0u8]).unwrap();
        feeder.tend(&mut client).unwrap();
        assert!(!feeder.is_waiting(), "asked for a second token under --max 1");
        drop(client);
        let (requests, _) = broker.finish();
        assert_eq!(requests, "", "the feeder sent requests though it was at its cap");
    }

    /// Regression: the build read back a token it had written back between
    /// the feeder's look at the FIFO and its taking the token out; the
    /// feeder gave nothing back but asked for another as if it had, one
    /// past the limit (the broker refused, and `baton run` lost it). A
    /// build that holds each token a moment, gives it back and at once
    /// takes it again runs against the feeder for a while; the broker's
    /// side checks the cap.
    #[test]
    fn a_token_the_build_takes_again_as_it_goes_back_does_not_break_the_cap() {
        use std::io::{Read, Write};
        let (broker, mut client) = PlayedBroker::start("retake");
        let mut feeder = Feeder::new(Fifo::create(&broker.dir).unwrap(), 1);
        let path = feeder.fifo.path().to_path_buf();
        let build = std::thread::spawn(move || {
            use std::os::unix::fs::OpenOptionsExt;
            let mut fifo = std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_NONBLOCK).open(path).unwrap();
            let deadline = Instant::now() + Duration::from_millis(500);
            let mut token = [0u8];
            while Instant::now() < deadline {
                if fifo.read(&mut token).is_ok() {
                    std::thread::sleep(Duration::from_micros(20));
                    fifo.write_all(&token).unwrap();
                }
            }
        });
        let deadline = Instant::now() + Duration::from_millis(500);
        while Instant::now() < deadline {
            feeder.on_fifo_event();
            feeder.step(&mut client).unwrap();
            if feeder.is_waiting() {
                let reply = client.read_reply().unwrap();
                feeder.on_reply(reply).unwrap();
            }
        }
        build.join().unwrap();
        feeder.withdraw(&mut client).unwrap();
        drop(client);
        let (requests, most) = broker.finish();
        assert!(requests.contains("RELEASE"), "the build never gave a token back to the feeder: {requests}");
        assert!(most <= 1, "the feeder held {most} tokens under --max 1");
    }
}
