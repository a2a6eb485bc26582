//! The region's words as the real fast path will store them: a [`Slot`]
//! and a [`Record`] of the model, each packed into one 64-bit word, bit for
//! bit as docs/fastpath.md ("The region") lays them out. Pure: the
//! compare-and-swaps on the shared mapping will exchange these words, and
//! the broker's audit reads them back.
//!
//! A slot's word also carries what the model leaves out: the ticket it
//! carries now (`gen`, which tells a slot's ticket from the one `capacity`
//! before it) and whether its claimer sleeps in `futex_wait` (which saves a
//! releaser the wake of a claimer that does not). A record's word carries
//! the low 24 bits of a `Taking` ticket (the broker matches them against
//! the slot's `gen`) and a 14-bit count of the record's changes (so that
//! two equal reads of it are one instant's value). A party is stored as
//! seat + 1 in 11 bits, 0 being the broker.

use super::{Claim, Grant, Party, Seat, Slot};

/// A slot's word, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotWord {
    /// The ticket the slot carries now (tickets wrap at 2^32).
    pub gen: u32,
    /// Its claim and grant halves.
    pub slot: Slot,
    /// Its claimer is in, or about to enter, `futex_wait` on it.
    pub sleeping: bool,
}

/// A record's intent as its word stores it: a `Taking` ticket's low 24
/// bits only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum IntentWord {
    /// Nothing in flight.
    #[default]
    Idle,
    /// Taking the token of the ticket whose low 24 bits these are.
    Taking(u32),
    /// A token on its way to the queue.
    Releasing,
}

/// A record's word, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RecordWord {
    /// Tokens the client holds (at most 65,535 are lent).
    pub held: u16,
    /// Tokens released past the barrier, for the broker to collect.
    pub returned: u8,
    /// The operation in flight.
    pub intent: IntentWord,
    /// How many times the record changed, modulo 2^14.
    pub changes: u16,
}

/// Why a word does not decode: it is none that a correct client or broker
/// writes (garbage, for the audit to count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadWord {
    /// A two-bit state field holds its unused value.
    State,
    /// A field that must be zero in this state is not.
    Stray,
}

const CLAIM_SHIFT: u32 = 30;
const CLAIMER_SHIFT: u32 = 19;
const GRANT_SHIFT: u32 = 17;
const GIVER_SHIFT: u32 = 6;
const ACKED: u64 = 1 << 5;
const SLEEPING: u64 = 1 << 4;
/// A party: 0 for the broker, a seat + 1 otherwise (11 bits: 2047 seats).
pub const PARTY_BITS: u32 = 11;
const PARTY_MASK: u64 = (1 << PARTY_BITS) - 1;
const LOW_BITS_UNUSED: u64 = (1 << 4) - 1;

fn party_bits(party: Party) -> u64 {
    match party {
        Party::Broker => 0,
        Party::Seat(Seat(seat)) => u64::from(seat) + 1,
    }
}

fn party(bits: u64) -> Result<Party, BadWord> {
    match bits {
        0 => Ok(Party::Broker),
        // Eleven bits: every value names a seat a region may have.
        n => Ok(Party::Seat(Seat((n - 1) as u16))),
    }
}

impl SlotWord {
    /// The word a compare-and-swap stores.
    pub fn pack(self) -> u64 {
        let (claim_state, claimer) = match self.slot.claim {
            Claim::Unclaimed => (0, 0),
            Claim::Claimed(p) => (1, party_bits(p)),
            Claim::Taken(p) => (2, party_bits(p)),
            Claim::Cancelled(p) => (3, party_bits(p)),
        };
        let (grant_state, giver, acked) = match self.slot.grant {
            Grant::Open => (0, 0, false),
            Grant::Stop => (1, 0, false),
            Grant::Given { by, acked } => (2, party_bits(by), acked),
        };
        u64::from(self.gen) << 32
            | claim_state << CLAIM_SHIFT
            | claimer << CLAIMER_SHIFT
            | grant_state << GRANT_SHIFT
            | giver << GIVER_SHIFT
            | if acked { ACKED } else { 0 }
            | if self.sleeping { SLEEPING } else { 0 }
    }

