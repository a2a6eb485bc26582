//! The broker's side of a pile (docs/fastpath.md, "The pile"): a build's
//! region in which a freed token goes to whoever comes for it first.
//!
//! The pool stays the one book of tokens, as with the ring: the pile's
//! lent tokens are held in the pool by its lender, and only the broker
//! turns a `BROKER` word into anything else, so `lent` (which words are
//! out) is the broker's own book, and `held_by(lender) == lent.count()`
//! between any two of its moves.
//!
//! - **Open** (the same conditions as a ring's): every free token of the
//!   pool is put on the pile, as far as it has words.
//! - **Closed**: the pile's free tokens come back, every held one is
//!   recalled (its holder's release hands it to the broker and nudges
//!   it), and the closed word tells a client going to sleep to nudge the
//!   broker, which then asks the pool for one token per sleeper; each
//!   grant is put on the pile and rung for.
//! - **A client that dies**: the words naming its seat are seized (the
//!   broker's again), booked on its connection as the ring's are, and
//!   the model-checked repair takes its count out of the bell.
//! - **The audit** reads every word: one that is not a token word, one
//!   the broker did not lend that is not the broker's, or one naming a
//!   seat nobody sits in, was written by no correct client. The pile is
//!   then ended: each client keeps what its words say it holds, on its
//!   connection, and the build gets no region again.

use super::{FirstSeen, Offer, Seen, SEATS};
use crate::broker::Broker;
use crate::log;
use baton_client::fastpath::{futex_wake_one, Mapping};
use baton_core::fastpath::pile::{Bell, Pile, TokenWord, MAX_TOKENS};
use baton_core::fastpath::Seat;
use baton_core::{Acquired, BuildId, ClientId, Tag};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

/// The broker only wakes sleepers; it never sleeps on the bell.
struct Waker;

impl Bell for Waker {
    fn wait(&self, _: &AtomicU64, _: u32, _: Option<Instant>) {
        unreachable!("the broker never waits on a pile")
    }

    fn wake_one(&self, word: &AtomicU64) -> bool {
        futex_wake_one(word)
    }
}

/// One build's pile.
pub(super) struct PileRegion {
    pub(super) mapping: Arc<Mapping>,
    fd: OwnedFd,
    /// Holds the pile's lent tokens in the pool.
    pub(super) lender: ClientId,
    /// The client in each seat.
    pub(super) clients: Vec<Option<ClientId>>,
    /// Which token words the broker lent (the rest are its own).
    lent: Vec<bool>,
    /// Every free token of the pool goes on the pile.
    pub(super) open: bool,
    /// The lender's requests in the pool's queue, one per sleeper while
    /// the pile is closed.
    pub(super) asked: Vec<Tag>,
    next_tag: Tag,
    /// When each sleeping seat was first seen asleep; shared with STATUS.
    pub(super) first_seen: Arc<FirstSeen>,
    /// The broker still holds the liveness word.
    alive: bool,
}

/// Why an audit found a pile wrong, if it did.
fn wrong_word(word: TokenWord, lent: bool, seated: &[Option<ClientId>]) -> Option<&'static str> {
    match word {
        TokenWord::Bad(_) => Some("a token word no correct client writes"),
        TokenWord::Free | TokenWord::Held { .. } if !lent => Some("a token the broker never lent"),
        TokenWord::Held { seat, .. } if seated[usize::from(seat.0)].is_none() => {
            Some("a token held by a seat nobody sits in")
        }
        _ => None,
    }
}

impl PileRegion {
    /// A pile for `build`, with a token word for each token of the pool's
    /// limit (as far as a pile holds): a limit raised later reaches the
    /// build's fast-path clients when its pile is made again.
    pub(super) fn new(
        broker: &mut Broker,
        first: ClientId,
        build: BuildId,
    ) -> Result<PileRegion, String> {
        let tokens = (broker.pool().limit() as usize).clamp(1, MAX_TOKENS);
        let (mapping, fd) = Mapping::create_pile(tokens, SEATS)
            .map_err(|e| format!("the broker cannot make a pile: {e}"))?;
        mapping
            .hold_liveness()
            .map_err(|e| format!("the broker cannot lock the pile's liveness word: {e}"))?;
        let lender = broker.connect_lender(
            first,
            format!("[fast path of build {}: free on its pile]", build.0),
        );
        log::debug(format_args!(
            "fast path: a pile of {tokens} tokens for build {}",
            build.0
        ));
        Ok(PileRegion {
            mapping: Arc::new(mapping),
            fd,
            lender,
            clients: vec![None; SEATS],
            lent: vec![false; tokens],
            open: false,
            asked: Vec::new(),
            next_tag: 0,
            first_seen: Arc::default(),
            alive: true,
        })
    }

