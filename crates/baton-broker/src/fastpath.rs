//! The broker's side of the shared-memory fast path (docs/fastpath.md):
//! a region per build whose clients ask for one, lent tokens from the
//! pool, and the broker's moves on it.
//!
//! The pool stays the one book of tokens. A region's tokens are held in
//! the pool by its *lender*, a client of the region's build with no
//! connection (crate::broker::Transport::Region): the shares, the gates
//! and STATUS count them as that build's. Inside the region the clients
//! pass them among themselves without the broker; the broker's moves
//! (`baton_core::fastpath::Ring`'s keeper) keep `held_by(lender)` equal to
//! what the region counts, between any two of its rounds:
//!
//! - **Open** (no barrier) while the region's build is the only one with
//!   a region and nobody else waits in the pool, nothing is to be retired
//!   (a lowered limit, a gate's cap below what is held) and no reclaim
//!   grace runs: every free token of the pool is lent to it.
//! - **Closed** otherwise: the barrier stands, the free tokens come out,
//!   a token released in the region comes back to the pool (the client's
//!   `NUDGE` says so), and each claim waiting behind the barrier is one
//!   request of the lender in the pool's queue, served in the share
//!   policy's order like any other.
//! - **A client that dies** (its connection closes): its seat is repaired
//!   and what the region says it held is booked on its connection just
//!   before the connection leaves the pool, so that the socket path's
//!   rules apply (a build whose jobs run on keeps them).
//! - **The audit**: at most once a second while the broker is awake, a
//!   snapshot of each region is checked against the lender's books. A
//!   mismatch seen twice is logged and counted, and every client of the
//!   region is dropped to the socket path with what the region says it
//!   holds (a queue the audit cannot read closes the region for good):
//!   from then on every token its clients get comes from the pool, which
//!   never grants past the limit.

use crate::broker::Broker;
use crate::log;
use baton_client::fastpath::{Futexes, Mapping};
use baton_core::fastpath::{ring, Audit, Books, Notice, Refused, Ring, Seat, Unread};
use baton_core::BuildId;
use baton_core::{Acquired, ClientId, Tag};
use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

mod pile;
use pile::PileRegion;

/// Seats per region: clients of one build that share its memory. The
/// layout allows 2047; a region's seat lines take 64 bytes each, and the
/// audit reads them all.
pub const SEATS: usize = 1024;

/// How often, at most, the broker audits each region while it is awake.
pub const AUDIT_EVERY: Duration = Duration::from_secs(1);

/// The audit's period: [`AUDIT_EVERY`], or `BATON_FASTPATH_AUDIT_MS`
/// milliseconds. A knob for tests: with a long period, a broker that
/// waits for its audit clock where a client's nudge should have woken it
/// hangs, where it would only have been slow.
pub fn audit_every() -> Duration {
    static EVERY: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *EVERY.get_or_init(|| {
        std::env::var("BATON_FASTPATH_AUDIT_MS")
            .ok()
            .and_then(|ms| ms.parse().ok())
            .map_or(AUDIT_EVERY, Duration::from_millis)
    })
}

/// The broker only wakes claimers; it never waits on a slot, nor tells
/// itself anything.
fn host() -> Futexes<fn(Notice)> {
    Futexes { tell: |_| {} }
}

/// Every region, by build, and where each fast-path client sits.
#[derive(Default)]
pub struct Regions {
    /// Ordered, so that each round visits the regions in the same order
    /// (the oldest build first) and a run can be replayed.
    by_build: BTreeMap<BuildId, Region>,
    /// The builds whose region is a pile (docs/fastpath.md, "The pile").
    piles: BTreeMap<BuildId, PileRegion>,
    seated: HashMap<ClientId, (BuildId, Seat)>,
    audited: Option<Instant>,
    /// Builds whose region an audit ended: none is made for them again
    /// while they live.
    refused: Vec<BuildId>,
}

/// One build's region.
struct Region {
    mapping: Arc<Mapping>,
    fd: OwnedFd,
    /// Holds the region's tokens in the pool.
    lender: ClientId,
    /// The client in each seat.
    clients: Vec<Option<ClientId>>,
    /// Seats never given again: their repair found a record no correct
    /// client writes.
    burnt: Vec<bool>,
    /// No barrier: clients give each other tokens.
    open: bool,
    /// The lender's requests in the pool's queue, one per claim waiting
    /// behind the barrier.
    asked: Vec<Tag>,
    next_tag: Tag,
    /// Audits in a row that did not balance.
    odd_audits: u32,
    /// Closed for good after a confirmed mismatch.
    tainted: bool,
    /// When each waiting claim was first seen; shared with STATUS's view.
    first_seen: Arc<FirstSeen>,
}

/// When the broker first saw each claim waiting in a region, by ticket.
/// The region keeps no clock (a client's claim is one compare-and-swap),
/// so a waiter's `since` is the first audit or STATUS that saw it waiting:
/// at most one audit period late while the audit clock runs.
#[derive(Debug, Default)]
struct FirstSeen(Mutex<BTreeMap<u64, SystemTime>>);

impl FirstSeen {
    /// The time each of `tickets` (waiting now) was first seen waiting:
    /// `now` for those not seen before. Tickets no longer waiting are
    /// forgotten, so that the map holds only the queue's waiters.
    fn note(&self, tickets: &[u64], now: SystemTime) -> Vec<SystemTime> {
        let mut seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
        seen.retain(|t, _| tickets.contains(t));
        let since = |&t: &u64| *seen.entry(t).or_insert(now);
        tickets.iter().map(since).collect()
    }
}

/// The absolute tickets and seats of the claims waiting in a snapshot
/// whose oldest ticket is `base`.
fn waiting_claims(region: &baton_core::fastpath::Region, base: usize) -> Vec<(u64, Seat)> {
    let at = |(t, seat): (usize, Seat)| ((base + t) as u64, seat);
    region.waiting_tickets().into_iter().map(at).collect()
}

/// A region as STATUS reads it: its memory, its lender, and who sits
/// where. Shared with the broker's books, which answer STATUS.
#[derive(Debug, Clone)]
pub struct View {
    mapping: Arc<Mapping>,
    pub lender: ClientId,
    seated: Vec<(Seat, ClientId)>,
    first_seen: Arc<FirstSeen>,
}

/// What STATUS reads in one region at one moment.
#[derive(Debug, Default)]
pub struct Seen {
    /// Each seated client and the tokens the region attributes to it:
    /// held, returned, in flight.
    pub holdings: Vec<(ClientId, u32)>,
    /// The client of each claim waiting for a token, oldest first, and
    /// when the broker first saw the claim waiting.
    pub waiting: Vec<(ClientId, SystemTime)>,
}

