//! The fast path's barging mode: a pile of tokens anyone may take, for the
//! users who want a lock's price more than first come, first served
//! (docs/fastpath.md, "The pile"). The ring hands each freed token to the
//! oldest waiter, so with one token among many processes every transfer
//! wakes somebody; here a releaser puts its token back on the pile, and
//! whoever comes first takes it, as a semaphore does.
//!
//! What stays exact is the books: the pile is a fixed row of token words,
//! one per token lent, and each word names its holder (a seat, the
//! broker, or nobody). A token moves only by a compare-and-swap of its own
//! word, so no sequence of steps, and no client killed between two of
//! them, can make or lose one: the broker's repair of a dead seat is to
//! free every word that names it.
//!
//! Waking is an eventcount, the bell: sleepers count themselves in it and
//! sleep on its sequence; a releaser that sees sleepers bumps the sequence
//! and wakes one of them, and marks a wake-up in flight so that the
//! releases after it do not wake more sleepers before that one has looked.
//! Whoever clears that mark looks again for a free token, so a release
//! that saw the mark and did not ring is never lost
//! (`tests/fastpath_pile.rs` runs every interleaving with a kill at every
//! step).
//!
//! Each operation is a small machine whose every step is one atomic access
//! to the region, or a request for a futex call ([`Step`]): the real
//! client runs it in a loop ([`Pile::acquire`], [`Pile::release`]), and the
//! model test runs the same machines under a scheduler of its own.

use super::Seat;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::Instant;

/// The first word of a pile region ("BATONPL1"): a region made by another
/// version is refused.
pub const MAGIC: u64 = u64::from_le_bytes(*b"BATONPL1");
/// Words per cache line: the bell sits alone on one.
const LINE: usize = 8;
/// Word 1: how many tokens and seats (tokens in the low 32 bits).
const SIZES: usize = 1;
/// The bell: the sequence sleepers wait on, their count, the mark.
const BELL: usize = LINE;
/// The first token word.
const TOKENS: usize = 2 * LINE;
/// Seats a pile serves: a holder is stored as seat + 1 in 16 bits.
pub const MAX_SEATS: usize = 2047;
/// Tokens a pile holds: a release scans them all, so few.
pub const MAX_TOKENS: usize = 4096;

/// A token word nobody holds.
pub const FREE: u64 = 0;
/// Added to a held token's word by the broker: its holder gives it back
/// to the broker, not to the pile (a lowered limit, a closed gate).
pub const RECALL: u64 = 1 << 16;
/// A token word the broker holds: out of the pile until it lends it again.
pub const BROKER: u64 = 1 << 17;
/// A seat's record word: it is counted among the bell's sleepers.
pub const COUNTED: u64 = 1;

const SEQ_MASK: u64 = 0xffff_ffff;
const SLEEPER: u64 = 1 << 32;
const SLEEPERS_MASK: u64 = ((1 << 30) - 1) << 32;
const DIRTY: u64 = 1 << 62;
const PENDING: u64 = 1 << 63;

/// A holder's word: seat + 1 (0 is [`FREE`]).
pub fn holder(seat: Seat) -> u64 {
    u64::from(seat.0) + 1
}

/// What a token word says, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenWord {
    /// On the pile.
    Free,
    /// Held by a seat; `recalled` if it goes back to the broker on release.
    Held {
        /// Its holder.
        seat: Seat,
        /// It goes back to the broker when released.
        recalled: bool,
    },
    /// Taken out of the pile by the broker.
    Broker,
    /// No correct party writes this (garbage, for the audit to count).
    Bad(u64),
}

impl TokenWord {
    /// Decodes a token word of a pile with `seats` seats.
    pub fn decode(word: u64, seats: usize) -> TokenWord {
        let owner = word & !RECALL;
        match word {
            FREE => TokenWord::Free,
            BROKER => TokenWord::Broker,
            _ if (1..=seats as u64).contains(&owner) => TokenWord::Held {
                seat: Seat((owner - 1) as u16),
                recalled: word & RECALL != 0,
            },
            _ => TokenWord::Bad(word),
        }
    }
}

/// The bell's word, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BellWord {
    /// What sleepers wait on; every ring changes it.
    pub seq: u32,
    /// Sleepers counted in (a client killed between counting itself and
    /// marking its record leaves one too many: rings that wake nobody).
    pub sleepers: u32,
    /// A wake-up is in flight: its sleeper has not looked yet.
    pub pending: bool,
    /// A token was freed while it was: whoever clears the mark looks.
    pub dirty: bool,
}

impl BellWord {
    /// Decodes the bell's word.
    pub fn decode(word: u64) -> BellWord {
        BellWord {
            seq: (word & SEQ_MASK) as u32,
            sleepers: ((word & SLEEPERS_MASK) >> 32) as u32,
            pending: word & PENDING != 0,
            dirty: word & DIRTY != 0,
        }
    }
}

/// Why a region cannot be a pile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// Not a pile, or another version's.
    #[error("the region is not a baton pile of this version")]
    Magic,
    /// Sizes out of range.
    #[error("a pile holds 1 to {MAX_TOKENS} tokens and 1 to {MAX_SEATS} seats")]
    Sizes,
    #[error("the region has {have} words where its sizes need {need}")]
    /// Fewer words than its sizes need.
    Short {
        /// Words there are.
        have: usize,
        /// Words its sizes need.
        need: usize,
    },
}

/// Why an operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Refused {
    /// `TRY`: no token on the pile.
    #[error("no token is free")]
    Busy,
    /// A release of a token this seat does not hold.
    #[error("this seat does not hold that token")]
    NotHeld,
    /// The broker that made the region is gone.
    #[error("the broker that made the region is gone")]
    Gone,
}

/// How an acquire ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Acquired {
    /// The token whose word now names the seat.
    Token(usize),
    /// The deadline passed first.
    TimedOut,
}

/// How a release ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Released {
    /// Back on the pile.
    Piled,
    /// Recalled: the broker holds it now, and must be told.
    ToBroker,
}

/// The futex calls the machines ask for.
pub trait Bell {
    /// Sleeps while the low 32 bits of `word` are `expected`, until woken,
    /// until `deadline`, or for no reason at all.
    fn wait(&self, word: &AtomicU64, expected: u32, deadline: Option<Instant>);
    /// Wakes one sleeper on `word`; whether there was one.
    fn wake_one(&self, word: &AtomicU64) -> bool;
    /// Whether the broker is gone (asked after each wait).
    fn gone(&self) -> bool {
        false
    }
}

