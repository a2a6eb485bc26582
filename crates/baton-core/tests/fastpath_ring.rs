//! The real ring against the model (docs/fastpath.md, "The proof"): the
//! same moves (clients' steps, timeouts, kills and the broker's repair,
//! its barrier, regrants, drains and collections) applied to the model's
//! `Region` and to a `Ring` of atomic words, side by side. After every
//! move each slot the ring holds must say what the model's slot of the
//! same ticket says, and each record what the model's record says: the
//! exhaustive model checks the protocol, and this checks that the words,
//! the ring's wrap and the hints do what the model does. The ring is
//! small, so that it wraps many times in one run, and a killed client's
//! seat is given to a new client once its repair is over.
//!
//! Then threads: clients acquiring and releasing at once with a broker
//! putting its barrier up and down, counted from the clients themselves.

mod support;

use baton_core::fastpath::words::{IntentWord, SlotWord};
use baton_core::fastpath::{
    ring, Acquired, Books, Claim, Grant, Host, Intent, Notice, Phase, Refused, Region, Released,
    Ring, Seat, Slot,
};
use proptest::prelude::*;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::Instant;

/// A host that remembers what it was asked: the ring's tests wait by
/// looking again, as a futex may always return early.
#[derive(Default)]
struct Recorder {
    wakes: RefCell<u32>,
    told: RefCell<Vec<Notice>>,
}

impl Host for Recorder {
    fn wait(&self, _: &AtomicU64, _: u32, _: Option<Instant>) {}
    fn wake(&self, _: &AtomicU64) {
        *self.wakes.borrow_mut() += 1;
    }
    fn tell(&self, notice: Notice) {
        self.told.borrow_mut().push(notice);
    }
}

const EMPTY: Slot = Slot {
    claim: Claim::Unclaimed,
    grant: Grant::Open,
};

#[derive(Debug, Clone, Copy)]
enum Move {
    Step(u8),
    TimeOut(u8),
    Kill(u8),
    Broker,
    Close,
    Reopen,
    /// Both hints go back to ticket 0, as a client that read them long
    /// ago sees them: searches start earlier and must land where they
    /// would have.
    ForgetHints,
}

fn arb_move(seats: u8) -> impl Strategy<Value = Move> {
    prop_oneof![
        12 => (0..seats).prop_map(Move::Step),
        1 => (0..seats).prop_map(Move::TimeOut),
        1 => (0..seats).prop_map(Move::Kill),
        3 => Just(Move::Broker),
        1 => Just(Move::Close),
        1 => Just(Move::Reopen),
        1 => Just(Move::ForgetHints),
    ]
}

/// Both sides, and what the clients believe.
struct Pair<'w> {
    words: &'w [AtomicU64],
    model: Region,
    ring: Ring<'w>,
    host: Recorder,
    phases: Vec<Phase>,
    /// Jobs each client runs: the tokens it believes it holds.
    running: Vec<u32>,
    /// Killed clients whose repair is under way.
    dead: Vec<Seat>,
    model_hand: u32,
    ring_hand: u32,
    lent: u32,
    /// Steps a full ring refused.
    full: u32,
}

