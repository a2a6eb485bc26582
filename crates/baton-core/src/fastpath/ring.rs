//! The region itself: the model's steps (the parent module) done with
//! compare-and-swaps on 64-bit atomic words, laid out as docs/fastpath.md
//! ("The region") says, with the ring that the model leaves unbounded.
//!
//! A [`Ring`] borrows the words; it does not know where they live. The
//! broker and its clients map one memfd and hand its words here; the
//! tests hand it a `Vec`. The futex calls and the line a client writes to
//! its socket are the [`Host`]'s: this module does no I/O, so each step
//! can be checked against the model (`tests/fastpath_ring.rs` runs the two
//! side by side and compares every word).
//!
//! Tickets are 64-bit here and in the hints; a slot keeps the low 32 bits
//! (`gen`). Slot `t % capacity` carries ticket `t` once somebody touched
//! it: until then it still carries ticket `t - capacity`, and it may be
//! taken over only once that ticket is finished (both halves done, the
//! giver's acknowledgement in). Every ticket before a claimed or granted
//! one was touched before it (claims and grants go in ticket order), so a
//! slot is never two laps behind.

use super::words::{BadWord, IntentWord, RecordWord, SlotWord};
use super::{Claim, Event, Grant, Party, Phase, Seat, Slot, Ticket};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::Instant;

/// The first word of every region: "BATONFP" and the layout's version.
pub const MAGIC: u64 = u64::from_le_bytes(*b"BATONFP1");
/// Words in a 64-byte cache line: the header's fields and each seat get
/// one line each, so that no two writers share a line.
const LINE: usize = 8;
/// Header words: magic, capacity, seats, tokens lent.
const CAPACITY: usize = 1;
const SEATS: usize = 2;
const LENT: usize = 3;
/// The broker's liveness word (line 1; see docs/fastpath.md).
pub const LIVENESS: usize = LINE;
/// No ticket before the `tail` hint is unclaimed. The hints are only
/// where the searches start: any value no greater than the truth works.
pub const TAIL: usize = 2 * LINE;
/// No ticket before the `serve` hint awaits a token.
pub const SERVE: usize = 3 * LINE;
/// Where the ring starts.
const RING: usize = 4 * LINE;
/// A seat's line: its record, then the broker's revoked flag.
const RECORD: usize = 0;
const REVOKED: usize = 1;
/// Seats a region serves: a slot names its parties in 11 bits, 0 being
/// the broker.
pub const MAX_SEATS: usize = (1 << super::words::PARTY_BITS) - 1;
/// The largest ring: tickets' low 32 bits tell laps apart only while the
/// ring is far smaller than 2^31.
pub const MAX_CAPACITY: usize = 1 << 20;

/// Why a region cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// The first word is not [`MAGIC`]: not a baton region, or another version.
    #[error("not a baton fast-path region of layout 1 (magic {0:#018x})")]
    Magic(u64),
    /// The header's sizes do not fit the words given.
    #[error("the region's header asks for {needed} words, and it has {have}")]
    Size {
        /// Words the header's capacity and seats need.
        needed: usize,
        /// Words there are.
        have: usize,
    },
    /// A capacity or seat count out of range.
    #[error("a ring of {capacity} slots for {seats} seats is out of range")]
    Range {
        /// Slots asked for.
        capacity: usize,
        /// Seats asked for.
        seats: usize,
    },
}

/// Why an operation did not happen in the region: the client then uses
/// the socket for it, as if it had no region. Refused before its first
/// step, nothing in the region changed; `Revoked` or `Gone` while asleep
/// leave the claim in its slot (the seat is given up, and the broker's
/// repair or the region's end takes care of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// `TRY`: no free token; the client did not join the queue.
    #[error("no token is free")]
    Busy,
    /// Every slot is still in use by a ticket a lap before (a client
    /// stopped between two steps): the ring is full.
    #[error("the ring is full")]
    Full,
    /// The broker dropped this seat to the socket path.
    #[error("the broker revoked this seat")]
    Revoked,
    /// A word no correct party writes: somebody corrupted the region.
    #[error("the region holds a word no correct client writes")]
    Corrupt,
    /// A release with no token held.
    #[error("this seat holds no token")]
    NothingHeld,
    /// The broker that made the region is gone (its host says so): the
    /// region is dead, and a wait in it would never end.
    #[error("the broker that made the region is gone")]
    Gone,
}