    /// The slot a word says, or why no correct party wrote it.
    pub fn unpack(word: u64) -> Result<SlotWord, BadWord> {
        if word & LOW_BITS_UNUSED != 0 {
            return Err(BadWord::Stray);
        }
        let claimer_bits = (word >> CLAIMER_SHIFT) & PARTY_MASK;
        let claim = match (word >> CLAIM_SHIFT) & 3 {
            0 if claimer_bits != 0 => return Err(BadWord::Stray),
            0 => Claim::Unclaimed,
            1 => Claim::Claimed(party(claimer_bits)?),
            2 => Claim::Taken(party(claimer_bits)?),
            _ => Claim::Cancelled(party(claimer_bits)?),
        };
        let giver_bits = (word >> GIVER_SHIFT) & PARTY_MASK;
        let acked = word & ACKED != 0;
        let grant = match (word >> GRANT_SHIFT) & 3 {
            0 | 1 if giver_bits != 0 || acked => return Err(BadWord::Stray),
            0 => Grant::Open,
            1 => Grant::Stop,
            2 => Grant::Given {
                by: party(giver_bits)?,
                acked,
            },
            _ => return Err(BadWord::State),
        };
        Ok(SlotWord {
            gen: (word >> 32) as u32,
            slot: Slot { claim, grant },
            sleeping: word & SLEEPING != 0,
        })
    }

    /// The low 32 bits, on which the claimer waits (futex(2) waits on a
    /// 32-bit word): every grant changes them, so a grant that lands
    /// between the claimer's last look and its `futex_wait` makes the
    /// call return at once.
    pub fn futex_half(word: u64) -> u32 {
        word as u32
    }
}

const HELD_SHIFT: u32 = 48;
const RETURNED_SHIFT: u32 = 40;
const INTENT_SHIFT: u32 = 38;
const TICKET_SHIFT: u32 = 14;
const TICKET_MASK: u64 = (1 << 24) - 1;
const CHANGES_MASK: u64 = (1 << 14) - 1;

impl RecordWord {
    /// The word its client stores.
    pub fn pack(self) -> u64 {
        let (intent, ticket) = match self.intent {
            IntentWord::Idle => (0, 0),
            IntentWord::Taking(t) => (1, u64::from(t) & TICKET_MASK),
            IntentWord::Releasing => (2, 0),
        };
        u64::from(self.held) << HELD_SHIFT
            | u64::from(self.returned) << RETURNED_SHIFT
            | intent << INTENT_SHIFT
            | ticket << TICKET_SHIFT
            | u64::from(self.changes) & CHANGES_MASK
    }

    /// The record a word says, or why no correct client wrote it.
    pub fn unpack(word: u64) -> Result<RecordWord, BadWord> {
        let ticket = ((word >> TICKET_SHIFT) & TICKET_MASK) as u32;
        let intent = match (word >> INTENT_SHIFT) & 3 {
            0 | 2 if ticket != 0 => return Err(BadWord::Stray),
            0 => IntentWord::Idle,
            1 => IntentWord::Taking(ticket),
            2 => IntentWord::Releasing,
            _ => return Err(BadWord::State),
        };
        Ok(RecordWord {
            held: (word >> HELD_SHIFT) as u16,
            returned: (word >> RETURNED_SHIFT) as u8,
            intent,
            changes: (word & CHANGES_MASK) as u16,
        })
    }