impl Pair<'_> {
    fn apply(&mut self, m: Move) {
        match m {
            Move::Step(s) => self.step(Seat(s.into())),
            Move::TimeOut(s) => self.time_out(Seat(s.into())),
            Move::Kill(s) => {
                let seat = Seat(s.into());
                if !self.dead.contains(&seat) {
                    self.dead.push(seat);
                    self.phases[usize::from(s)] = Phase::Done;
                    self.running[usize::from(s)] = 0;
                }
            }
            Move::Broker => self.broker(),
            Move::Close => {
                self.both(|model, _| model.close(), |ring, _, _| ring.close());
            }
            Move::Reopen => {
                self.both(|model, _| model.reopen(), |ring, _, _| ring.reopen());
            }
            Move::ForgetHints => {
                self.words[ring::TAIL].store(0, SeqCst);
                self.words[ring::SERVE].store(0, SeqCst);
            }
        }
    }

    fn step(&mut self, seat: Seat) {
        let i = usize::from(seat.0);
        if self.dead.contains(&seat) {
            return;
        }
        let phase = match self.phases[i] {
            Phase::Done if self.running[i] > 0 => Phase::Hand,
            Phase::Done => Phase::Claim,
            // A sleeper looks again, as a futex wake (or none) makes it.
            Phase::Asleep(t) => Phase::Check(t),
            phase => phase,
        };
        let before = self.dump();
        let (ring_next, ring_event) = match self.ring.step(seat, phase, &self.host) {
            Ok(stepped) => stepped,
            Err(Refused::Full) => {
                // A slow client holds the slot a lap on: this step waits
                // (a real client would use the socket), and changed
                // nothing. The model has no ring, so it does not step.
                assert_eq!(self.dump(), before, "a full ring changed under {seat:?}");
                self.full += 1;
                return;
            }
            Err(e) => panic!("{seat:?} in {phase:?}: {e}\n{before}"),
        };
        let (model_next, model_event) = self.model.step(seat, phase);
        assert_eq!(
            (ring_next, ring_event),
            (model_next, model_event),
            "{seat:?} in {phase:?}"
        );
        if let Phase::Take(_) = phase {
            self.running[i] += 1;
        }
        if phase == Phase::Hand {
            self.running[i] -= 1;
        }
        self.phases[i] = ring_next;
    }

    fn time_out(&mut self, seat: Seat) {
        let i = usize::from(seat.0);
        let (Phase::Check(t) | Phase::Asleep(t)) = self.phases[i] else {
            return;
        };
        let model = self.model.time_out(seat, t);
        let ring = self.ring.time_out(seat, t).unwrap();
        assert_eq!(ring, model, "{seat:?} timing out on ticket {t}");
        self.phases[i] = ring.0;
    }

    /// The broker's next move: repair the oldest dead client, else
    /// collect returns and regrant what it holds, or drain a free token.
    fn broker(&mut self) {
        if let Some(&seat) = self.dead.first() {
            let repaired = self.both(
                |model, hand| model.repair_step(seat, hand),
                |ring, hand, host| ring.repair_step(seat, hand, host),
            );
            if repaired == Some(None) {
                // Nothing names it: the seat goes to a new client.
                self.dead.remove(0);
            }
            return;
        }
        for s in 0..self.phases.len() {
            let seat = Seat(s as u16);
            self.both(
                |model, hand| model.collect_step(seat, hand),
                |ring, hand, _| ring.collect_step(seat, hand),
            );
        }
        let regranted = self.both(
            |model, hand| model.regrant_step(hand),
            |ring, hand, host| ring.regrant_step(hand, host),
        );
        if regranted == Some(None) {
            self.both(
                |model, hand| model.drain_step(hand),
                |ring, hand, _| ring.drain_step(hand),
            );
        }
    }

    /// One move of the broker on both sides, which must agree; unless the
    /// ring is full, which must then be unchanged (the model, which has
    /// no ring, does not move either).
    fn both<T: PartialEq + std::fmt::Debug>(
        &mut self,
        model: impl FnOnce(&mut Region, &mut u32) -> T,
        ring: impl FnOnce(&Ring, &mut u32, &Recorder) -> Result<T, Refused>,
    ) -> Option<T> {
        let before = self.dump();
        let ring = match ring(&self.ring, &mut self.ring_hand, &self.host) {
            Err(Refused::Full) => {
                assert_eq!(self.dump(), before, "a full ring changed under the broker");
                self.full += 1;
                return None;
            }
            ring => ring.unwrap_or_else(|e| panic!("the broker: {e}\n{before}")),
        };
        let model = model(&mut self.model, &mut self.model_hand);
        assert_eq!(ring, model, "the broker's move\n{before}");
        Some(ring)
    }

    /// The ring's slots and records, for a failure's message.
    fn dump(&self) -> String {
        let slots = (0..self.ring.capacity()).map(|i| {
            let word = SlotWord::unpack(self.ring.slot_word(i).load(SeqCst));
            format!("slot {i}: {word:?}\n")
        });
        let records = (0..self.phases.len()).map(|s| {
            let seat = Seat(s as u16);
            format!(
                "{seat:?}: {:?} {:?}\n",
                self.phases[s],
                self.ring.record(seat)
            )
        });
        slots.chain(records).collect()
    }

    /// Every slot the ring holds says what the model's slot of its ticket
    /// says; every record what the model's record says; and the ring,
    /// read as the broker reads it, counts what the model counts.
    fn check(&self, after: &[Move]) {
        assert_eq!(
            self.ring_hand, self.model_hand,
            "the broker's hands after {after:?}"
        );
        for i in 0..self.ring.capacity() {
            let word = SlotWord::unpack(self.ring.slot_word(i).load(SeqCst)).unwrap();
            let t = self.ring.ticket_of(word.gen);
            assert_eq!(t % self.ring.capacity(), i, "slot {i} carries ticket {t}");
            let model = self.model.slots.get(t).copied().unwrap_or(EMPTY);
            assert_eq!(word.slot, model, "ticket {t} (slot {i}) after {after:?}");
        }
        for (s, model) in self.model.records.iter().enumerate() {
            let ring = self.ring.record(Seat(s as u16)).unwrap();
            let intent = match model.intent {
                Intent::Idle => IntentWord::Idle,
                Intent::Releasing => IntentWord::Releasing,
                Intent::Taking(t) => IntentWord::Taking(t as u32 & 0xff_ffff),
            };
            assert_eq!(
                (u32::from(ring.held), u32::from(ring.returned), ring.intent),
                (model.held, model.returned, intent),
                "seat {s}'s record after {after:?}"
            );
        }
        let waiting = self
            .model
            .slots
            .iter()
            .filter(|s| matches!(s.claim, Claim::Claimed(_)) && !s.is_granted())
            .count();
        assert_eq!(
            self.ring.waiters() as usize,
            waiting,
            "waiters after {after:?}"
        );
        let (snapshot, _) = self.ring.snapshot().unwrap();
        // Its tickets count from the oldest in the ring: never more than
        // the ring holds, however far the tickets have run (a span
        // counted from ticket 0 would grow with every lap).
        assert!(
            snapshot.slots.len() <= self.ring.capacity(),
            "a snapshot of {} slots from a ring of {} after {after:?}",
            snapshot.slots.len(),
            self.ring.capacity()
        );
        let books = Books {
            lent: self.lent,
            in_hand: self.ring_hand,
            ..Books::default()
        };
        assert_eq!(
            snapshot.tokens(),
            self.model.tokens(),
            "tokens after {after:?}"
        );
        let audit = snapshot.audit(&books);
        assert!(audit.balanced(), "{audit:?} after {after:?}");
        for (s, &running) in self.running.iter().enumerate() {
            let seat = Seat(s as u16);
            if !self.dead.contains(&seat) {
                let held = self.ring.record(seat).unwrap().held;
                assert_eq!(u32::from(held), running, "{seat:?} runs {running} jobs");
            }
        }
    }
}