/// What one step of a machine did, or asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step<T> {
    /// One atomic access done; step again.
    Busy,
    /// Call `Bell::wait` on the bell with this sequence, then `waited`.
    Wait(u32),
    /// Call `Bell::wake_one` on the bell, then `woke` with its answer.
    Wake,
    /// Finished.
    Done(T),
}

/// A pile's words, and the operations on them.
#[derive(Debug, Clone, Copy)]
pub struct Pile<'w> {
    words: &'w [AtomicU64],
    tokens: usize,
    seats: usize,
}

/// Words a pile of `tokens` tokens and `seats` seats takes.
pub fn words_for(tokens: usize, seats: usize) -> usize {
    TOKENS + tokens + seats
}

impl<'w> Pile<'w> {
    /// Lays a new pile out in zeroed `words`: `lent` of its `tokens` on the
    /// pile, the rest the broker's.
    pub fn init(
        words: &'w [AtomicU64],
        tokens: usize,
        seats: usize,
        lent: usize,
    ) -> Result<Self, LayoutError> {
        if !(1..=MAX_TOKENS).contains(&tokens) || !(1..=MAX_SEATS).contains(&seats) || lent > tokens
        {
            return Err(LayoutError::Sizes);
        }
        let need = words_for(tokens, seats);
        if words.len() < need {
            return Err(LayoutError::Short {
                have: words.len(),
                need,
            });
        }
        words[SIZES].store(((seats as u64) << 32) | tokens as u64, SeqCst);
        for (i, word) in words[TOKENS..TOKENS + tokens].iter().enumerate() {
            word.store(if i < lent { FREE } else { BROKER }, SeqCst);
        }
        words[0].store(MAGIC, SeqCst);
        Pile::attach(words)
    }

    /// A client's view of a pile the broker laid out.
    pub fn attach(words: &'w [AtomicU64]) -> Result<Self, LayoutError> {
        if words.len() < TOKENS || words[0].load(SeqCst) != MAGIC {
            return Err(LayoutError::Magic);
        }
        let sizes = words[SIZES].load(SeqCst);
        let (tokens, seats) = ((sizes & SEQ_MASK) as usize, (sizes >> 32) as usize);
        if !(1..=MAX_TOKENS).contains(&tokens) || !(1..=MAX_SEATS).contains(&seats) {
            return Err(LayoutError::Sizes);
        }
        let need = words_for(tokens, seats);
        if words.len() < need {
            return Err(LayoutError::Short {
                have: words.len(),
                need,
            });
        }
        Ok(Pile {
            words,
            tokens,
            seats,
        })
    }

    /// Token words in the pile (lent or the broker's).
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Seats, each with a record.
    pub fn seats(&self) -> usize {
        self.seats
    }

    /// The word sleepers wait on.
    pub fn bell(&self) -> &'w AtomicU64 {
        &self.words[BELL]
    }

    /// The bell, decoded.
    pub fn bell_word(&self) -> BellWord {
        BellWord::decode(self.bell().load(SeqCst))
    }

    fn token(&self, i: usize) -> &'w AtomicU64 {
        &self.words[TOKENS + i]
    }

    /// Token `i`'s word, decoded.
    pub fn token_word(&self, i: usize) -> TokenWord {
        TokenWord::decode(self.token(i).load(SeqCst), self.seats)
    }

    fn record(&self, seat: Seat) -> &'w AtomicU64 {
        &self.words[TOKENS + self.tokens + usize::from(seat.0)]
    }

    /// Whether the seat's record says it is counted among the sleepers.
    pub fn counted(&self, seat: Seat) -> bool {
        self.record(seat).load(SeqCst) & COUNTED != 0
    }

    /// Takes a token, waiting for one until `deadline` (`try_only`: not at
    /// all).
    pub fn acquire(
        &self,
        seat: Seat,
        bell: &impl Bell,
        deadline: Option<Instant>,
        try_only: bool,
    ) -> Result<Acquired, Refused> {
        let mut op = Acquire::new(seat, try_only);
        loop {
            match op.step(self) {
                Step::Busy => {}
                Step::Wait(seq) => {
                    bell.wait(self.bell(), seq, deadline);
                    let late = deadline.is_some_and(|d| Instant::now() >= d);
                    op.waited(late, bell.gone());
                }
                Step::Wake => op.woke(bell.wake_one(self.bell())),
                Step::Done(out) => return out,
            }
        }
    }

    /// Gives token `i` back: onto the pile, or to the broker if recalled.
    pub fn release(&self, seat: Seat, i: usize, bell: &impl Bell) -> Result<Released, Refused> {
        let mut op = Release::new(seat, i);
        loop {
            match op.step(self) {
                Step::Busy => {}
                Step::Wait(_) => unreachable!("a release never waits"),
                Step::Wake => op.woke(bell.wake_one(self.bell())),
                Step::Done(out) => return out,
            }
        }
    }

    /// The broker's repair of a dead seat: every token it held back on the
    /// pile (or to the broker, if recalled), its count among the sleepers
    /// taken out, and any wake-up it was given passed on. Returns the
    /// tokens freed and those recalled.
    pub fn repair(&self, seat: Seat, bell: &impl Bell) -> (usize, usize) {
        let mut op = Repair::new(seat);
        loop {
            match op.step(self) {
                Step::Busy | Step::Wait(_) => {}
                Step::Wake => op.woke(bell.wake_one(self.bell())),
                Step::Done(out) => return out,
            }
        }
    }
}

/// Rings the bell if somebody sleeps and no wake-up is in flight. If one
/// is, a releaser marks the bell dirty instead: its token was freed while
/// the woken sleeper had not looked yet, and whoever clears the mark (that
/// sleeper, or the ringer if its wake found nobody asleep) looks for it
/// and rings again. A ring that found nobody asleep and no dirty mark is
/// done: a sleeper still on its way to sleep counted itself before the
/// ringer looked, so it finds the token or its wait returns at once.
// A machine's state: its fields are the registers a step reads.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ring {
    /// Reading the bell.
    Load,
    /// A wake-up is in flight: marking the bell dirty.
    Dirty {
        old: u64,
    },
    /// Swapping in the next sequence and the mark.
    Mark {
        old: u64,
    },
    /// The wake was asked for.
    Waking,
    /// Nobody was woken: clearing the mark.
    Clear,
    /// The mark was dirty: looking for a free token from token `i`.
    Look {
        i: usize,
    },
    Done,
}

