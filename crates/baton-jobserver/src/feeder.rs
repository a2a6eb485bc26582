//! Feeding a build's FIFO from the pool: the rules (`plan`, pure and
//! tested on their own) and the `Feeder` that carries them out over the
//! broker connection.

use crate::{log, Fifo};
use baton_client::{Client, Error as ClientError};
use baton_core::protocol::{ErrorCode, Reply, Request};
use std::time::{Duration, Instant};

/// What the broker said when the feeder last looked (`WANTED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Wanted {
    /// Tokens that requests of other builds wait for.
    pub others: u32,
    /// Tokens nobody holds.
    pub free: u32,
}

/// What the feeder should do, from what it sees. Pure, so the rules are
/// tested on their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Plan {
    /// Bytes beyond what we put in: written by a client that gave back
    /// more than it took. Taken out (return pipe first) and thrown away.
    pub discard: u32,
    /// Spare tokens that go back to the pool for other builds (return
    /// pipe first, then the FIFO).
    pub give_back: u32,
    /// Tokens in the return pipe (pipe style) that go back into the FIFO
    /// for the build's next job.
    pub recycle: u32,
    /// Take up to this many more from the pool, as many as are free, if
    /// nobody waits (`TRY`), straight into the FIFO.
    pub top_up: u32,
    /// Queue at the pool for one more token (`ACQUIRE 1`), if the top-up
    /// got none.
    pub ask: bool,
}

/// What the feeder sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Seen {
    /// Bytes in the FIFO.
    pub queued: u32,
    /// Bytes in the return pipe (pipe style).
    pub returned: u32,
    /// Pool tokens the build has beyond CMD's own: in the FIFO, in the
    /// return pipe or in use.
    pub lent: u32,
    /// A request for one more token is waiting at the pool.
    pub pending: bool,
    /// At most this many may be lent.
    pub max_lent: u32,
    /// The broker's answer, if the feeder looked this step (see
    /// [`should_look`]); None: the last look, at most [`LOOK_EVERY`] ago,
    /// found nobody else waiting.
    pub wanted: Option<Wanted>,
}

/// Tokens of ours that the build is not using: unread in the FIFO or
/// written back (bytes beyond what we lent were made up by the build).
pub fn spare(seen: Seen) -> u32 {
    (seen.queued + seen.returned).min(seen.lent)
}

/// Whether to ask the broker who else waits before acting: only with
/// spare tokens (there is nothing to decide without), and then when the
/// last look is [`LOOK_EVERY`] old, or found other builds waiting (while
/// they wait, every token the build writes back is a candidate for them),
/// or a token came back through the return pipe (pipe style). That one
/// goes back into the FIFO only on a fresh answer: a lowered limit (or a
/// build that now waits) takes it before the build's next job can, so the
/// next job already obeys the new limit. (It used to go back first while
/// the last look, up to 50 ms old, found nobody: in a suite run, make
/// 4.4.1 started 2 jobs beside the one still running from before the limit
/// went from 4 to 1.) A look is one round trip to the broker per token
/// written back, a few tens of microseconds beside a job.
pub fn should_look(seen: Seen, due: bool, contended: bool) -> bool {
    !seen.pending && spare(seen) > 0 && (due || contended || seen.returned > 0)
}

/// The rules. A build keeps every token it has and may take every free one,
/// unread in its FIFO ahead of its reads (ninja 1.13 reads a token only as
/// it starts a job, and after finding the FIFO empty takes none until one
/// of its jobs ends), as long as no other build waits; spare tokens go
/// back as soon as a look finds one waiting.
pub fn plan(seen: Seen) -> Plan {
    let total = seen.queued + seen.returned;
    let spare = spare(seen);
    let discard = total - spare;
    let returned_left = seen.returned - seen.returned.min(discard);
    let Some(wanted) = seen.wanted else {
        // Out of tokens: fill up at once if the pool is idle (ninja reads
        // its first wave of tokens in one burst as it starts), else queue.
        let ask = spare == 0 && seen.lent < seen.max_lent && !seen.pending;
        let top_up = if ask { seen.max_lent - seen.lent } else { 0 };
        return Plan {
            discard,
            recycle: returned_left,
            top_up,
            ask,
            ..Plan::default()
        };
    };
    let give_back = wanted.others.min(spare);
    let recycle = returned_left - returned_left.min(give_back);
    let lent = seen.lent - give_back;
    let top_up = if wanted.others == 0 {
        wanted.free.min(seen.max_lent - lent)
    } else {
        0
    };
    let ask = spare - give_back + top_up == 0 && lent < seen.max_lent && !seen.pending;
    Plan {
        discard,
        give_back,
        recycle,
        top_up,
        ask,
    }
}

/// How often, at most, the feeder asks the broker whether other builds
/// wait while the build has spare tokens, unless the last look found some
/// waiting. It bounds how long a token sits unread in one build's FIFO
/// while another build waits: this, plus a round trip to the broker.
pub const LOOK_EVERY: Duration = Duration::from_millis(50);

/// How often a `fifo:` build that uses every token it has asks whether it
/// should give some back (a lowered limit, a waiting build, a gate): its
/// tokens come back into the FIFO and are read again at once, so it never
/// has a spare one to prompt a look. What a look finds is then taken back
/// as the build writes it (see `claw`).
pub const LOOK_IN_USE_EVERY: Duration = Duration::from_millis(200);

/// How often a build whose request a lowered limit refused tries again
/// (`TRY`), in case the limit went up: with no spare token it may have
/// nothing else that wakes the feeder.
pub const PAST_LIMIT_RETRY: Duration = Duration::from_millis(200);

/// Whether the broker refused a request because the build holds what a
/// lowered limit allows, or more: not the broker's end, only "not now".
pub fn refused_past_the_limit(e: &ClientError) -> bool {
    matches!(
        e,
        ClientError::Refused {
            code: ErrorCode::Range,
            ..
        }
    )
}

/// Moves tokens between the pool and the build's FIFO.
pub struct Feeder {
    fifo: Fifo,
    /// Pool tokens the build has beyond CMD's own: in the FIFO or in use.
    lent: u32,
    max_lent: u32,
    /// An ACQUIRE 1 is waiting at the broker.
    pending: bool,
    /// When we last asked the broker who else waits.
    last_look: Option<Instant>,
    /// That look found other builds waiting.
    contended: bool,
    /// The command is a known jobserver client: fill its FIFO before it
    /// opens it, so its first reads find tokens.
    eager: bool,
    /// Stray bytes taken out and not yet told to the broker (it may not
    /// be asked while an ACQUIRE of ours waits).
    stray_untold: u32,
    /// Stray bytes taken out in all.
    stray_total: u32,
    /// A bmake build aborted and the tokens put in before were taken out.
    stopper_placed: bool,
    /// The broker refused our last ACQUIRE: the build holds what the
    /// (lowered) limit allows. No ACQUIRE until a TRY or a look finds room.
    past_limit: bool,
}