/// Plays `moves` on a ring and on the model side by side, checking them
/// against each other after every move; returns how many steps the ring
/// refused as full, and how far its tail hint moved (tickets claimed).
fn run(lent: u32, seats: u8, capacity: usize, moves: &[Move]) -> (u32, u64) {
    support::fail_fast();
    let words: Vec<AtomicU64> = (0..ring::words_for(capacity, seats.into()))
        .map(|_| AtomicU64::new(0))
        .collect();
    let ring = Ring::init(&words, capacity, seats.into(), lent).unwrap();
    let mut pair = Pair {
        words: &words,
        model: Region::new(seats.into(), lent),
        ring,
        host: Recorder::default(),
        phases: vec![Phase::Done; seats.into()],
        running: vec![0; seats.into()],
        dead: Vec::new(),
        model_hand: 0,
        ring_hand: 0,
        lent,
        full: 0,
    };
    pair.check(&[]);
    for (i, &m) in moves.iter().enumerate() {
        pair.apply(m);
        pair.check(&moves[..=i]);
    }
    (pair.full, pair.ring.hint_word(ring::TAIL))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(support::cases(400)))]

    /// The ring wraps: its capacity is the fewest slots the clients and
    /// the free tokens can hold unfinished at once.
    #[test]
    fn the_ring_does_what_the_model_does(
        lent in 1u32..4,
        seats in 2u8..5,
        moves in proptest::collection::vec(arb_move(4), 1..400),
    ) {
        let capacity = lent as usize + 2 * usize::from(seats) + 2;
        let moves: Vec<Move> = moves
            .into_iter()
            .map(|m| match m {
                Move::Step(s) => Move::Step(s % seats),
                Move::TimeOut(s) => Move::TimeOut(s % seats),
                Move::Kill(s) => Move::Kill(s % seats),
                m => m,
            })
            .collect();
        run(lent, seats, capacity, &moves);
    }
}