impl Ring {
    fn start() -> Ring {
        Ring::Load
    }

    fn step(&mut self, pile: &Pile) -> Step<()> {
        match *self {
            Ring::Load => {
                let old = pile.bell().load(SeqCst);
                *self = if old & SLEEPERS_MASK == 0 || old & DIRTY != 0 {
                    Ring::Done
                } else if old & PENDING != 0 {
                    Ring::Dirty { old }
                } else {
                    Ring::Mark { old }
                };
            }
            Ring::Dirty { old } => {
                let swapped = pile
                    .bell()
                    .compare_exchange(old, old | DIRTY, SeqCst, SeqCst)
                    .is_ok();
                *self = if swapped { Ring::Done } else { Ring::Load };
            }
            Ring::Mark { old } => {
                let new = (old & SLEEPERS_MASK) | PENDING | u64::from((old as u32).wrapping_add(1));
                let swapped = pile
                    .bell()
                    .compare_exchange(old, new, SeqCst, SeqCst)
                    .is_ok();
                if swapped {
                    *self = Ring::Waking;
                    return Step::Wake;
                }
                *self = Ring::Load;
            }
            Ring::Waking => unreachable!("woke() moves a ring on"),
            Ring::Clear => {
                let was = pile.bell().fetch_and(!(PENDING | DIRTY), SeqCst);
                *self = if was & DIRTY != 0 {
                    Ring::Look { i: 0 }
                } else {
                    Ring::Done
                };
            }
            Ring::Look { i } => {
                *self = if pile.token(i).load(SeqCst) == FREE {
                    Ring::Load
                } else if i + 1 < pile.tokens {
                    Ring::Look { i: i + 1 }
                } else {
                    Ring::Done
                };
            }
            Ring::Done => return Step::Done(()),
        }
        Step::Busy
    }

    fn woke(&mut self, somebody: bool) {
        assert_eq!(*self, Ring::Waking, "woke() without a wake");
        *self = if somebody { Ring::Done } else { Ring::Clear };
    }
}

/// An acquire's steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Acquire {
    seat: Seat,
    try_only: bool,
    at: AcquireAt,
    /// The token taken, once it is.
    taken: Option<usize>,
    /// How it ends, once known.
    outcome: Option<Result<Acquired, Refused>>,
}

// A machine's state: its fields are the registers a step reads; the
// model test names them, nobody else.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AcquireAt {
    /// Trying token `i`'s word; `counted` once among the sleepers;
    /// `cleared` if this client cleared a wake-up's mark since it last
    /// looked (it then passes on a second free token it sees).
    Take {
        i: usize,
        counted: bool,
        seq: u32,
        cleared: bool,
    },
    /// Reading the bell's sequence before counting itself in.
    Sequence {
        cleared: bool,
    },
    /// Counting itself among the sleepers.
    Count {
        seq: u32,
        cleared: bool,
    },
    /// Marking its record as counted.
    Mark {
        seq: u32,
        cleared: bool,
    },
    /// Asleep (or about to be).
    Sleeping {
        seq: u32,
    },
    /// Leaving the count: its record first, then the bell.
    Unmark {
        then: Then,
        cleared: bool,
    },
    Uncount {
        then: Then,
        cleared: bool,
    },
    /// Back from a wait: clearing the mark of the wake-up that may have
    /// been its own.
    Unpend {
        then: Then,
    },
    /// Looking for a second free token from `i`, to ring for it.
    PassLook {
        i: usize,
    },
    /// Ringing for it.
    Ringing(Ring),
    Finished,
}

/// What an acquire does once it is out of the sleepers' count.
// A machine's state: its fields are the registers a step reads; the
// model test names them, nobody else.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Then {
    /// Took a token: pass on what it saw, and end.
    Took,
    /// Woke: clear the mark, look again.
    Retry,
    /// Woke late (or its broker is gone): clear the mark, pass on, end.
    End,
}

impl Acquire {
    /// An acquire by `seat`; `try_only` never waits.
    pub fn new(seat: Seat, try_only: bool) -> Acquire {
        Acquire {
            seat,
            try_only,
            at: AcquireAt::Take {
                i: 0,
                counted: false,
                seq: 0,
                cleared: false,
            },
            taken: None,
            outcome: None,
        }
    }

    /// Where it is (for the model test).
    pub fn at(&self) -> AcquireAt {
        self.at
    }

    /// The token this acquire holds, if it took one (for the model test:
    /// a client killed after this holds it).
    pub fn taken(&self) -> Option<usize> {
        self.taken
    }

    /// One step: one atomic access, or a futex call asked for.
    pub fn step(&mut self, pile: &Pile) -> Step<Result<Acquired, Refused>> {
        use AcquireAt::*;
        match self.at {
            Take {
                i,
                counted,
                seq,
                cleared,
            } => {
                let me = holder(self.seat);
                if pile
                    .token(i)
                    .compare_exchange(FREE, me, SeqCst, SeqCst)
                    .is_ok()
                {
                    self.taken = Some(i);
                    self.outcome = Some(Ok(Acquired::Token(i)));
                    self.at = if counted {
                        Unmark {
                            then: Then::Took,
                            cleared,
                        }
                    } else {
                        Acquire::pass_or_finish(cleared)
                    };
                } else if i + 1 < pile.tokens {
                    self.at = Take {
                        i: i + 1,
                        counted,
                        seq,
                        cleared,
                    };
                } else if counted {
                    self.at = Sleeping { seq };
                    return Step::Wait(seq);
                } else if self.try_only {
                    self.outcome = Some(Err(Refused::Busy));
                    self.at = Acquire::pass_or_finish(cleared);
                } else {
                    self.at = Sequence { cleared };
                }
            }
            Sequence { cleared } => {
                let seq = pile.bell().load(SeqCst) as u32;
                self.at = Count { seq, cleared };
            }
            Count { seq, cleared } => {
                pile.bell().fetch_add(SLEEPER, SeqCst);
                self.at = Mark { seq, cleared };
            }
            Mark { seq, cleared } => {
                pile.record(self.seat).store(COUNTED, SeqCst);
                self.at = Take {
                    i: 0,
                    counted: true,
                    seq,
                    cleared,
                };
            }
            Sleeping { .. } => unreachable!("waited() moves a sleeper on"),
            Unmark { then, cleared } => {
                pile.record(self.seat).store(0, SeqCst);
                self.at = Uncount { then, cleared };
            }
            Uncount { then, cleared } => {
                pile.bell().fetch_sub(SLEEPER, SeqCst);
                self.at = Acquire::after_count(then, cleared);
            }
            Unpend { then } => {
                let was = pile.bell().fetch_and(!(PENDING | DIRTY), SeqCst);
                let cleared = was & DIRTY != 0;
                self.at = match then {
                    Then::Retry => Take {
                        i: 0,
                        counted: false,
                        seq: 0,
                        cleared,
                    },
                    Then::Took | Then::End => Acquire::pass_or_finish(cleared),
                };
            }
            PassLook { i } => {
                self.at = if pile.token(i).load(SeqCst) == FREE {
                    Ringing(Ring::start())
                } else if i + 1 < pile.tokens {
                    PassLook { i: i + 1 }
                } else {
                    Finished
                };
            }
            Ringing(mut ring) => {
                let step = ring.step(pile);
                self.at = Ringing(ring);
                match step {
                    Step::Done(()) => self.at = Finished,
                    Step::Wake => return Step::Wake,
                    _ => {}
                }
            }
            Finished => {
                return Step::Done(self.outcome.expect("an acquire ends with an outcome"));
            }
        }
        Step::Busy
    }

