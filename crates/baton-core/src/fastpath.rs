//! The shared-memory fast path (docs/fastpath.md), as a model: the region is a
//! plain struct, each client operation a sequence of steps, each step one
//! atomic read-modify-write or store on the region, as the real code will do
//! them, and the broker's repair a function of the region and the dead client's
//! seat. No threads, no unsafe: `tests/fastpath_model.rs` runs every
//! interleaving of a few clients' steps, kills a client at every step, and
//! checks that no token is lost or created, that the queue stays first come,
//! first served, and that nobody sleeps forever.
//!
//! The idea, in one paragraph (the page says it at length): tokens never sit in
//! an anonymous counter. A queue of tickets is the only place they move
//! through: a client claims the first unclaimed ticket, and a releaser gives
//! its token to the first ticket not yet given one. Each ticket's slot names
//! who claimed it and who gave its token, written by the same compare-and-swap
//! that made the move, so a client killed between any two steps leaves a region
//! that says exactly what it had done; its own record (tokens held, and the one
//! operation in flight) says the rest. Free tokens are tokens given to tickets
//! nobody has claimed yet: the next client to come takes one at once, and once
//! they are gone it waits, in ticket order, for a releaser to give it one.

mod keeper;
pub mod pile;
pub mod ring;
pub mod words;

pub use keeper::Unread;
pub use ring::{Acquired, Host, LayoutError, Notice, Refused, Released, Ring};

/// A client's place in the region: the index of its record. The broker
/// gives each fast-path connection one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Seat(pub u16);

impl Seat {
    fn index(self) -> usize {
        usize::from(self.0)
    }
}

/// A position in the queue, and the slot that carries its token. The real
/// region reuses slot `ticket % capacity` and tags it with the ticket
/// (docs/fastpath.md, "Layout"); the model's queue never wraps.
pub type Ticket = usize;

/// Who claimed a ticket, or gave a ticket its token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Party {
    /// A client, by its seat.
    Seat(Seat),
    /// The broker: tokens it lends, gives back for a dead client, or takes
    /// out of the region.
    Broker,
}

/// A slot's claim half: who takes the ticket's token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Claim {
    /// Nobody yet: the ticket is past the queue's tail.
    Unclaimed,
    /// Claimed, and the claimer's record does not count the token yet
    /// (there may be none yet: it waits).
    Claimed(Party),
    /// The token is in the claimer's record (or the broker's hands).
    Taken(Party),
    /// The claimer stopped waiting before a token came; grants pass it by.
    Cancelled(Party),
}

/// A slot's grant half: whether the ticket has its token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Grant {
    /// No token yet.
    Open,
    /// The broker's barrier: no client may give a token to this ticket or
    /// any later one; a releaser that meets it returns its token to the
    /// broker instead. Only the broker grants past it.
    Stop,
    /// The ticket has its token, given by `by`. `acked` once the giver's
    /// record no longer needs the slot to say that its release happened.
    Given {
        /// Who gave it.
        by: Party,
        /// Whether the giver has finished with the slot.
        acked: bool,
    },
}

/// One ticket's slot: both halves live in one word, so that a claim and a
/// grant decide their race with one compare-and-swap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Slot {
    /// Who takes the token.
    pub claim: Claim,
    /// Whether there is one.
    pub grant: Grant,
}

impl Slot {
    const EMPTY: Slot = Slot {
        claim: Claim::Unclaimed,
        grant: Grant::Open,
    };

    /// Whether the ticket has its token.
    pub fn is_granted(&self) -> bool {
        matches!(self.grant, Grant::Given { .. })
    }

    /// Whether the next grant lands here: no token yet, and its claimer
    /// still wants one. The barrier stays where it stands even if its
    /// ticket's claimer gives up: only the broker moves it.
    fn awaits_grant(&self) -> bool {
        match self.grant {
            Grant::Stop => true,
            Grant::Open => !matches!(self.claim, Claim::Cancelled(_)),
            Grant::Given { .. } => false,
        }
    }
}