#[test]
fn a_long_run_wraps_the_ring_many_times() {
    // Two clients taking turns with one token on a ring of five slots:
    // each acquire and release moves on a ticket.
    let mut moves = Vec::new();
    for _ in 0..200 {
        moves.extend([Move::Step(0); 6]);
        moves.extend([Move::Step(1); 6]);
    }
    let (full, tail) = run(1, 2, 5, &moves);
    // Two clients and one token never fill five slots; and the tickets
    // went round the ring many times.
    assert_eq!(full, 0);
    assert!(tail >= 200, "tail at ticket {tail}: 40 laps at least");
}

#[test]
fn a_slot_naming_a_seat_the_region_does_not_have_is_corrupt() {
    use baton_core::fastpath::{Party, Slot, Unread};
    let words = words(8, 2);
    let ring = Ring::init(&words, 8, 2, 1).unwrap();
    assert!(ring.snapshot().is_ok());
    for (seat, corrupt) in [(1, false), (2, true), (2046, true)] {
        let claimed = SlotWord {
            gen: 0,
            slot: Slot {
                claim: Claim::Claimed(Party::Seat(Seat(seat))),
                grant: Grant::Open,
            },
            sleeping: false,
        };
        ring.slot_word(0).store(claimed.pack(), SeqCst);
        assert_eq!(
            ring.snapshot().err() == Some(Unread::Corrupt),
            corrupt,
            "claimed by seat {seat}"
        );
        let given = SlotWord {
            slot: Slot {
                claim: Claim::Unclaimed,
                grant: Grant::Given {
                    by: Party::Seat(Seat(seat)),
                    acked: false,
                },
            },
            ..claimed
        };
        ring.slot_word(0).store(given.pack(), SeqCst);
        assert_eq!(
            ring.snapshot().err() == Some(Unread::Corrupt),
            corrupt,
            "given by seat {seat}"
        );
    }
}

#[test]
fn a_region_of_another_layout_is_refused() {
    use baton_core::fastpath::ring::LayoutError;
    let words: Vec<AtomicU64> = (0..64).map(|_| AtomicU64::new(0)).collect();
    assert!(
        matches!(Ring::attach(&words), Err(LayoutError::Magic(0))),
        "all zero: no magic"
    );
    Ring::init(&words, 16, 2, 3).unwrap();
    let ring = Ring::attach(&words).unwrap();
    assert_eq!((ring.capacity(), ring.seats(), ring.lent()), (16, 2, 3));
    assert!(
        matches!(Ring::attach(&words[..40]), Err(LayoutError::Size { .. })),
        "shorter than its header says"
    );
    // The magic, and no more than the header's own lines: the sizes are
    // read, and found not to fit.
    assert!(
        matches!(Ring::attach(&words[..32]), Err(LayoutError::Size { .. })),
        "the header alone"
    );
    assert!(
        matches!(Ring::attach(&words[..31]), Err(LayoutError::Magic(_))),
        "not even its header"
    );
    // A header whose capacity is out of range, seats in range.
    let capacity = 1; // the header's word after the magic
    words[capacity].store(0, SeqCst);
    assert!(
        matches!(
            Ring::attach(&words),
            Err(LayoutError::Range { capacity: 0, .. })
        ),
        "a ring of no slots"
    );
    assert!(
        Ring::init(&words, 16, 2, 16).is_err(),
        "no room for the free tokens"
    );
}

/// A zeroed region's words; every test that makes a ring starts here, so
/// this is also where the first failure is made to end the run, if asked.
fn words(capacity: usize, seats: usize) -> Vec<AtomicU64> {
    support::fail_fast();
    (0..ring::words_for(capacity, seats))
        .map(|_| AtomicU64::new(0))
        .collect()
}

/// What the ring and the broker's hands count, against what was lent.
fn assert_conserved(ring: &Ring, in_hand: u32, lent: u32) {
    let (region, _) = ring.snapshot().unwrap();
    let books = Books {
        lent,
        in_hand,
        ..Books::default()
    };
    let audit = region.audit(&books);
    assert!(audit.balanced(), "{audit:?}");
}