    /// Where it goes once out of the sleepers' count.
    fn after_count(then: Then, cleared: bool) -> AcquireAt {
        match then {
            Then::Took => Acquire::pass_or_finish(cleared),
            Then::Retry | Then::End => AcquireAt::Unpend { then },
        }
    }

    /// Whoever cleared a wake-up's mark looks for a token freed while the
    /// mark stood (its releaser left the ringing to the mark's sleeper).
    fn pass_or_finish(cleared: bool) -> AcquireAt {
        if cleared {
            AcquireAt::PassLook { i: 0 }
        } else {
            AcquireAt::Finished
        }
    }

    /// Back from `Bell::wait`: `late` if the deadline passed, `gone` if the
    /// broker is.
    pub fn waited(&mut self, late: bool, gone: bool) {
        let AcquireAt::Sleeping { .. } = self.at else {
            unreachable!("waited() without a wait")
        };
        let then = if gone {
            self.outcome = Some(Err(Refused::Gone));
            Then::End
        } else if late {
            self.outcome = Some(Ok(Acquired::TimedOut));
            Then::End
        } else {
            Then::Retry
        };
        self.at = AcquireAt::Unmark {
            then,
            cleared: false,
        };
    }

    /// Back from `Bell::wake_one`: whether it woke somebody.
    pub fn woke(&mut self, somebody: bool) {
        let AcquireAt::Ringing(mut ring) = self.at else {
            unreachable!("woke() without a wake")
        };
        ring.woke(somebody);
        self.at = AcquireAt::Ringing(ring);
    }
}

/// A release's steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Release {
    seat: Seat,
    token: usize,
    at: ReleaseAt,
}

// A machine's state: its fields are the registers a step reads; the
// model test names them, nobody else.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReleaseAt {
    /// Putting the token back on the pile.
    Give,
    /// It was recalled: handing it to the broker.
    Recall,
    /// On the pile: ringing for it.
    Ringing(Ring),
    Finished(Result<Released, Refused>),
}

impl Release {
    /// A release of token `token` by `seat`.
    pub fn new(seat: Seat, token: usize) -> Release {
        Release {
            seat,
            token,
            at: ReleaseAt::Give,
        }
    }

    /// Where it is (for the model test).
    pub fn at(&self) -> ReleaseAt {
        self.at
    }

    /// The token it gives back.
    pub fn token(&self) -> usize {
        self.token
    }

    /// One step: one atomic access, or a futex call asked for.
    pub fn step(&mut self, pile: &Pile) -> Step<Result<Released, Refused>> {
        let me = holder(self.seat);
        match self.at {
            ReleaseAt::Give if self.token >= pile.tokens => {
                self.at = ReleaseAt::Finished(Err(Refused::NotHeld));
            }
            ReleaseAt::Give => {
                self.at = match pile
                    .token(self.token)
                    .compare_exchange(me, FREE, SeqCst, SeqCst)
                {
                    Ok(_) => ReleaseAt::Ringing(Ring::start()),
                    Err(now) if now == me | RECALL => ReleaseAt::Recall,
                    Err(_) => ReleaseAt::Finished(Err(Refused::NotHeld)),
                };
            }
            ReleaseAt::Recall => {
                let handed = pile
                    .token(self.token)
                    .compare_exchange(me | RECALL, BROKER, SeqCst, SeqCst)
                    .is_ok();
                self.at = ReleaseAt::Finished(if handed {
                    Ok(Released::ToBroker)
                } else {
                    Err(Refused::NotHeld)
                });
            }
            ReleaseAt::Ringing(mut ring) => {
                let step = ring.step(pile);
                self.at = ReleaseAt::Ringing(ring);
                match step {
                    Step::Done(()) => self.at = ReleaseAt::Finished(Ok(Released::Piled)),
                    Step::Wake => return Step::Wake,
                    _ => {}
                }
            }
            ReleaseAt::Finished(out) => return Step::Done(out),
        }
        Step::Busy
    }

    /// Back from `Bell::wake_one`: whether it woke somebody.
    pub fn woke(&mut self, somebody: bool) {
        let ReleaseAt::Ringing(mut ring) = self.at else {
            unreachable!("woke() without a wake")
        };
        ring.woke(somebody);
        self.at = ReleaseAt::Ringing(ring);
    }
}

/// The broker's repair of a dead seat, in steps (it runs beside the live
/// clients, who do not stop for it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Repair {
    seat: Seat,
    at: RepairAt,
    freed: usize,
    recalled: usize,
}

// A machine's state: its fields are the registers a step reads; the
// model test names them, nobody else.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RepairAt {
    /// Freeing token `i` if the dead seat holds it.
    Free {
        i: usize,
    },
    /// Token `i` was recalled from it: the broker's now.
    Recall {
        i: usize,
    },
    /// Reading its record: was it counted among the sleepers?
    Record,
    /// It was: its record cleared, and now the bell's count.
    Uncount,
    /// Clearing a wake-up's mark it may have been given.
    Unpend,
    /// Ringing for what it freed.
    Ringing(Ring),
    Finished,
}