    fn pile(&self) -> Pile<'_> {
        self.mapping.pile()
    }

    /// What a client is told when it gets seat `seat`.
    pub(super) fn offer(&self, seat: usize) -> Offer<'_> {
        Offer {
            seat: seat as u32,
            bytes: (self.mapping.words().len() * 8) as u32,
            fd: self.fd.as_fd(),
        }
    }

    /// `seat`'s client is leaving: the tokens it holds are the broker's
    /// again, and its count comes out of the bell. Returns how many it
    /// held, for the caller to book on its connection.
    pub(super) fn repair(&mut self, seat: Seat) -> u32 {
        let seized = self.pile().seize(seat);
        for &i in &seized {
            self.lent[i] = false;
        }
        let (freed, recalled) = self.pile().repair(seat, &Waker);
        debug_assert_eq!((freed, recalled), (0, 0), "seized first");
        self.clients[usize::from(seat.0)] = None;
        seized.len() as u32
    }

    /// Tokens holders handed back to the broker (recalled, then
    /// released) go back to the pool.
    pub(super) fn collect(&mut self, broker: &mut Broker) {
        let pile = self.mapping.pile();
        let mut returned = 0;
        for (i, lent) in self.lent.iter_mut().enumerate() {
            if *lent && pile.token_word(i) == TokenWord::Broker {
                *lent = false;
                returned += 1;
            }
        }
        self.give_back(broker, returned);
    }

    fn give_back(&self, broker: &mut Broker, tokens: u32) {
        if tokens > 0 {
            broker
                .release(self.lender, tokens)
                .expect("the lender holds what the pile was lent");
        }
    }

    /// Puts one token the lender holds on the pile; false if the pile
    /// has no word for it.
    fn put_on_pile(&mut self) -> bool {
        let Some(i) = self.lent.iter().position(|&lent| !lent) else {
            return false;
        };
        if !self.pile().lend(i, &Waker) {
            return false; // forged: the audit ends the pile
        }
        self.lent[i] = true;
        true
    }

    /// A grant to the lender: onto the pile for a sleeper (or back to the
    /// pool if the pile has no word for it).
    pub(super) fn serve(&mut self, broker: &mut Broker, tokens: u32) {
        let placed = (0..tokens).take_while(|_| self.put_on_pile()).count() as u32;
        self.give_back(broker, tokens - placed);
    }

    /// Open: recalls are withdrawn, requests cancelled, and every free
    /// token of the pool goes on the pile.
    pub(super) fn lend(&mut self, broker: &mut Broker) {
        if !self.open {
            self.open = true;
            self.pile().closed().store(0, SeqCst);
            for i in 0..self.lent.len() {
                self.pile().unrecall(i);
            }
            for tag in std::mem::take(&mut self.asked) {
                broker.cancel(self.lender, tag);
            }
        }
        while self.lent.contains(&false) && broker.try_acquire(self.lender, 1) == Ok(true) {
            if !self.put_on_pile() {
                self.give_back(broker, 1);
                break;
            }
        }
    }

    /// Closed: free tokens come off the pile (while nobody sleeps for
    /// them), held ones are recalled, and each sleeper is one request of
    /// the lender in the pool.
    pub(super) fn hold_back(&mut self, broker: &mut Broker) {
        if self.open {
            self.open = false;
            // Before the sleepers are read: a client counted in after
            // this sees it and nudges.
            self.pile().closed().store(1, SeqCst);
        }
        let pile = self.mapping.pile();
        let sleepers = pile.bell_word().sleepers as usize;
        let mut taken = 0;
        for (i, lent) in self.lent.iter_mut().enumerate() {
            if !*lent {
                continue;
            }
            if sleepers == 0 && pile.take_back(i) {
                *lent = false;
                taken += 1;
            } else {
                pile.recall(i);
            }
        }
        self.give_back(broker, taken);
        self.ask_for_sleepers(broker, sleepers);
    }

    /// One request in the pool per sleeper that no free token on the
    /// pile is there for (a grant is put on the pile, and its sleeper may
    /// not have taken it yet), as far as the limit and the pile's words
    /// allow; requests nobody sleeps for are cancelled.
    fn ask_for_sleepers(&mut self, broker: &mut Broker, sleepers: usize) {
        let wanted = |region: &PileRegion, broker: &Broker| {
            let pool = broker.pool();
            let room = pool.limit().saturating_sub(pool.held_by(region.lender)) as usize;
            let words = region.lent.iter().filter(|&&lent| !lent).count();
            sleepers
                .saturating_sub(region.free_on_pile())
                .min(room)
                .min(words)
        };
        while self.asked.len() < wanted(self, broker) {
            let tag = self.next_tag;
            self.next_tag += 1;
            match broker.acquire(self.lender, tag, 1) {
                Ok(Acquired::Granted) => self.serve(broker, 1),
                Ok(Acquired::Queued) => self.asked.push(tag),
                Err(e) => {
                    log::warn(format_args!(
                        "fast path: asking the pool for a sleeper: {e}"
                    ));
                    break;
                }
            }
        }
        while self.asked.len() > wanted(self, broker) {
            let tag = self.asked.pop().expect("longer than wanted");
            broker.cancel(self.lender, tag);
        }
    }

    /// Lent tokens lying free on the pile.
    fn free_on_pile(&self) -> usize {
        let pile = self.pile();
        (0..self.lent.len())
            .filter(|&i| self.lent[i] && pile.token_word(i) == TokenWord::Free)
            .count()
    }

    /// Whether the pool's books hold on the lender what the broker's book
    /// says it lent (between rounds, once every grant to lenders is
    /// served).
    pub(super) fn balances(&self, broker: &Broker) -> bool {
        broker.pool().held_by(self.lender) as usize == self.lent.iter().filter(|&&l| l).count()
    }

    /// Reads every word against the broker's book of what it lent: why
    /// the pile is wrong, if it is.
    pub(super) fn audit(&self) -> Option<&'static str> {
        let pile = self.pile();
        (0..self.lent.len())
            .find_map(|i| wrong_word(pile.token_word(i), self.lent[i], &self.clients))
    }

    /// The pile as STATUS reads it: each seat's tokens, and the clients
    /// asleep on the bell.
    pub(super) fn seen(
        mapping: &Mapping,
        seated: &[(Seat, ClientId)],
        first_seen: &FirstSeen,
    ) -> Seen {
        let pile = mapping.pile();
        let holdings = pile.holdings();
        let asleep = pile.sleeping();
        let keys: Vec<u64> = asleep.iter().map(|s| u64::from(s.0)).collect();
        let since = first_seen.note(&keys, SystemTime::now());
        let client_at = |seat: Seat| seated.iter().find(|&&(s, _)| s == seat).map(|&(_, c)| c);
        Seen {
            holdings: seated
                .iter()
                .map(|&(seat, client)| (client, holdings[usize::from(seat.0)]))
                .collect(),
            waiting: asleep
                .into_iter()
                .zip(since)
                .filter_map(|(seat, since)| Some((client_at(seat)?, since)))
                .collect(),
        }
    }

    /// Ends the pile with its clients still in it (a handover, or an
    /// audit that found it wrong). The broker lets go of it first, so that
    /// each client's next operation uses the socket; then its free tokens
    /// come back to the pool and each seated client's are booked on its
    /// connection, until a pass finds nothing to move (an operation begun
    /// before the letting go moves a word or two); every sleeper wakes to
    /// find the pile gone, and each client's library moves what it held
    /// there to its connection's count.
    pub(super) fn evict(mut self, broker: &mut Broker) {
        self.let_go();
        while self.take_everything_back(broker) {}
        self.pile().wake_all(&Waker);
        self.retire(broker);
    }

    /// One pass of an eviction: whether it moved anything.
    fn take_everything_back(&mut self, broker: &mut Broker) -> bool {
        let pile = self.mapping.pile();
        // Free words come off the pile; their tokens stay the lender's
        // until the pile retires, which gives back all it holds.
        let mut moved = false;
        for (i, lent) in self.lent.iter_mut().enumerate() {
            if *lent && pile.take_back(i) {
                *lent = false;
                moved = true;
            }
        }
        for s in 0..SEATS {
            let Some(client) = self.clients[s] else {
                continue;
            };
            let seized = pile.seize(Seat(s as u16));
            for &i in &seized {
                self.lent[i] = false;
            }
            moved |= !seized.is_empty();
            if let Err(e) = broker.transfer(self.lender, client, seized.len() as u32) {
                log::warn(format_args!("fast path: booking a seat's tokens: {e}"));
            }
        }
        moved
    }

    /// The broker lets go of the pile's liveness word: a client sees the
    /// pile gone at its next operation, or its next wake-up.
    fn let_go(&mut self) {
        if !std::mem::replace(&mut self.alive, false) {
            return;
        }
        if let Err(e) = self.mapping.release_liveness() {
            log::warn(format_args!(
                "fast path: unlocking a pile's liveness word: {e}"
            ));
        }
    }

    /// The last client left (or the pile was evicted): what the lender
    /// holds goes back to the pool.
    pub(super) fn retire(mut self, broker: &mut Broker) {
        self.let_go();
        let left = broker.drop_lender(self.lender);
        log::debug(format_args!(
            "fast path: a pile closed, {left} token(s) back to the pool"
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::{ClientMeta, Transport};
    use crate::fastpath::Regions;
    use baton_core::protocol::FASTPATH_PILE;

    fn client(broker: &mut Broker) -> ClientId {
        let meta = ClientMeta::new(std::process::id(), "test".into(), Transport::Socket);
        broker.connect(meta)
    }

    #[test]
    fn the_audit_names_each_word_no_correct_client_writes() {
        let seated = [Some(ClientId(7)), None];
        let held_by = |s: u16| TokenWord::Held {
            seat: Seat(s),
            recalled: true,
        };
        assert_eq!(wrong_word(TokenWord::Free, true, &seated), None);
        assert_eq!(wrong_word(held_by(0), true, &seated), None);
        assert_eq!(wrong_word(TokenWord::Broker, true, &seated), None);
        assert_eq!(wrong_word(TokenWord::Broker, false, &seated), None);
        assert_eq!(
            wrong_word(TokenWord::Bad(9), true, &seated),
            Some("a token word no correct client writes")
        );
        for forged in [TokenWord::Free, held_by(0)] {
            assert_eq!(
                wrong_word(forged, false, &seated),
                Some("a token the broker never lent")
            );
        }
        assert_eq!(
            wrong_word(held_by(1), true, &seated),
            Some("a token held by a seat nobody sits in")
        );
    }

    /// A pile lends the pool's free tokens while alone; a departing
    /// client's tokens are booked on its connection, not put back on the
    /// pile; and the pile's last client takes the rest back to the pool.
    #[test]
    fn a_pile_lends_the_pool_and_a_departure_books_what_it_held() {
        let mut broker = Broker::new(3).unwrap();
        let mut regions = Regions::default();
        let a = client(&mut broker);
        broker.start_build(a, 1, "one build".into()).unwrap();
        let b = client(&mut broker);
        let mapping = seat_on_pile(&mut regions, &mut broker, a);
        regions.offer(&mut broker, b, FASTPATH_PILE).unwrap();
        regions.round(&mut broker);
        assert_eq!((broker.pool().held(), broker.pool().free()), (3, 0));
        let pile = mapping.pile();
        let bell = Waker;
        for _ in 0..2 {
            pile.acquire(Seat(0), &bell, None, true).unwrap();
        }
        regions.leave(&mut broker, a);
        assert_eq!(broker.pool().held_by(a), 2, "booked on a's connection");
        assert_eq!(pile.holdings()[0], 0);
        let words: Vec<_> = (0..3).map(|i| pile.token_word(i)).collect();
        assert_eq!(
            words,
            [TokenWord::Broker, TokenWord::Broker, TokenWord::Free],
            "out of the pile, not free on it"
        );
        assert_eq!(broker.status().totals.fastpath_repairs, 1);
        regions.leave(&mut broker, b);
        assert!(regions.is_empty());
        assert_eq!((broker.pool().held(), broker.pool().free()), (2, 1));
        broker.disconnect(a);
        assert_eq!((broker.pool().held(), broker.pool().free()), (0, 3));
    }

    /// Closed by another build's wait: the free tokens come off, the held
    /// ones are recalled, each sleeper is one request in the pool, and a
    /// request nobody sleeps for any more is cancelled.
    #[test]
    fn a_closed_pile_asks_the_pool_once_per_sleeper() {
        let mut broker = Broker::new(2).unwrap();
        let mut regions = Regions::default();
        let other = client(&mut broker);
        let a = client(&mut broker);
        broker.start_build(a, 1, "one build".into()).unwrap();
        let mapping = seat_on_pile(&mut regions, &mut broker, a);
        regions.round(&mut broker);
        let pile = mapping.pile();
        pile.acquire(Seat(0), &Waker, None, true).unwrap();
        assert_eq!(broker.acquire(other, 0, 2), Ok(Acquired::Queued));
        regions.round(&mut broker);
        assert_eq!(pile.closed().load(SeqCst), 1);
        assert_eq!(broker.pool().free(), 1, "the free token came off");
        assert_eq!(
            pile.token_word(0),
            TokenWord::Held {
                seat: Seat(0),
                recalled: true
            }
        );
        // Two sleepers counted in, as sleeping acquires leave them.
        mapping.words()[8].fetch_add(2 << 32, SeqCst);
        regions.round(&mut broker);
        assert_eq!(the_pile(&regions).asked.len(), 1, "room for one");
        mapping.words()[8].fetch_sub(2 << 32, SeqCst);
        regions.round(&mut broker);
        assert!(the_pile(&regions).asked.is_empty(), "nobody sleeps now");
        assert_eq!(
            pile.release(Seat(0), 0, &Waker),
            Ok(baton_core::fastpath::pile::Released::ToBroker)
        );
        regions.round(&mut broker);
        assert_eq!(broker.pool().held_by(other), 2, "both to the other build");
        regions.leave(&mut broker, a);
        assert_eq!(broker.pool().held(), 2);
    }

    /// STATUS lists the tokens each seat's words name as its client's,
    /// the rest of what the pile was lent as its lender's, and each seat
    /// whose record says it sleeps as a waiter of its client.
    #[test]
    fn status_lists_a_piles_holders_and_sleepers_as_their_clients() {
        let mut broker = Broker::new(2).unwrap();
        let mut regions = Regions::default();
        let a = client(&mut broker);
        broker.start_build(a, 1, "one build".into()).unwrap();
        let meta = ClientMeta::new(std::process::id(), "b".into(), Transport::Socket);
        let b = broker.connect(meta);
        let mapping = seat_on_pile(&mut regions, &mut broker, a);
        regions.offer(&mut broker, b, FASTPATH_PILE).unwrap();
        regions.round(&mut broker);
        mapping.pile().acquire(Seat(1), &Waker, None, true).unwrap();
        // Seat 0's record says it sleeps (word 16 + 2 tokens + seat 0).
        mapping.words()[18].store(1, SeqCst);
        let status = broker.status();
        let mut holders: Vec<(String, u32)> = status
            .holders
            .iter()
            .map(|h| (h.command.clone(), h.tokens))
            .collect();
        holders.sort();
        let build = broker.pool().build_of(a).unwrap().0;
        let free = format!("[fast path of build {build}: free on its pile]");
        assert_eq!(holders, [(free, 1), ("b".into(), 1)], "{status:#?}");
        let waiters: Vec<_> = status
            .waiters
            .iter()
            .map(|w| (w.command.as_str(), w.transport.as_str(), w.tokens))
            .collect();
        assert_eq!(waiters, [("test", "fastpath", 1)], "a's seat: {status:#?}");
        mapping.words()[18].store(0, SeqCst);
        assert!(broker.status().waiters.is_empty());
        for id in [a, b] {
            regions.leave(&mut broker, id);
        }
    }

    /// A sleeper that only a wake-up ends: its futex wait has no deadline
    /// and no look at the broker (the client library looks once a second,
    /// which would hide a broker that never wakes anybody).
    struct Deaf;

    impl Bell for Deaf {
        fn wait(&self, word: &AtomicU64, expected: u32, _: Option<Instant>) {
            baton_client::fastpath::futex_wait(word, expected, None);
        }

        fn wake_one(&self, word: &AtomicU64) -> bool {
            futex_wake_one(word)
        }
    }

    /// A token the broker puts on the pile (another build gave it back,
    /// and the pile reopened) wakes the client asleep on the bell.
    #[test]
    fn a_token_the_broker_lends_wakes_a_sleeper() {
        let mut broker = Broker::new(1).unwrap();
        let mut regions = Regions::default();
        let other = client(&mut broker);
        let a = client(&mut broker);
        broker.start_build(a, 1, "one build".into()).unwrap();
        let mapping = Arc::new(seat_on_pile(&mut regions, &mut broker, a));
        // The other build holds the one token: nothing to lend yet.
        assert_eq!(broker.try_acquire(other, 1), Ok(true));
        regions.round(&mut broker);
        // Not a scoped thread: one never woken must fail the test, not
        // hang it.
        let shared = mapping.clone();
        let (tid_tx, tid) = std::sync::mpsc::channel();
        let sleeper = std::thread::spawn(move || {
            // SAFETY: gettid has no arguments and cannot fail.
            tid_tx.send(unsafe { libc::gettid() }).unwrap();
            shared.pile().acquire(Seat(0), &Deaf, None, false)
        });
        // In the kernel, in futex_wait, not merely about to be: so only a
        // wake can end its wait.
        let wchan = format!("/proc/self/task/{}/wchan", tid.recv().unwrap());
        let patience = std::time::Duration::from_secs(60);
        baton_testkit::wait_for(patience, "the sleeper to sleep in futex_wait", || {
            std::fs::read_to_string(&wchan).is_ok_and(|w| w.contains("futex"))
        });
        broker.release(other, 1).unwrap();
        regions.round(&mut broker);
        let woken = baton_testkit::join_within(sleeper, patience, "the sleeper");
        assert_eq!(woken, Ok(baton_core::fastpath::pile::Acquired::Token(0)));
        regions.leave(&mut broker, a);
        broker.disconnect(a);
        assert_eq!(broker.pool().free(), 1);
    }

    /// A pile closed while another build holds every token: each of two
    /// sleepers is one request in the pool, each with its own tag.
    #[test]
    fn two_sleepers_behind_a_closed_pile_are_two_requests() {
        let mut broker = Broker::new(3).unwrap();
        let mut regions = Regions::default();
        let other = client(&mut broker);
        let a = client(&mut broker);
        broker.start_build(a, 1, "one build".into()).unwrap();
        let mapping = seat_on_pile(&mut regions, &mut broker, a);
        let third = client(&mut broker);
        assert_eq!(broker.try_acquire(other, 3), Ok(true));
        assert_eq!(broker.acquire(third, 0, 1), Ok(Acquired::Queued));
        regions.round(&mut broker);
        mapping.words()[8].fetch_add(2 << 32, SeqCst);
        regions.round(&mut broker);
        assert_eq!(the_pile(&regions).asked.len(), 2);
        assert_eq!(broker.pool().waiting(), 3, "the third's request and two");
        broker.release(other, 3).unwrap();
        assert_eq!(broker.pool().held_by(third), 1, "first in line");
        regions.round(&mut broker); // the grants, each onto the pile
        let free: Vec<_> = (0..3).map(|i| mapping.pile().token_word(i)).collect();
        assert_eq!(free.iter().filter(|&&w| w == TokenWord::Free).count(), 2);
        broker.release(third, 1).unwrap();
        mapping.words()[8].fetch_sub(2 << 32, SeqCst);
        regions.leave(&mut broker, a);
        assert_eq!(broker.pool().free(), 3);
    }

    /// A sleeper behind a pile closed by another build's region gets one
    /// token from the pool, not every free one; and a round before it has
    /// taken it asks for no other.
    #[test]
    fn a_sleeper_is_lent_one_token_however_many_rounds_pass() {
        let mut broker = Broker::new(3).unwrap();
        let mut regions = Regions::default();
        let other = client(&mut broker);
        regions.offer(&mut broker, other, FASTPATH_PILE).unwrap();
        let a = client(&mut broker);
        broker.start_build(a, 1, "one build".into()).unwrap();
        let mapping = seat_on_pile(&mut regions, &mut broker, a);
        regions.round(&mut broker);
        assert_eq!(broker.pool().free(), 3, "two piles: both closed");
        mapping.words()[8].fetch_add(1 << 32, SeqCst);
        for round in 0..3 {
            regions.round(&mut broker);
            assert_eq!(broker.pool().free(), 2, "round {round}: one lent");
        }
        mapping.words()[8].fetch_sub(1 << 32, SeqCst);
        regions.round(&mut broker);
        assert_eq!(broker.pool().free(), 3, "nobody sleeps: taken back");
        for id in [a, other] {
            regions.leave(&mut broker, id);
        }
    }

    /// A closed pile whose one lent token is held, not free: its sleeper
    /// is one request (no free token on the pile waits for it).
    #[test]
    fn a_held_token_is_not_counted_as_waiting_for_a_sleeper() {
        let mut broker = Broker::new(2).unwrap();
        let mut regions = Regions::default();
        let third = client(&mut broker);
        let a = client(&mut broker);
        broker.start_build(a, 1, "one build".into()).unwrap();
        let mapping = seat_on_pile(&mut regions, &mut broker, a);
        regions.round(&mut broker);
        mapping.pile().acquire(Seat(0), &Waker, None, true).unwrap();
        assert_eq!(broker.acquire(third, 0, 1), Ok(Acquired::Queued));
        regions.round(&mut broker);
        assert_eq!(
            broker.pool().held_by(third),
            1,
            "the free one went to the third"
        );
        // The third asks again: the pile stays closed.
        assert_eq!(broker.acquire(third, 1, 1), Ok(Acquired::Queued));
        mapping.words()[8].fetch_add(1 << 32, SeqCst);
        regions.round(&mut broker);
        assert_eq!(the_pile(&regions).asked.len(), 1);
        mapping.words()[8].fetch_sub(1 << 32, SeqCst);
        broker.cancel(third, 1);
        regions.leave(&mut broker, a);
        broker.disconnect(a);
        broker.release(third, 1).unwrap();
        assert_eq!(broker.pool().free(), 2);
    }

    /// The pool's books and the broker's book of what it lent agree while
    /// the broker alone moves tokens; a token moved behind the pile's back
    /// unbalances them, and the audit ends the pile for it.
    #[test]
    fn the_audit_ends_a_pile_whose_lender_holds_what_it_did_not_lend() {
        let mut broker = Broker::new(2).unwrap();
        let mut regions = Regions::default();
        let other = client(&mut broker);
        let a = client(&mut broker);
        broker.start_build(a, 1, "one build".into()).unwrap();
        regions.offer(&mut broker, a, FASTPATH_PILE).unwrap();
        regions.round(&mut broker);
        assert!(the_pile(&regions).balances(&broker));
        let lender = the_pile(&regions).lender;
        broker.transfer(lender, other, 1).unwrap();
        assert!(!the_pile(&regions).balances(&broker));
        regions.audit_piles(&mut broker);
        assert!(regions.is_empty(), "the pile ended");
        assert_eq!(broker.status().totals.fastpath_mismatches, 1);
        regions.leave(&mut broker, a);
    }

    /// One of two requests granted, then the build ahead stops waiting:
    /// the pile, alone and with nobody else waiting, opens, and the
    /// request not granted leaves the pool's queue (a request left there
    /// untracked would count as another build waiting, and keep the pile
    /// closed).
    #[test]
    fn a_pile_that_reopens_leaves_no_request_in_the_pool() {
        let mut broker = Broker::new(3).unwrap();
        let mut regions = Regions::default();
        let other = client(&mut broker);
        let third = client(&mut broker);
        let a = client(&mut broker);
        broker.start_build(a, 1, "one build".into()).unwrap();
        let mapping = seat_on_pile(&mut regions, &mut broker, a);
        assert_eq!(broker.try_acquire(other, 3), Ok(true));
        assert_eq!(broker.acquire(third, 0, 1), Ok(Acquired::Queued));
        regions.round(&mut broker);
        mapping.words()[8].fetch_add(2 << 32, SeqCst);
        regions.round(&mut broker);
        assert_eq!(the_pile(&regions).asked, [0, 1]);
        // The third asks again, behind the pile's two: the pile stays closed.
        assert_eq!(broker.acquire(third, 1, 1), Ok(Acquired::Queued));
        broker.release(other, 2).unwrap(); // one to the third, one to the pile
        regions.round(&mut broker);
        assert_eq!(the_pile(&regions).asked, [1], "the granted one is gone");
        assert_eq!(broker.pool().held_by(third), 1);
        broker.cancel(third, 1);
        mapping.words()[8].fetch_sub(2 << 32, SeqCst);
        regions.round(&mut broker);
        assert!(the_pile(&regions).open, "alone, nobody else waiting");
        assert_eq!(broker.pool().waiting(), 0, "no request left behind");
        regions.leave(&mut broker, a);
        broker.release(third, 1).unwrap();
        broker.release(other, 1).unwrap();
        assert_eq!(broker.pool().free(), 3);
    }

    /// Two builds' piles, both closed: one's recalled token goes back to
    /// the pool in a round and is granted at once to the other's lender,
    /// which serves it only in the next round. A round that ends with a
    /// grant not yet served must not be taken for unbalanced books (a
    /// debug build checks them after every round).
    #[test]
    fn a_grant_to_another_pile_in_the_same_round_is_served_in_the_next() {
        let mut broker = Broker::new(1).unwrap();
        let mut regions = Regions::default();
        let b = client(&mut broker);
        let b_pile = seat_on_pile(&mut regions, &mut broker, b);
        let a = client(&mut broker);
        broker.start_build(a, 1, "one build".into()).unwrap();
        let a_pile = seat_on_pile(&mut regions, &mut broker, a);
        regions.round(&mut broker);
        // a's sleeper is served first, then b's waits for the one token.
        a_pile.words()[8].fetch_add(1 << 32, SeqCst);
        regions.round(&mut broker);
        a_pile.words()[8].fetch_sub(1 << 32, SeqCst);
        assert_eq!(
            a_pile.pile().acquire(Seat(0), &Waker, None, true),
            Ok(baton_core::fastpath::pile::Acquired::Token(0))
        );
        b_pile.words()[8].fetch_add(1 << 32, SeqCst);
        regions.round(&mut broker);
        assert_eq!(broker.pool().waiting(), 1, "b's request");
        regions.round(&mut broker); // recalls a's token
        assert_eq!(
            a_pile.pile().release(Seat(0), 0, &Waker),
            Ok(baton_core::fastpath::pile::Released::ToBroker)
        );
        regions.round(&mut broker); // back to the pool, granted to b's lender
        regions.round(&mut broker); // onto b's pile
        assert_eq!(b_pile.pile().token_word(0), TokenWord::Free);
        b_pile.words()[8].fetch_sub(1 << 32, SeqCst);
        for id in [a, b] {
            regions.leave(&mut broker, id);
        }
        assert_eq!(broker.pool().free(), 1);
    }

    /// A seat for `client` on its build's pile, and the pile mapped as
    /// the client maps it.
    fn seat_on_pile(regions: &mut Regions, broker: &mut Broker, client: ClientId) -> Mapping {
        let offer = regions.offer(broker, client, FASTPATH_PILE).unwrap();
        Mapping::map(offer.fd).unwrap()
    }

    fn the_pile(regions: &Regions) -> &PileRegion {
        regions.piles.values().next().expect("a pile")
    }
}