impl View {
    /// The region now, read as the audit reads (two equal passes); a
    /// region that keeps moving is read as it was last seen whole, or not
    /// at all.
    pub fn read(&self) -> Seen {
        if self.mapping.is_pile() {
            return PileRegion::seen(&self.mapping, &self.seated, &self.first_seen);
        }
        let ring = self.mapping.ring();
        let Some((region, base)) = (0..100).find_map(|_| ring.snapshot().ok()) else {
            return Seen::default();
        };
        let attributions = region.attributions();
        Seen {
            holdings: self
                .seated
                .iter()
                .map(|&(seat, client)| (client, attributions[usize::from(seat.0)]))
                .collect(),
            waiting: self.waiting(&region, base),
        }
    }

    /// Each claim waiting in `region` (a snapshot whose oldest ticket is
    /// `base`) as its client, with when it was first seen waiting.
    fn waiting(
        &self,
        region: &baton_core::fastpath::Region,
        base: usize,
    ) -> Vec<(ClientId, SystemTime)> {
        let claims = waiting_claims(region, base);
        let tickets: Vec<u64> = claims.iter().map(|&(t, _)| t).collect();
        let since = self.first_seen.note(&tickets, SystemTime::now());
        let client_at = |seat: Seat| {
            self.seated
                .iter()
                .find(|&&(s, _)| s == seat)
                .map(|&(_, client)| client)
        };
        claims
            .iter()
            .zip(since)
            .filter_map(|(&(_, seat), since)| Some((client_at(seat)?, since)))
            .collect()
    }
}

/// Why a build gets no seat after an audit.
const AUDITED_OUT: &str = "an audit found its build's region wrong";

/// What an audit concluded.
enum Verdict {
    /// Balanced, not yet confirmed, or confirmed before.
    Fine,
    /// Confirmed, and the region readable: its clients go to the socket,
    /// the seats of `.0` (records no correct client writes) last.
    Dropped(Vec<Seat>),
    /// Confirmed, and its queue unreadable: closed for good.
    Closed,
}

/// What a client is told when it gets a seat.
pub struct Offer<'a> {
    pub seat: u32,
    pub bytes: u32,
    pub fd: BorrowedFd<'a>,
}

impl Regions {
    /// Whether no build has a region.
    pub fn is_empty(&self) -> bool {
        self.by_build.is_empty() && self.piles.is_empty()
    }