#[test]
fn a_client_stopped_between_two_steps_fills_the_ring_and_nothing_is_lost() {
    let words = words(4, 2);
    let ring = Ring::init(&words, 4, 2, 2).unwrap();
    let host = Recorder::default();
    let (stopped, other) = (Seat(0), Seat(1));
    // Stopped (SIGSTOP) after counting its token, before marking ticket 0
    // taken: slot 0 stays unfinished.
    let (phase, _) = ring.step(stopped, Phase::Claim, &host).unwrap();
    let (stuck, _) = ring.step(stopped, phase, &host).unwrap();
    assert_eq!(stuck, Phase::AckTaken(0));
    // The other client goes round the ring until it meets slot 0.
    let mut returned = 0;
    for _ in 0..3 {
        assert_eq!(ring.acquire(other, &host, None), Ok(Acquired::Token));
        match ring.release(other, &host).unwrap() {
            Released::Given => {}
            Released::Returned => returned += 1,
        }
    }
    assert_eq!(
        returned, 1,
        "ticket 4 is slot 0's: the token goes back to the broker"
    );
    assert_eq!(host.told.borrow().as_slice(), [Notice::Returned]);
    assert_eq!(ring.acquire(other, &host, None), Err(Refused::Full));
    let mut in_hand = 0;
    ring.collect_step(other, &mut in_hand).unwrap();
    assert_eq!(in_hand, 1);
    assert_conserved(&ring, in_hand, 2);
    assert_eq!(ring.regrant_step(&mut in_hand, &host), Err(Refused::Full));
    assert_eq!(in_hand, 1, "a grant the ring cannot take stays in hand");
    // The stopped client goes on: the ring is whole again.
    assert_eq!(ring.step(stopped, stuck, &host).unwrap().0, Phase::Done);
    assert!(ring.regrant_step(&mut in_hand, &host).unwrap().is_some());
    assert_eq!(ring.acquire(other, &host, None), Ok(Acquired::Token));
    assert_conserved(&ring, in_hand, 2);
    assert_eq!(ring.record(stopped).unwrap().held, 1);
    assert_eq!(ring.record(other).unwrap().held, 1);
}

#[test]
fn a_wait_that_times_out_leaves_the_queue() {
    let words = words(8, 2);
    let ring = Ring::init(&words, 8, 2, 1).unwrap();
    let host = Recorder::default();
    assert_eq!(ring.acquire(Seat(0), &host, None), Ok(Acquired::Token));
    assert_eq!(ring.try_acquire(Seat(1), &host), Err(Refused::Busy));
    let past = Some(Instant::now());
    assert_eq!(ring.acquire(Seat(1), &host, past), Ok(Acquired::TimedOut));
    // The cancelled ticket is passed by: the token goes free, not to it.
    assert_eq!(ring.release(Seat(0), &host), Ok(Released::Given));
    assert_eq!(
        ring.hint_word(ring::SERVE),
        2,
        "the release moved the serve hint past the ticket it passed by"
    );
    assert_eq!(ring.try_acquire(Seat(1), &host), Ok(()));
    assert_conserved(&ring, 0, 1);
    assert_eq!(ring.record(Seat(1)).unwrap().held, 1);
    assert_eq!(ring.release(Seat(0), &host), Err(Refused::NothingHeld));
}

#[test]
fn a_revoked_seat_is_refused_before_it_touches_the_ring() {
    let words = words(8, 2);
    let ring = Ring::init(&words, 8, 2, 1).unwrap();
    let host = Recorder::default();
    ring.revoke(Seat(1));
    assert_eq!(ring.acquire(Seat(1), &host, None), Err(Refused::Revoked));
    assert_eq!(ring.try_acquire(Seat(1), &host), Err(Refused::Revoked));
    assert_eq!(
        ring.acquire(Seat(2), &host, None),
        Err(Refused::Revoked),
        "no such seat"
    );
    assert_eq!(ring.acquire(Seat(0), &host, None), Ok(Acquired::Token));
    ring.revoke(Seat(0));
    let before: Vec<u64> = words.iter().map(|w| w.load(SeqCst)).collect();
    assert_eq!(ring.release(Seat(0), &host), Err(Refused::Revoked));
    let after: Vec<u64> = words.iter().map(|w| w.load(SeqCst)).collect();
    assert_eq!(before, after, "a refused release changes nothing");
}