/// The one operation a client has in flight, beside what its record counts:
/// what the broker needs to finish or undo it if the client dies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Intent {
    /// Nothing in flight.
    #[default]
    Idle,
    /// `held` counts the token of this ticket already, and its slot may not
    /// say so yet.
    Taking(Ticket),
    /// One token has left `held` and is on its way to the queue: in flight
    /// until a slot names this client as its giver.
    Releasing,
}

/// A client's record: one word, written only by its client (and by the
/// broker once the client is dead, or to collect `returned`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Record {
    /// Tokens the client holds.
    pub held: u32,
    /// The operation in flight.
    pub intent: Intent,
    /// Tokens released while the broker's barrier stood, for the broker to
    /// collect.
    pub returned: u32,
}

/// Where a client is in its operation: its program counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Acquire: about to claim the first unclaimed ticket.
    Claim,
    /// Acquire: claims ticket `t`, which had no token: about to call
    /// futex_wait on its slot (which returns at once if a token came).
    Check(Ticket),
    /// Acquire: asleep in futex_wait on slot `t`, until a wake or a timeout.
    Asleep(Ticket),
    /// Acquire: ticket `t` has its token: about to count it in `held`.
    Take(Ticket),
    /// Acquire: `held` counts it: about to mark slot `t` taken.
    AckTaken(Ticket),
    /// Release: about to move one token from `held` into the intent.
    Hand,
    /// Release: about to give it to the first ticket that awaits a grant.
    Grant,
    /// Release: met the broker's barrier: about to return the token through
    /// `returned`.
    Return,
    /// Release: gave ticket `t` its token: about to futex_wake its claimer.
    Wake(Ticket),
    /// Release: about to clear the intent (the release is done).
    Settle(Ticket),
    /// Release: about to mark its grant of `t` acknowledged.
    AckGrant(Ticket),
    /// Between operations.
    Done,
}

/// What a step did that others see: the checker's view of the queue and of
/// the futex.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Nothing beyond the region's words.
    Quiet,
    /// Claimed ticket `t` with no token yet: waits, in ticket order.
    Enqueued(Ticket),
    /// Claimed ticket `t`, which had its token already: an uncontended
    /// acquire.
    ClaimedFree(Ticket),
    /// Gave ticket `t` its token.
    Granted(Ticket),
    /// futex_wake on slot `t`: its claimer, if asleep there, wakes.
    Wake(Ticket),
    /// The broker gave ticket `t` its token and woke its claimer.
    GrantedAndWoke(Ticket),
    /// Ticket `t`'s claimer stopped waiting.
    Cancelled(Ticket),
    /// A releaser met the broker's barrier.
    Stopped,
}

/// The shared region: the queue's slots and the clients' records.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Region {
    /// Slot `t` is ticket `t`'s; only tickets something touched are here.
    pub slots: Vec<Slot>,
    /// One record per seat.
    pub records: Vec<Record>,
}

impl Region {
    /// A region for `seats` clients with `lent` tokens given to the first
    /// tickets: free for the first clients to claim.
    pub fn new(seats: usize, lent: u32) -> Self {
        let mut region = Region {
            slots: Vec::new(),
            records: vec![Record::default(); seats],
        };
        for _ in 0..lent {
            let t = region.grant_target();
            region.slot_mut(t).grant = BROKER_GRANT;
        }
        region
    }

    fn slot(&self, t: Ticket) -> Slot {
        self.slots.get(t).copied().unwrap_or(Slot::EMPTY)
    }

    /// Slot `t`, brought into the model's queue if nothing touched it yet.
    fn slot_mut(&mut self, t: Ticket) -> &mut Slot {
        if t >= self.slots.len() {
            self.slots.resize(t + 1, Slot::EMPTY);
        }
        &mut self.slots[t]
    }

    fn record_mut(&mut self, seat: Seat) -> &mut Record {
        &mut self.records[seat.index()]
    }