/// What a step asks of the world outside the region: the futex calls,
/// and the one line a client writes to the broker's socket.
pub trait Host {
    /// Sleeps while the low 32 bits of `word` are `expected`, until woken,
    /// until `deadline`, or for no reason at all (callers look again).
    fn wait(&self, word: &AtomicU64, expected: u32, deadline: Option<Instant>);
    /// Wakes the one client that waits on `word`.
    fn wake(&self, word: &AtomicU64);
    /// Tells the broker what it must act on: the barrier stands, or the
    /// ring is full, and a token came back or a client waits.
    fn tell(&self, notice: Notice);
    /// Whether the broker is gone: a sleeper looks after each wake (its
    /// host wakes it now and then to look), and gives up.
    fn gone(&self) -> bool {
        false
    }
}

/// What a client tells the broker over its socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notice {
    /// It claimed a ticket behind the broker's barrier: it waits for the
    /// broker to serve it.
    Waiting,
    /// It returned a token through its record (`returned`): collect it.
    Returned,
}

/// How an acquire ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquired {
    /// A token, now in the seat's record.
    Token,
    /// The deadline passed first; the wait is withdrawn.
    TimedOut,
}

/// How a release ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// Given to the next ticket (a waiter, woken, or the next claimer).
    Given,
    /// The barrier stood (or the ring was full): returned to the broker,
    /// which was told.
    Returned,
}

/// Where a ticket's slot is.
#[derive(Debug, Clone, Copy)]
pub(super) enum Lap {
    /// The slot carries the ticket: its word, decoded.
    This(SlotWord),
    /// It still carries the ticket a lap before.
    Earlier(SlotWord),
    /// It carries a later ticket: this one was claimed (or granted) and
    /// finished long ago.
    Later,
}

/// A region's words, and the operations on them.
#[derive(Debug, Clone, Copy)]
pub struct Ring<'w> {
    words: &'w [AtomicU64],
    capacity: usize,
    seats: usize,
}

/// Words a region of `capacity` slots and `seats` seats takes.
pub fn words_for(capacity: usize, seats: usize) -> usize {
    RING + capacity + seats * LINE
}

fn load(word: &AtomicU64) -> u64 {
    word.load(SeqCst)
}

pub(super) fn cas(word: &AtomicU64, old: u64, new: u64) -> bool {
    word.compare_exchange(old, new, SeqCst, SeqCst).is_ok()
}

/// Whether a slot's ticket needs it no more: both halves done, and the
/// giver's acknowledgement in (the broker's grants need none).
pub(super) fn finished(slot: Slot) -> bool {
    let claim_done = matches!(slot.claim, Claim::Taken(_) | Claim::Cancelled(_));
    let grant_done = match slot.grant {
        Grant::Given { acked, .. } => acked,
        Grant::Open => matches!(slot.claim, Claim::Cancelled(_)),
        Grant::Stop => false,
    };
    claim_done && grant_done
}

/// Whether the next grant lands on this slot (the model's rule).
pub(super) fn awaits_grant(slot: Slot) -> bool {
    match slot.grant {
        Grant::Stop => true,
        Grant::Open => !matches!(slot.claim, Claim::Cancelled(_)),
        Grant::Given { .. } => false,
    }
}

pub(super) fn fresh(t: Ticket, slot: Slot) -> u64 {
    SlotWord {
        gen: t as u32,
        slot,
        sleeping: false,
    }
    .pack()
}

fn with_slot(word: SlotWord, slot: Slot) -> u64 {
    SlotWord { slot, ..word }.pack()
}

pub(super) const BROKER_GRANT: Grant = Grant::Given {
    by: Party::Broker,
    acked: true,
};

impl From<BadWord> for Refused {
    fn from(_: BadWord) -> Self {
        Refused::Corrupt
    }
}