    /// The same record after one more change: what a client stores next,
    /// its count moved on so that the audit tells the two apart.
    pub fn changed(self, f: impl FnOnce(&mut RecordWord)) -> RecordWord {
        let mut next = self;
        f(&mut next);
        next.changes = self.changes.wrapping_add(1) & CHANGES_MASK as u16;
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_party() -> impl Strategy<Value = Party> {
        prop_oneof![
            Just(Party::Broker),
            (0u16..(1 << PARTY_BITS) - 1).prop_map(|s| Party::Seat(Seat(s)))
        ]
    }

    fn arb_slot() -> impl Strategy<Value = Slot> {
        let claim = prop_oneof![
            Just(Claim::Unclaimed),
            arb_party().prop_map(Claim::Claimed),
            arb_party().prop_map(Claim::Taken),
            arb_party().prop_map(Claim::Cancelled),
        ];
        let grant = prop_oneof![
            Just(Grant::Open),
            Just(Grant::Stop),
            (arb_party(), any::<bool>()).prop_map(|(by, acked)| Grant::Given { by, acked }),
        ];
        (claim, grant).prop_map(|(claim, grant)| Slot { claim, grant })
    }

    proptest! {
        #[test]
        fn every_slot_survives_its_word(gen in any::<u32>(), slot in arb_slot(), sleeping in any::<bool>()) {
            let word = SlotWord { gen, slot, sleeping };
            prop_assert_eq!(SlotWord::unpack(word.pack()), Ok(word));
        }

        #[test]
        fn every_record_survives_its_word(
            held in any::<u16>(),
            returned in any::<u8>(),
            intent in prop_oneof![
                Just(IntentWord::Idle),
                (0u32..1 << 24).prop_map(IntentWord::Taking),
                Just(IntentWord::Releasing),
            ],
            changes in 0u16..1 << 14,
        ) {
            let word = RecordWord { held, returned, intent, changes };
            prop_assert_eq!(RecordWord::unpack(word.pack()), Ok(word));
        }

        #[test]
        fn a_word_decodes_only_to_what_packs_back_to_it(word in any::<u64>()) {
            if let Ok(slot) = SlotWord::unpack(word) {
                prop_assert_eq!(slot.pack(), word);
            }
            if let Ok(record) = RecordWord::unpack(word) {
                prop_assert_eq!(record.pack(), word);
            }
        }

        #[test]
        fn every_grant_changes_the_half_a_claimer_waits_on(gen in any::<u32>(), by in arb_party(), claimer in arb_party()) {
            let waiting = SlotWord {
                gen,
                slot: Slot { claim: Claim::Claimed(claimer), grant: Grant::Open },
                sleeping: true,
            };
            let granted = SlotWord {
                slot: Slot { grant: Grant::Given { by, acked: false }, ..waiting.slot },
                ..waiting
            };
            prop_assert_ne!(SlotWord::futex_half(waiting.pack()), SlotWord::futex_half(granted.pack()));
        }
    }

    #[test]
    fn the_layout_is_the_one_the_design_gives() {
        // docs/fastpath.md: gen 63..32, claim 31..30, claimer 29..19,
        // grant 18..17, giver 16..6, acked 5, sleeping 4.
        let word = SlotWord {
            gen: 7,
            slot: Slot {
                claim: Claim::Taken(Party::Seat(Seat(2))),
                grant: Grant::Given {
                    by: Party::Broker,
                    acked: true,
                },
            },
            sleeping: true,
        };
        assert_eq!(
            word.pack(),
            7 << 32 | 2 << 30 | 3 << 19 | 2 << 17 | 1 << 5 | 1 << 4
        );
        // held 63..48, returned 47..40, intent 39..38, ticket 37..14,
        // changes 13..0.
        let record = RecordWord {
            held: 3,
            returned: 1,
            intent: IntentWord::Taking(5),
            changes: 9,
        };
        assert_eq!(record.pack(), 3 << 48 | 1 << 40 | 1 << 38 | 5 << 14 | 9);
    }

    #[test]
    fn garbage_is_told_from_a_word() {
        assert_eq!(
            SlotWord::unpack(3 << 17),
            Err(BadWord::State),
            "grant state 3"
        );
        assert_eq!(SlotWord::unpack(1), Err(BadWord::Stray), "a low bit");
        assert_eq!(
            SlotWord::unpack(5 << 19),
            Err(BadWord::Stray),
            "an unclaimed slot's claimer"
        );
        assert_eq!(
            SlotWord::unpack(1 << 5),
            Err(BadWord::Stray),
            "an open slot acked"
        );
        // A seat the region does not have is told by the snapshot, which
        // knows the region's seats (tests/fastpath_ring.rs).
        assert_eq!(RecordWord::unpack(3 << 38), Err(BadWord::State), "intent 3");
        assert_eq!(
            RecordWord::unpack(2 << 38 | 1 << 14),
            Err(BadWord::Stray),
            "releasing with a ticket"
        );
    }

    #[test]
    fn a_change_moves_the_count_on_and_wraps() {
        let record = RecordWord {
            changes: (1 << 14) - 1,
            ..RecordWord::default()
        };
        let next = record.changed(|r| r.held += 1);
        assert_eq!((next.held, next.changes), (1, 0));
        assert_ne!(next.pack(), record.pack());
    }
}