impl Repair {
    /// The repair of dead `seat`.
    pub fn new(seat: Seat) -> Repair {
        Repair {
            seat,
            at: RepairAt::Free { i: 0 },
            freed: 0,
            recalled: 0,
        }
    }

    /// Where it is (for the model test).
    pub fn at(&self) -> RepairAt {
        self.at
    }

    /// One step: one atomic access, or a futex call asked for.
    pub fn step(&mut self, pile: &Pile) -> Step<(usize, usize)> {
        let dead = holder(self.seat);
        let next = |i: usize| {
            if i + 1 < pile.tokens {
                RepairAt::Free { i: i + 1 }
            } else {
                RepairAt::Record
            }
        };
        match self.at {
            RepairAt::Free { i } => {
                self.at = match pile.token(i).compare_exchange(dead, FREE, SeqCst, SeqCst) {
                    Ok(_) => {
                        self.freed += 1;
                        next(i)
                    }
                    Err(now) if now == dead | RECALL => RepairAt::Recall { i },
                    Err(_) => next(i),
                };
            }
            RepairAt::Recall { i } => {
                if pile
                    .token(i)
                    .compare_exchange(dead | RECALL, BROKER, SeqCst, SeqCst)
                    .is_ok()
                {
                    self.recalled += 1;
                }
                self.at = next(i);
            }
            RepairAt::Record => {
                self.at = if pile.record(self.seat).swap(0, SeqCst) & COUNTED != 0 {
                    RepairAt::Uncount
                } else {
                    RepairAt::Unpend
                };
            }
            RepairAt::Uncount => {
                pile.bell().fetch_sub(SLEEPER, SeqCst);
                self.at = RepairAt::Unpend;
            }
            RepairAt::Unpend => {
                pile.bell().fetch_and(!(PENDING | DIRTY), SeqCst);
                self.at = RepairAt::Ringing(Ring::start());
            }
            RepairAt::Ringing(mut ring) => {
                let step = ring.step(pile);
                self.at = RepairAt::Ringing(ring);
                match step {
                    Step::Done(()) => self.at = RepairAt::Finished,
                    Step::Wake => return Step::Wake,
                    _ => {}
                }
            }
            RepairAt::Finished => return Step::Done((self.freed, self.recalled)),
        }
        Step::Busy
    }

    /// Back from `Bell::wake_one`: whether it woke somebody.
    pub fn woke(&mut self, somebody: bool) {
        let RepairAt::Ringing(mut ring) = self.at else {
            unreachable!("woke() without a wake")
        };
        ring.woke(somebody);
        self.at = RepairAt::Ringing(ring);
    }
}

/// The liveness word of a pile: a robust mutex the broker's serving thread
/// holds, as in the ring. It takes words 2 to 6 of the first line, which
/// clients read only when they attach.
pub const LIVENESS: usize = 2;
/// A word the broker sets while the pile is closed (its tokens come from
/// the pool's queue): a client that goes to sleep then tells the broker,
/// which asks the pool for a token on its behalf.
pub const CLOSED: usize = 7;
// The liveness word's five words (a pthread mutex) lie between the sizes
// and the closed word, all in the first line, away from the bell's.
const _: () = assert!(SIZES < LIVENESS && LIVENESS + 5 <= CLOSED && CLOSED < BELL);

/// The broker's moves on a pile. Only the broker turns a [`BROKER`] word
/// into anything else, so which words are lent is its own book, and a
/// word it did not lend that is not [`BROKER`] was forged.
impl<'w> Pile<'w> {
    /// Puts token `i`, the broker's, on the pile and rings for it; false
    /// if it was not the broker's.
    pub fn lend(&self, i: usize, bell: &impl Bell) -> bool {
        let lent = self
            .token(i)
            .compare_exchange(BROKER, FREE, SeqCst, SeqCst)
            .is_ok();
        if lent {
            self.ring(bell);
        }
        lent
    }

    /// Rings the bell for a token the broker put on the pile (the same
    /// steps a release takes).
    fn ring(&self, bell: &impl Bell) {
        let mut ring = Ring::start();
        loop {
            match ring.step(self) {
                Step::Busy | Step::Wait(_) => {}
                Step::Wake => ring.woke(bell.wake_one(self.bell())),
                Step::Done(()) => return,
            }
        }
    }

    /// Takes free token `i` off the pile; false if it was not free.
    pub fn take_back(&self, i: usize) -> bool {
        self.token(i)
            .compare_exchange(FREE, BROKER, SeqCst, SeqCst)
            .is_ok()
    }

    /// Asks the holder of token `i` to give it to the broker when it
    /// releases it; false if nobody holds it, or it is recalled already.
    pub fn recall(&self, i: usize) -> bool {
        let word = self.token(i).load(SeqCst);
        matches!(
            TokenWord::decode(word, self.seats),
            TokenWord::Held {
                recalled: false,
                ..
            }
        ) && self
            .token(i)
            .compare_exchange(word, word | RECALL, SeqCst, SeqCst)
            .is_ok()
    }

    /// Lets the holder of token `i` put it back on the pile again; false
    /// if it was not recalled (or is released already).
    pub fn unrecall(&self, i: usize) -> bool {
        let word = self.token(i).load(SeqCst);
        matches!(
            TokenWord::decode(word, self.seats),
            TokenWord::Held { recalled: true, .. }
        ) && self
            .token(i)
            .compare_exchange(word, word & !RECALL, SeqCst, SeqCst)
            .is_ok()
    }

    /// Takes every token dead `seat` holds out of the pile, recalled or
    /// not: the broker's now, to book where the seat's connection was.
    /// Returns their indexes. [`Pile::repair`] then finds none to free.
    pub fn seize(&self, seat: Seat) -> Vec<usize> {
        let dead = holder(seat);
        (0..self.tokens)
            .filter(|&i| {
                let word = self.token(i).load(SeqCst);
                word & !RECALL == dead
                    && self
                        .token(i)
                        .compare_exchange(word, BROKER, SeqCst, SeqCst)
                        .is_ok()
            })
            .collect()
    }

    /// Tokens each seat holds (recalled ones too), by seat.
    pub fn holdings(&self) -> Vec<u32> {
        let mut held = vec![0; self.seats];
        for i in 0..self.tokens {
            if let TokenWord::Held { seat, .. } = self.token_word(i) {
                held[usize::from(seat.0)] += 1;
            }
        }
        held
    }