/// A host for threads: a wait only yields (a futex may always return
/// early, so the ring must look again), and a notice is counted for the
/// broker's thread to act on.
#[derive(Default)]
struct Yielding {
    notices: std::sync::atomic::AtomicU32,
}

impl Host for Yielding {
    fn wait(&self, _: &AtomicU64, _: u32, _: Option<Instant>) {
        std::thread::yield_now();
    }
    fn wake(&self, _: &AtomicU64) {}
    fn tell(&self, _: Notice) {
        self.notices.fetch_add(1, SeqCst);
    }
}

#[test]
fn clients_on_threads_never_run_more_jobs_than_lent_while_the_barrier_comes_and_goes() {
    use std::sync::atomic::{AtomicBool, AtomicU32};
    const LENT: u32 = 2;
    const CLIENTS: u8 = 4;
    const ROUNDS: u32 = 2_000;
    let words = words(16, CLIENTS.into());
    let ring = Ring::init(&words, 16, CLIENTS.into(), LENT).unwrap();
    let host = Yielding::default();
    let running = AtomicU32::new(0);
    let most = AtomicU32::new(0);
    let done = AtomicBool::new(false);
    let mut in_hand = 0;
    std::thread::scope(|s| {
        let clients: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let (ring, host, running, most) = (&ring, &host, &running, &most);
                s.spawn(move || {
                    let seat = Seat(c.into());
                    let mut socket = 0;
                    for round in 0..ROUNDS {
                        // Every few rounds a wait that gives up at once.
                        let deadline = (round % 7 == 0).then(Instant::now);
                        match ring.acquire(seat, host, deadline) {
                            Ok(Acquired::Token) => {}
                            Ok(Acquired::TimedOut) => continue,
                            Err(Refused::Full) => {
                                socket += 1;
                                continue;
                            }
                            Err(e) => panic!("{seat:?}: {e}"),
                        }
                        let now = running.fetch_add(1, SeqCst) + 1;
                        most.fetch_max(now, SeqCst);
                        assert!(now <= LENT, "{now} jobs run on {LENT} tokens");
                        std::thread::yield_now();
                        running.fetch_sub(1, SeqCst);
                        ring.release(seat, host).unwrap();
                    }
                    socket
                })
            })
            .collect();
        // The broker: the barrier up for a while, then down, serving the
        // queue by hand while it stands.
        let mut round = 0u32;
        while !done.load(SeqCst) {
            round += 1;
            let closed = round % 64 < 16;
            // A full ring refuses the barrier's move: the broker tries again.
            let moved = if closed { ring.close() } else { Ok(()) };
            assert!(matches!(moved, Ok(()) | Err(Refused::Full)), "{moved:?}");
            for c in 0..CLIENTS {
                ring.collect_step(Seat(c.into()), &mut in_hand).unwrap();
            }
            while let Ok(Some(_)) = ring.regrant_step(&mut in_hand, &host) {}
            let moved = if closed { Ok(()) } else { ring.reopen() };
            assert!(matches!(moved, Ok(()) | Err(Refused::Full)), "{moved:?}");
            std::thread::yield_now();
            done.store(clients.iter().all(|c| c.is_finished()), SeqCst);
        }
        for client in clients {
            client.join().unwrap();
        }
    });
    ring.reopen().unwrap();
    for c in 0..CLIENTS {
        ring.collect_step(Seat(c.into()), &mut in_hand).unwrap();
        assert_eq!(ring.record(Seat(c.into())).unwrap().held, 0);
    }
    while ring.regrant_step(&mut in_hand, &host).unwrap().is_some() {}
    assert_eq!(in_hand, 0);
    let (region, _) = ring.snapshot().unwrap();
    assert_eq!(region.free(), LENT, "every token is free again");
    assert_conserved(&ring, 0, LENT);
    assert!(
        host.notices.load(SeqCst) > 0,
        "the barrier never stood in anyone's way"
    );
    assert!(most.load(SeqCst) >= 1);
}