impl Feeder {
    /// Whether a request of ours waits at the broker (its reply is ours
    /// to read).
    pub fn is_waiting(&self) -> bool {
        self.pending
    }

    /// What to watch for the build's reads and writes: nothing while
    /// [`Feeder::quiet`].
    pub fn event_fds(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        if self.quiet() {
            return Vec::new();
        }
        self.fifo.event_fds()
    }

    /// Nothing the build does with its FIFO needs an answer now: it has
    /// every token it may, no request of ours waits, nobody waited at the
    /// last look, and its tokens come back into the FIFO itself (not into
    /// the pipe style's return pipe, which we must empty). Then the feeder
    /// stops waking for each of the build's reads and writes (hundreds a
    /// second in a big build) and only looks every [`LOOK_EVERY`].
    pub fn quiet(&self) -> bool {
        self.lent == self.max_lent
            && !self.pending
            && !self.contended
            && !self.stopper_placed
            && !self.fifo.has_return_pipe()
            && self.fifo.clawing() == 0
    }

    /// Whether to ask the broker, though nothing is spare, whether the
    /// build should give tokens back: a `fifo:` build using every token
    /// it has (see [`LOOK_IN_USE_EVERY`]).
    fn in_use_look_due(&self, seen: Seen) -> bool {
        !self.fifo.has_return_pipe()
            && !self.pending
            && !self.stopper_placed
            && seen.lent > 0
            && spare(seen) == 0
            && self
                .last_look
                .is_none_or(|t| t.elapsed() >= LOOK_IN_USE_EVERY)
    }

    /// After a look: the tokens the build is using that should come back
    /// (others wait for more than is spare) are taken as it writes them
    /// back; none once nobody waits.
    fn claw_back(&mut self, others: u32) -> Result<(), ClientError> {
        if self.fifo.has_return_pipe() || self.stopper_placed {
            return Ok(());
        }
        let spare = spare(self.seen());
        let in_use = self.lent.saturating_sub(spare);
        let wanted = others.saturating_sub(spare).min(in_use);
        if wanted == 0 && self.fifo.clawing() == 0 {
            return Ok(());
        }
        self.fifo
            .claw(wanted)
            .map_err(|e| ClientError::Protocol(e.to_string()))
    }

    /// The build touched its FIFO: note what it did (see [`Fifo::drain_events`]).
    pub fn on_fifo_event(&mut self) {
        self.fifo.drain_events();
    }

    /// Brings the FIFO in line with the rules; the same as [`Feeder::step`],
    /// also called when [`Feeder::idle_timeout`] runs out.
    pub fn tend(&mut self, client: &mut Client) -> Result<(), ClientError> {
        if self.quiet() {
            // What the build did meanwhile, unheard: the FIFO says it all.
            self.fifo.drain_events();
        }
        self.step(client)
    }

    /// `eager`: the command is known to read its jobserver (make, ninja,
    /// cargo); otherwise nothing is fetched until it opens the FIFO.
    pub fn new(fifo: Fifo, max_lent: u32, eager: bool) -> Self {
        Feeder {
            fifo,
            lent: 0,
            max_lent,
            pending: false,
            last_look: None,
            contended: false,
            eager,
            stray_untold: 0,
            stray_total: 0,
            stopper_placed: false,
            past_limit: false,
        }
    }

    fn seen(&self) -> Seen {
        Seen {
            queued: self.fifo.queued(),
            returned: self.fifo.returned(),
            lent: self.lent,
            pending: self.pending,
            max_lent: self.max_lent,
            wanted: None,
        }
    }

    fn look_due(&self) -> bool {
        self.last_look.is_none_or(|t| t.elapsed() >= LOOK_EVERY)
    }

    /// Brings the FIFO in line with the plan for what is in it now.
    pub fn step(&mut self, client: &mut Client) -> Result<(), ClientError> {
        if let Some(stopper) = self.fifo.bmake_abort() {
            return self.wind_down(client, stopper);
        }
        // The build wrote a token back while we queue for one: we no longer
        // need it (and the protocol allows nothing else while it waits).
        if self.pending && spare(self.seen()) > 0 {
            self.cancel(client)?;
        }
        let mut seen = self.seen();
        if should_look(seen, self.look_due(), self.contended) || self.in_use_look_due(seen) {
            let (others, free) = client.wanted()?;
            self.past_limit &= free == 0;
            self.last_look = Some(Instant::now());
            self.contended = others > 0;
            self.claw_back(others)?;
            seen = Seen {
                wanted: Some(Wanted { others, free }),
                ..self.seen()
            };
        }
        self.carry_out(plan(seen), client)
    }

    fn carry_out(&mut self, plan: Plan, client: &mut Client) -> Result<(), ClientError> {
        if plan.discard > 0 {
            self.discard(plan.discard);
        }
        self.tell_stray(client)?;
        if plan.give_back > 0 {
            // The build may have taken some since we looked: give back
            // what is still there.
            let taken = self.fifo.take(plan.give_back);
            if taken > 0 {
                client.release(taken)?;
                self.lent -= taken;
            }
        }
        if plan.recycle > 0 {
            self.fifo
                .recycle(plan.recycle)
                .map_err(|e| ClientError::Protocol(e.to_string()))?;
        }
        // A command that never opens the FIFO (not a jobserver client)
        // would only sit on tokens. The build reads the FIFO too: the cap
        // is checked against what is lent now, not the plan's look.
        let room = self.max_lent - self.lent;
        if !(self.eager || self.fifo.in_use()) || self.pending {
            return Ok(());
        }
        let got = match plan.top_up.min(room) {
            0 => 0,
            n => client.try_up_to(n)?,
        };
        self.past_limit &= got == 0;
        self.lend(got)?;
        let may_ask = plan.ask && !self.past_limit && room > 0;
        if got == 0 && may_ask && self.fifo.queued() + self.fifo.returned() == 0 {
            client.send(&Request::Acquire(1))?;
            self.pending = true;
        }
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
        self.release_unused(client)?;
        self.stopper_placed = true;
        // A reader took it and puts it back (through us, in the pipe
        // style): until then, one for the next reader.
        if self.fifo.queued() == 0 {
            self.fifo
                .put_byte(stopper)
                .map_err(|e| ClientError::Protocol(e.to_string()))?;
        }
        Ok(())
    }

    fn lend(&mut self, tokens: u32) -> Result<(), ClientError> {
        self.lent += tokens;
        self.fifo
            .put(tokens)
            .map_err(|e| ClientError::Protocol(e.to_string()))
    }