    /// The queue's tail: the first ticket nobody claimed. Claims go in
    /// ticket order (the real code: a hint, and a compare-and-swap that
    /// fails on a claimed slot and moves the hint on), so every ticket
    /// before it is claimed.
    pub fn first_unclaimed(&self) -> Ticket {
        self.slots
            .iter()
            .position(|s| s.claim == Claim::Unclaimed)
            .unwrap_or(self.slots.len())
    }

    /// Where the next token goes: the first ticket without one whose
    /// claimer (if any) still waits. Grants go in ticket order, so every
    /// ticket before it has its token or was cancelled.
    pub fn grant_target(&self) -> Ticket {
        self.grant_target_from(0)
    }

    fn grant_target_from(&self, from: Ticket) -> Ticket {
        (from..self.slots.len())
            .find(|&t| self.slots[t].awaits_grant())
            .unwrap_or(self.slots.len().max(from))
    }

    /// The ticket `party` claimed and has not yet taken or cancelled: a
    /// client has at most one.
    pub fn claimed_by(&self, party: Party) -> Option<Ticket> {
        self.slots
            .iter()
            .position(|s| s.claim == Claim::Claimed(party))
    }

    /// The ticket `party` gave a token to and has not acknowledged: a
    /// client has at most one.
    pub fn unacked_grant_by(&self, party: Party) -> Option<Ticket> {
        self.slots.iter().position(|s| {
            s.grant
                == Grant::Given {
                    by: party,
                    acked: false,
                }
        })
    }

    /// One step of `seat`'s client in `phase`: the new phase, and what
    /// others see. Each arm is one atomic operation on one word.
    ///
    /// # Panics
    ///
    /// In `Asleep` and `Done`, which have no step of their own.
    pub fn step(&mut self, seat: Seat, phase: Phase) -> (Phase, Event) {
        let me = Party::Seat(seat);
        match phase {
            Phase::Claim => self.claim(me),
            // futex_wait(slot, "no token"): returns at once if one came.
            Phase::Check(t) if self.slot(t).is_granted() => (Phase::Take(t), Event::Quiet),
            Phase::Check(t) => (Phase::Asleep(t), Event::Quiet),
            Phase::Take(t) => {
                // One store: `held` and the intent naming the slot change
                // together, so the broker never counts this token twice.
                let record = self.record_mut(seat);
                record.held += 1;
                record.intent = Intent::Taking(t);
                (Phase::AckTaken(t), Event::Quiet)
            }
            Phase::AckTaken(t) => {
                self.slot_mut(t).claim = Claim::Taken(me);
                (Phase::Done, Event::Quiet)
            }
            Phase::Hand => {
                let record = self.record_mut(seat);
                record.held -= 1;
                record.intent = Intent::Releasing;
                (Phase::Grant, Event::Quiet)
            }
            Phase::Grant => self.grant(me),
            Phase::Return => {
                let record = self.record_mut(seat);
                record.intent = Intent::Idle;
                record.returned += 1;
                (Phase::Done, Event::Quiet)
            }
            Phase::Wake(t) => (Phase::Settle(t), Event::Wake(t)),
            Phase::Settle(t) => {
                // Before the acknowledgement: while the intent says
                // Releasing, the unacknowledged slot is what says that the
                // token left.
                self.record_mut(seat).intent = Intent::Idle;
                (Phase::AckGrant(t), Event::Quiet)
            }
            Phase::AckGrant(t) => {
                self.slot_mut(t).grant = Grant::Given {
                    by: me,
                    acked: true,
                };
                (Phase::Done, Event::Quiet)
            }
            Phase::Asleep(_) | Phase::Done => panic!("{phase:?} has no step"),
        }
    }

    /// Claims the first unclaimed ticket: one compare-and-swap that both
    /// joins the queue and names the claimer.
    fn claim(&mut self, me: Party) -> (Phase, Event) {
        let t = self.first_unclaimed();
        let slot = self.slot_mut(t);
        slot.claim = Claim::Claimed(me);
        if slot.is_granted() {
            (Phase::Take(t), Event::ClaimedFree(t))
        } else {
            (Phase::Check(t), Event::Enqueued(t))
        }
    }