/// A repair clears a dead client's record but keeps counting its changes:
/// the count is how two equal reads of a record tell "unchanged" from "changed
/// and changed back", so a repair that reset it could make a record read
/// before and after look untouched.
#[test]
fn a_repair_clears_the_record_and_counts_one_more_change() {
    let words = words(8, 2);
    let ring = Ring::init(&words, 8, 2, 2).unwrap();
    let host = Recorder::default();
    for _ in 0..2 {
        assert_eq!(ring.acquire(Seat(0), &host, None), Ok(Acquired::Token));
    }
    let before = ring.record(Seat(0)).unwrap();
    assert!(before.changes >= 2, "{before:?}");
    // Seat 0's client dies holding both: the broker repairs its seat.
    let mut in_hand = 0;
    while ring
        .repair_step(Seat(0), &mut in_hand, &host)
        .unwrap()
        .is_some()
    {}
    let after = ring.record(Seat(0)).unwrap();
    assert_eq!(in_hand, 2);
    assert_eq!((after.held, after.returned), (0, 0));
    assert_eq!(after.changes, before.changes + 1, "{after:?}");
}

/// A snapshot keeps the queue's order: the claims waiting come out oldest
/// first (STATUS lists them so).
#[test]
fn a_snapshot_lists_the_waiting_claims_oldest_first() {
    let words = words(8, 3);
    let ring = Ring::init(&words, 8, 3, 0).unwrap();
    let host = Recorder::default();
    for seat in [Seat(2), Seat(0), Seat(1)] {
        let (phase, _) = ring.step(seat, Phase::Claim, &host).unwrap();
        assert!(matches!(phase, Phase::Check(_)), "{phase:?}");
    }
    let (region, _) = ring.snapshot().unwrap();
    assert_eq!(region.waiting(), [Seat(2), Seat(0), Seat(1)]);
}

/// A record that is no word at all reads as more than any pool lends, so
/// the audit names its seat, not only a shortfall.
#[test]
fn a_record_that_is_no_word_is_a_suspect() {
    let words = words(8, 2);
    let ring = Ring::init(&words, 8, 2, 1).unwrap();
    ring.record_word(Seat(1)).store(u64::MAX, SeqCst);
    let (region, _) = ring.snapshot().unwrap();
    let books = Books {
        lent: 1,
        ..Books::default()
    };
    assert_eq!(region.audit(&books).suspects, [Seat(1)]);
}

/// The layout is a protocol (the C client has its own copy of it): line 1
/// is the broker's liveness word, lines 2 and 3 the hints, as
/// docs/fastpath.md draws them.
#[test]
fn the_region_has_the_documented_layout() {
    const LINE: usize = 8; // words of 64 bytes
    assert_eq!(
        (ring::LIVENESS, ring::TAIL, ring::SERVE),
        (LINE, 2 * LINE, 3 * LINE)
    );
    // The ring follows, then a line per seat.
    assert_eq!(ring::words_for(16, 3), 4 * LINE + 16 + 3 * LINE);
}

/// A slot names a party in 11 bits, 0 being the broker: 2,047 seats fit,
/// 2,048 do not (seat 2,047 would be party 2,048, which has no bits).
#[test]
fn a_region_seats_at_most_2047_clients() {
    assert_eq!(ring::MAX_SEATS, 2047);
    assert!(Ring::init(&words(8, 2047), 8, 2047, 0).is_ok());
    assert!(Ring::init(&words(8, 2048), 8, 2048, 0).is_err());
}

/// A slot's ticket is this lap's, the lap before (a ring's length behind)
/// or a later one; a ticket behind by anything else no correct party
/// writes, and an operation that meets it is refused, not misled.
#[test]
fn a_slot_behind_by_less_than_a_lap_is_corrupt() {
    let words = words(8, 2);
    let ring = Ring::init(&words, 8, 2, 0).unwrap();
    let host = Recorder::default();
    let behind = SlotWord {
        gen: u32::MAX, // ticket 0 less one
        slot: Slot {
            claim: Claim::Unclaimed,
            grant: Grant::Open,
        },
        sleeping: false,
    };
    ring.slot_word(0).store(behind.pack(), SeqCst);
    assert_eq!(
        ring.step(Seat(0), Phase::Claim, &host).map(|(p, _)| p),
        Err(Refused::Corrupt)
    );
}