    /// Takes out bytes the pool never lent: each is counted, the first
    /// said at once, and all of them told to the broker (`status` shows
    /// them per build).
    fn discard(&mut self, n: u32) {
        let taken = self.fifo.take(n);
        if taken > 0 && self.stray_total == 0 {
            log::warn(format_args!(
                "the build's jobserver held {taken} byte(s) more than the pool lent it \
                 (written by a client that gave back more than it took, or by another process); \
                 they were taken out"
            ));
        }
        self.stray_untold += taken;
        self.stray_total += taken;
    }

    /// Stray bytes taken out of the build's jobserver in all.
    pub fn stray_total(&self) -> u32 {
        self.stray_total
    }

    /// Tells the broker of stray bytes taken out since it was last told,
    /// once no request of ours waits there.
    fn tell_stray(&mut self, client: &mut Client) -> Result<(), ClientError> {
        if self.stray_untold > 0 && !self.pending {
            client.stray(self.stray_untold)?;
            self.stray_untold = 0;
        }
        Ok(())
    }

    /// Takes the broker's answer to our pending request, or its refusal: a
    /// refusal because the build holds what a lowered limit allows ends the
    /// request, not the connection (issue #32).
    pub fn on_answer(&mut self, answer: Result<Reply, ClientError>) -> Result<(), ClientError> {
        match answer {
            Ok(reply) => self.on_reply(reply),
            Err(e) if self.pending && refused_past_the_limit(&e) => {
                self.pending = false;
                self.past_limit = true;
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Takes the broker's answer to our pending request.
    pub fn on_reply(&mut self, reply: Reply) -> Result<(), ClientError> {
        match reply {
            Reply::Granted { tokens, .. } => {
                self.pending = false;
                self.lend(tokens)
            }
            other => Err(ClientError::Protocol(format!("unexpected {other:?}"))),
        }
    }

    /// CMD was killed and processes it started may run on: every token
    /// of ours the build is not using (unread, or written back) goes back
    /// to the pool now, so that they hold only what they use. A bmake
    /// abort token is left where it is: it was never a token.
    pub fn give_back_unused(&mut self, client: &mut Client) -> Result<(), ClientError> {
        self.withdraw(client)?;
        self.fifo.drain_events();
        self.release_unused(client)
    }

    /// Releases what the build is not using: the tokens written back and
    /// those still unread (none once a bmake abort token stands in the
    /// FIFO: what is there then is the abort token).
    fn release_unused(&mut self, client: &mut Client) -> Result<(), ClientError> {
        let unread = match self.stopper_placed {
            true => 0,
            false => self.fifo.queued(),
        };
        let back = self.fifo.take(self.fifo.returned() + unread).min(self.lent);
        if back > 0 {
            client.release(back)?;
            self.lent -= back;
        }
        Ok(())
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
            match client.read_reply() {
                Ok(Reply::Cancelled { .. }) => break,
                // The request was refused before the CANCEL arrived.
                answer => self.on_answer(answer)?,
            }
        }
        self.pending = false;
        Ok(())
    }

    /// We re-attached to a new broker: a request pending at the old one
    /// died with it, and what we learnt of other builds is stale. Until
    /// the first look, others are taken to wait: the new broker may have
    /// a smaller limit, and tokens the build wrote back while no broker
    /// answered must not go back into its FIFO before we ask (found by
    /// the soak: 3 jobs at once under a limit of 2 as a broker came back).
    pub fn reattached(&mut self) {
        self.pending = false;
        self.last_look = None;
        self.contended = true;
    }

    /// How long until the feeder should look again: only while the build
    /// has spare tokens, which may be wanted elsewhere.
    pub fn idle_timeout(&self) -> Option<Duration> {
        let until_look = self
            .last_look
            .map_or(Duration::ZERO, |t| LOOK_EVERY.saturating_sub(t.elapsed()));
        if self.quiet() {
            // Unheard, the build may have written a token back since: look
            // when due, or, if a step just found nothing to look at, in a
            // while (not at once, again and again).
            return Some(if until_look.is_zero() {
                LOOK_EVERY
            } else {
                until_look
            });
        }
        if self.past_limit && !self.pending {
            return Some(until_look.max(PAST_LIMIT_RETRY));
        }
        let seen = self.seen();
        if self.in_use_look_due(seen) {
            return Some(Duration::ZERO);
        }
        // After a bmake abort, the abort token waits unread on purpose.
        if self.pending || self.stopper_placed || spare(seen) == 0 {
            // A build using all it has is asked about in a while.
            let in_use_look = !self.fifo.has_return_pipe()
                && !self.pending
                && !self.stopper_placed
                && seen.lent > 0;
            return in_use_look.then(|| {
                self.last_look.map_or(Duration::ZERO, |t| {
                    LOOK_IN_USE_EVERY.saturating_sub(t.elapsed())
                })
            });
        }
        Some(until_look)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(queued: u32, lent: u32, pending: bool) -> Seen {
        Seen {
            queued,
            returned: 0,
            lent,
            pending,
            max_lent: 3,
            wanted: None,
        }
    }

    fn looked(seen: Seen, others: u32, free: u32) -> Seen {
        Seen {
            wanted: Some(Wanted { others, free }),
            ..seen
        }
    }

    #[test]
    fn asks_for_a_token_when_the_fifo_is_empty() {
        // As many as free right away if nobody waits, else queue for one.
        assert_eq!(
            plan(seen(0, 0, false)),
            Plan {
                top_up: 3,
                ask: true,
                ..Plan::default()
            }
        );
        assert_eq!(
            plan(seen(0, 2, false)),
            Plan {
                top_up: 1,
                ask: true,
                ..Plan::default()
            }
        );
    }

    #[test]
    fn respects_the_cap_and_a_pending_request() {
        assert_eq!(plan(seen(0, 3, false)), Plan::default());
        assert_eq!(plan(seen(0, 1, true)), Plan::default());
        assert_eq!(
            plan(looked(seen(1, 3, false), 0, 5)),
            Plan::default(),
            "no top-up past the cap"
        );
    }

    #[test]
    fn fills_the_fifo_with_every_free_token_while_nobody_else_waits() {
        assert_eq!(
            plan(looked(seen(1, 1, false), 0, 5)),
            Plan {
                top_up: 2,
                ..Plan::default()
            }
        );
        assert_eq!(
            plan(looked(seen(1, 1, false), 0, 1)),
            Plan {
                top_up: 1,
                ..Plan::default()
            }
        );
        assert_eq!(
            plan(looked(seen(1, 1, false), 0, 0)),
            Plan::default(),
            "nothing free: keep what we have"
        );
    }

    #[test]
    fn keeps_tokens_written_back_while_nobody_else_waits() {
        // Without a fresh look, the last one found nobody: keep them.
        assert_eq!(plan(seen(2, 3, false)), Plan::default());
        let s = Seen {
            returned: 2,
            ..seen(0, 3, false)
        };
        assert_eq!(
            plan(s),
            Plan {
                recycle: 2,
                ..Plan::default()
            },
            "the pipe style's returns go back into the FIFO"
        );
    }

    #[test]
    fn spare_tokens_go_to_builds_that_wait() {
        assert_eq!(
            plan(looked(seen(3, 3, false), 1, 0)),
            Plan {
                give_back: 1,
                ..Plan::default()
            }
        );
        // All spare tokens given back: the build queues again, behind them.
        assert_eq!(
            plan(looked(seen(1, 2, false), 4, 0)),
            Plan {
                give_back: 1,
                ask: true,
                ..Plan::default()
            }
        );
        assert_eq!(plan(looked(seen(1, 3, false), 0, 0)), Plan::default());
        // The return pipe first; what is left goes back into the FIFO.
        let s = Seen {
            returned: 2,
            ..seen(1, 3, false)
        };
        assert_eq!(
            plan(looked(s, 1, 0)),
            Plan {
                give_back: 1,
                recycle: 1,
                ..Plan::default()
            }
        );
    }

    #[test]
    fn looks_only_with_spare_tokens_when_due_or_contended() {
        assert!(
            !should_look(seen(0, 3, false), true, true),
            "nothing to decide"
        );
        assert!(
            !should_look(seen(1, 3, false), false, false),
            "looked a moment ago and nobody waited"
        );
        assert!(should_look(seen(1, 3, false), true, false));
        assert!(should_look(seen(1, 3, false), false, true));
        assert!(
            !should_look(seen(1, 3, true), true, true),
            "nothing but CANCEL while ACQUIRE waits"
        );
    }

    #[test]
    fn a_token_written_back_is_looked_at_before_it_goes_back_in() {
        let returned = Seen {
            returned: 1,
            lent: 3,
            ..seen(0, 3, false)
        };
        assert!(
            should_look(returned, false, false),
            "not due, nobody waited: a lowered limit may still want it"
        );
        assert!(
            !should_look(seen(1, 3, false), false, false),
            "unread in the FIFO, not due: the FIFO bridge looks every LOOK_EVERY"
        );
    }

    #[test]
    fn bytes_beyond_what_was_lent_are_thrown_away() {
        // Lent 1, which is in use; the client wrote 10 bytes it never took.
        assert_eq!(
            plan(looked(seen(10, 1, false), 1, 0)),
            Plan {
                discard: 9,
                give_back: 1,
                ask: true,
                ..Plan::default()
            }
        );
        assert_eq!(
            plan(seen(10, 0, false)),
            Plan {
                discard: 10,
                top_up: 3,
                ask: true,
                ..Plan::default()
            }
        );
        // Ten bytes written to W by a client that took one token.
        let s = Seen {
            returned: 10,
            ..seen(0, 1, false)
        };
        assert_eq!(
            plan(s),
            Plan {
                discard: 9,
                recycle: 1,
                ..Plan::default()
            }
        );
    }

    /// The broker's side of the feeder's connection, played by a thread:
    /// it grants every ACQUIRE and TRY at once, answers WANTED with `others`
    /// tokens waited for elsewhere and none free, and notes every request
    /// after HELLO and the most tokens the connection ever held.
    struct PlayedBroker {
        dir: std::path::PathBuf,
        thread: std::thread::JoinHandle<(String, u32)>,
    }

    impl PlayedBroker {
        fn start(name: &str, others: u32) -> (PlayedBroker, Client) {
            use std::io::{BufRead, BufReader, Write};
            let dir =
                std::env::temp_dir().join(format!("baton-feeder-{name}-{}", std::process::id()));
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
                        Some(("ACQUIRE" | "TRY", n)) => {
                            held += n.parse::<u32>().unwrap();
                            format!("GRANTED {n} {held}")
                        }
                        Some(("RELEASE", n)) => {
                            held -= n.parse::<u32>().unwrap();
                            format!("RELEASED {n} {held}")
                        }
                        _ if line == "CANCEL" => "CANCELLED 0".to_string(),
                        _ if line == "WANTED" => format!("WANTED {others} 0"),
                        Some(("STRAY", n)) => format!("STRAY {n}"),
                        _ => panic!("unexpected request {line:?}"),
                    };
                    if i > 0 {
                        requests.push_str(&line);
                        requests.push('\n');
                    }
                    most = most.max(held);
                    (&stream)
                        .write_all(format!("{reply}\n").as_bytes())
                        .unwrap();
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

    /// With every token it may have and nobody else waiting, the feeder
    /// stops listening to the build's reads and writes, but still looks
    /// on a timer; once another build waits, it listens again.
    #[test]
    fn a_build_with_all_it_may_have_is_not_listened_to_until_another_waits() {
        let (broker, mut client) = PlayedBroker::start("quiet", 1);
        let mut feeder = Feeder::new(Fifo::create(&broker.dir).unwrap(), 2, true);
        assert!(!feeder.quiet(), "nothing lent yet");
        feeder.tend(&mut client).unwrap();
        assert!(
            feeder.quiet() && feeder.event_fds().is_empty(),
            "both tokens lent, nobody seen waiting"
        );
        assert!(
            feeder.idle_timeout().is_some_and(|t| t <= LOOK_EVERY),
            "it still looks, on a timer"
        );
        feeder.last_look = Some(Instant::now() - LOOK_EVERY * 2);
        feeder.tend(&mut client).unwrap();
        assert!(
            !feeder.quiet() && !feeder.event_fds().is_empty(),
            "another build waits: listening again"
        );
        drop(client);
        let (requests, _) = broker.finish();
        assert_eq!(
            requests, "TRY 2\nWANTED\nRELEASE 1\n",
            "filled, then looked and gave the waiting build one"
        );
    }

    /// Regression: the idle timer came due just as the build read the
    /// token; the feeder gave nothing back and asked for one more anyway,
    /// one past `--max`. The broker's side is played by the test, to see
    /// every request the feeder sends.
    #[test]
    fn a_token_read_as_its_idle_time_comes_does_not_break_the_cap() {
        use std::io::Read;
        let (broker, mut client) = PlayedBroker::start("idle", 1);
        let mut feeder = Feeder::new(Fifo::create(&broker.dir).unwrap(), 1, false);
        let mut build = std::fs::File::open(feeder.fifo.path()).unwrap();
        feeder.on_fifo_event();
        feeder.pending = true;
        feeder
            .on_reply(Reply::Granted { tokens: 1, held: 2 })
            .unwrap();
        // Unread for longer than the feeder waits before looking again ...
        feeder.last_look = Some(Instant::now() - LOOK_EVERY * 2);
        // ... and read by the build just before the feeder looks.
        build.read_exact(&mut [0u8]).unwrap();
        feeder.tend(&mut client).unwrap();
        assert!(
            !feeder.is_waiting(),
            "asked for a second token under --max 1"
        );
        drop(client);
        let (requests, _) = broker.finish();
        assert_eq!(
            requests, "",
            "the feeder sent requests though it was at its cap"
        );
    }

    /// Regression: the build read back a token it had written back between
    /// the feeder's look at the FIFO and its taking the token out; the
    /// feeder gave nothing back but asked for another as if it had, one
    /// past the limit (the broker refused, and `baton run` lost it). A
    /// build that holds each token a moment, gives it back and soon takes
    /// it again runs against the feeder for a while; the broker's side
    /// checks the cap.
    #[test]
    fn a_token_the_build_takes_again_as_it_goes_back_does_not_break_the_cap() {
        use std::io::{Read, Write};
        let (broker, mut client) = PlayedBroker::start("retake", 1);
        let mut feeder = Feeder::new(Fifo::create(&broker.dir).unwrap(), 1, false);
        let path = feeder.fifo.path().to_path_buf();
        let build = std::thread::spawn(move || {
            use std::os::unix::fs::OpenOptionsExt;
            let mut fifo = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(path)
                .unwrap();
            let deadline = Instant::now() + Duration::from_millis(500);
            let mut token = [0u8];
            while Instant::now() < deadline {
                if fifo.read(&mut token).is_ok() {
                    std::thread::sleep(Duration::from_micros(20));
                    fifo.write_all(&token).unwrap();
                    // About a round trip to the broker: the feeder, which
                    // asks who waits before taking, wins some races.
                    std::thread::sleep(Duration::from_micros(100));
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
        assert!(
            requests.contains("RELEASE"),
            "the build never gave a token back to the feeder: {requests}"
        );
        assert!(most <= 1, "the feeder held {most} tokens under --max 1");
    }

    /// A feeder of at most `max_lent` tokens on a FIFO of its own, with no
    /// broker: for the rules that need none.
    fn feeder(scratch: &crate::tests::Scratch, max_lent: u32) -> Feeder {
        Feeder::new(Fifo::create(&scratch.0).unwrap(), max_lent, true)
    }

    #[test]
    fn a_refusal_past_a_lowered_limit_ends_the_request_not_the_connection() {
        let scratch = crate::tests::Scratch::new("feeder-refused");
        let mut feeder = feeder(&scratch, 2);
        let refused = |code| ClientError::Refused {
            code,
            message: "over the limit".into(),
        };
        assert!(refused_past_the_limit(&refused(ErrorCode::Range)));
        assert!(!refused_past_the_limit(&refused(ErrorCode::Busy)));
        assert!(!refused_past_the_limit(&ClientError::Disconnected));
        feeder.pending = true;
        assert!(feeder.is_waiting());
        assert!(feeder.on_answer(Err(refused(ErrorCode::Range))).is_ok());
        assert!(!feeder.is_waiting(), "the request is over");
        // With nothing else to wake it, it tries again in a while.
        assert_eq!(feeder.idle_timeout(), Some(PAST_LIMIT_RETRY));
        // Any other refusal, or one with no request of ours waiting, ends
        // the connection.
        feeder.pending = true;
        assert!(feeder.on_answer(Err(refused(ErrorCode::Busy))).is_err());
        let mut idle = self::feeder(&scratch, 2);
        assert!(idle.on_answer(Err(refused(ErrorCode::Range))).is_err());
    }

    #[test]
    fn a_grant_ends_the_request_and_its_tokens_go_into_the_fifo() {
        let scratch = crate::tests::Scratch::new("feeder-granted");
        let mut feeder = feeder(&scratch, 3);
        feeder.pending = true;
        feeder
            .on_answer(Ok(Reply::Granted { tokens: 2, held: 3 }))
            .unwrap();
        assert!(!feeder.is_waiting());
        assert_eq!((feeder.lent, feeder.fifo.queued()), (2, 2));
        assert!(feeder.on_reply(Reply::Cancelled { tokens: 0 }).is_err());
    }

    /// A `fifo:` build using every token it has (none spare in its FIFO)
    /// is asked about every [`LOOK_IN_USE_EVERY`]; one that has spare
    /// tokens, a return pipe, a request waiting or an abort under way is
    /// not.
    #[test]
    fn a_fifo_build_using_every_token_is_looked_at_in_a_while() {
        let scratch = crate::tests::Scratch::new("feeder-in-use");
        let mut feeder = feeder(&scratch, 3);
        assert!(
            !feeder.in_use_look_due(feeder.seen()),
            "nothing lent, nothing to take back"
        );
        feeder.lent = 2; // both read by the build, one short of its cap
        assert!(feeder.in_use_look_due(feeder.seen()), "never looked");
        feeder.last_look = Some(Instant::now());
        assert!(!feeder.in_use_look_due(feeder.seen()), "just looked");
        feeder.last_look = Some(Instant::now() - LOOK_IN_USE_EVERY);
        assert!(feeder.in_use_look_due(feeder.seen()), "looked long ago");
        assert_eq!(feeder.idle_timeout(), Some(Duration::ZERO), "due now");
        feeder.pending = true;
        assert!(!feeder.in_use_look_due(feeder.seen()), "a request waits");
        feeder.pending = false;
        feeder.stopper_placed = true;
        assert!(!feeder.in_use_look_due(feeder.seen()), "bmake aborted");
        feeder.stopper_placed = false;
        feeder.fifo.put(1).unwrap();
        assert!(
            !feeder.in_use_look_due(feeder.seen()),
            "a spare token: the usual look decides"
        );
        feeder.fifo.take(1);
        let _ends = feeder.fifo.open_pipe_ends().unwrap();
        assert!(
            !feeder.in_use_look_due(feeder.seen()),
            "the pipe style's tokens come back through its own pipe"
        );
    }

    /// The claw takes back, as the build writes them, the tokens others
    /// wait for beyond the spare ones, and stops once nobody waits.
    #[test]
    fn tokens_in_use_are_clawed_back_while_others_wait_for_them() {
        let scratch = crate::tests::Scratch::new("feeder-claw");
        let mut feeder = feeder(&scratch, 3);
        feeder.lent = 3;
        feeder.fifo.put(1).unwrap(); // one spare, two in use
        feeder.claw_back(1).unwrap();
        assert_eq!(feeder.fifo.clawing(), 0, "the spare one covers it");
        // (Not with the claw running: it would take the spare token.)
        feeder.fifo.take(1); // all three in use
        feeder.claw_back(2).unwrap();
        assert_eq!(feeder.fifo.clawing(), 2);
        assert!(!feeder.quiet(), "the claw's bytes must be heard");
        feeder.claw_back(5).unwrap();
        assert_eq!(feeder.fifo.clawing(), 3, "no more than are in use");
        feeder.claw_back(0).unwrap();
        assert_eq!(feeder.fifo.clawing(), 0, "nobody waits: stop taking");
        feeder.claw_back(0).unwrap();
        assert_eq!(feeder.fifo.clawing(), 0);
    }

    #[test]
    fn no_claw_for_the_pipe_style_or_after_a_bmake_abort() {
        let scratch = crate::tests::Scratch::new("feeder-no-claw");
        let mut aborted = feeder(&scratch, 3);
        aborted.lent = 3;
        aborted.stopper_placed = true;
        aborted.claw_back(3).unwrap();
        assert_eq!(aborted.fifo.clawing(), 0, "bmake aborted");
        drop(aborted);
        let mut pipe = feeder(&scratch, 3);
        let _ends = pipe.fifo.open_pipe_ends().unwrap();
        pipe.lent = 3;
        pipe.claw_back(3).unwrap();
        assert_eq!(pipe.fifo.clawing(), 0, "tokens come back through W");
    }

    #[test]
    fn a_look_at_the_cap_asks_for_nothing() {
        // A `fifo:` build using all of its 3 tokens is looked at (see
        // `in_use_look_due`): nobody waits, nothing is spare.
        assert_eq!(plan(looked(seen(0, 3, false), 0, 0)), Plan::default());
        assert_eq!(plan(looked(seen(0, 3, false), 0, 4)), Plan::default());
        assert_eq!(
            plan(looked(seen(0, 2, false), 0, 0)),
            Plan {
                ask: true,
                ..Plan::default()
            },
            "one short of the cap, nothing free: queue for it"
        );
    }

    /// The build's side of its FIFO, opened as a `fifo:` client does.
    fn build_end(feeder: &Feeder) -> std::fs::File {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(feeder.fifo.path())
            .unwrap()
    }

    #[test]
    fn a_build_with_spare_tokens_is_looked_at_only_when_the_last_look_is_old() {
        let (broker, mut client) = PlayedBroker::start("look-due", 0);
        let mut feeder = Feeder::new(Fifo::create(&broker.dir).unwrap(), 2, true);
        feeder.tend(&mut client).unwrap();
        feeder.tend(&mut client).unwrap(); // two spare tokens: look
                                           // As if it had looked a moment ago (a moment still to come, so
                                           // that the test does not race the clock).
        feeder.last_look = Some(Instant::now() + Duration::from_secs(3600));
        feeder.tend(&mut client).unwrap();
        feeder.last_look = Some(Instant::now() - LOOK_EVERY);
        feeder.tend(&mut client).unwrap();
        drop(client);
        let (requests, _) = broker.finish();
        assert_eq!(requests, "TRY 2\nWANTED\nWANTED\n");
    }

    /// While ACQUIRE waits, a token the build writes back is one it no
    /// longer needs: the request is withdrawn. Not before.
    #[test]
    fn a_waiting_request_is_withdrawn_once_the_build_writes_a_token_back() {
        use std::io::Write;
        let (broker, mut client) = PlayedBroker::start("cancel", 0);
        let mut feeder = Feeder::new(Fifo::create(&broker.dir).unwrap(), 2, true);
        let mut build = build_end(&feeder);
        // One token in use, and ACQUIRE 1 waiting (the broker played here
        // does not mind that it never saw it).
        feeder.lent = 1;
        feeder.pending = true;
        feeder.on_fifo_event();
        feeder.step(&mut client).unwrap();
        assert!(feeder.is_waiting(), "nothing written back: still waiting");
        build.write_all(b"+").unwrap();
        feeder.on_fifo_event();
        feeder.step(&mut client).unwrap();
        assert!(!feeder.is_waiting());
        drop(client);
        let (requests, _) = broker.finish();
        assert_eq!(requests, "CANCEL\nWANTED\n");
    }

    /// After it gave its spare token to a waiting build, a build queues
    /// again for one; not one that a lowered limit refused, while looks
    /// find nothing free (it tries again on a timer instead).
    #[test]
    fn a_build_refused_past_its_limit_queues_again_only_once_tokens_are_free() {
        use std::io::{Read, Write};
        for refused in [false, true] {
            let (broker, mut client) = PlayedBroker::start("past-limit", 1);
            let mut feeder = Feeder::new(Fifo::create(&broker.dir).unwrap(), 2, true);
            feeder.tend(&mut client).unwrap();
            let mut build = build_end(&feeder);
            build.read_exact(&mut [0u8; 2]).unwrap();
            feeder.past_limit = refused;
            build.write_all(b"+").unwrap();
            feeder.on_fifo_event();
            feeder.step(&mut client).unwrap();
            assert_eq!(feeder.is_waiting(), !refused, "refused: {refused}");
            if feeder.is_waiting() {
                // The grant, read before the connection closes.
                let reply = client.read_reply().unwrap();
                feeder.on_reply(reply).unwrap();
            }
            drop(client);
            let (requests, _) = broker.finish();
            let expected = if refused {
                "TRY 2\nWANTED\nRELEASE 1\n"
            } else {
                "TRY 2\nWANTED\nRELEASE 1\nACQUIRE 1\n"
            };
            assert_eq!(requests, expected, "refused: {refused}");
        }
    }

    /// While another build waits, every token the build writes back is a
    /// candidate for it: each step looks, not only every [`LOOK_EVERY`].
    #[test]
    fn while_another_build_waits_every_step_looks() {
        let (broker, mut client) = PlayedBroker::start("contended", 1);
        let mut feeder = Feeder::new(Fifo::create(&broker.dir).unwrap(), 3, true);
        feeder.tend(&mut client).unwrap();
        feeder.tend(&mut client).unwrap(); // looks: one build waits
                                           // Not due (as if it had just looked, without racing the clock).
        feeder.last_look = Some(Instant::now() + Duration::from_secs(3600));
        feeder.tend(&mut client).unwrap();
        drop(client);
        let (requests, _) = broker.finish();
        assert_eq!(requests, "TRY 3\nWANTED\nRELEASE 1\nWANTED\nRELEASE 1\n");
    }

    #[test]
    fn bytes_the_pool_never_lent_are_taken_out_and_told_to_the_broker() {
        use std::io::{Read, Write};
        let (broker, mut client) = PlayedBroker::start("stray", 0);
        let mut feeder = Feeder::new(Fifo::create(&broker.dir).unwrap(), 1, true);
        feeder.tend(&mut client).unwrap();
        let mut build = build_end(&feeder);
        build.read_exact(&mut [0u8]).unwrap();
        // It gives back three bytes for the one token it took.
        build.write_all(b"+++").unwrap();
        feeder.on_fifo_event();
        feeder.step(&mut client).unwrap();
        assert_eq!(feeder.stray_total(), 2);
        assert_eq!(feeder.fifo.queued(), 1, "its one token is left to it");
        drop(client);
        let (requests, _) = broker.finish();
        assert_eq!(requests, "TRY 1\nWANTED\nSTRAY 2\n");
    }

    /// Between a look and the giving back, the build may read the spare
    /// tokens: what is no longer there is not given back (RELEASE 0 is
    /// refused by the broker).
    #[test]
    fn a_token_the_build_took_since_the_look_is_not_given_back() {
        use std::io::Read;
        let (broker, mut client) = PlayedBroker::start("taken", 1);
        let mut feeder = Feeder::new(Fifo::create(&broker.dir).unwrap(), 2, true);
        feeder.tend(&mut client).unwrap();
        build_end(&feeder).read_exact(&mut [0u8; 2]).unwrap();
        let looked = Plan {
            give_back: 1,
            ..Plan::default()
        };
        feeder.carry_out(looked, &mut client).unwrap();
        assert_eq!(feeder.lent, 2, "both still the build's");
        drop(client);
        let (requests, _) = broker.finish();
        assert_eq!(requests, "TRY 2\n");
    }

    #[test]
    fn the_pipe_style_s_returned_tokens_go_back_into_its_fifo() {
        use std::io::{Read, Write};
        let (broker, mut client) = PlayedBroker::start("recycle", 0);
        let mut feeder = Feeder::new(Fifo::create(&broker.dir).unwrap(), 1, true);
        let (read, write) = feeder.fifo.open_pipe_ends().unwrap();
        let (mut read, mut write) = (std::fs::File::from(read), std::fs::File::from(write));
        feeder.tend(&mut client).unwrap();
        let mut token = [0u8];
        read.read_exact(&mut token).unwrap();
        write.write_all(&token).unwrap();
        feeder.step(&mut client).unwrap();
        assert_eq!((feeder.fifo.queued(), feeder.fifo.returned()), (1, 0));
        read.read_exact(&mut token).unwrap();
        drop(client);
        let (requests, _) = broker.finish();
        assert_eq!(requests, "TRY 1\nWANTED\n", "the same token, not a new one");
    }

    /// A plan made before the build wrote a token back asks for one it no
    /// longer needs: no ACQUIRE while a token waits in the FIFO or the
    /// return pipe.
    #[test]
    fn no_request_while_a_token_written_back_waits() {
        use std::io::Write;
        let (broker, mut client) = PlayedBroker::start("no-ask", 0);
        let mut feeder = Feeder::new(Fifo::create(&broker.dir).unwrap(), 3, true);
        let (_read, write) = feeder.fifo.open_pipe_ends().unwrap();
        feeder.lent = 1; // in use (this played broker does not count it)
        let ask = Plan {
            ask: true,
            ..Plan::default()
        };
        std::fs::File::from(write).write_all(b"+").unwrap();
        feeder.carry_out(ask, &mut client).unwrap();
        assert!(!feeder.is_waiting(), "one in the return pipe");
        feeder.fifo.recycle(1).unwrap();
        feeder.carry_out(ask, &mut client).unwrap();
        assert!(!feeder.is_waiting(), "one in the FIFO");
        drop(client);
        let (requests, _) = broker.finish();
        assert_eq!(requests, "");
    }

    /// bmake aborted (`E` written back): the tokens it has not read go
    /// back to the pool, and the abort token waits in the FIFO for its
    /// next reader, which stops.
    /// CMD was killed: what the build has not read goes back, what it
    /// uses stays lent (the broker keeps it while the build's processes
    /// live), and nothing is asked for after.
    #[test]
    fn a_killed_command_s_unread_tokens_go_back_and_those_in_use_stay() {
        use std::io::Read;
        let (broker, mut client) = PlayedBroker::start("killed", 0);
        let mut feeder = Feeder::new(Fifo::create(&broker.dir).unwrap(), 5, true);
        feeder.tend(&mut client).unwrap();
        assert_eq!(feeder.fifo.queued(), 5);
        build_end(&feeder).read_exact(&mut [0u8; 2]).unwrap(); // two in use
        feeder.give_back_unused(&mut client).unwrap();
        assert_eq!((feeder.lent, feeder.fifo.queued()), (2, 0));
        drop(client);
        let (requests, _) = broker.finish();
        assert_eq!(requests, "TRY 5\nRELEASE 3\n");
    }

    /// With every token in use there is nothing to give back, and no
    /// `RELEASE 0` (which the broker refuses) is sent.
    #[test]
    fn a_killed_command_using_every_token_gives_nothing_back() {
        use std::io::Read;
        let (broker, mut client) = PlayedBroker::start("all-in-use", 0);
        let mut feeder = Feeder::new(Fifo::create(&broker.dir).unwrap(), 2, true);
        feeder.tend(&mut client).unwrap();
        build_end(&feeder).read_exact(&mut [0u8; 2]).unwrap();
        feeder.give_back_unused(&mut client).unwrap();
        assert_eq!(feeder.lent, 2);
        drop(client);
        let (requests, _) = broker.finish();
        assert_eq!(requests, "TRY 2\n");
    }

    #[test]
    fn a_bmake_abort_gives_back_the_unread_tokens_and_leaves_the_abort_token() {
        use std::io::{Read, Write};
        let (broker, mut client) = PlayedBroker::start("abort", 0);
        let mut feeder = Feeder::new(Fifo::create(&broker.dir).unwrap(), 2, true);
        let (read, write) = feeder.fifo.open_pipe_ends().unwrap();
        let (mut read, mut write) = (std::fs::File::from(read), std::fs::File::from(write));
        feeder.fifo.sort_bmake_returns();
        feeder.tend(&mut client).unwrap();
        read.read_exact(&mut [0u8]).unwrap(); // one in use, one unread
        write.write_all(b"E").unwrap();
        feeder.on_fifo_event();
        feeder.step(&mut client).unwrap();
        assert_eq!(feeder.lent, 1, "the one in use stays the build's");
        let mut next = [0u8];
        read.read_exact(&mut next).unwrap();
        assert_eq!(next, *b"E", "the next reader finds the abort token");
        // Nothing more to give back (RELEASE 0 would be refused); one
        // abort token for the reader after.
        feeder.on_fifo_event();
        feeder.step(&mut client).unwrap();
        read.read_exact(&mut next).unwrap();
        assert_eq!(next, *b"E");
        drop(client);
        let (requests, _) = broker.finish();
        assert_eq!(requests, "TRY 2\nRELEASE 1\n");
    }

    /// Before the build's tokens go back, a request waiting at the broker
    /// is withdrawn; a grant that won the race is the build's.
    #[test]
    fn withdrawing_a_waiting_request_keeps_a_grant_that_won_the_race() {
        let (broker, mut client) = PlayedBroker::start("withdraw", 0);
        let mut feeder = Feeder::new(Fifo::create(&broker.dir).unwrap(), 2, true);
        feeder.withdraw(&mut client).unwrap();
        client.send(&Request::Acquire(1)).unwrap(); // granted at once
        feeder.pending = true;
        feeder.withdraw(&mut client).unwrap();
        assert!(!feeder.is_waiting());
        assert_eq!((feeder.lent, feeder.fifo.queued()), (1, 1));
        drop(client);
        let (requests, _) = broker.finish();
        assert_eq!(requests, "ACQUIRE 1\nCANCEL\n");
    }

    /// A pipe-style build of a cap of 2 against a played broker where one
    /// other build waits: the feeder lent both tokens and the build read
    /// them. Returns the build's write end (its return pipe).
    fn a_pipe_build_using_both_its_tokens(
        name: &str,
    ) -> (PlayedBroker, Client, Feeder, std::fs::File) {
        use std::io::Read;
        let (broker, mut client) = PlayedBroker::start(name, 1);
        let mut feeder = Feeder::new(Fifo::create(&broker.dir).unwrap(), 2, true);
        let (read, write) = feeder.fifo.open_pipe_ends().unwrap();
        let mut read = std::fs::File::from(read);
        feeder.tend(&mut client).unwrap();
        read.read_exact(&mut [0u8; 2]).unwrap();
        (broker, client, feeder, std::fs::File::from(write))
    }

    /// The feeder queued again behind the waiting build: its grant is read
    /// before the connection closes; then what the broker was asked.
    fn requeued_and_finished(
        broker: PlayedBroker,
        mut client: Client,
        feeder: &mut Feeder,
    ) -> String {
        assert!(feeder.is_waiting());
        let reply = client.read_reply().unwrap();
        feeder.on_reply(reply).unwrap();
        drop(client);
        broker.finish().0
    }

    /// Re-attached to a new broker (played here), which may have a smaller
    /// limit: a token the build wrote back meanwhile does not go back into
    /// its FIFO before a look, and the old broker's request is forgotten.
    #[test]
    fn after_re_attaching_the_feeder_looks_before_recycling_a_returned_token() {
        use std::io::Write;
        let (broker, mut client, mut feeder, mut write) =
            a_pipe_build_using_both_its_tokens("reattach");
        write.write_all(b"+").unwrap();
        // The old broker's last look found nobody (a moment still to come,
        // so as not to race the clock), and a request of ours waited there.
        feeder.last_look = Some(Instant::now() + Duration::from_secs(3600));
        feeder.pending = true;
        feeder.reattached();
        assert!(!feeder.is_waiting(), "the request died with the old broker");
        feeder.step(&mut client).unwrap();
        assert_eq!(
            (feeder.fifo.queued(), feeder.fifo.returned()),
            (0, 0),
            "given back, never put back"
        );
        assert_eq!(
            requeued_and_finished(broker, client, &mut feeder),
            "TRY 2\nWANTED\nRELEASE 1\nACQUIRE 1\n"
        );
    }

    /// Re-attached with every token lent (a `fifo:` build at its cap, which
    /// is otherwise left unheard between looks): until the new broker is
    /// asked, others are taken to wait, so the build's reads and writes are
    /// listened to again at once, not only at the next timed look.
    #[test]
    fn a_build_at_its_cap_is_listened_to_again_after_a_re_attach() {
        let scratch = crate::tests::Scratch::new("feeder-reattach-quiet");
        let mut feeder = feeder(&scratch, 2);
        feeder.lend(2).unwrap();
        assert!(feeder.quiet(), "at its cap with nobody waiting: unheard");
        feeder.reattached();
        assert!(!feeder.quiet(), "the new broker may want tokens back");
    }

    /// A lowered limit the last look (a moment ago) could not know of: the
    /// token a job writes back goes to the broker, which wants it, not into
    /// the FIFO for the build's next job (it used to: up to 50 ms after a
    /// look, a written-back token went straight back in).
    #[test]
    fn a_token_written_back_a_moment_after_a_look_is_asked_about_first() {
        use std::io::Write;
        let (broker, mut client, mut feeder, mut write) =
            a_pipe_build_using_both_its_tokens("fresh-look");
        // The last look found nobody, a moment ago (still to come, so as
        // not to race the clock); then the limit went down.
        feeder.last_look = Some(Instant::now() + Duration::from_secs(3600));
        feeder.contended = false;
        write.write_all(b"+").unwrap();
        feeder.step(&mut client).unwrap();
        assert_eq!(
            (feeder.fifo.queued(), feeder.fifo.returned(), feeder.lent),
            (0, 0, 1),
            "given back, not put back for the next job"
        );
        assert_eq!(
            requeued_and_finished(broker, client, &mut feeder),
            "TRY 2\nWANTED\nRELEASE 1\nACQUIRE 1\n"
        );
    }

    /// How long the run loop waits for nothing but the clock before it
    /// tends the feeder again. Each case a moment after a look (a moment
    /// still to come, so as not to race the clock).
    #[test]
    fn the_feeder_wakes_on_a_timer_only_when_a_look_may_find_something() {
        let scratch = crate::tests::Scratch::new("feeder-idle-timeout");
        let just_looked = || Some(Instant::now() + Duration::from_secs(3600));
        let mut fifo_build = feeder(&scratch, 3);
        fifo_build.last_look = just_looked();
        assert_eq!(fifo_build.idle_timeout(), None, "nothing lent yet");
        fifo_build.lent = 2; // both in use, one short of its cap
        assert_eq!(
            fifo_build.idle_timeout(),
            Some(LOOK_IN_USE_EVERY),
            "a fifo: build using all it has is asked about in a while"
        );
        fifo_build.fifo.put(1).unwrap();
        assert_eq!(
            fifo_build.idle_timeout(),
            Some(LOOK_EVERY),
            "a spare token: the next look is due sooner"
        );
        // bmake aborted: its abort token waits unread on purpose.
        fifo_build.fifo.take(1);
        fifo_build.fifo.put_byte(b'E').unwrap();
        fifo_build.stopper_placed = true;
        assert_eq!(fifo_build.idle_timeout(), None, "after a bmake abort");
        drop(fifo_build);

        let mut pipe_build = feeder(&scratch, 3);
        let _ends = pipe_build.fifo.open_pipe_ends().unwrap();
        pipe_build.last_look = just_looked();
        pipe_build.lent = 2;
        assert_eq!(
            pipe_build.idle_timeout(),
            None,
            "the pipe style's tokens come back through its return pipe, which wakes it"
        );
        pipe_build.pending = true;
        assert_eq!(
            pipe_build.idle_timeout(),
            None,
            "the broker's answer wakes it"
        );
    }
}