    /// Gives the token in flight to the first ticket awaiting one, naming
    /// the giver in the same compare-and-swap; or meets the barrier.
    fn grant(&mut self, me: Party) -> (Phase, Event) {
        let t = self.grant_target();
        let slot = self.slot_mut(t);
        if slot.grant == Grant::Stop {
            return (Phase::Return, Event::Stopped);
        }
        slot.grant = Grant::Given {
            by: me,
            acked: false,
        };
        (Phase::Wake(t), Event::Granted(t))
    }

    /// `seat`'s wait on ticket `t` timed out (or was cancelled): one
    /// compare-and-swap, which loses to a grant that came first.
    pub fn time_out(&mut self, seat: Seat, t: Ticket) -> (Phase, Event) {
        let slot = self.slot_mut(t);
        if slot.is_granted() {
            return (Phase::Take(t), Event::Quiet);
        }
        slot.claim = Claim::Cancelled(Party::Seat(seat));
        (Phase::Done, Event::Cancelled(t))
    }

    /// One step of the broker taking back what the region says the dead
    /// `seat` had, into `in_hand`; `None` once nothing is attributed to it.
    /// Its tokens then go back to the queue through [`Region::regrant_step`].
    pub fn repair_step(&mut self, seat: Seat, in_hand: &mut u32) -> Option<Event> {
        let dead = Party::Seat(seat);
        let intent = self.records[seat.index()].intent;
        if let Some(t) = self.claimed_by(dead) {
            let slot = self.slot_mut(t);
            if !slot.is_granted() {
                // Still waiting: withdraw, as a timeout would.
                slot.claim = Claim::Cancelled(dead);
                return Some(Event::Cancelled(t));
            }
            slot.claim = Claim::Taken(dead);
            if intent != Intent::Taking(t) {
                // Granted but not yet in its record: the broker takes it.
                *in_hand += 1;
            }
            return Some(Event::Quiet);
        }
        if let Some(t) = self.unacked_grant_by(dead) {
            if intent == Intent::Releasing {
                // The slot says the release reached the queue: it is done.
                self.record_mut(seat).intent = Intent::Idle;
                return Some(Event::Quiet);
            }
            // Its claimer may not have been woken yet; a second wake is
            // harmless.
            self.slot_mut(t).grant = Grant::Given {
                by: dead,
                acked: true,
            };
            return Some(Event::Wake(t));
        }
        let record = self.record_mut(seat);
        if record.intent == Intent::Releasing {
            // No slot names it: the token never left the intent.
            record.intent = Intent::Idle;
            *in_hand += 1;
            return Some(Event::Quiet);
        }
        if *record != Record::default() {
            *in_hand += record.held + record.returned;
            *record = Record::default();
            return Some(Event::Quiet);
        }
        None
    }

    /// Gives one token from the broker's hands to the first ticket awaiting
    /// one and wakes its claimer; `None` with nothing in hand, or when the
    /// barrier stands before a ticket nobody claimed (closed, the broker
    /// keeps free tokens in its books).
    pub fn regrant_step(&mut self, in_hand: &mut u32) -> Option<Event> {
        if *in_hand == 0 {
            return None;
        }
        let t = self.grant_target();
        let slot = self.slot(t);
        if slot.grant == Grant::Stop {
            if slot.claim == Claim::Unclaimed {
                return None;
            }
            // The barrier moves on first, so that no releaser ever sees
            // the queue without it.
            let next = self.grant_target_from(t + 1);
            self.slot_mut(next).grant = Grant::Stop;
            if let Claim::Cancelled(_) = slot.claim {
                // Its claimer gave up: pass it by.
                self.slot_mut(t).grant = Grant::Open;
                return Some(Event::Quiet);
            }
        }
        self.slot_mut(t).grant = BROKER_GRANT;
        *in_hand -= 1;
        Some(Event::GrantedAndWoke(t))
    }