    /// Seats `client` in its build's region, made on first use. `Err` says
    /// why not, for `ERR unavailable`: the client stays on the socket.
    /// `layout` is the one FASTPATH named: a ring, or a pile; a build's
    /// first fast-path client chooses for the build.
    pub fn offer(
        &mut self,
        broker: &mut Broker,
        client: ClientId,
        layout: u32,
    ) -> Result<Offer<'_>, String> {
        if self.seated.contains_key(&client) {
            return Err("this connection has a seat already".into());
        }
        let build = broker
            .pool()
            .build_of(client)
            .ok_or("the connection has not said HELLO")?;
        // Builds that ended are forgotten (their ids are not used again).
        let pool = broker.pool();
        self.refused.retain(|&b| pool.builds().any(|x| x.id == b));
        if self.refused.contains(&build) {
            return Err(AUDITED_OUT.into());
        }
        let wants_pile = layout == baton_core::protocol::FASTPATH_PILE;
        let other = if wants_pile {
            self.by_build.contains_key(&build)
        } else {
            self.piles.contains_key(&build)
        };
        if other {
            return Err(format!(
                "its build's fast path is a {}: ask for FASTPATH {}",
                if wants_pile { "ring" } else { "pile" },
                if wants_pile { 1 } else { 2 }
            ));
        }
        if wants_pile {
            return self.offer_pile(broker, client, build);
        }
        let region = match self.by_build.entry(build) {
            Entry::Occupied(found) => found.into_mut(),
            Entry::Vacant(slot) => slot.insert(Region::new(broker, client, build)?),
        };
        if region.tainted {
            return Err(AUDITED_OUT.into());
        }
        let seat = (0..SEATS)
            .find(|&s| region.clients[s].is_none() && !region.burnt[s])
            .ok_or(format!(
                "its build's region has no free seat ({SEATS} clients use it)"
            ))?;
        region.clients[seat] = Some(client);
        let seat = Seat(seat as u16);
        self.seated.insert(client, (build, seat));
        broker.set_fast_views(self.views());
        let region = &self.by_build[&build];
        Ok(Offer {
            seat: u32::from(seat.0),
            bytes: (region.mapping.words().len() * 8) as u32,
            fd: region.fd.as_fd(),
        })
    }

    /// A seat for `client` on `build`'s pile, made on first use.
    fn offer_pile(
        &mut self,
        broker: &mut Broker,
        client: ClientId,
        build: BuildId,
    ) -> Result<Offer<'_>, String> {
        let region = match self.piles.entry(build) {
            Entry::Occupied(found) => found.into_mut(),
            Entry::Vacant(slot) => slot.insert(PileRegion::new(broker, client, build)?),
        };
        let seat = (0..SEATS)
            .find(|&s| region.clients[s].is_none())
            .ok_or(format!(
                "its build's pile has no free seat ({SEATS} clients use it)"
            ))?;
        region.clients[seat] = Some(client);
        self.seated.insert(client, (build, Seat(seat as u16)));
        broker.set_fast_views(self.views());
        Ok(self.piles[&build].offer(seat))
    }

    /// `client`'s connection is closing: its seat is repaired and what it
    /// held there is booked on its connection, which the caller then takes
    /// out of the pool. The region goes with its last client.
    pub fn leave(&mut self, broker: &mut Broker, client: ClientId) {
        let Some((build, seat)) = self.seated.remove(&client) else {
            return;
        };
        if let Some(pile) = self.piles.get_mut(&build) {
            let in_hand = pile.repair(seat);
            broker.fast_counts().repairs += 1;
            if let Err(e) = broker.transfer(pile.lender, client, in_hand) {
                log::warn(format_args!(
                    "fast path: booking a closing client's tokens: {e}"
                ));
            }
            if pile.clients.iter().all(Option::is_none) {
                let pile = self.piles.remove(&build).expect("found above");
                pile.retire(broker);
            }
            broker.set_fast_views(self.views());
            return;
        }
        let region = self
            .by_build
            .get_mut(&build)
            .expect("a seated client's region");
        let mut in_hand = 0;
        let clean = region.repair(seat, &mut in_hand);
        broker.fast_counts().repairs += 1;
        let held = broker.pool().held_by(region.lender);
        if in_hand > held {
            log::warn(format_args!(
                "fast path: the region says a closing client held {in_hand} token(s), and it lends {held}"
            ));
        }
        let booked = in_hand.min(held);
        if let Err(e) = broker.transfer(region.lender, client, booked) {
            log::warn(format_args!(
                "fast path: booking a closing client's tokens: {e}"
            ));
        }
        region.clients[usize::from(seat.0)] = None;
        region.burnt[usize::from(seat.0)] |= !clean;
        if region.clients.iter().all(Option::is_none) {
            let region = self.by_build.remove(&build).expect("found above");
            region.retire(broker);
        }
        broker.set_fast_views(self.views());
    }

    /// The regions as STATUS reads them.
    fn views(&self) -> Vec<View> {
        let view = |region: &Region| View {
            mapping: region.mapping.clone(),
            lender: region.lender,
            seated: region
                .seats()
                .map(|seat| (seat, region.clients[usize::from(seat.0)].expect("seated")))
                .collect(),
            first_seen: region.first_seen.clone(),
        };
        let pile_view = |pile: &PileRegion| View {
            mapping: pile.mapping.clone(),
            lender: pile.lender,
            seated: (0..SEATS)
                .filter_map(|s| Some((Seat(s as u16), pile.clients[s]?)))
                .collect(),
            first_seen: pile.first_seen.clone(),
        };
        let rings = self.by_build.values().map(view);
        rings.chain(self.piles.values().map(pile_view)).collect()
    }

    /// Before a successor takes over (`serve --replace`): the regions die
    /// with this broker. Each one's barrier goes up and its free tokens
    /// come back; each seat is revoked, its sleeper woken to see it, and
    /// what the region attributes to it is booked on its connection, which
    /// the successor adopts. Its client then uses the socket (its library
    /// moves what it held there to the connection's count).
    pub fn evict_all(&mut self, broker: &mut Broker) {
        self.seated.clear();
        broker.set_fast_views(Vec::new());
        for (_, region) in std::mem::take(&mut self.by_build) {
            region.evict(broker, &[]);
        }
        for (_, pile) in std::mem::take(&mut self.piles) {
            pile.evict(broker);
        }
    }

    /// An audit confirmed that `build`'s region is wrong, and could read
    /// it: every client is dropped to the socket path with what the region
    /// attributes to it (`suspects` last, so that a record no correct
    /// client writes takes only what is left), and the build gets no
    /// region again.
    fn drop_to_the_socket(&mut self, broker: &mut Broker, build: BuildId, suspects: &[Seat]) {
        let Some(region) = self.by_build.remove(&build) else {
            return;
        };
        self.seated.retain(|_, &mut (b, _)| b != build);
        self.refused.push(build);
        broker.set_fast_views(self.views());
        region.evict(broker, suspects);
    }

    /// The broker's moves after each of its rounds: grants to lenders go
    /// into their regions, returned tokens come back, each region opens
    /// or closes as the pool's state says, and, at most once a second,
    /// the audit.
    pub fn round(&mut self, broker: &mut Broker) {
        if self.is_empty() {
            return;
        }
        for grant in broker.take_grants(crate::broker::Transport::Region) {
            if let Some(region) = self
                .by_build
                .values_mut()
                .find(|r| r.lender == grant.client)
            {
                region.asked.retain(|&t| t != grant.tag);
                region.serve(broker, grant.tokens);
            }
            if let Some(pile) = self.piles.values_mut().find(|p| p.lender == grant.client) {
                pile.asked.retain(|&t| t != grant.tag);
                pile.serve(broker, grant.tokens);
            }
        }
        let lenders_waiting: usize = self.by_build.values().map(|r| r.asked.len()).sum::<usize>()
            + self.piles.values().map(|p| p.asked.len()).sum::<usize>();
        let others_waiting = broker.pool().waiting() > lenders_waiting;
        let alone = self.by_build.len() + self.piles.len() == 1;
        for pile in self.piles.values_mut() {
            pile.collect(broker);
            match closed_by(broker, alone, others_waiting, false) {
                None => pile.lend(broker),
                Some(why) => {
                    if pile.open {
                        log::debug(format_args!("fast path: a pile closes: {why}"));
                    }
                    pile.hold_back(broker);
                }
            }
        }
        for region in self.by_build.values_mut() {
            region.collect(broker);
            match closed_by(broker, alone, others_waiting, region.tainted) {
                None => region.lend(broker),
                Some(why) => {
                    if region.open {
                        log::debug(format_args!("fast path: a region closes: {why}"));
                    }
                    region.hold_back(broker);
                }
            }
        }
        let due = self.audited.is_none_or(|t| t.elapsed() >= audit_every());
        if due {
            self.audited = Some(Instant::now());
            let mut readable = Vec::new();
            for (&build, region) in self.by_build.iter_mut() {
                match region.audit(broker) {
                    Verdict::Fine => continue,
                    Verdict::Dropped(suspects) => readable.push((build, suspects)),
                    Verdict::Closed => {}
                }
                broker.fast_counts().mismatches += 1;
            }
            for (build, suspects) in readable {
                self.drop_to_the_socket(broker, build, &suspects);
            }
            self.audit_piles(broker);
        }
        // The broker's own books of its piles (a slip here would make or
        // lose a token without any client's doing): checked in every
        // debug build's round, the tests' among them.
        let settled = !broker.has_grants_for(crate::broker::Transport::Region);
        debug_assert!(
            !settled || self.piles.values().all(|p| p.balances(broker)),
            "a pile's lent words and its lender's tokens differ"
        );
    }

    /// Ends each pile whose words no correct client wrote: its clients
    /// keep what it says they hold, on their connections, and use the
    /// socket from their next operation; its build gets no region again.
    fn audit_piles(&mut self, broker: &mut Broker) {
        let settled = !broker.has_grants_for(crate::broker::Transport::Region);
        let unbalanced = |pile: &PileRegion| {
            (settled && !pile.balances(broker))
                .then_some("a count of lent words its lender's books do not hold")
        };
        let wrong: Vec<(BuildId, &'static str)> = self
            .piles
            .iter()
            .filter_map(|(&build, pile)| Some((build, pile.audit().or_else(|| unbalanced(pile))?)))
            .collect();
        for (build, why) in wrong {
            log::warn(format_args!(
                "fast path: a pile holds {why}; its clients are dropped to the socket path with what it says they hold"
            ));
            broker.fast_counts().mismatches += 1;
            let pile = self.piles.remove(&build).expect("found above");
            self.seated.retain(|_, &mut (b, _)| b != build);
            self.refused.push(build);
            broker.set_fast_views(self.views());
            pile.evict(broker);
        }
    }
}

/// Why a region (ring or pile) is closed this round, if it is: it is not
/// the only one, others wait in the pool, an audit found it wrong, or the
/// pool may not lend.
fn closed_by(
    broker: &Broker,
    alone: bool,
    others_waiting: bool,
    tainted: bool,
) -> Option<&'static str> {
    if !alone {
        Some("another build has a region")
    } else if others_waiting {
        Some("others wait in the pool")
    } else if tainted {
        Some("an audit found it wrong")
    } else {
        must_retire(broker)
    }
}

/// Why the pool may not lend now, if so: a lowered limit or a gate wants
/// tokens back, or a reclaim grace holds every grant back.
fn must_retire(broker: &Broker) -> Option<&'static str> {
    let pool = broker.pool();
    let held = pool.held();
    if held > pool.limit() {
        Some("more tokens are held than the limit")
    } else if pool.admission_cap().is_some_and(|cap| held > cap) {
        Some("a gate holds tokens back")
    } else if broker.reclaim_left().is_some() {
        Some("builds re-attach after a broker's death")
    } else if broker.in_cluster() {
        // A token lent ahead of demand would hold a cluster token that
        // another machine may wait for.
        Some("a cluster pool's tokens are taken only as asked")
    } else {
        None
    }
}