    /// The seats whose record says they sleep, waiting for a token.
    pub fn sleeping(&self) -> Vec<Seat> {
        (0..self.seats)
            .map(|s| Seat(s as u16))
            .filter(|&seat| self.counted(seat))
            .collect()
    }

    /// The closed word: whether a client going to sleep tells the broker.
    pub fn closed(&self) -> &'w AtomicU64 {
        &self.words[CLOSED]
    }

    /// The broker is leaving the pile: every sleeper's wait is made to
    /// end (the sequence changes, and each is woken), to see it gone.
    pub fn wake_all(&self, bell: &impl Bell) {
        let bump = |old: u64| Some((old & !SEQ_MASK) | u64::from((old as u32).wrapping_add(1)));
        let _ = self.bell().fetch_update(SeqCst, SeqCst, bump);
        while bell.wake_one(self.bell()) {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn words(tokens: usize, seats: usize) -> Vec<AtomicU64> {
        (0..words_for(tokens, seats))
            .map(|_| AtomicU64::new(0))
            .collect()
    }

    /// A bell whose waits return at once (a spurious wake-up each time)
    /// and that counts its wakes; `gone` says the broker is.
    #[derive(Default)]
    struct Counting {
        waits: Cell<usize>,
        wakes: Cell<usize>,
        gone: bool,
    }

    impl Bell for Counting {
        fn wait(&self, _word: &AtomicU64, _expected: u32, _deadline: Option<Instant>) {
            self.waits.set(self.waits.get() + 1);
            // Nothing here ever frees a token while a test waits: a wait
            // that comes round again is a bug, and fails now, not at the
            // mutation run's timeout.
            assert!(self.waits.get() < 100, "an acquire waits for ever");
        }
        fn wake_one(&self, _word: &AtomicU64) -> bool {
            self.wakes.set(self.wakes.get() + 1);
            false
        }
        fn gone(&self) -> bool {
            self.gone
        }
    }

    /// Seat i takes token i by TRY, for the first `n` seats.
    fn seats_take_tokens_in_turn(pile: &Pile, n: u16) {
        let bell = Counting::default();
        for i in 0..n {
            let taken = pile.acquire(Seat(i), &bell, None, true);
            assert_eq!(taken, Ok(Acquired::Token(usize::from(i))));
        }
    }

    #[test]
    fn a_layout_is_refused_with_the_reason() {
        let w = words(4, 2);
        assert_eq!(Pile::init(&w, 0, 2, 0).unwrap_err(), LayoutError::Sizes);
        assert_eq!(Pile::init(&w, 4, 0, 0).unwrap_err(), LayoutError::Sizes);
        assert_eq!(Pile::init(&w, 4, 2, 5).unwrap_err(), LayoutError::Sizes);
        assert_eq!(
            Pile::init(&w, MAX_TOKENS + 1, 2, 0).unwrap_err(),
            LayoutError::Sizes
        );
        assert_eq!(
            Pile::init(&w, 4, MAX_SEATS + 1, 0).unwrap_err(),
            LayoutError::Sizes
        );
        assert_eq!(
            Pile::init(&w[..words_for(4, 2) - 1], 4, 2, 4).unwrap_err(),
            LayoutError::Short {
                have: words_for(4, 2) - 1,
                need: words_for(4, 2)
            }
        );
        assert_eq!(Pile::attach(&w).unwrap_err(), LayoutError::Magic);
        let pile = Pile::init(&w, 4, 2, 3).unwrap();
        assert_eq!((pile.tokens(), pile.seats()), (4, 2));
        let lent: Vec<_> = (0..4).map(|i| pile.token_word(i)).collect();
        assert_eq!(
            lent,
            [
                TokenWord::Free,
                TokenWord::Free,
                TokenWord::Free,
                TokenWord::Broker
            ]
        );
        assert_eq!(
            Pile::attach(&w[..words_for(4, 2) - 1]).unwrap_err(),
            LayoutError::Short {
                have: words_for(4, 2) - 1,
                need: words_for(4, 2)
            }
        );
        assert_eq!(
            Pile::attach(&w[..TOKENS]).unwrap_err(),
            LayoutError::Short {
                have: TOKENS,
                need: words_for(4, 2)
            }
        );
        assert_eq!(Pile::attach(&w[..3]).unwrap_err(), LayoutError::Magic);
        // Either size out of range is refused, the other one good.
        w[SIZES].store(4, SeqCst);
        assert_eq!(Pile::attach(&w).unwrap_err(), LayoutError::Sizes);
        w[SIZES].store(2 << 32, SeqCst);
        assert_eq!(Pile::attach(&w).unwrap_err(), LayoutError::Sizes);
    }

    #[test]
    fn words_decode_to_what_they_say() {
        let seat = Seat(6);
        assert_eq!(TokenWord::decode(FREE, 8), TokenWord::Free);
        assert_eq!(TokenWord::decode(BROKER, 8), TokenWord::Broker);
        assert_eq!(
            TokenWord::decode(holder(seat), 8),
            TokenWord::Held {
                seat,
                recalled: false
            }
        );
        assert_eq!(
            TokenWord::decode(holder(seat) | RECALL, 8),
            TokenWord::Held {
                seat,
                recalled: true
            }
        );
        assert_eq!(TokenWord::decode(9, 8), TokenWord::Bad(9));
        assert_eq!(TokenWord::decode(RECALL, 8), TokenWord::Bad(RECALL));
        assert_eq!(TokenWord::decode(1 << 40, 8), TokenWord::Bad(1 << 40));
        let bell = BellWord::decode(PENDING | DIRTY | (3 * SLEEPER) | 17);
        assert_eq!(
            bell,
            BellWord {
                seq: 17,
                sleepers: 3,
                pending: true,
                dirty: true
            }
        );
        assert_eq!(
            BellWord::decode(SEQ_MASK),
            BellWord {
                seq: u32::MAX,
                sleepers: 0,
                pending: false,
                dirty: false
            }
        );
    }

    #[test]
    fn a_token_is_taken_given_back_and_refused_to_who_does_not_hold_it() {
        let w = words(2, 2);
        let pile = Pile::init(&w, 2, 2, 2).unwrap();
        let bell = Counting::default();
        let (a, b) = (Seat(0), Seat(1));
        assert_eq!(pile.acquire(a, &bell, None, true), Ok(Acquired::Token(0)));
        assert_eq!(pile.acquire(b, &bell, None, true), Ok(Acquired::Token(1)));
        assert_eq!(pile.acquire(b, &bell, None, true), Err(Refused::Busy));
        assert_eq!(pile.release(b, 0, &bell), Err(Refused::NotHeld));
        assert_eq!(pile.release(a, 2, &bell), Err(Refused::NotHeld));
        assert_eq!(pile.release(a, 0, &bell), Ok(Released::Piled));
        assert_eq!(pile.release(a, 0, &bell), Err(Refused::NotHeld));
        assert_eq!(pile.token_word(0), TokenWord::Free);
        // Nobody sleeps: the release rang no bell.
        assert_eq!((bell.waits.get(), bell.wakes.get()), (0, 0));
        assert_eq!(pile.bell_word().sleepers, 0);
    }

    #[test]
    fn a_release_past_the_last_token_touches_no_record() {
        // The word after the last token is seat 0's record, and a counted
        // record holds 1, which is also seat 0's holder value.
        let w = words(2, 2);
        let pile = Pile::init(&w, 2, 2, 2).unwrap();
        w[TOKENS + 2].store(COUNTED, SeqCst);
        let bell = Counting::default();
        assert_eq!(pile.release(Seat(0), 2, &bell), Err(Refused::NotHeld));
        assert!(pile.counted(Seat(0)));
    }

    #[test]
    fn a_recalled_token_goes_to_the_broker_and_a_repair_counts_what_it_freed() {
        let w = words(3, 2);
        let pile = Pile::init(&w, 3, 2, 3).unwrap();
        let bell = Counting::default();
        let (a, dead) = (Seat(0), Seat(1));
        assert_eq!(pile.acquire(a, &bell, None, true), Ok(Acquired::Token(0)));
        assert_eq!(
            pile.acquire(dead, &bell, None, true),
            Ok(Acquired::Token(1))
        );
        assert_eq!(
            pile.acquire(dead, &bell, None, true),
            Ok(Acquired::Token(2))
        );
        // The broker recalls a's token and one of the dead seat's.
        w[TOKENS].fetch_or(RECALL, SeqCst);
        w[TOKENS + 2].fetch_or(RECALL, SeqCst);
        assert_eq!(pile.release(a, 0, &bell), Ok(Released::ToBroker));
        assert_eq!(pile.token_word(0), TokenWord::Broker);
        assert_eq!(pile.repair(dead, &bell), (1, 1));
        let after: Vec<_> = (0..3).map(|i| pile.token_word(i)).collect();
        assert_eq!(
            after,
            [TokenWord::Broker, TokenWord::Free, TokenWord::Broker]
        );
    }

    #[test]
    fn a_wait_ends_at_its_deadline_or_when_the_broker_is_gone_and_leaves_the_count() {
        let w = words(1, 2);
        let pile = Pile::init(&w, 1, 2, 1).unwrap();
        let bell = Counting::default();
        assert_eq!(
            pile.acquire(Seat(0), &bell, None, false),
            Ok(Acquired::Token(0))
        );
        let past = Some(Instant::now());
        assert_eq!(
            pile.acquire(Seat(1), &bell, past, false),
            Ok(Acquired::TimedOut)
        );
        assert_eq!(bell.waits.get(), 1);
        let gone = Counting {
            gone: true,
            ..Counting::default()
        };
        assert_eq!(
            pile.acquire(Seat(1), &gone, None, false),
            Err(Refused::Gone)
        );
        let bell_now = pile.bell_word();
        assert_eq!((bell_now.sleepers, bell_now.pending), (0, false));
        assert!(!pile.counted(Seat(1)));
        // The holder's release finds nobody asleep: no wake.
        assert_eq!(pile.release(Seat(0), 0, &bell), Ok(Released::Piled));
        assert_eq!(bell.wakes.get(), 0);
    }

    #[test]
    fn a_bell_that_does_not_say_otherwise_has_its_broker() {
        // A wait that ends because another client gave a token back goes
        // on to take it: a bell that keeps `gone`'s default is not gone.
        struct FreesOnWait<'a>(&'a [AtomicU64]);
        impl Bell for FreesOnWait<'_> {
            fn wait(&self, _: &AtomicU64, _: u32, _: Option<Instant>) {
                // Asleep, the waiter is counted, and its record says so.
                let pile = Pile::attach(self.0).unwrap();
                assert_eq!(pile.bell_word().sleepers, 1);
                assert!(pile.counted(Seat(1)));
                self.0[TOKENS].store(FREE, SeqCst);
            }
            fn wake_one(&self, _: &AtomicU64) -> bool {
                false
            }
        }
        let w = words(1, 2);
        let pile = Pile::init(&w, 1, 2, 1).unwrap();
        let bell = FreesOnWait(&w);
        assert_eq!(
            pile.acquire(Seat(0), &bell, None, false),
            Ok(Acquired::Token(0))
        );
        assert_eq!(
            pile.acquire(Seat(1), &bell, None, false),
            Ok(Acquired::Token(0))
        );
        assert_eq!(
            pile.token_word(0),
            TokenWord::Held {
                seat: Seat(1),
                recalled: false
            }
        );
    }

    #[test]
    fn after_a_wake_that_found_nobody_the_look_for_a_free_token_stops_at_the_last_token() {
        // Two tokens, both held; one sleeper counted in. A release rings;
        // while its wake is in flight another releaser marks the bell dirty
        // and a barger takes the token back, and the wake finds nobody. The
        // ringer then looks at the two tokens (held, both) and stops: the
        // words after them are records, not tokens, and a record of 0
        // would look free and ring again.
        let w = words(2, 3);
        let pile = Pile::init(&w, 2, 3, 2).unwrap();
        seats_take_tokens_in_turn(&pile, 2);
        w[BELL].fetch_add(SLEEPER, SeqCst);
        struct Barged<'a>(&'a [AtomicU64], Cell<usize>);
        impl Bell for Barged<'_> {
            fn wait(&self, _: &AtomicU64, _: u32, _: Option<Instant>) {}
            fn wake_one(&self, bell: &AtomicU64) -> bool {
                self.1.set(self.1.get() + 1);
                if self.1.get() == 1 {
                    bell.fetch_or(DIRTY, SeqCst);
                    self.0[TOKENS].store(holder(Seat(2)), SeqCst);
                }
                false
            }
        }
        let barged = Barged(&w, Cell::new(0));
        assert_eq!(pile.release(Seat(0), 0, &barged), Ok(Released::Piled));
        assert_eq!(barged.1.get(), 1, "rang again for a token nobody freed");
        let bell = pile.bell_word();
        assert_eq!((bell.pending, bell.dirty), (false, false));
    }

    #[test]
    fn a_release_rings_once_for_sleepers_and_marks_the_bell_while_the_wake_is_in_flight() {
        let w = words(2, 3);
        let pile = Pile::init(&w, 2, 3, 2).unwrap();
        seats_take_tokens_in_turn(&pile, 2);
        // Two sleepers counted in, as a sleeping acquire leaves them.
        w[BELL].fetch_add(2 * SLEEPER, SeqCst);
        struct Wakes(Cell<usize>);
        impl Bell for Wakes {
            fn wait(&self, _: &AtomicU64, _: u32, _: Option<Instant>) {}
            fn wake_one(&self, _: &AtomicU64) -> bool {
                self.0.set(self.0.get() + 1);
                true
            }
        }
        let woke = Wakes(Cell::new(0));
        assert_eq!(pile.release(Seat(0), 0, &woke), Ok(Released::Piled));
        let rung = pile.bell_word();
        assert_eq!(
            (woke.0.get(), rung.seq, rung.pending, rung.dirty),
            (1, 1, true, false)
        );
        // The wake-up has not looked yet: the next release marks, not rings.
        assert_eq!(pile.release(Seat(1), 1, &woke), Ok(Released::Piled));
        let marked = pile.bell_word();
        assert_eq!(
            (woke.0.get(), marked.seq, marked.pending, marked.dirty),
            (1, 1, true, true)
        );
    }

    /// A bell that wakes `sleepers` sleepers, one a call, then nobody.
    struct Sleepers(Cell<usize>);

    impl Bell for Sleepers {
        fn wait(&self, _: &AtomicU64, _: u32, _: Option<Instant>) {}
        fn wake_one(&self, _: &AtomicU64) -> bool {
            let left = self.0.get();
            self.0.set(left.saturating_sub(1));
            left > 0
        }
    }

    /// The broker lends only its own words, and rings for each: a
    /// sleeper counted in is woken.
    #[test]
    fn the_broker_lends_only_its_own_words_and_rings_for_them() {
        let w = words(3, 2);
        let pile = Pile::init(&w, 3, 2, 1).unwrap();
        let bell = Sleepers(Cell::new(1));
        assert!(!pile.lend(0, &bell), "token 0 is on the pile already");
        w[BELL].fetch_add(SLEEPER, SeqCst);
        assert!(pile.lend(1, &bell));
        assert_eq!(pile.token_word(1), TokenWord::Free);
        assert_eq!(bell.0.get(), 0, "the sleeper was woken");
        assert!(pile.bell_word().pending, "its wake-up is in flight");
        assert_eq!(pile.token_word(2), TokenWord::Broker, "lent one only");
    }

    /// Taking back works on free words only; a recall marks a held word
    /// once, and only a recalled word is let go again.
    #[test]
    fn the_broker_takes_back_free_words_and_recalls_held_ones() {
        let w = words(3, 2);
        let pile = Pile::init(&w, 3, 2, 3).unwrap();
        seats_take_tokens_in_turn(&pile, 1);
        assert!(!pile.take_back(0), "held, not free");
        assert!(pile.take_back(1));
        assert!(!pile.take_back(1), "the broker's now");
        assert_eq!(pile.token_word(1), TokenWord::Broker);
        assert!(!pile.recall(1) && !pile.recall(2), "nobody holds them");
        assert!(!pile.unrecall(0), "not recalled yet");
        assert!(pile.recall(0));
        assert!(!pile.recall(0), "recalled already");
        let recalled = TokenWord::Held {
            seat: Seat(0),
            recalled: true,
        };
        assert_eq!(pile.token_word(0), recalled);
        assert!(pile.unrecall(0));
        assert!(!pile.unrecall(0));
        assert_eq!(
            pile.release(Seat(0), 0, &Counting::default()),
            Ok(Released::Piled),
            "let go: back on the pile"
        );
    }

    /// A dead seat's words, recalled or not, are the broker's; nobody
    /// else's are touched, and the holdings and sleepers say who holds
    /// and who sleeps.
    #[test]
    fn a_dead_seats_words_are_seized_and_nobody_elses() {
        let w = words(4, 3);
        let pile = Pile::init(&w, 4, 3, 4).unwrap();
        let bell = Counting::default();
        for seat in [0, 1, 0] {
            pile.acquire(Seat(seat), &bell, None, true).unwrap();
        }
        assert!(pile.recall(2));
        assert_eq!(pile.holdings(), [2, 1, 0]);
        w[TOKENS + 4 + 2].store(COUNTED, SeqCst);
        assert_eq!(pile.sleeping(), [Seat(2)]);
        assert_eq!(pile.seize(Seat(0)), [0, 2]);
        assert_eq!(pile.holdings(), [0, 1, 0]);
        let words: Vec<_> = (0..4).map(|i| pile.token_word(i)).collect();
        let held = TokenWord::Held {
            seat: Seat(1),
            recalled: false,
        };
        assert_eq!(
            words,
            [TokenWord::Broker, held, TokenWord::Broker, TokenWord::Free]
        );
        assert!(pile.seize(Seat(0)).is_empty(), "nothing left to seize");
    }

    /// The closed word is word 7, and a broker leaving wakes every sleeper with a new
    /// sequence (a sleeper not yet in the kernel does not sleep on).
    #[test]
    fn a_leaving_broker_changes_the_sequence_and_wakes_every_sleeper() {
        let w = words(2, 2);
        let pile = Pile::init(&w, 2, 2, 0).unwrap();
        assert!(std::ptr::eq(pile.closed(), &w[CLOSED]));
        w[BELL].store(u64::from(u32::MAX) | (3 * SLEEPER), SeqCst);
        let bell = Sleepers(Cell::new(3));
        pile.wake_all(&bell);
        assert_eq!(bell.0.get(), 0, "all three woken");
        let after = pile.bell_word();
        assert_eq!((after.seq, after.sleepers), (0, 3), "wrapped, count kept");
    }
}