    /// Puts up the barrier: from now on only the broker gives tokens.
    pub fn close(&mut self) {
        let t = self.grant_target();
        self.slot_mut(t).grant = Grant::Stop;
    }

    /// Takes the barrier down: releasers give tokens again (the broker's
    /// own go back through [`Region::regrant_step`]).
    pub fn reopen(&mut self) {
        let t = self.grant_target();
        let slot = self.slot_mut(t);
        if slot.grant == Grant::Stop {
            slot.grant = Grant::Open;
        }
    }

    /// Takes one free token (given to a ticket nobody claimed) into the
    /// broker's hands, as a client's claim would; `None` if there is none.
    pub fn drain_step(&mut self, in_hand: &mut u32) -> Option<Event> {
        let t = self.first_unclaimed();
        let slot = self.slot_mut(t);
        if !slot.is_granted() {
            return None;
        }
        slot.claim = Claim::Taken(Party::Broker);
        *in_hand += 1;
        Some(Event::Quiet)
    }

    /// Collects the tokens `seat` returned while the barrier stood: one
    /// compare-and-swap on its record (its client's own writes to it are
    /// compare-and-swaps too, so neither loses the other's).
    pub fn collect_step(&mut self, seat: Seat, in_hand: &mut u32) -> Option<Event> {
        let record = self.record_mut(seat);
        if record.returned == 0 {
            return None;
        }
        *in_hand += record.returned;
        record.returned = 0;
        Some(Event::Quiet)
    }

    /// Tokens given to tickets nobody claimed: free for the next claim.
    pub fn free(&self) -> u32 {
        let free = self
            .slots
            .iter()
            .filter(|s| s.claim == Claim::Unclaimed && s.is_granted());
        free.count() as u32
    }

    /// The seat of each claim still waiting for its token, oldest ticket
    /// first: one entry per waiting acquire.
    pub fn waiting(&self) -> Vec<Seat> {
        let tickets = self.waiting_tickets().into_iter();
        tickets.map(|(_, seat)| seat).collect()
    }

