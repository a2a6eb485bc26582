//! The broker's moves on a [`Ring`]: the model's repair, regrant,
//! barrier, drain and collect (docs/fastpath.md, "When a client dies" and
//! "Policy"), each one compare-and-swap among the clients' steps; and the
//! snapshot the audit reads, as a model [`Region`], so that the broker
//! counts the ring's tokens with the very functions the proof checked.
//!
//! A move that loses a compare-and-swap to a client changes nothing and
//! reports `Some(Event::Quiet)`: the broker calls it again, as it calls
//! every move until it reports `None`.

use super::ring::{
    awaits_grant, cas, finished, Host, Lap, Refused, Ring, BROKER_GRANT, SERVE, TAIL,
};
use super::words::{IntentWord, RecordWord, SlotWord};
use super::{Claim, Event, Grant, Intent, Party, Record, Region, Seat, Slot, Ticket};
use std::sync::atomic::Ordering::SeqCst;

/// Why the broker could not read the ring as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unread {
    /// A word changed between the two reads: try again later.
    Moving,
    /// A slot holds a word no correct party writes.
    Corrupt,
}

impl Ring<'_> {
    /// The ring's slots, each with its full ticket and word.
    fn slots(&self) -> impl Iterator<Item = (Ticket, u64, SlotWord)> + '_ {
        (0..self.capacity()).filter_map(move |i| {
            let raw = self.slot_word(i).load(SeqCst);
            let word = SlotWord::unpack(raw).ok()?;
            Some((self.ticket_of(word.gen), raw, word))
        })
    }

    /// The full ticket whose low 32 bits are `gen`: the one nearest the
    /// tail (every ticket in the ring is within two laps of it).
    pub fn ticket_of(&self, gen: u32) -> Ticket {
        let tail = self.hint(TAIL);
        let ahead = i64::from(gen.wrapping_sub(tail as u32) as i32);
        (tail as i64 + ahead).max(0) as Ticket
    }

    fn find(&self, f: impl Fn(&Slot) -> bool) -> Option<(Ticket, u64, SlotWord)> {
        self.slots().find(|(_, _, w)| f(&w.slot))
    }

    /// One step of taking back what the ring says the dead (or revoked)
    /// `seat` had, into `in_hand`, waking any claimer its death may have
    /// left asleep; `None` once nothing names it.
    pub fn repair_step(
        &self,
        seat: Seat,
        in_hand: &mut u32,
        host: &dyn Host,
    ) -> Result<Option<Event>, Refused> {
        let dead = Party::Seat(seat);
        let record = self.record(seat)?;
        if let Some((t, raw, word)) = self.find(|s| s.claim == Claim::Claimed(dead)) {
            let granted = word.slot.is_granted();
            let claim = if granted {
                Claim::Taken(dead)
            } else {
                Claim::Cancelled(dead)
            };
            let next = SlotWord {
                slot: Slot { claim, ..word.slot },
                sleeping: false,
                ..word
            };
            if !cas(self.slot_word(t), raw, next.pack()) {
                return Ok(Some(Event::Quiet));
            }
            if !granted {
                return Ok(Some(Event::Cancelled(t)));
            }
            if record.intent != IntentWord::Taking(t as u32) {
                // Granted, not yet in its record: the broker takes it.
                *in_hand += 1;
            }
            return Ok(Some(Event::Quiet));
        }
        let unacked = |s: &Slot| {
            s.grant
                == Grant::Given {
                    by: dead,
                    acked: false,
                }
        };
        if let Some((t, raw, word)) = self.find(unacked) {
            if record.intent == IntentWord::Releasing {
                // The slot says the release reached the queue: it is done.
                self.update_record(seat, |r| r.intent = IntentWord::Idle)?;
                return Ok(Some(Event::Quiet));
            }
            let acked = SlotWord {
                slot: Slot {
                    grant: Grant::Given {
                        by: dead,
                        acked: true,
                    },
                    ..word.slot
                },
                ..word
            };
            if !cas(self.slot_word(t), raw, acked.pack()) {
                return Ok(Some(Event::Quiet));
            }
            // Its claimer may not have been woken yet; a second wake is
            // harmless.
            host.wake(self.slot_word(t));
            return Ok(Some(Event::Wake(t)));
        }
        if record.intent == IntentWord::Releasing {
            // No slot names it: the token never left the intent.
            self.update_record(seat, |r| r.intent = IntentWord::Idle)?;
            *in_hand += 1;
            return Ok(Some(Event::Quiet));
        }
        if record.held != 0 || record.returned != 0 || record.intent != IntentWord::Idle {
            let mut took = 0;
            self.update_record(seat, |r| {
                took = u32::from(r.held) + u32::from(r.returned);
                // (`update_record` moves the change count on itself.)
                *r = RecordWord::default();
            })?;
            *in_hand += took;
            return Ok(Some(Event::Quiet));
        }
        Ok(None)
    }

    /// The first ticket awaiting a grant from `from` on: its ticket, the
    /// word read, and its slot (the empty one of an untouched ticket).
    /// Moves the serve hint past what it walks over, as a releaser's
    /// grant does: without that, the broker giving back n tokens (a dead
    /// client's, or a drained region's) walks over every token it gave
    /// before, n²/2 slots in all.
    fn first_awaiting(&self, from: Ticket) -> Result<(Ticket, u64, SlotWord), Refused> {
        let mut t = from.max(self.hint(SERVE));
        loop {
            let (raw, lap) = self.lap(t)?;
            match lap {
                Lap::This(word) if awaits_grant(word.slot) => return Ok((t, raw, word)),
                Lap::Earlier(word) if finished(word.slot) => {
                    let word = SlotWord {
                        gen: t as u32,
                        slot: Slot::EMPTY,
                        sleeping: false,
                    };
                    return Ok((t, raw, word));
                }
                Lap::Earlier(_) => return Err(Refused::Full),
                Lap::This(_) | Lap::Later => {
                    if from == 0 {
                        self.pass(SERVE, t);
                    }
                    t += 1;
                }
            }
        }
    }

    /// Gives one token from the broker's hands to the first ticket
    /// awaiting one and wakes its claimer; `None` with nothing in hand, or
    /// when the barrier stands before a ticket nobody claimed.
    pub fn regrant_step(
        &self,
        in_hand: &mut u32,
        host: &dyn Host,
    ) -> Result<Option<Event>, Refused> {
        if *in_hand == 0 {
            return Ok(None);
        }
        let (t, raw, word) = self.first_awaiting(0)?;
        if word.slot.grant == Grant::Stop {
            if word.slot.claim == Claim::Unclaimed {
                return Ok(None);
            }
            // The barrier moves on first, so that no releaser ever sees
            // the queue without it.
            self.put_barrier(t + 1)?;
            if let Claim::Cancelled(_) = word.slot.claim {
                let passed = with_grant(word, Grant::Open);
                cas(self.slot_word(t), raw, passed);
                return Ok(Some(Event::Quiet));
            }
        }
        if !cas(self.slot_word(t), raw, with_grant(word, BROKER_GRANT)) {
            return Ok(Some(Event::Quiet));
        }
        *in_hand -= 1;
        if word.sleeping {
            host.wake(self.slot_word(t));
        }
        Ok(Some(Event::GrantedAndWoke(t)))
    }

    /// Claims that wait for a token. While the barrier stands, each is a
    /// ticket only the broker will serve: it asks its pool for as many.
    pub fn waiters(&self) -> u32 {
        let waiting = |(_, _, w): &(Ticket, u64, SlotWord)| {
            matches!(w.slot.claim, Claim::Claimed(_)) && !w.slot.is_granted()
        };
        self.slots().filter(waiting).count() as u32
    }

    /// Puts the barrier on the first ticket from `from` that awaits a
    /// grant.
    fn put_barrier(&self, from: Ticket) -> Result<(), Refused> {
        loop {
            let (t, raw, word) = self.first_awaiting(from)?;
            if word.slot.grant == Grant::Stop
                || cas(self.slot_word(t), raw, with_grant(word, Grant::Stop))
            {
                return Ok(());
            }
        }
    }

    /// Puts up the barrier: from now on only the broker gives tokens.
    pub fn close(&self) -> Result<(), Refused> {
        self.put_barrier(0)
    }

    /// Takes the barrier down: releasers give tokens again (the broker's
    /// own go back through [`Ring::regrant_step`]).
    pub fn reopen(&self) -> Result<(), Refused> {
        loop {
            let (t, raw, word) = self.first_awaiting(0)?;
            if word.slot.grant != Grant::Stop
                || cas(self.slot_word(t), raw, with_grant(word, Grant::Open))
            {
                return Ok(());
            }
        }
    }

    /// Takes one free token into the broker's hands, as a claim would;
    /// `None` if there is none.
    pub fn drain_step(&self, in_hand: &mut u32) -> Result<Option<Event>, Refused> {
        let drained = self.claim_first(Claim::Taken(Party::Broker), Slot::is_granted)?;
        Ok(drained.map(|_| {
            *in_hand += 1;
            Event::Quiet
        }))
    }

    /// Collects the tokens `seat` returned while the barrier stood.
    pub fn collect_step(&self, seat: Seat, in_hand: &mut u32) -> Result<Option<Event>, Refused> {
        if self.record(seat)?.returned == 0 {
            return Ok(None);
        }
        let mut took = 0;
        self.update_record(seat, |r| {
            took = u32::from(r.returned);
            r.returned = 0;
        })?;
        *in_hand += took;
        Ok(Some(Event::Quiet))
    }

    /// The ring as the model's [`Region`], read twice: every word had the
    /// value read at one instant between the reads, since none goes back
    /// to an earlier value (a slot's `gen` only grows and its halves only
    /// move on within a ticket; a record carries its change count). Its
    /// tickets count from the oldest ticket in the ring, which is
    /// ticket 0 in the region returned, and the second value.
    pub fn snapshot(&self) -> Result<(Region, Ticket), Unread> {
        let first = self.read_words();
        let second = self.read_words();
        if first != second {
            return Err(Unread::Moving);
        }
        let (slots, records) = first;
        let tail = self.hint(TAIL);
        let mut tickets = Vec::with_capacity(slots.len());
        for &raw in &slots {
            let word = SlotWord::unpack(raw).map_err(|_| Unread::Corrupt)?;
            if !names_only_seats_below(word.slot, self.seats()) {
                return Err(Unread::Corrupt);
            }
            let ahead = i64::from(word.gen.wrapping_sub(tail as u32) as i32);
            tickets.push((tail as i64 + ahead, word));
        }
        let base = tickets.iter().map(|(t, _)| *t).min().unwrap_or(0);
        let span = tickets
            .iter()
            .map(|(t, _)| (t - base) as usize + 1)
            .max()
            .unwrap_or(0);
        let mut region = Region {
            slots: vec![Slot::EMPTY; span],
            records: Vec::with_capacity(records.len()),
        };
        for (t, word) in &tickets {
            region.slots[(t - base) as usize] = word.slot;
        }
        // A `Taking` intent outlives its acquire, harmlessly, and the
        // ticket it names may have left the ring since: then its slot was
        // finished long ago, and the intent says no more than `Idle`.
        let intent_of = |low: u32| {
            let ticket = tickets.iter().find(|(_, w)| w.gen & 0xff_ffff == low);
            ticket.map_or(Intent::Idle, |(t, _)| Intent::Taking((t - base) as usize))
        };
        for raw in records {
            // Garbage in a record is the client's own: the audit finds it
            // implausible, as the model's does (a ticket it cannot name).
            let record = RecordWord::unpack(raw).unwrap_or(RecordWord {
                held: u16::MAX,
                ..RecordWord::default()
            });
            region.records.push(Record {
                held: u32::from(record.held),
                returned: u32::from(record.returned),
                intent: match record.intent {
                    IntentWord::Idle => Intent::Idle,
                    IntentWord::Releasing => Intent::Releasing,
                    IntentWord::Taking(low) => intent_of(low),
                },
            });
        }
        Ok((region, base.max(0) as Ticket))
    }

    fn read_words(&self) -> (Vec<u64>, Vec<u64>) {
        let slots = (0..self.capacity()).map(|i| self.slot_word(i).load(SeqCst));
        let records = (0..self.seats()).map(|s| self.record_word(Seat(s as u16)).load(SeqCst));
        (slots.collect(), records.collect())
    }
}

/// Whether every seat a slot names is one of the region's: a slot that
/// names another is garbage (the model would have no record for it).
fn names_only_seats_below(slot: Slot, seats: usize) -> bool {
    let ok = |party: Party| match party {
        Party::Broker => true,
        Party::Seat(seat) => usize::from(seat.0) < seats,
    };
    let claimer = match slot.claim {
        Claim::Unclaimed => true,
        Claim::Claimed(p) | Claim::Taken(p) | Claim::Cancelled(p) => ok(p),
    };
    let giver = match slot.grant {
        Grant::Given { by, .. } => ok(by),
        Grant::Open | Grant::Stop => true,
    };
    claimer && giver
}

fn with_grant(word: SlotWord, grant: Grant) -> u64 {
    let slot = Slot { grant, ..word.slot };
    SlotWord { slot, ..word }.pack()
}