impl<'w> Ring<'w> {
    /// Lays out a new region in `words` (all zero, as a fresh memfd is):
    /// `lent` tokens given to the first tickets, free for the first
    /// claimers. The broker does this once, before any client maps it.
    pub fn init(
        words: &'w [AtomicU64],
        capacity: usize,
        seats: usize,
        lent: u32,
    ) -> Result<Self, LayoutError> {
        let ring = Ring::checked(words, capacity, seats)?;
        if lent as usize >= capacity {
            return Err(LayoutError::Range { capacity, seats });
        }
        for (i, word) in words[RING..RING + capacity].iter().enumerate() {
            let slot = Slot {
                claim: Claim::Unclaimed,
                grant: if i < lent as usize {
                    BROKER_GRANT
                } else {
                    Grant::Open
                },
            };
            word.store(fresh(i, slot), SeqCst);
        }
        words[SERVE].store(u64::from(lent), SeqCst);
        words[CAPACITY].store(capacity as u64, SeqCst);
        words[SEATS].store(seats as u64, SeqCst);
        words[LENT].store(u64::from(lent), SeqCst);
        // Last: a client that sees the magic sees the rest.
        words[0].store(MAGIC, SeqCst);
        Ok(ring)
    }

    /// A region laid out by [`Ring::init`], as a client maps it: the
    /// header is checked against the words there are.
    pub fn attach(words: &'w [AtomicU64]) -> Result<Self, LayoutError> {
        let magic = words.first().map_or(0, load);
        if magic != MAGIC || words.len() < RING {
            return Err(LayoutError::Magic(magic));
        }
        let capacity = load(&words[CAPACITY]) as usize;
        let seats = load(&words[SEATS]) as usize;
        Ring::checked(words, capacity, seats)
    }

    fn checked(words: &'w [AtomicU64], capacity: usize, seats: usize) -> Result<Self, LayoutError> {
        if !(1..=MAX_CAPACITY).contains(&capacity) || !(1..=MAX_SEATS).contains(&seats) {
            return Err(LayoutError::Range { capacity, seats });
        }
        let needed = words_for(capacity, seats);
        if words.len() < needed {
            return Err(LayoutError::Size {
                needed,
                have: words.len(),
            });
        }
        Ok(Ring {
            words,
            capacity,
            seats,
        })
    }

    /// Slots in the ring.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Seats it serves.
    pub fn seats(&self) -> usize {
        self.seats
    }

    /// Tokens the broker lent it when it laid it out.
    pub fn lent(&self) -> u32 {
        load(&self.words[LENT]) as u32
    }