    /// [`Region::waiting`], each with its ticket: what tells one wait
    /// from the next wait of the same seat.
    pub fn waiting_tickets(&self) -> Vec<(Ticket, Seat)> {
        let waits = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(t, s)| match s.claim {
                Claim::Claimed(Party::Seat(seat)) if !s.is_granted() => Some((t, seat)),
                _ => None,
            });
        waits.collect()
    }

    /// Tokens the region attributes to `seat`: held, returned, in flight in
    /// its intent, and granted to its ticket but not yet in its record.
    /// Only `seat`'s own record enters the sum, and only through slots that
    /// name `seat`: what a client writes into its record moves nobody
    /// else's count.
    pub fn attributed(&self, seat: Seat) -> u32 {
        let me = Party::Seat(seat);
        self.attribution(
            seat,
            self.claimed_by(me),
            self.unacked_grant_by(me).is_some(),
        )
    }

    /// [`Region::attributed`] of every seat, in one pass over the queue.
    /// The audit needs them all once a second, and asking seat by seat
    /// walks the queue twice per seat: 1,024 seats by a 4,096-slot ring
    /// is 8 million slots a second, in the broker's loop.
    pub fn attributions(&self) -> Vec<u32> {
        let seats = self.records.len();
        let (mut claimed, mut unacked) = (vec![None; seats], vec![false; seats]);
        for (t, slot) in self.slots.iter().enumerate() {
            if let Claim::Claimed(Party::Seat(seat)) = slot.claim {
                if let Some(first) = claimed.get_mut(seat.index()) {
                    first.get_or_insert(t);
                }
            }
            if let Grant::Given {
                by: Party::Seat(seat),
                acked: false,
            } = slot.grant
            {
                if let Some(found) = unacked.get_mut(seat.index()) {
                    *found = true;
                }
            }
        }
        (0..seats)
            .map(|i| self.attribution(Seat(i as u16), claimed[i], unacked[i]))
            .collect()
    }

    /// What the region attributes to `seat`, given the first ticket it
    /// claimed and whether it gave a token it has not acknowledged.
    fn attribution(&self, seat: Seat, claimed: Option<Ticket>, unacked_grant: bool) -> u32 {
        let record = self.records[seat.index()];
        let releasing = record.intent == Intent::Releasing && !unacked_grant;
        let waiting_in_slot =
            claimed.filter(|&t| self.slot(t).is_granted() && record.intent != Intent::Taking(t));
        record
            .held
            .saturating_add(record.returned)
            .saturating_add(u32::from(releasing))
            .saturating_add(u32::from(waiting_in_slot.is_some()))
    }

    /// Every token the region holds: free, and attributed to each seat (the
    /// broker never leaves one in a slot it claimed).
    pub fn tokens(&self) -> u32 {
        self.tokens_with(&self.attributions())
    }

    fn tokens_with(&self, attributions: &[u32]) -> u32 {
        attributions
            .iter()
            .copied()
            .fold(self.free(), u32::saturating_add)
    }

    /// The broker's check of a consistent snapshot against its books: what
    /// the region counts, and the seats whose records cannot be right
    /// whatever the others did.
    pub fn audit(&self, books: &Books) -> Audit {
        let attributions = self.attributions();
        let suspects = (0..self.records.len())
            .filter(|&i| !self.plausible(Seat(i as u16), attributions[i], books.lent))
            .map(|i| Seat(i as u16))
            .collect();
        Audit {
            counted: books.counted_with(self.tokens_with(&attributions)),
            expected: books.lent,
            suspects,
        }
    }

    /// Whether `seat`'s record, which the region attributes `attributed`
    /// tokens, could have been written by a client that follows the
    /// protocol.
    fn plausible(&self, seat: Seat, attributed: u32, lent: u32) -> bool {
        let record = self.records[seat.index()];
        let taking_ok = match record.intent {
            Intent::Taking(t) => {
                let slot = self.slot(t);
                let mine = matches!(slot.claim, Claim::Claimed(p) | Claim::Taken(p) if p == Party::Seat(seat));
                mine && slot.is_granted()
            }
            Intent::Idle | Intent::Releasing => true,
        };
        taking_ok && attributed <= lent
    }

    /// Drops `seat` to the socket path: takes everything the region
    /// attributes to it out of the region (waits withdrawn, grants
    /// acknowledged, record cleared). Returns what it took: the broker
    /// books it as the client's on its connection. The broker first revokes
    /// the seat and waits for the operation in flight to end
    /// (docs/fastpath.md, "A client that misbehaves").
    pub fn evict(&mut self, seat: Seat) -> Eviction {
        let mut eviction = Eviction::default();
        while let Some(event) = self.repair_step(seat, &mut eviction.taken) {
            if let Event::Wake(t) = event {
                eviction.wake.push(t);
            }
        }
        eviction
    }

    /// Answers an audit that does not balance. One suspect: it alone is
    /// dropped, and booked on its connection with what the region
    /// attributes to it less the surplus (exactly what it holds, if it is
    /// the only one whose record is wrong). No suspect, or several, or a
    /// surplus larger than the suspect's count: every seat is dropped with
    /// what the region attributes to it, and the difference is retired as
    /// tokens come back (a surplus) or held back until those clients are
    /// gone (a shortfall). Returns the seats dropped.
    pub fn answer(&mut self, audit: &Audit, books: &mut Books) -> Answer {
        let mut answer = Answer::default();
        let surplus = i64::from(audit.counted) - i64::from(audit.expected);
        if surplus == 0 && audit.suspects.is_empty() {
            return answer;
        }
        if let [suspect] = audit.suspects[..] {
            let holds = i64::from(self.attributed(suspect)) - surplus;
            if (0..=i64::from(books.lent)).contains(&holds) {
                answer.wake = self.evict(suspect).wake;
                books.on_socket += holds as u32;
                answer.dropped.push(suspect);
                return answer;
            }
        }
        for seat in (0..self.records.len()).map(|i| Seat(i as u16)) {
            let eviction = self.evict(seat);
            books.on_socket += eviction.taken;
            answer.wake.extend(eviction.wake);
            answer.dropped.push(seat);
        }
        if surplus > 0 {
            books.to_retire += surplus as u32;
        } else {
            books.held_back += (-surplus) as u32;
        }
        answer
    }
}