/// The hints as laid out: no ticket claimed yet, and the first tickets
/// past the lent tokens awaiting a grant.
#[test]
fn the_hints_start_at_the_tail_and_past_the_lent_tokens() {
    let words = words(8, 2);
    let ring = Ring::init(&words, 8, 2, 3).unwrap();
    assert_eq!(
        (ring.hint_word(ring::TAIL), ring.hint_word(ring::SERVE)),
        (0, 3)
    );
}

/// The broker's grants move the serve hint on as a releaser's do: giving
/// back n tokens that nobody waits for walks the ring once, not over
/// every token given before (n²/2 slots: seconds of the broker's CPU for
/// the 20,000 tokens of a dead bulk-wake waker's region).
#[test]
fn the_brokers_grants_move_the_serve_hint_on() {
    let words = words(16, 2);
    let ring = Ring::init(&words, 16, 2, 0).unwrap();
    let host = Recorder::default();
    let mut in_hand = 5;
    while ring.regrant_step(&mut in_hand, &host).unwrap().is_some() {}
    assert_eq!(in_hand, 0);
    assert_eq!(
        ring.hint_word(ring::SERVE),
        4,
        "tickets 0 to 3 were passed on the way to ticket 4"
    );
    assert_conserved(&ring, 0, 5);
}

/// A claim in an open region waits without a word to the broker; the
/// claim that lands on the barrier tells it (a NUDGE), since only the
/// broker can serve what waits there.
#[test]
fn only_a_claim_on_the_barrier_tells_the_broker() {
    let host = Recorder::default();
    let words = words(8, 2);
    let open = Ring::init(&words, 8, 2, 0).unwrap();
    open.step(Seat(0), Phase::Claim, &host).unwrap();
    assert!(host.told.borrow().is_empty(), "open: nothing to tell");
    let words = self::words(8, 2);
    let closed = Ring::init(&words, 8, 2, 0).unwrap();
    closed.close().unwrap();
    closed.step(Seat(0), Phase::Claim, &host).unwrap();
    assert_eq!(host.told.borrow().as_slice(), [Notice::Waiting]);
}

/// A waiter marks its slot sleeping before it sleeps, so that the release
/// that serves it wakes it: here the holder releases while the waiter is
/// in its host's wait, and its one futex wake is the one it must make.
#[test]
fn a_sleeping_waiter_is_woken_by_the_release_that_serves_it() {
    struct ReleaseDuringTheWait<'r> {
        ring: &'r Ring<'r>,
        releaser: Recorder,
        released: std::cell::Cell<bool>,
    }
    impl Host for ReleaseDuringTheWait<'_> {
        fn wait(&self, _: &AtomicU64, _: u32, _: Option<Instant>) {
            if !self.released.replace(true) {
                self.ring.release(Seat(0), &self.releaser).unwrap();
            }
        }
        fn wake(&self, _: &AtomicU64) {}
        fn tell(&self, _: Notice) {}
    }
    let words = words(8, 2);
    let ring = Ring::init(&words, 8, 2, 1).unwrap();
    assert_eq!(
        ring.acquire(Seat(0), &Recorder::default(), None),
        Ok(Acquired::Token)
    );
    let host = ReleaseDuringTheWait {
        ring: &ring,
        releaser: Recorder::default(),
        released: std::cell::Cell::new(false),
    };
    assert_eq!(ring.acquire(Seat(1), &host, None), Ok(Acquired::Token));
    assert_eq!(*host.releaser.wakes.borrow(), 1, "the sleeper was woken");
}

/// The first failure ends the binary under BATON_TEST_FAIL_FAST, even
/// while another test waits for ever: the child is this test again, with
/// a thread that panics while the test itself never ends.
#[test]
fn under_fail_fast_a_panic_on_any_thread_ends_the_binary() {
    const CHILD: &str = "BATON_FAIL_FAST_CHILD";
    if std::env::var_os(CHILD).is_some() {
        support::fail_fast();
        std::thread::spawn(|| panic!("a planted failure"));
        loop {
            std::thread::park();
        }
    }
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "under_fail_fast_a_panic_on_any_thread_ends_the_binary",
        ])
        .env("BATON_TEST_FAIL_FAST", "1")
        .env(CHILD, "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let guard = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if guard.elapsed().as_secs() > 60 {
            child.kill().unwrap();
            child.wait().unwrap();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let status = status.expect("the child still ran a minute after its panic");
    assert_eq!(status.code(), Some(101), "{status}");
}