/// A ring this large holds every token a pool of `limit` can lend and a
/// waiting claim from every seat, twice over: a full ring (a client
/// stopped between two steps) should be rare.
fn capacity_for(limit: u32) -> usize {
    ((limit as usize + SEATS) * 2)
        .next_power_of_two()
        .clamp(4096, ring::MAX_CAPACITY)
}

impl Region {
    fn new(broker: &mut Broker, first: ClientId, build: BuildId) -> Result<Region, String> {
        let capacity = capacity_for(broker.pool().limit());
        let (mapping, fd) = Mapping::create(capacity, SEATS, 0)
            .map_err(|e| format!("the broker cannot make a region: {e}"))?;
        mapping
            .hold_liveness()
            .map_err(|e| format!("the broker cannot lock the region's liveness word: {e}"))?;
        let lender = broker.connect_lender(
            first,
            format!("[fast path of build {}: free in its region]", build.0),
        );
        log::debug(format_args!(
            "fast path: a region of {capacity} slots for build {}",
            build.0
        ));
        Ok(Region {
            mapping: Arc::new(mapping),
            fd,
            lender,
            clients: vec![None; SEATS],
            burnt: vec![false; SEATS],
            open: true,
            asked: Vec::new(),
            next_tag: 0,
            odd_audits: 0,
            tainted: false,
            first_seen: Arc::default(),
        })
    }