/// The broker's side of the tokens it lent the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Books {
    /// Tokens the region holds, as the broker counts them.
    pub lent: u32,
    /// Tokens the broker took back (from the dead, the barrier, a drain)
    /// and has not given out again.
    pub in_hand: u32,
    /// Tokens clients dropped to the socket path hold on their connections.
    pub on_socket: u32,
    /// Tokens a bad audit counted that never were: retired as tokens come
    /// back, as a lowered limit retires them.
    pub to_retire: u32,
    /// Tokens a bad audit could not find: held back until the clients
    /// that may hold them are gone.
    pub held_back: u32,
}

impl Books {
    /// What the region and these books count together, to compare with
    /// `lent`.
    pub fn counted(&self, region: &Region) -> u32 {
        self.counted_with(region.tokens())
    }

    /// The same, given what the region holds.
    fn counted_with(&self, region_tokens: u32) -> u32 {
        (region_tokens + self.in_hand + self.on_socket + self.held_back)
            .saturating_sub(self.to_retire)
    }
}

/// What [`Region::evict`] took out of the region.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Eviction {
    /// Tokens the region attributed to the seat.
    pub taken: u32,
    /// Tickets the seat gave tokens to without acknowledging: their
    /// claimers may not have been woken.
    pub wake: Vec<Ticket>,
}

/// What [`Region::answer`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Answer {
    /// The seats dropped to the socket path.
    pub dropped: Vec<Seat>,
    /// Tickets whose claimers the broker must wake.
    pub wake: Vec<Ticket>,
}

/// What an audit found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Audit {
    /// Tokens counted in the region and the broker's books.
    pub counted: u32,
    /// Tokens lent: what `counted` must be.
    pub expected: u32,
    /// Seats whose records no correct client could have written.
    pub suspects: Vec<Seat>,
}

impl Audit {
    /// Whether the region agrees with the books and every record is
    /// plausible.
    pub fn balanced(&self) -> bool {
        self.counted == self.expected && self.suspects.is_empty()
    }
}

/// A token the broker gives needs no acknowledgement: the broker is not
/// killed halfway (if it is, the region goes with it).
const BROKER_GRANT: Grant = Grant::Given {
    by: Party::Broker,
    acked: true,
};

#[cfg(test)]
mod tests {
    use super::*;

    const A: Seat = Seat(0);
    const B: Seat = Seat(1);

    /// Runs `seat` from `phase` until it blocks or finishes.
    fn run(region: &mut Region, seat: Seat, mut phase: Phase) -> Phase {
        while !matches!(phase, Phase::Asleep(_) | Phase::Done) {
            phase = region.step(seat, phase).0;
        }
        phase
    }

    #[test]
    fn an_uncontended_acquire_takes_a_free_token() {
        let mut region = Region::new(2, 1);
        assert_eq!(
            region.step(A, Phase::Claim),
            (Phase::Take(0), Event::ClaimedFree(0))
        );
        assert_eq!(run(&mut region, A, Phase::Take(0)), Phase::Done);
        assert_eq!((region.records[0].held, region.free()), (1, 0));
        assert_eq!(region.tokens(), 1);
    }

    /// A record taking a ticket that another seat claimed cannot be a
    /// correct client's, though that ticket has its token.
    #[test]
    fn a_record_taking_another_seats_ticket_is_a_suspect() {
        let mut region = Region::new(2, 1);
        assert_eq!(run(&mut region, A, Phase::Claim), Phase::Done);
        region.records[1].intent = Intent::Taking(0);
        let books = Books {
            lent: 1,
            ..Books::default()
        };
        assert_eq!(region.audit(&books).suspects, [B]);
    }