    /// The word of ticket `t`'s slot: what its claimer futex-waits on.
    pub fn slot_word(&self, t: Ticket) -> &'w AtomicU64 {
        &self.words[RING + t % self.capacity]
    }

    fn seat_word(&self, seat: Seat, field: usize) -> &'w AtomicU64 {
        &self.words[RING + self.capacity + usize::from(seat.0) * LINE + field]
    }

    /// A hint's value ([`TAIL`] or [`SERVE`]), for a post-mortem.
    pub fn hint_word(&self, hint: usize) -> u64 {
        load(&self.words[hint])
    }

    /// A seat's record word.
    pub fn record_word(&self, seat: Seat) -> &'w AtomicU64 {
        self.seat_word(seat, RECORD)
    }

    /// Whether the broker dropped `seat` to the socket path.
    pub fn revoked(&self, seat: Seat) -> bool {
        load(self.seat_word(seat, REVOKED)) != 0
    }

    /// Drops `seat` to the socket path: its client finishes the operation
    /// in flight and uses the socket from then on.
    pub fn revoke(&self, seat: Seat) {
        self.seat_word(seat, REVOKED).store(1, SeqCst);
    }

    /// Ticket `t`'s slot: its word as read, and which lap it carries.
    pub(super) fn lap(&self, t: Ticket) -> Result<(u64, Lap), Refused> {
        let raw = load(self.slot_word(t));
        let word = SlotWord::unpack(raw)?;
        let ahead = word.gen.wrapping_sub(t as u32) as i32;
        let lap = match ahead {
            0 => Lap::This(word),
            d if d == -(self.capacity as i32) => Lap::Earlier(word),
            d if d > 0 => Lap::Later,
            _ => return Err(Refused::Corrupt),
        };
        Ok((raw, lap))
    }

    /// Moves a hint from `t` to `t + 1`, unless somebody already moved it.
    pub(super) fn pass(&self, hint: usize, t: Ticket) {
        let _ = self.words[hint].compare_exchange(t as u64, t as u64 + 1, SeqCst, SeqCst);
    }

    pub(super) fn hint(&self, hint: usize) -> Ticket {
        load(&self.words[hint]) as Ticket
    }

    /// Changes ticket `t`'s slot with `f` (given its current slot; `None`
    /// leaves it alone) in one compare-and-swap, retried while others
    /// change the word under it. Returns the slot word it replaced.
    pub(super) fn update_slot(
        &self,
        t: Ticket,
        mut f: impl FnMut(SlotWord) -> Option<SlotWord>,
    ) -> Result<Option<SlotWord>, Refused> {
        loop {
            let (raw, lap) = self.lap(t)?;
            let Lap::This(word) = lap else {
                return Err(Refused::Corrupt);
            };
            let Some(next) = f(word) else {
                return Ok(None);
            };
            if cas(self.slot_word(t), raw, next.pack()) {
                return Ok(Some(word));
            }
        }
    }

    /// Changes `seat`'s record with `f`, moving its change count on; one
    /// compare-and-swap, retried if the broker collected `returned`
    /// meanwhile.
    pub(super) fn update_record(
        &self,
        seat: Seat,
        mut f: impl FnMut(&mut RecordWord),
    ) -> Result<(), Refused> {
        let word = self.record_word(seat);
        loop {
            let raw = load(word);
            let next = RecordWord::unpack(raw)?.changed(&mut f);
            if cas(word, raw, next.pack()) {
                return Ok(());
            }
        }
    }

    /// The record of `seat`.
    pub fn record(&self, seat: Seat) -> Result<RecordWord, BadWord> {
        RecordWord::unpack(load(self.record_word(seat)))
    }

    /// Claims the first unclaimed ticket (`claim` says who, and how) if
    /// `wanted` accepts its slot: the ticket and the slot as it left it,
    /// or `None` if `wanted` refused the first unclaimed one.
    pub(super) fn claim_first(
        &self,
        claim: Claim,
        wanted: impl Fn(&Slot) -> bool,
    ) -> Result<Option<(Ticket, Slot)>, Refused> {
        loop {
            let t = self.hint(TAIL);
            let (raw, lap) = self.lap(t)?;
            let slot = match lap {
                Lap::Later => {
                    self.pass(TAIL, t);
                    continue;
                }
                Lap::This(word) if word.slot.claim != Claim::Unclaimed => {
                    self.pass(TAIL, t);
                    continue;
                }
                Lap::This(word) => word.slot,
                Lap::Earlier(word) if finished(word.slot) => Slot::EMPTY,
                Lap::Earlier(_) => return Err(Refused::Full),
            };
            if !wanted(&slot) {
                return Ok(None);
            }
            let claimed = Slot { claim, ..slot };
            if cas(self.slot_word(t), raw, fresh(t, claimed)) {
                self.pass(TAIL, t);
                return Ok(Some((t, claimed)));
            }
        }
    }

    /// Finds the first ticket awaiting a grant and hands it to `give`
    /// (its slot, or the empty one of an untouched ticket), which returns
    /// the slot to store, or `None` to stop there. Returns the ticket and
    /// its word before the change.
    pub(super) fn grant_first(
        &self,
        from: Ticket,
        mut give: impl FnMut(Ticket, Slot) -> Option<Slot>,
    ) -> Result<Option<(Ticket, SlotWord)>, Refused> {
        let mut t = from.max(self.hint(SERVE));
        loop {
            let (raw, lap) = self.lap(t)?;
            let word = match lap {
                Lap::Later => None,
                Lap::This(word) if awaits_grant(word.slot) => Some(word),
                Lap::This(_) => None,
                Lap::Earlier(word) if finished(word.slot) => Some(SlotWord {
                    gen: t as u32,
                    slot: Slot::EMPTY,
                    sleeping: false,
                }),
                Lap::Earlier(_) => return Err(Refused::Full),
            };
            let Some(word) = word else {
                if from == 0 {
                    self.pass(SERVE, t);
                }
                t += 1;
                continue;
            };
            let Some(next) = give(t, word.slot) else {
                return Ok(None);
            };
            if cas(self.slot_word(t), raw, with_slot(word, next)) {
                return Ok(Some((t, word)));
            }
        }
    }

    /// One step of `seat`'s client in `phase`, as the model's
    /// `Region::step`: the next phase, and what others see. `Asleep` is
    /// the caller's (a futex wait); the other phases are one atomic
    /// operation each, plus the retries of a compare-and-swap that others
    /// raced.
    pub fn step(
        &self,
        seat: Seat,
        phase: Phase,
        host: &dyn Host,
    ) -> Result<(Phase, Event), Refused> {
        let me = Party::Seat(seat);
        Ok(match phase {
            Phase::Claim => match self.claim_first(Claim::Claimed(me), |_| true)? {
                Some((t, slot)) if slot.is_granted() => (Phase::Take(t), Event::ClaimedFree(t)),
                Some((t, slot)) => {
                    if slot.grant == Grant::Stop {
                        host.tell(Notice::Waiting);
                    }
                    (Phase::Check(t), Event::Enqueued(t))
                }
                None => unreachable!("a claim that accepts every slot"),
            },
            Phase::Check(t) => {
                let (_, lap) = self.lap(t)?;
                match lap {
                    Lap::This(word) if word.slot.is_granted() => (Phase::Take(t), Event::Quiet),
                    Lap::This(_) => (Phase::Asleep(t), Event::Quiet),
                    _ => return Err(Refused::Corrupt),
                }
            }
            Phase::Take(t) => {
                self.update_record(seat, |r| {
                    r.held += 1;
                    r.intent = IntentWord::Taking(t as u32);
                })?;
                (Phase::AckTaken(t), Event::Quiet)
            }
            Phase::AckTaken(t) => {
                self.update_slot(t, |w| {
                    Some(SlotWord {
                        slot: Slot {
                            claim: Claim::Taken(me),
                            ..w.slot
                        },
                        sleeping: false,
                        ..w
                    })
                })?;
                (Phase::Done, Event::Quiet)
            }
            Phase::Hand => {
                if self.record(seat)?.held == 0 {
                    return Err(Refused::NothingHeld);
                }
                self.update_record(seat, |r| {
                    r.held -= 1;
                    r.intent = IntentWord::Releasing;
                })?;
                (Phase::Grant, Event::Quiet)
            }
            Phase::Grant => self.give(me)?,
            Phase::Return => {
                let mut full = false;
                self.update_record(seat, |r| {
                    full = r.returned == u8::MAX;
                    if !full {
                        r.returned += 1;
                        r.intent = IntentWord::Idle;
                    }
                })?;
                if full {
                    // The broker has not collected 255 returns yet: ask
                    // again, and try once more.
                    host.tell(Notice::Returned);
                    std::thread::yield_now();
                    return Ok((Phase::Return, Event::Quiet));
                }
                host.tell(Notice::Returned);
                (Phase::Done, Event::Quiet)
            }
            Phase::Wake(t) => {
                if let (_, Lap::This(word)) = self.lap(t)? {
                    if word.sleeping {
                        host.wake(self.slot_word(t));
                    }
                }
                (Phase::Settle(t), Event::Wake(t))
            }
            Phase::Settle(t) => {
                self.update_record(seat, |r| r.intent = IntentWord::Idle)?;
                (Phase::AckGrant(t), Event::Quiet)
            }
            Phase::AckGrant(t) => {
                self.update_slot(t, |w| {
                    Some(SlotWord {
                        slot: Slot {
                            grant: Grant::Given {
                                by: me,
                                acked: true,
                            },
                            ..w.slot
                        },
                        ..w
                    })
                })?;
                (Phase::Done, Event::Quiet)
            }
            Phase::Asleep(_) | Phase::Done => panic!("{phase:?} has no step"),
        })
    }

    /// The release's grant: the token in flight goes to the first ticket
    /// awaiting one, or back to the broker if that ticket is its barrier.
    /// A full ring refuses (nothing changed): [`Ring::release`] then
    /// returns the token to the broker too.
    fn give(&self, me: Party) -> Result<(Phase, Event), Refused> {
        let given = self.grant_first(0, |_, slot| {
            (slot.grant != Grant::Stop).then_some(Slot {
                grant: Grant::Given {
                    by: me,
                    acked: false,
                },
                ..slot
            })
        });
        Ok(match given? {
            Some((t, _)) => (Phase::Wake(t), Event::Granted(t)),
            None => (Phase::Return, Event::Stopped),
        })
    }

    /// `seat`'s wait on ticket `t` ends without a token, unless one came
    /// first: then the client takes it (the next phase says which).
    pub fn time_out(&self, seat: Seat, t: Ticket) -> Result<(Phase, Event), Refused> {
        let me = Party::Seat(seat);
        let before = self.update_slot(t, |w| {
            (!w.slot.is_granted()).then_some(SlotWord {
                slot: Slot {
                    claim: Claim::Cancelled(me),
                    ..w.slot
                },
                sleeping: false,
                ..w
            })
        })?;
        Ok(match before {
            Some(_) => (Phase::Done, Event::Cancelled(t)),
            None => (Phase::Take(t), Event::Quiet),
        })
    }

    /// Acquires one token for `seat`, waiting in ticket order until
    /// `deadline`. `Refused` means nothing changed in the region: the
    /// client asks the socket instead.
    pub fn acquire(
        &self,
        seat: Seat,
        host: &dyn Host,
        deadline: Option<Instant>,
    ) -> Result<Acquired, Refused> {
        self.usable(seat)?;
        self.run(seat, Phase::Claim, host, deadline)
    }

    /// Takes a free token for `seat` if there is one, without joining the
    /// queue: `TRY 1`.
    pub fn try_acquire(&self, seat: Seat, host: &dyn Host) -> Result<(), Refused> {
        self.usable(seat)?;
        let (t, _) = self
            .claim_first(Claim::Claimed(Party::Seat(seat)), Slot::is_granted)?
            .ok_or(Refused::Busy)?;
        self.run(seat, Phase::Take(t), host, None).map(|_| ())
    }

    /// Gives one of `seat`'s tokens to the next ticket, or back to the
    /// broker while its barrier stands.
    pub fn release(&self, seat: Seat, host: &dyn Host) -> Result<Released, Refused> {
        self.usable(seat)?;
        let mut phase = Phase::Hand;
        let mut released = Released::Given;
        while phase != Phase::Done {
            let (next, event) = match self.step(seat, phase, host) {
                Err(Refused::Full) if phase == Phase::Grant => (Phase::Return, Event::Stopped),
                stepped => stepped?,
            };
            if event == Event::Stopped {
                released = Released::Returned;
            }
            phase = next;
        }
        Ok(released)
    }

    /// Runs `seat`'s steps from `phase` to the end of its acquire.
    fn run(
        &self,
        seat: Seat,
        mut phase: Phase,
        host: &dyn Host,
        deadline: Option<Instant>,
    ) -> Result<Acquired, Refused> {
        loop {
            phase = match phase {
                Phase::Done => return Ok(Acquired::Token),
                Phase::Asleep(t) => match self.sleep(seat, t, host, deadline)? {
                    Some(phase) => phase,
                    None => return Ok(Acquired::TimedOut),
                },
                phase => self.step(seat, phase, host)?.0,
            };
        }
    }

    /// `Asleep(t)`: marks the slot `sleeping` and waits on its low half
    /// until a grant changes it. Past the deadline it withdraws the wait
    /// (`None`), unless a token came first.
    fn sleep(
        &self,
        seat: Seat,
        t: Ticket,
        host: &dyn Host,
        deadline: Option<Instant>,
    ) -> Result<Option<Phase>, Refused> {
        loop {
            if self.revoked(seat) {
                return Err(Refused::Revoked);
            }
            if host.gone() {
                return Err(Refused::Gone);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(match self.time_out(seat, t)? {
                    (Phase::Done, _) => None,
                    (phase, _) => Some(phase),
                });
            }
            self.update_slot(t, |w| {
                (!w.slot.is_granted() && !w.sleeping).then_some(SlotWord {
                    sleeping: true,
                    ..w
                })
            })?;
            let (raw, lap) = self.lap(t)?;
            match lap {
                Lap::This(word) if word.slot.is_granted() => return Ok(Some(Phase::Take(t))),
                Lap::This(_) => host.wait(self.slot_word(t), SlotWord::futex_half(raw), deadline),
                _ => return Err(Refused::Corrupt),
            }
        }
    }

    fn usable(&self, seat: Seat) -> Result<(), Refused> {
        if usize::from(seat.0) >= self.seats || self.revoked(seat) {
            return Err(Refused::Revoked);
        }
        Ok(())
    }
}