    fn ring(&self) -> Ring<'_> {
        self.mapping.ring()
    }

    fn seats(&self) -> impl Iterator<Item = Seat> + '_ {
        (0..SEATS)
            .filter(|&s| self.clients[s].is_some())
            .map(|s| Seat(s as u16))
    }

    /// Takes back what the ring says `seat` had, into `in_hand`; false if
    /// its record could not be read (no correct client writes it).
    fn repair(&self, seat: Seat, in_hand: &mut u32) -> bool {
        let host = host();
        loop {
            match self.ring().repair_step(seat, in_hand, &host) {
                Ok(Some(_)) => continue,
                Ok(None) => return true,
                Err(why) => {
                    log::warn(format_args!("fast path: repairing seat {}: {why}", seat.0));
                    return false;
                }
            }
        }
    }

    /// Tokens the pool granted the lender (or the broker took back while
    /// the region is open) go to the region's queue: the oldest waiting
    /// claim first, then free for the next claim. What the ring cannot
    /// take goes back to the pool.
    fn serve(&mut self, broker: &mut Broker, tokens: u32) {
        let mut in_hand = tokens;
        let host = host();
        loop {
            match self.ring().regrant_step(&mut in_hand, &host) {
                Ok(Some(_)) => continue,
                Ok(None) | Err(Refused::Full) => break,
                Err(why) => {
                    log::warn(format_args!(
                        "fast path: giving a token to the region: {why}"
                    ));
                    break;
                }
            }
        }
        self.give_back(broker, in_hand);
    }

    /// Returns tokens the broker took out of the region to the pool.
    fn give_back(&mut self, broker: &mut Broker, tokens: u32) {
        let tokens = tokens.min(broker.pool().held_by(self.lender));
        if tokens > 0 {
            broker
                .release(self.lender, tokens)
                .expect("the lender holds them");
        }
    }

    /// Tokens clients returned through their records while the barrier
    /// stood (or the ring was full).
    fn collect(&mut self, broker: &mut Broker) {
        let mut in_hand = 0;
        let seats: Vec<Seat> = self.seats().collect();
        for seat in seats {
            while let Ok(Some(_)) = self.ring().collect_step(seat, &mut in_hand) {}
        }
        if self.open {
            self.serve(broker, in_hand);
        } else {
            self.give_back(broker, in_hand);
        }
    }

    /// Open: the barrier comes down, and every free token of the pool is
    /// lent to the region.
    fn lend(&mut self, broker: &mut Broker) {
        if !self.open {
            if self.ring().reopen().is_err() {
                return; // the ring is full: tried again next round
            }
            self.open = true;
            for tag in std::mem::take(&mut self.asked) {
                broker.cancel(self.lender, tag);
            }
        }
        let mut lent = 0;
        while broker.pool().free() > 0 && broker.try_acquire(self.lender, 1) == Ok(true) {
            lent += 1;
        }
        if lent > 0 {
            self.serve(broker, lent);
        }
    }

    /// Closed: the barrier stands, the free tokens go back to the pool,
    /// and each claim behind the barrier is one request in the pool.
    fn hold_back(&mut self, broker: &mut Broker) {
        if !self.put_up_barrier(broker) {
            return; // the ring is full: tried again next round
        }
        // One request per claim behind the barrier. The pool lets a client
        // hold and wait for at most the limit: a lender that holds it all
        // asks again as tokens come back to it.
        loop {
            let wanted = self.requests_wanted(broker);
            if self.asked.len() >= wanted {
                break;
            }
            let tag = self.next_tag;
            self.next_tag += 1;
            match broker.acquire(self.lender, tag, 1) {
                Ok(Acquired::Granted) => self.serve(broker, 1),
                Ok(Acquired::Queued) => self.asked.push(tag),
                Err(e) => {
                    log::warn(format_args!("fast path: asking the pool for a waiter: {e}"));
                    break;
                }
            }
        }
        while self.asked.len() > self.requests_wanted(broker) {
            let tag = self.asked.pop().expect("longer than wanted");
            broker.cancel(self.lender, tag);
        }
    }

    /// Requests the lender should have in the pool's queue: one per claim
    /// waiting behind the barrier, as far as the limit allows.
    fn requests_wanted(&self, broker: &Broker) -> usize {
        let pool = broker.pool();
        let room = pool.limit().saturating_sub(pool.held_by(self.lender)) as usize;
        (self.ring().waiters() as usize).min(room)
    }

    /// The barrier goes up, and the free tokens back to the pool; false
    /// if the ring was full (tried again next round).
    fn put_up_barrier(&mut self, broker: &mut Broker) -> bool {
        if self.open {
            if self.ring().close().is_err() {
                return false;
            }
            self.open = false;
            let mut in_hand = 0;
            while let Ok(Some(_)) = self.ring().drain_step(&mut in_hand) {}
            self.give_back(broker, in_hand);
        }
        true
    }

    /// Checks the region against the lender's books: a mismatch seen
    /// twice in a row is confirmed (once), logged, and answered (the
    /// verdict says how).
    fn audit(&mut self, broker: &mut Broker) -> Verdict {
        let lent = broker.pool().held_by(self.lender);
        let snapshot = self.ring().snapshot();
        let unreadable = matches!(snapshot, Err(Unread::Corrupt));
        let audit = match snapshot {
            Err(Unread::Moving) => return Verdict::Fine, // read again later
            Ok((snapshot, base)) => {
                // The audit clock is also the waiters' clock.
                let claims = waiting_claims(&snapshot, base);
                let tickets: Vec<u64> = claims.iter().map(|&(t, _)| t).collect();
                self.first_seen.note(&tickets, SystemTime::now());
                let audit = snapshot.audit(&Books {
                    lent,
                    ..Books::default()
                });
                if audit.balanced() {
                    self.odd_audits = 0;
                    return Verdict::Fine;
                }
                audit
            }
            // A slot no correct party writes: the queue cannot be read, so
            // nothing in it can be counted, and nobody is named.
            Err(Unread::Corrupt) => Audit {
                counted: 0,
                expected: lent,
                suspects: Vec::new(),
            },
        };
        self.odd_audits += 1;
        if self.odd_audits < 2 || self.tainted {
            return Verdict::Fine;
        }
        let suspects: Vec<String> = audit
            .suspects
            .iter()
            .filter_map(|s| self.clients[usize::from(s.0)])
            .filter_map(|c| {
                broker
                    .pool()
                    .meta(c)
                    .map(|m| format!("pid {} ({})", m.pid, m.command))
            })
            .collect();
        let found = if unreadable {
            "a region's queue holds a word no correct client writes".to_string()
        } else {
            format!(
                "a region counts {} token(s) where its build was lent {}",
                audit.counted, audit.expected
            )
        };
        let answer = if unreadable {
            "it is closed for good (what it was lent comes back with its last client), and its clients get every token from the pool"
        } else {
            "every client of it is dropped to the socket path with what the region says it holds"
        };
        log::warn(format_args!(
            "fast path: {found}{}; {answer}",
            if suspects.is_empty() {
                String::new()
            } else {
                format!(
                    "; records no correct client writes: {}",
                    suspects.join(", ")
                )
            }
        ));
        self.tainted = true;
        if unreadable {
            self.hold_back(broker);
            Verdict::Closed
        } else {
            Verdict::Dropped(audit.suspects)
        }
    }

    /// Revokes every seat and wakes every sleeper; books on each seated
    /// client's connection what the region attributes to it (`last`
    /// after the others), as far as the lender holds it; then ends the
    /// region. Its clients use the socket from their next operation (their
    /// library moves what it held through the region to the connection's
    /// count), at a handover and after an audit alike.
    fn evict(mut self, broker: &mut Broker, last: &[Seat]) {
        self.put_up_barrier(broker);
        let mut seats: Vec<Seat> = self.seats().collect();
        seats.sort_by_key(|s| last.contains(s));
        let ring = self.ring();
        for &seat in &seats {
            ring.revoke(seat);
        }
        for i in 0..ring.capacity() {
            baton_client::fastpath::futex_wake(ring.slot_word(i));
        }
        // A client between two steps moves a word: read again until two
        // reads agree (its step is a few instructions).
        let snapshot = (0..10_000).find_map(|_| ring.snapshot().ok());
        let Some((snapshot, _)) = snapshot else {
            log::warn(format_args!(
                "fast path: a region kept moving while its seats were revoked; its tokens go back to the pool"
            ));
            self.retire(broker);
            return;
        };
        let attributions = snapshot.attributions();
        for seat in seats {
            let client = self.clients[usize::from(seat.0)].expect("seated");
            let held = broker.pool().held_by(self.lender);
            let booked = attributions[usize::from(seat.0)].min(held);
            if let Err(e) = broker.transfer(self.lender, client, booked) {
                log::warn(format_args!("fast path: booking a seat's tokens: {e}"));
            }
        }
        self.retire(broker);
    }

    /// The last client left: the free tokens, and whatever the lender
    /// still holds, go back to the pool.
    fn retire(self, broker: &mut Broker) {
        // Any client still looking (one revoked at a handover) sees no
        // broker; and the word leaves this thread's robust list before
        // the mapping goes.
        if let Err(e) = self.mapping.release_liveness() {
            log::warn(format_args!(
                "fast path: unlocking a region's liveness word: {e}"
            ));
        }
        let left = broker.drop_lender(self.lender);
        log::debug(format_args!(
            "fast path: a region closed, {left} token(s) back to the pool"
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::{ClientMeta, Transport};
    use baton_core::protocol::FASTPATH_VERSION as RING;

    /// A deadline for an acquire that should be served at once, from what
    /// the region holds: nothing else in these tests could serve it later,
    /// so a second is no timing check, only a bound, and a broken lend
    /// fails the test instead of blocking it (and its mutant's run) for ever.
    fn soon() -> Option<Instant> {
        Some(Instant::now() + Duration::from_secs(1))
    }

    fn client(broker: &mut Broker) -> ClientId {
        let meta = ClientMeta::new(std::process::id(), "test".into(), Transport::Socket);
        broker.connect(meta)
    }

    #[test]
    fn the_pool_lends_only_while_nothing_is_to_be_retired() {
        let mut broker = Broker::new(2).unwrap();
        assert_eq!(must_retire(&broker), None);
        let a = client(&mut broker);
        broker.try_acquire(a, 2).unwrap();
        assert_eq!(must_retire(&broker), None, "held up to the limit");
        broker.set_limit(1).unwrap();
        assert_eq!(
            must_retire(&broker),
            Some("more tokens are held than the limit")
        );
        broker.release(a, 1).unwrap();
        assert_eq!(must_retire(&broker), None, "back at the limit");
        broker.start_reclaim(Duration::from_secs(60));
        assert_eq!(
            must_retire(&broker),
            Some("a gate holds tokens back"),
            "the grace's cap of 0"
        );
        broker.release(a, 1).unwrap();
        assert_eq!(
            must_retire(&broker),
            Some("builds re-attach after a broker's death")
        );
        broker.end_reclaim();
        assert_eq!(must_retire(&broker), None);
    }

    #[cfg(feature = "cluster")]
    #[test]
    fn a_cluster_members_pool_is_never_lent_ahead_of_demand() {
        let mut broker = Broker::new(2).unwrap();
        broker.join_cluster(&baton_core::cluster::Config {
            endpoints: vec!["http://127.0.0.1:1".into()],
            pool: "test".into(),
            jobs: 8,
            ttl: Duration::from_secs(10),
            linger: Duration::from_secs(1),
            watch_all: false,
        });
        broker.set_cluster_held(2, baton_core::cluster::Contact::Reachable);
        assert_eq!(
            must_retire(&broker),
            Some("a cluster pool's tokens are taken only as asked")
        );
    }

    #[test]
    fn a_ring_holds_every_token_and_a_claim_from_every_seat_twice_over() {
        assert_eq!(capacity_for(1), 4096, "never smaller");
        assert_eq!(capacity_for(2000), 8192);
        assert!(capacity_for(2000) >= 2 * (2000 + SEATS));
        assert_eq!(capacity_for(baton_core::MAX_LIMIT), ring::MAX_CAPACITY);
    }

    /// A seated client, its region open and lent the pool, and what the
    /// broker's books and the region say as it holds, dies and leaves.
    #[test]
    fn a_seat_lends_the_pool_and_its_departure_books_what_it_held() {
        let mut broker = Broker::new(3).unwrap();
        let mut regions = Regions::default();
        let a = client(&mut broker);
        let offer = regions.offer(&mut broker, a, RING).unwrap();
        assert_eq!(offer.seat, 0);
        let fd = offer.fd.try_clone_to_owned().unwrap();
        assert!(
            regions.offer(&mut broker, a, RING).is_err(),
            "one seat a connection"
        );
        regions.round(&mut broker);
        assert_eq!(
            (broker.pool().held(), broker.pool().free()),
            (3, 0),
            "all lent"
        );
        // The client takes two tokens in the region.
        let region = Mapping::map(fd.as_fd()).unwrap();
        let host = host();
        region.ring().acquire(Seat(0), &host, soon()).unwrap();
        region.ring().acquire(Seat(0), &host, soon()).unwrap();
        let status = broker.status();
        let held: Vec<_> = status.holders.iter().map(|h| h.tokens).collect();
        assert_eq!(held.iter().sum::<u32>(), 3);
        assert!(
            status
                .holders
                .iter()
                .any(|h| h.command == "test" && h.tokens == 2),
            "{status:#?}"
        );
        // Its connection closes: the two are booked on it, the free one
        // stays lent until the region ends with its last client.
        regions.leave(&mut broker, a);
        assert_eq!(broker.pool().held_by(a), 2);
        assert_eq!(
            broker.pool().held(),
            2,
            "the region ended: its free token went back"
        );
        assert_eq!(broker.status().totals.fastpath_repairs, 1);
        broker.disconnect(a);
        assert_eq!((broker.pool().held(), broker.pool().free()), (0, 3));
    }

    #[test]
    fn a_second_region_closes_both_and_a_waiter_becomes_a_request_in_the_pool() {
        let mut broker = Broker::new(1).unwrap();
        let mut regions = Regions::default();
        let (a, b) = (client(&mut broker), client(&mut broker));
        let fd_a = regions
            .offer(&mut broker, a, RING)
            .unwrap()
            .fd
            .try_clone_to_owned()
            .unwrap();
        regions.round(&mut broker);
        let ring_a = Mapping::map(fd_a.as_fd()).unwrap();
        let host = host();
        ring_a.ring().acquire(Seat(0), &host, soon()).unwrap();
        // b is another build: its region makes two, and both close.
        let fd_b = regions
            .offer(&mut broker, b, RING)
            .unwrap()
            .fd
            .try_clone_to_owned()
            .unwrap();
        regions.round(&mut broker);
        let ring_b = Mapping::map(fd_b.as_fd()).unwrap();
        let past = Some(std::time::Instant::now());
        assert_eq!(
            ring_b.ring().acquire(Seat(0), &host, past),
            Ok(baton_core::fastpath::Acquired::TimedOut),
            "nothing free behind the barrier"
        );
        assert_eq!(
            ring_b.ring().try_acquire(Seat(0), &host),
            Err(Refused::Busy)
        );
        // a's release meets the barrier: it comes back through the pool.
        assert_eq!(
            ring_a.ring().release(Seat(0), &host),
            Ok(baton_core::fastpath::Released::Returned)
        );
        regions.round(&mut broker);
        assert_eq!((broker.pool().held(), broker.pool().free()), (0, 1));
        regions.leave(&mut broker, a);
        regions.leave(&mut broker, b);
        assert_eq!((broker.pool().held(), broker.pool().free()), (0, 1));
    }

    /// The region a test's `client` sits in, mapped as the client maps it.
    fn seat_of(regions: &mut Regions, broker: &mut Broker, client: ClientId) -> (Mapping, Seat) {
        let offer = regions.offer(broker, client, RING).unwrap();
        let seat = Seat(offer.seat as u16);
        let fd = offer.fd.try_clone_to_owned().unwrap();
        (Mapping::map(fd.as_fd()).unwrap(), seat)
    }

    /// A record no correct client writes: more tokens than the pool has.
    fn write_garbage(region: &Mapping, seat: Seat) {
        let garbage = baton_core::fastpath::words::RecordWord {
            held: 7,
            ..Default::default()
        };
        region
            .ring()
            .record_word(seat)
            .store(garbage.pack(), std::sync::atomic::Ordering::SeqCst);
    }

    fn the_region(regions: &mut Regions) -> &mut Region {
        regions.by_build.values_mut().next().expect("a region")
    }

    /// What an audit concluded, as a word for a test's assertions.
    fn verdict(regions: &mut Regions, broker: &mut Broker) -> &'static str {
        match the_region(regions).audit(broker) {
            Verdict::Fine => "fine",
            Verdict::Dropped(_) => "dropped",
            Verdict::Closed => "closed",
        }
    }

    /// A balanced region passes every audit; a mismatch is confirmed only
    /// when seen twice in a row, and confirmed once.
    #[test]
    fn an_audit_confirms_a_mismatch_seen_twice_and_only_then() {
        let mut broker = Broker::new(3).unwrap();
        let mut regions = Regions::default();
        let a = client(&mut broker);
        broker.start_build(a, 1, "one build".into()).unwrap();
        let (region, seat) = seat_of(&mut regions, &mut broker, a);
        regions.round(&mut broker);
        region.ring().acquire(seat, &host(), soon()).unwrap();
        for n in 1..=3 {
            assert_eq!(
                verdict(&mut regions, &mut broker),
                "fine",
                "audit {n} of a region that matches the books"
            );
        }
        write_garbage(&region, seat);
        let audits: Vec<&str> = (0..3).map(|_| verdict(&mut regions, &mut broker)).collect();
        assert_eq!(
            audits,
            ["fine", "dropped", "fine"],
            "confirmed on the second, once"
        );
    }

    /// A confirmed mismatch in a region the broker can read drops every
    /// client of it to the socket path, each with what the region says it
    /// holds booked on its connection (the record no correct client
    /// writes last, with what the lender has left: its free tokens went
    /// back at the barrier), and its build gets no region again; nothing
    /// is lost when they leave.
    #[test]
    fn a_region_found_wrong_drops_its_clients_to_the_socket_with_their_tokens() {
        let mut broker = Broker::new(3).unwrap();
        let mut regions = Regions::default();
        let a = client(&mut broker);
        broker.start_build(a, 1, "one build".into()).unwrap();
        let (b, c) = (client(&mut broker), client(&mut broker));
        let (region, seat_b) = seat_of(&mut regions, &mut broker, b);
        let (_, seat_c) = seat_of(&mut regions, &mut broker, c);
        regions.round(&mut broker);
        region.ring().acquire(seat_c, &host(), soon()).unwrap();
        write_garbage(&region, seat_b);
        let long_ago = Instant::now() - 10 * AUDIT_EVERY;
        for _ in 0..2 {
            regions.audited = Some(long_ago);
            regions.round(&mut broker);
        }
        assert_eq!(broker.status().totals.fastpath_mismatches, 1);
        assert!(regions.is_empty(), "the region ended");
        assert_eq!(broker.pool().held_by(c), 1, "c's token, on its connection");
        assert_eq!(
            (broker.pool().held_by(b), broker.pool().free()),
            (0, 2),
            "the free ones went back at the barrier: b's 7 get nothing"
        );
        assert_eq!(
            region.ring().acquire(seat_c, &host(), soon()),
            Err(Refused::Revoked),
            "c uses the socket now"
        );
        let later = client(&mut broker);
        assert_eq!(
            regions.offer(&mut broker, later, RING).err().as_deref(),
            Some(AUDITED_OUT),
            "no region for the build again"
        );
        for id in [b, c, later, a] {
            regions.leave(&mut broker, id);
            broker.disconnect(id);
        }
        assert_eq!((broker.pool().held(), broker.pool().free()), (0, 3));
        let next = client(&mut broker);
        assert!(
            regions.offer(&mut broker, next, RING).is_ok(),
            "another build"
        );
        assert!(regions.refused.is_empty(), "the ended build forgotten");
    }

    /// A seat given up cleanly is offered again; one whose record could
    /// not be read at its client's departure never is.
    #[test]
    fn a_seat_is_reused_after_a_clean_departure_and_never_after_a_corrupt_one() {
        let mut broker = Broker::new(2).unwrap();
        let mut regions = Regions::default();
        let a = client(&mut broker);
        broker.start_build(a, 1, "one build".into()).unwrap();
        let b = client(&mut broker);
        assert_eq!(broker.pool().build_of(a), broker.pool().build_of(b));
        assert_eq!(seat_of(&mut regions, &mut broker, a).1, Seat(0));
        assert_eq!(seat_of(&mut regions, &mut broker, b).1, Seat(1));
        // (a's connection stays: it is the build's root.)
        regions.leave(&mut broker, a);
        let c = client(&mut broker);
        let (region, seat_c) = seat_of(&mut regions, &mut broker, c);
        assert_eq!(seat_c, Seat(0), "a clean seat is offered again");
        // Not even a record: its bits make no word a client writes.
        region
            .ring()
            .record_word(seat_c)
            .store(u64::MAX, std::sync::atomic::Ordering::SeqCst);
        regions.leave(&mut broker, c);
        broker.disconnect(c);
        let d = client(&mut broker);
        assert_eq!(broker.pool().build_of(d), broker.pool().build_of(a));
        assert_eq!(
            seat_of(&mut regions, &mut broker, d).1,
            Seat(2),
            "the corrupt seat is burnt"
        );
    }

    /// Two waiters behind the barrier are two requests in the pool, each
    /// granted into the region when another build gives tokens back; a
    /// waiter that gives up takes its request out of the pool; and the
    /// region reopens when it is alone again.
    #[test]
    fn requests_for_waiters_behind_the_barrier_follow_the_waiters() {
        let mut broker = Broker::new(2).unwrap();
        let mut regions = Regions::default();
        let (a, b) = (client(&mut broker), client(&mut broker));
        let (ring_a, seat_a) = seat_of(&mut regions, &mut broker, a);
        regions.round(&mut broker);
        for _ in 0..2 {
            ring_a.ring().acquire(seat_a, &host(), soon()).unwrap();
        }
        let (ring_b, seat_b) = seat_of(&mut regions, &mut broker, b);
        regions.round(&mut broker);
        let deadline = Instant::now() + Duration::from_secs(60);
        let waiters = std::thread::scope(|s| {
            let waiters: Vec<_> = (0..2)
                .map(|_| s.spawn(|| ring_b.ring().acquire(seat_b, &host(), Some(deadline))))
                .collect();
            while ring_b.ring().waiters() < 2 {
                assert!(Instant::now() < deadline, "two claims behind b's barrier");
                std::thread::yield_now();
            }
            regions.round(&mut broker);
            assert_eq!(the_requests(&regions), 2, "one request per waiter");
            for _ in 0..2 {
                assert_eq!(
                    ring_a.ring().release(seat_a, &host()),
                    Ok(baton_core::fastpath::Released::Returned)
                );
            }
            regions.round(&mut broker); // a's tokens back, granted to b's lender
            regions.round(&mut broker); // the grants into b's region
            waiters
                .into_iter()
                .map(|w| w.join().unwrap())
                .collect::<Vec<_>>()
        });
        assert_eq!(waiters, [Ok(baton_core::fastpath::Acquired::Token); 2]);
        // Now a waits twice (claims made step by step: no thread, no
        // clock): two requests. One is granted; the other wait is
        // withdrawn, and its request, not the granted one, leaves the pool.
        use baton_core::fastpath::Phase;
        let claim = || match ring_a.ring().step(seat_a, Phase::Claim, &host()) {
            Ok((Phase::Check(t), _)) => t,
            other => panic!("a claim behind the barrier: {other:?}"),
        };
        let (first, second) = (claim(), claim());
        regions.round(&mut broker);
        assert_eq!(broker.pool().waiting(), 2, "a request per wait");
        let waiters = broker.status().waiters;
        assert_eq!(
            waiters
                .iter()
                .map(|w| (w.command.as_str(), w.transport.as_str(), w.tokens))
                .collect::<Vec<_>>(),
            [("test", "fastpath", 1); 2],
            "STATUS lists the claims, not the lender's requests for them"
        );
        ring_b.ring().release(seat_b, &host()).unwrap();
        regions.round(&mut broker);
        regions.round(&mut broker);
        assert_eq!(
            ring_a.ring().time_out(seat_a, second).map(|(p, _)| p),
            Ok(Phase::Done),
            "the second wait, withdrawn"
        );
        let mut phase = ring_a.ring().time_out(seat_a, first).unwrap().0;
        assert_eq!(phase, Phase::Take(first), "the first wait got the token");
        while phase != Phase::Done {
            phase = ring_a.ring().step(seat_a, phase, &host()).unwrap().0;
        }
        regions.round(&mut broker);
        assert_eq!(
            (the_requests(&regions), broker.pool().waiting()),
            (0, 0),
            "nobody waits: no request"
        );
        // b leaves: a's region is alone, and opens again.
        regions.leave(&mut broker, b);
        broker.disconnect(b);
        regions.round(&mut broker);
        assert_eq!(ring_a.ring().try_acquire(seat_a, &host()), Ok(()));
        assert!(the_region(&mut regions).open);
    }

    fn the_requests(regions: &Regions) -> usize {
        regions.by_build.values().map(|r| r.asked.len()).sum()
    }

    /// The rounds audit at most once a second, and again whenever that
    /// second is up, however long the broker slept in between.
    #[test]
    fn a_round_audits_when_its_second_is_up_and_not_before() {
        let mut broker = Broker::new(2).unwrap();
        let mut regions = Regions::default();
        let a = client(&mut broker);
        let (region, seat) = seat_of(&mut regions, &mut broker, a);
        regions.round(&mut broker);
        write_garbage(&region, seat);
        regions.audited = Some(Instant::now());
        regions.round(&mut broker);
        assert_eq!(the_region(&mut regions).odd_audits, 0, "not yet due");
        let long_ago = Instant::now() - 10 * AUDIT_EVERY;
        for _ in 0..2 {
            regions.audited = Some(long_ago);
            regions.round(&mut broker);
        }
        assert_eq!(broker.status().totals.fastpath_mismatches, 1);
    }

    /// One build, one token, in an open region: seat A holds it, and
    /// seat B's claim waits for it. The region and A's seat, to release.
    fn a_claim_waiting_behind_a_holder() -> (Broker, Regions, Mapping, Seat) {
        let mut broker = Broker::new(1).unwrap();
        let mut regions = Regions::default();
        let a = client(&mut broker);
        broker.start_build(a, 1, "one build".into()).unwrap();
        let (region, seat_a) = seat_of(&mut regions, &mut broker, a);
        regions.round(&mut broker);
        region.ring().acquire(seat_a, &host(), soon()).unwrap();
        let b = client(&mut broker);
        let (region, seat_b) = seat_of(&mut regions, &mut broker, b);
        let step = region
            .ring()
            .step(seat_b, baton_core::fastpath::Phase::Claim, &host());
        assert!(step.is_ok(), "{step:?}");
        (broker, regions, region, seat_a)
    }

    /// A claim waiting in an open region (the broker never saw it) is in
    /// STATUS as its client's.
    #[test]
    fn status_lists_a_claim_waiting_in_an_open_region() {
        let (mut broker, mut regions, _, _) = a_claim_waiting_behind_a_holder();
        regions.round(&mut broker);
        assert!(the_region(&mut regions).open);
        let status = broker.status();
        assert_eq!(broker.pool().waiting(), 0, "the pool has nobody waiting");
        assert_eq!(status.waiters.len(), 1, "{status:#?}");
        assert_eq!(status.waiters[0].transport, "fastpath");
        assert_eq!(status.waiters[0].pid, std::process::id());
    }

    /// A waiting claim's `since` is when the broker first saw it waiting
    /// (here, by the audit clock), not the time of each STATUS; once
    /// served, it is forgotten.
    #[test]
    fn a_claim_waiting_in_a_region_keeps_the_time_it_was_first_seen() {
        let (mut broker, mut regions, region, seat_a) = a_claim_waiting_behind_a_holder();
        regions.audited = Some(Instant::now() - AUDIT_EVERY * 2);
        regions.round(&mut broker);
        // The audit noted the claim; date its sighting far back, so that a
        // STATUS that took its own time instead would show.
        let long_ago = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let first_seen = the_region(&mut regions).first_seen.clone();
        {
            let mut seen = first_seen.0.lock().unwrap();
            assert_eq!(seen.len(), 1, "the audit saw one waiting claim");
            seen.values_mut().for_each(|t| *t = long_ago);
        }
        let status = broker.status();
        assert_eq!(status.waiters.len(), 1, "{status:#?}");
        assert_eq!(status.waiters[0].since, 1000.0);
        assert_eq!(broker.status().waiters[0].since, 1000.0, "and again");
        // A serves B: the claim leaves the queue, and the clock forgets it.
        region.ring().release(seat_a, &host()).unwrap();
        assert!(broker.status().waiters.is_empty());
        assert!(first_seen.0.lock().unwrap().is_empty());
    }

    /// Each waiting claim keeps its own first sighting while the queue
    /// moves under it: the clock is keyed by a claim's ticket, not by its
    /// place in line, which changes each time the claim ahead is served.
    #[test]
    fn a_claim_keeps_its_own_first_sighting_when_the_one_ahead_is_served() {
        let (mut broker, mut regions, region, seat_a) = a_claim_waiting_behind_a_holder();
        let c = client(&mut broker);
        let (_, seat_c) = seat_of(&mut regions, &mut broker, c);
        let step = region
            .ring()
            .step(seat_c, baton_core::fastpath::Phase::Claim, &host());
        assert!(step.is_ok(), "{step:?}");
        regions.round(&mut broker);
        assert_eq!(broker.status().waiters.len(), 2, "B and C wait");
        // Date B's sighting at 1000 s and C's at 2000 s (tickets in order).
        let first_seen = the_region(&mut regions).first_seen.clone();
        {
            let mut seen = first_seen.0.lock().unwrap();
            assert_eq!(seen.len(), 2, "a sighting per claim: {seen:?}");
            for (t, secs) in seen.values_mut().zip([1000, 2000]) {
                *t = SystemTime::UNIX_EPOCH + Duration::from_secs(secs);
            }
        }
        // A serves B; C is now first in line, and still first seen at 2000.
        region.ring().release(seat_a, &host()).unwrap();
        let status = broker.status();
        assert_eq!(status.waiters.len(), 1, "{status:#?}");
        assert_eq!(status.waiters[0].since, 2000.0, "C's own sighting");
    }

    #[test]
    fn first_seen_keeps_each_tickets_first_sighting_and_forgets_the_served() {
        let at = |s: u64| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
        let seen = FirstSeen::default();
        assert_eq!(seen.note(&[5], at(10)), [at(10)]);
        assert_eq!(seen.note(&[5, 6], at(20)), [at(10), at(20)]);
        assert_eq!(seen.note(&[6], at(30)), [at(20)], "5 was served");
        assert_eq!(seen.note(&[5, 6], at(40)), [at(40), at(20)], "5 anew");
        assert_eq!(seen.note(&[], at(50)), []);
        assert!(seen.0.lock().unwrap().is_empty());
    }

    /// A slot word no correct party writes makes the queue unreadable:
    /// that too is a mismatch, confirmed on the second audit, and the
    /// region closes for good (its tokens cannot be counted in it).
    #[test]
    fn a_corrupt_slot_closes_the_region_for_good() {
        let mut broker = Broker::new(2).unwrap();
        let mut regions = Regions::default();
        let a = client(&mut broker);
        let (region, _) = seat_of(&mut regions, &mut broker, a);
        regions.round(&mut broker);
        region
            .ring()
            .slot_word(0)
            .store(u64::MAX, std::sync::atomic::Ordering::SeqCst);
        let audits: Vec<&str> = (0..3).map(|_| verdict(&mut regions, &mut broker)).collect();
        assert_eq!(audits, ["fine", "closed", "fine"]);
        assert!(the_region(&mut regions).tainted);
        // Its last client leaves: every token is back in the pool.
        regions.leave(&mut broker, a);
        broker.disconnect(a);
        assert_eq!((broker.pool().held(), broker.pool().free()), (0, 2));
    }
}