    /// A record that counts more tokens than were lent cannot be a
    /// correct client's, whatever its intent says.
    #[test]
    fn an_idle_record_holding_more_than_was_lent_is_a_suspect() {
        let mut region = Region::new(2, 2);
        region.records[1].held = 7;
        let books = Books {
            lent: 2,
            ..Books::default()
        };
        assert_eq!(region.audit(&books).suspects, [B]);
    }

    #[test]
    fn a_release_hands_the_token_to_the_waiter() {
        let mut region = Region::new(2, 1);
        run(&mut region, A, Phase::Claim);
        assert_eq!(
            region.step(B, Phase::Claim),
            (Phase::Check(1), Event::Enqueued(1))
        );
        assert_eq!(region.waiting(), [B], "B's claim waits");
        assert_eq!(region.step(B, Phase::Check(1)).0, Phase::Asleep(1));
        assert_eq!(region.step(A, Phase::Hand).0, Phase::Grant);
        assert_eq!(
            region.step(A, Phase::Grant),
            (Phase::Wake(1), Event::Granted(1))
        );
        assert_eq!(run(&mut region, A, Phase::Wake(1)), Phase::Done);
        assert!(region.waiting().is_empty(), "granted: no longer waiting");
        assert_eq!(run(&mut region, B, Phase::Check(1)), Phase::Done);
        assert_eq!((region.records[0].held, region.records[1].held), (0, 1));
        assert_eq!(region.tokens(), 1);
    }

    #[test]
    fn the_barrier_sends_a_release_to_the_broker() {
        let mut region = Region::new(1, 1);
        run(&mut region, A, Phase::Claim);
        region.close();
        assert_eq!(region.step(A, Phase::Hand).0, Phase::Grant);
        assert_eq!(
            region.step(A, Phase::Grant),
            (Phase::Return, Event::Stopped)
        );
        run(&mut region, A, Phase::Return);
        let mut in_hand = 0;
        assert!(region.collect_step(A, &mut in_hand).is_some());
        assert_eq!((in_hand, region.free(), region.tokens()), (1, 0, 0));
        // Closed, a free token stays in the broker's books; reopened, it
        // goes back to the queue.
        assert_eq!(region.regrant_step(&mut in_hand), None);
        region.reopen();
        assert!(region.regrant_step(&mut in_hand).is_some());
        assert_eq!((in_hand, region.free()), (0, 1));
    }

    #[test]
    fn repair_finishes_a_release_killed_after_its_grant() {
        let mut region = Region::new(2, 1);
        run(&mut region, A, Phase::Claim);
        run(&mut region, B, Phase::Claim);
        region.step(A, Phase::Hand);
        region.step(A, Phase::Grant);
        // A dies before waking B: the repair wakes B and takes nothing.
        let mut in_hand = 0;
        let mut events = Vec::new();
        while let Some(event) = region.repair_step(A, &mut in_hand) {
            events.push(event);
        }
        assert_eq!(events, [Event::Quiet, Event::Wake(1)]);
        assert_eq!((in_hand, region.attributed(A), region.tokens()), (0, 0, 1));
    }

    #[test]
    fn an_audit_finds_a_record_that_counts_too_much() {
        let mut region = Region::new(2, 2);
        run(&mut region, A, Phase::Claim);
        let mut books = Books {
            lent: 2,
            ..Books::default()
        };
        assert!(region.audit(&books).balanced());
        region.records[0].held = 9;
        let audit = region.audit(&books);
        assert_eq!((audit.counted, audit.suspects.clone()), (10, vec![A]));
        assert_eq!(region.answer(&audit, &mut books).dropped, vec![A]);
        assert_eq!(
            books.on_socket, 1,
            "A holds one token, on its connection now"
        );
        assert!(region.audit(&books).balanced());
    }
}
