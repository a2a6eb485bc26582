//! The token pool: limit, free count, holders and the wait queue.
//!
//! Every transport (socket, jobserver bridge, FUSE file) turns its events into
//! calls on [`Pool`] and delivers the [`Grant`]s it gets back. The pool does
//! no I/O and reads no clock, so its invariants can be checked after every
//! step of any sequence of calls (see the property tests at the bottom).
//!
//! The rules:
//! - Nothing creates a token except the limit. `free + held == limit`, except
//!   while a lowered limit drains: then `free == 0` and `held > limit`, and
//!   tokens given back are retired until the books balance again.
//! - Every client belongs to a build (see [`crate::share`]). A freed token
//!   goes to exactly one waiter: the oldest request of the waiting build
//!   that has used the least token-time for its weight. Within a build,
//!   and between builds that have used the same, first come, first served.
//! - Requests are all-or-nothing and the one chosen next is never
//!   overtaken, so a request for several tokens is never starved by
//!   smaller ones, and no client ever holds part of a request while waiting
//!   for the rest (which could deadlock two such clients).
//! - No waiter waits while the request chosen next could be served: every
//!   call that frees tokens serves the queue before returning.

use crate::share::{BuildId, Shares, MAX_WEIGHT};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};

/// Identifies one client of the pool: a socket connection, a build, or a
/// process using the FUSE token file. Chosen by the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ClientId(pub u64);

/// Identifies one pending request of a client. A socket client has at most
/// one at a time; a process reading the FUSE file from several threads may
/// have several. Chosen by the transport.
pub type Tag = u64;

/// Tokens handed to a waiter as the result of some other call. The transport
/// that owns `client` must tell it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    /// Who gets the tokens.
    pub client: ClientId,
    /// Which of its pending requests they answer.
    pub tag: Tag,
    /// How many: always the whole request.
    pub tokens: u32,
}

/// What happened to an [`Pool::acquire`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquired {
    /// The tokens are the client's now.
    Granted,
    /// The request is queued; a [`Grant`] with its tag will come later.
    Queued,
}

/// A request the pool refuses. The pool is unchanged by a refused call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// A pool needs at least one token.
    #[error("the limit must be at least 1")]
    ZeroLimit,
    #[error("limit {0} is above the maximum of {max}", max = MAX_LIMIT)]
    /// Above [`MAX_LIMIT`].
    LimitTooLarge(u32),
    #[error("unknown client {0:?}")]
    /// The client is not connected.
    UnknownClient(ClientId),
    /// Requests and releases are for at least one token.
    #[error("a request must be for at least one token")]
    ZeroTokens,
    /// A client may hold and wait for at most `limit` tokens in all.
    #[error("a client may hold and wait for at most {limit} tokens (the limit); this request would make {asked}")]
    MoreThanLimit {
        /// What the client would hold and wait for with this request.
        asked: u32,
        /// The pool's limit.
        limit: u32,
    },
    #[error("a request with tag {0} is already waiting")]
    /// The client already has a pending request with this tag.
    DuplicateTag(Tag),
    /// A build's weight is from 1 to [`MAX_WEIGHT`].
    #[error("a weight must be from 1 to {max}, not {0}", max = MAX_WEIGHT)]
    BadWeight(u32),
    #[error("cannot give back {asked} tokens: only {held} held")]
    /// A client gave back more than it holds; the pool never grows.
    OverRelease {
        /// Tokens it tried to give back.
        asked: u32,
        /// Tokens it holds.
        held: u32,
    },
}

/// The largest limit a pool accepts. Far above any real machine's job
/// count; it keeps every sum of tokens well inside `u32`.
pub const MAX_LIMIT: u32 = 1 << 20;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Client<M> {
    held: u32,
    build: BuildId,
    meta: M,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Waiter {
    client: ClientId,
    build: BuildId,
    tag: Tag,
    tokens: u32,
    /// Order of arrival: the queue is sorted by it.
    seq: u64,
}

/// Running totals, for `baton status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolTotals {
    /// Tokens handed out, immediately or after a wait.
    pub granted: u64,
    /// Tokens given back by their holder.
    pub released: u64,
    /// Tokens taken back from clients that went away holding them.
    pub reclaimed: u64,
    /// Requests that had to wait.
    pub waits: u64,
    /// Tokens counted again for clients that held them from a broker that
    /// went away ([`Pool::hold`]); among `granted` too.
    #[serde(default)]
    pub held_again: u64,
}

/// One client's view, for status reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientView<'a, M> {
    /// The client.
    pub id: ClientId,
    /// The build it belongs to.
    pub build: BuildId,
    /// Tokens it holds.
    pub held: u32,
    /// Tokens this client is waiting for, over all its pending requests.
    pub waiting: u32,
    /// What the transport remembers about it.
    pub meta: &'a M,
}

/// One build's view, for status reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuildView {
    /// The build.
    pub id: BuildId,
    /// Its share of the pool is in proportion to this.
    pub weight: u32,
    /// Tokens its clients hold.
    pub held: u32,
    /// Tokens its clients wait for.
    pub waiting: u32,
    /// Tokens granted to it so far.
    pub granted: u64,
    /// Tokens held × time, in the unit of [`Pool::advance`].
    pub token_time: u128,
}

/// A pool of `limit` interchangeable tokens. `M` is whatever the transport
/// wants to remember about each client (pid, command line, start time).
///
/// It serializes whole, so that a broker can hand it to its successor
/// (`baton serve --replace`); [`Pool::restore`] checks what it is given.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pool<M> {
    limit: u32,
    free: u32,
    /// Tokens held over all clients, kept in step so that reading it costs
    /// nothing (the broker reads it at every change).
    held: u32,
    clients: BTreeMap<ClientId, Client<M>>,
    queue: VecDeque<Waiter>,
    next_id: u64,
    totals: PoolTotals,
    /// At most this many tokens held in all while set (the gates' word on
    /// what the machine can take now); never below what is already held.
    cap: Option<u32>,
    shares: Shares,
    next_seq: u64,
}

impl<M> Pool<M> {
    /// A pool of `limit` free tokens.
    pub fn new(limit: u32) -> Result<Self, PoolError> {
        check_limit(limit)?;
        Ok(Pool {
            limit,
            free: limit,
            held: 0,
            clients: BTreeMap::new(),
            queue: VecDeque::new(),
            next_id: 1,
            totals: PoolTotals::default(),
            cap: None,
            shares: Shares::default(),
            next_seq: 0,
        })
    }

    /// How many tokens exist.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Tokens nobody holds.
    pub fn free(&self) -> u32 {
        self.free
    }

    /// Tokens held by all clients together.
    pub fn held(&self) -> u32 {
        self.held
    }

    /// Running totals since the pool was made.
    pub fn totals(&self) -> PoolTotals {
        self.totals
    }

    /// Tokens held by one client (0 for an unknown one).
    pub fn held_by(&self, id: ClientId) -> u32 {
        self.clients.get(&id).map_or(0, |c| c.held)
    }

    /// What the transport remembers about a client.
    pub fn meta(&self, id: ClientId) -> Option<&M> {
        self.clients.get(&id).map(|c| &c.meta)
    }

    /// The same, to change.
    pub fn meta_mut(&mut self, id: ClientId) -> Option<&mut M> {
        self.clients.get_mut(&id).map(|c| &mut c.meta)
    }

    /// Number of pending requests, over all clients.
    pub fn waiting(&self) -> usize {
        self.queue.len()
    }

    /// Registers a new client holding nothing, a build of its own.
    pub fn connect(&mut self, meta: M) -> ClientId {
        let build = self.shares.create();
        self.join(build, meta)
    }

    /// Registers a new client holding nothing, in the build of `peer`
    /// (in a build of its own if `peer` is gone).
    pub fn connect_beside(&mut self, peer: ClientId, meta: M) -> ClientId {
        match self.build_of(peer) {
            Some(build) => self.join(build, meta),
            None => self.connect(meta),
        }
    }

    fn join(&mut self, build: BuildId, meta: M) -> ClientId {
        let id = ClientId(self.next_id);
        self.next_id += 1;
        self.shares.get_mut(build).members += 1;
        self.clients.insert(
            id,
            Client {
                held: 0,
                build,
                meta,
            },
        );
        id
    }

    /// The build a client belongs to.
    pub fn build_of(&self, id: ClientId) -> Option<BuildId> {
        self.clients.get(&id).map(|c| c.build)
    }

    /// Sets the weight of a client's build: its share of a saturated pool
    /// is in proportion to it.
    pub fn set_weight(&mut self, id: ClientId, weight: u32) -> Result<(), PoolError> {
        let build = self.build_of(id).ok_or(PoolError::UnknownClient(id))?;
        if !(1..=MAX_WEIGHT).contains(&weight) {
            return Err(PoolError::BadWeight(weight));
        }
        self.shares.get_mut(build).weight = weight;
        Ok(())
    }

    /// Brings the clock to `now` (any unit, never going back; the broker
    /// uses nanoseconds): every build is charged for the tokens it held
    /// meanwhile. Call it before every other call for fair shares; without
    /// it, requests are served first come, first served.
    ///
    /// Returns the grants that follow: as builds use tokens, which one
    /// is served next changes, and it may be one whose request fits.
    pub fn advance(&mut self, now: u64) -> Vec<Grant> {
        self.shares.advance(now);
        self.serve_queue()
    }

    /// Every build, in the order they began.
    pub fn builds(&self) -> impl Iterator<Item = BuildView> + '_ {
        self.shares.builds.iter().map(|(&id, b)| BuildView {
            id,
            weight: b.weight,
            held: b.held,
            waiting: b.waiting,
            granted: b.granted,
            token_time: b.token_time,
        })
    }

    /// Tokens that requests of other builds wait for, of the builds the
    /// share policy would serve before this client's (those that used no
    /// more token-time for their weight): what a build that sits on unused
    /// tokens should give back. A build that is behind its share keeps
    /// them: they would come back to it first anyway.
    pub fn waiting_ahead(&self, id: ClientId) -> u32 {
        let Some(build) = self.build_of(id) else {
            return 0;
        };
        let mine = self.shares.get(build).vtime;
        let ahead = |w: &&Waiter| w.build != build && self.shares.get(w.build).vtime <= mine;
        self.queue.iter().filter(ahead).map(|w| w.tokens).sum()
    }

    /// Asks for `tokens` tokens. Granted at once only if they are free and
    /// nobody is queued ahead; otherwise queued under `tag`.
    pub fn acquire(&mut self, id: ClientId, tag: Tag, tokens: u32) -> Result<Acquired, PoolError> {
        self.check_request(id, tokens)?;
        if self.queue.iter().any(|w| w.client == id && w.tag == tag) {
            return Err(PoolError::DuplicateTag(tag));
        }
        let build = self.clients[&id].build;
        self.shares.wake(build);
        if self.queue.is_empty() && self.fits(tokens) {
            self.hand_out(id, tokens);
            return Ok(Acquired::Granted);
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.queue.push_back(Waiter {
            client: id,
            build,
            tag,
            tokens,
            seq,
        });
        self.shares.update(build, |b| b.waiting += tokens);
        if self.shares.oldest(build).is_none() {
            self.shares.set_oldest(build, Some(seq));
        }
        // Its build may have used less for its weight than those waiting:
        // then it goes first, and if its tokens are free, it waits for nothing.
        let last = self.queue.len() - 1;
        if self.next_waiter() == Some(last) && self.fits(tokens) {
            self.remove_waiter(last);
            self.hand_out(id, tokens);
            return Ok(Acquired::Granted);
        }
        self.totals.waits += 1;
        Ok(Acquired::Queued)
    }

    /// Takes `tokens` tokens if that can be done without waiting or jumping
    /// the queue; never queues.
    ///
    /// A TRY past the limit (with what the client holds) is "not now", not
    /// an error: it never waits, so it cannot wait forever, and the bridge
    /// tops up with TRY as far as the limit it started under; a lowered
    /// limit must not look like a broken broker to it (issue #32).
    pub fn try_acquire(&mut self, id: ClientId, tokens: u32) -> Result<bool, PoolError> {
        match self.check_request(id, tokens) {
            Err(PoolError::MoreThanLimit { .. }) => return Ok(false),
            checked => checked?,
        }
        if self.queue.is_empty() && self.fits(tokens) {
            self.shares.wake(self.clients[&id].build);
            self.hand_out(id, tokens);
            return Ok(true);
        }
        Ok(false)
    }

    /// Gives back `tokens` of the client's tokens; they go to waiters first.
    pub fn release(&mut self, id: ClientId, tokens: u32) -> Result<Vec<Grant>, PoolError> {
        let client = self
            .clients
            .get_mut(&id)
            .ok_or(PoolError::UnknownClient(id))?;
        if tokens == 0 {
            return Err(PoolError::ZeroTokens);
        }
        if tokens > client.held {
            return Err(PoolError::OverRelease {
                asked: tokens,
                held: client.held,
            });
        }
        client.held -= tokens;
        self.held -= tokens;
        self.shares.update(client.build, |b| b.held -= tokens);
        self.totals.released += u64::from(tokens);
        self.put_back(tokens);
        Ok(self.serve_queue())
    }

    /// Counts `tokens` that the client already holds, granted by a broker
    /// that went away, as its own (a build re-attaching after a crash).
    /// They come out of the free tokens; any beyond those leave the pool
    /// draining as a lowered limit does (held > limit, nothing free), so
    /// that the limit holds again once they come back. Nothing is created:
    /// the tokens were in use already, and the pool only learns of them.
    ///
    /// Held tokens are facts, not requests: a build that re-attaches to a
    /// broker started with a lower limit than the one that granted them
    /// still runs jobs on them, so they are counted even past the limit
    /// (the pool drains until they come back). Refusing them would leave
    /// the build running uncounted, and it would ask again and again.
    /// Only the pool's bound on all tokens ([`MAX_LIMIT`]) is refused.
    pub fn hold(&mut self, id: ClientId, tokens: u32) -> Result<(), PoolError> {
        if !self.clients.contains_key(&id) {
            return Err(PoolError::UnknownClient(id));
        }
        if tokens == 0 {
            return Err(PoolError::ZeroTokens);
        }
        let total = self.held.saturating_add(tokens);
        if total > MAX_LIMIT {
            return Err(PoolError::MoreThanLimit {
                asked: total,
                limit: MAX_LIMIT,
            });
        }
        self.free -= tokens.min(self.free);
        self.count_held(id, tokens);
        self.totals.held_again += u64::from(tokens);
        Ok(())
    }

    /// Withdraws a pending request. Returns the tokens it was waiting for (0
    /// if it was not waiting, e.g. because the grant already happened), and
    /// any grants its departure unblocked for the requests behind it.
    pub fn cancel(&mut self, id: ClientId, tag: Tag) -> (u32, Vec<Grant>) {
        let Some(pos) = self
            .queue
            .iter()
            .position(|w| w.client == id && w.tag == tag)
        else {
            return (0, Vec::new());
        };
        let waiter = self.remove_waiter(pos);
        (waiter.tokens, self.serve_queue())
    }

    /// Forgets a client: its pending requests are dropped and every token it
    /// held comes back. Returns how many it held and the grants that follow.
    pub fn disconnect(&mut self, id: ClientId) -> (u32, Vec<Grant>) {
        let Some(client) = self.clients.remove(&id) else {
            return (0, Vec::new());
        };
        while let Some(pos) = self.queue.iter().position(|w| w.client == id) {
            self.remove_waiter(pos);
        }
        let held = client.held;
        self.shares.update(client.build, |b| b.held -= held);
        self.held -= client.held;
        self.shares.leave(client.build);
        self.totals.reclaimed += u64::from(client.held);
        self.put_back(client.held);
        (client.held, self.serve_queue())
    }

    /// Changes the limit of a running pool. Raising it by K serves the queue
    /// with exactly the K new tokens; lowering it takes free tokens away
    /// first and retires the rest as holders give them back.
    pub fn set_limit(&mut self, limit: u32) -> Result<Vec<Grant>, PoolError> {
        check_limit(limit)?;
        if let Some(w) = self.queue.iter().find(|w| w.tokens > limit) {
            return Err(PoolError::MoreThanLimit {
                asked: w.tokens,
                limit,
            });
        }
        let held = self.held();
        self.limit = limit;
        self.free = limit.saturating_sub(held);
        Ok(self.serve_queue())
    }

    /// Caps how many tokens may be held in all, without touching the limit:
    /// a closed gate (memory, load) holds free tokens back this way. Tokens
    /// already held are never taken back; a cap above what is held lets
    /// the queue be served up to it. None lifts the cap.
    pub fn set_admission_cap(&mut self, cap: Option<u32>) -> Vec<Grant> {
        self.cap = cap;
        self.serve_queue()
    }

    /// The gates' cap on tokens held in all, if one is set.
    pub fn admission_cap(&self) -> Option<u32> {
        self.cap
    }

    /// Moves `tokens` that `from` holds to `to`, as one step: nobody else
    /// can be granted them in between, and nothing is freed or created.
    /// The fast path books on a client's connection what it held through
    /// its build's shared region when the broker drops it from there.
    pub fn transfer(&mut self, from: ClientId, to: ClientId, tokens: u32) -> Result<(), PoolError> {
        let held = self.held_by(from);
        if !self.clients.contains_key(&to) {
            return Err(PoolError::UnknownClient(to));
        }
        if !self.clients.contains_key(&from) {
            return Err(PoolError::UnknownClient(from));
        }
        if tokens > held {
            return Err(PoolError::OverRelease {
                asked: tokens,
                held,
            });
        }
        let giver = self.clients.get_mut(&from).expect("checked above");
        giver.held -= tokens;
        let build = giver.build;
        self.shares.update(build, |b| b.held -= tokens);
        let taker = self.clients.get_mut(&to).expect("checked above");
        taker.held += tokens;
        let build = taker.build;
        // Not a grant: they were counted as granted when `from` got them.
        self.shares.update(build, |b| b.held += tokens);
        Ok(())
    }

    /// How many tokens the request served next asks for, if any waits.
    pub fn next_request(&self) -> Option<u32> {
        self.next_waiter().map(|pos| self.queue[pos].tokens)
    }

    /// Every client with what it holds and waits for, in connection order.
    pub fn clients(&self) -> impl Iterator<Item = ClientView<'_, M>> {
        // One pass over the queue, not one per client: ten thousand
        // clients waiting made every status a hundred million steps.
        let mut waiting: BTreeMap<ClientId, u32> = BTreeMap::new();
        for w in &self.queue {
            *waiting.entry(w.client).or_default() += w.tokens;
        }
        self.clients.iter().map(move |(&id, c)| ClientView {
            id,
            build: c.build,
            held: c.held,
            waiting: waiting.get(&id).copied().unwrap_or(0),
            meta: &c.meta,
        })
    }

    /// Pending requests, oldest first: (client, tag, tokens).
    pub fn queue(&self) -> impl Iterator<Item = (ClientId, Tag, u32)> + '_ {
        self.queue.iter().map(|w| (w.client, w.tag, w.tokens))
    }

    /// Checks the pool's invariants; panics with a description if broken.
    /// Cheap enough for tests after every step, not meant for production.
    pub fn assert_invariants(&self) {
        if let Err(broken) = self.check() {
            panic!("{broken}");
        }
        if let Some(next) = self.next_waiter() {
            assert!(!self.fits(self.queue[next].tokens), "the request chosen next waits although its tokens are free and the cap allows them");
        }
    }

    /// A pool that came from elsewhere (a predecessor's snapshot), taken
    /// only if its books balance. (A request that [`Pool::advance`] made
    /// the next to serve may fit and wait until the next call serves the
    /// queue, in a live pool too: that is not refused.)
    ///
    /// # Errors
    /// The invariant it breaks, in words.
    pub fn restore(mut self) -> Result<Self, RestoreError> {
        // The snapshot carries the books, not the indexes made of them.
        self.shares.reindex();
        self.check().map_err(RestoreError)?;
        Ok(self)
    }

    fn check(&self) -> Result<(), &'static str> {
        let held = self.held();
        ensure(
            held == self.clients.values().map(|c| c.held).sum::<u32>(),
            "the pool holds what its clients hold",
        )?;
        let balanced = if held <= self.limit {
            self.free + held == self.limit
        } else {
            self.free == 0
        };
        ensure(
            balanced,
            "free + held must equal the limit (a draining pool has no free tokens)",
        )?;
        ensure(check_limit(self.limit).is_ok(), "the limit is out of range")?;
        ensure(
            self.queue.iter().all(|w| {
                self.clients
                    .get(&w.client)
                    .is_some_and(|c| c.build == w.build)
            }),
            "a waiter belongs to no client, or to another build",
        )?;
        ensure(
            self.queue
                .iter()
                .all(|w| w.tokens > 0 && w.seq < self.next_seq),
            "a waiter asks for nothing, or came after the last arrival",
        )?;
        ensure(
            self.queue
                .iter()
                .zip(self.queue.iter().skip(1))
                .all(|(a, b)| a.seq < b.seq),
            "the queue is in order of arrival",
        )?;
        ensure(
            self.clients.keys().all(|id| id.0 < self.next_id),
            "a client id is not below the next one",
        )?;
        ensure(
            self.clients
                .values()
                .all(|c| self.shares.builds.contains_key(&c.build)),
            "a client belongs to no build",
        )?;
        // Each build's books, summed from its clients and requests in one
        // pass (a fuzz input connects hundreds of clients: a scan per build
        // made this check the fuzzer's whole cost).
        let mut sums: BTreeMap<BuildId, BuildSums> = BTreeMap::new();
        for c in self.clients.values() {
            let s = sums.entry(c.build).or_default();
            s.held += c.held;
            s.members += 1;
        }
        for w in &self.queue {
            let s = sums.entry(w.build).or_default();
            s.waiting += w.tokens;
            s.oldest.get_or_insert(w.seq);
        }
        for b in self.builds() {
            let s = sums.remove(&b.id).unwrap_or_default();
            ensure(
                self.shares.oldest(b.id) == s.oldest,
                "the share policy knows each build's oldest request",
            )?;
            ensure(b.held == s.held, "a build holds what its clients hold")?;
            ensure(
                b.waiting == s.waiting,
                "a build waits for what its clients wait for",
            )?;
            ensure(
                s.members == self.shares.get(b.id).members,
                "a build counts its members",
            )?;
        }
        self.shares.check()
    }

    /// A client may hold and wait for at most `limit` tokens in all: more
    /// could never be granted, so the request would wait forever.
    fn check_request(&self, id: ClientId, tokens: u32) -> Result<(), PoolError> {
        let client = self.clients.get(&id).ok_or(PoolError::UnknownClient(id))?;
        if tokens == 0 {
            return Err(PoolError::ZeroTokens);
        }
        let waiting: u32 = self
            .queue
            .iter()
            .filter(|w| w.client == id)
            .map(|w| w.tokens)
            .sum();
        let total = client.held.saturating_add(waiting).saturating_add(tokens);
        if total > self.limit {
            return Err(PoolError::MoreThanLimit {
                asked: total,
                limit: self.limit,
            });
        }
        Ok(())
    }

    /// Whether `tokens` more can be handed out now: they are free and the
    /// admission cap, if any, allows them.
    fn fits(&self, tokens: u32) -> bool {
        tokens <= self.free
            && self
                .cap
                .is_none_or(|cap| self.held().saturating_add(tokens) <= cap)
    }

    fn hand_out(&mut self, id: ClientId, tokens: u32) {
        self.free -= tokens;
        self.count_held(id, tokens);
    }

    /// Books `tokens` as held by the client, its build and the pool.
    fn count_held(&mut self, id: ClientId, tokens: u32) {
        let client = self
            .clients
            .get_mut(&id)
            .expect("caller checked the client");
        client.held += tokens;
        self.held += tokens;
        self.shares.update(client.build, |b| {
            b.held += tokens;
            b.granted += u64::from(tokens);
        });
        self.totals.granted += u64::from(tokens);
    }

    /// Returns tokens to the free count, retiring any that a lowered limit
    /// no longer has room for.
    fn put_back(&mut self, tokens: u32) {
        let held = self.held();
        self.free = (self.free + tokens).min(self.limit.saturating_sub(held));
    }

    /// Where in the queue the request served next is: the oldest of the
    /// build the share policy picks.
    fn next_waiter(&self) -> Option<usize> {
        let (_, seq) = self.shares.pick()?;
        Some(
            self.queue
                .binary_search_by_key(&seq, |w| w.seq)
                .expect("the policy's requests are queued"),
        )
    }

    /// Takes a request out of the queue, keeping its build's books.
    fn remove_waiter(&mut self, pos: usize) -> Waiter {
        let w = self.queue.remove(pos).expect("position is in range");
        self.shares.update(w.build, |b| b.waiting -= w.tokens);
        if self.shares.oldest(w.build) == Some(w.seq) {
            let next = match self.shares.get(w.build).waiting {
                0 => None,
                _ => self
                    .queue
                    .iter()
                    .skip(pos)
                    .find(|o| o.build == w.build)
                    .map(|o| o.seq),
            };
            self.shares.set_oldest(w.build, next);
        }
        w
    }

    fn serve_queue(&mut self) -> Vec<Grant> {
        let mut grants = Vec::new();
        while let Some(next) = self.next_waiter() {
            let w = self.queue[next];
            if !self.fits(w.tokens) {
                break;
            }
            self.remove_waiter(next);
            self.hand_out(w.client, w.tokens);
            grants.push(Grant {
                client: w.client,
                tag: w.tag,
                tokens: w.tokens,
            });
        }
        grants
    }
}

/// A snapshot [`Pool::restore`] refused, and the invariant it breaks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the pool's snapshot is inconsistent: {0}")]
pub struct RestoreError(pub &'static str);

fn ensure(holds: bool, invariant: &'static str) -> Result<(), &'static str> {
    if holds {
        Ok(())
    } else {
        Err(invariant)
    }
}

/// What [`Pool::check`] adds up for one build from its clients and requests.
#[derive(Default)]
struct BuildSums {
    held: u32,
    waiting: u32,
    members: u32,
    /// The sequence number of its first request in the queue.
    oldest: Option<u64>,
}

fn check_limit(limit: u32) -> Result<(), PoolError> {
    match limit {
        0 => Err(PoolError::ZeroLimit),
        l if l > MAX_LIMIT => Err(PoolError::LimitTooLarge(l)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(limit: u32) -> Pool<()> {
        Pool::new(limit).unwrap()
    }

    #[test]
    fn grants_at_once_while_tokens_are_free() {
        let mut p = pool(2);
        let a = p.connect(());
        assert_eq!(p.acquire(a, 0, 2), Ok(Acquired::Granted));
        assert_eq!((p.free(), p.held_by(a)), (0, 2));
        p.assert_invariants();
    }

    #[test]
    fn a_transfer_moves_held_tokens_and_frees_or_grants_none() {
        let mut p = pool(3);
        let lender = p.connect(());
        let member = p.connect_beside(lender, ());
        let other = p.connect(());
        p.acquire(lender, 0, 3).unwrap();
        p.acquire(other, 0, 1).unwrap();
        let granted = p.totals().granted;
        assert_eq!(p.transfer(lender, member, 2), Ok(()));
        assert_eq!((p.held_by(lender), p.held_by(member), p.free()), (1, 2, 0));
        assert_eq!(p.totals().granted, granted, "not a grant");
        let build: Vec<_> = p.builds().map(|b| (b.held, b.granted)).collect();
        assert!(
            build.contains(&(3, 3)),
            "the build holds what it held: {build:?}"
        );
        assert_eq!(p.waiting(), 1, "the waiter still waits");
        assert_eq!(
            p.transfer(lender, member, 2),
            Err(PoolError::OverRelease { asked: 2, held: 1 })
        );
        assert_eq!(
            p.transfer(lender, ClientId(99), 1),
            Err(PoolError::UnknownClient(ClientId(99)))
        );
        assert_eq!(
            p.transfer(ClientId(98), member, 0),
            Err(PoolError::UnknownClient(ClientId(98)))
        );
        p.release(member, 2).unwrap();
        assert_eq!(p.held_by(other), 1, "the waiter got a token back");
        p.assert_invariants();
    }

    /// Counts that a division would also give are no proof: here each
    /// transfer's amount differs from what the giver holds, and the last
    /// one moves everything it holds, to another build.
    #[test]
    fn a_transfer_moves_exactly_its_tokens_between_clients_and_builds() {
        let mut p = pool(3);
        let lender = p.connect(());
        let member = p.connect_beside(lender, ());
        let other = p.connect(());
        p.acquire(lender, 0, 3).unwrap();
        p.transfer(lender, member, 1).unwrap();
        assert_eq!((p.held_by(lender), p.held_by(member)), (2, 1));
        p.transfer(lender, other, 2).unwrap();
        assert_eq!((p.held_by(lender), p.held_by(other)), (0, 2), "all it held");
        let mut builds: Vec<u32> = p.builds().map(|b| b.held).collect();
        builds.sort();
        assert_eq!(builds, [1, 2], "each build holds what its clients hold");
        p.assert_invariants();
    }

    #[test]
    fn the_admission_cap_reads_back() {
        let mut p = pool(3);
        assert_eq!(p.admission_cap(), None);
        p.set_admission_cap(Some(2));
        assert_eq!(p.admission_cap(), Some(2));
    }

    #[test]
    fn every_request_that_waits_is_counted_once() {
        let mut p = pool(1);
        let [a, b, c] = [p.connect(()), p.connect(()), p.connect(())];
        p.acquire(a, 0, 1).unwrap();
        assert_eq!(p.totals().waits, 0, "granted at once");
        p.acquire(b, 0, 1).unwrap();
        p.acquire(c, 0, 1).unwrap();
        assert_eq!(p.totals().waits, 2);
    }

    #[test]
    fn held_tokens_are_counted_up_to_the_pool_s_bound_and_no_further() {
        let mut p = pool(2);
        let a = p.connect(());
        assert_eq!(p.hold(a, MAX_LIMIT - 1), Ok(()), "past the limit: a fact");
        assert_eq!(
            p.hold(a, 2),
            Err(PoolError::MoreThanLimit {
                asked: MAX_LIMIT + 1,
                limit: MAX_LIMIT
            })
        );
        assert_eq!(p.hold(a, 1), Ok(()), "exactly the bound");
        assert_eq!(p.held_by(a), MAX_LIMIT);
        assert_eq!(p.totals().held_again, u64::from(MAX_LIMIT));
    }

    #[test]
    fn what_a_transport_keeps_of_a_client_is_found_and_changed_by_its_id() {
        let mut p = Pool::<u32>::new(1).unwrap();
        let a = p.connect(7);
        assert_eq!(p.meta(a), Some(&7));
        *p.meta_mut(a).unwrap() = 8;
        assert_eq!(p.meta(a), Some(&8));
        p.disconnect(a);
        assert_eq!(p.meta(a), None);
    }

    #[test]
    fn the_limit_may_be_the_maximum_and_no_more() {
        assert!(Pool::<()>::new(MAX_LIMIT).is_ok());
        assert_eq!(
            Pool::<()>::new(MAX_LIMIT + 1).err(),
            Some(PoolError::LimitTooLarge(MAX_LIMIT + 1))
        );
    }

    #[test]
    fn views_show_what_each_client_and_build_waits_for_and_was_granted() {
        let mut p = pool(3);
        let [a, b] = [p.connect(()), p.connect(())];
        p.acquire(a, 0, 3).unwrap();
        assert_eq!(p.next_request(), None, "nothing waits");
        p.acquire(b, 1, 2).unwrap();
        p.acquire(b, 2, 1).unwrap();
        assert_eq!(p.next_request(), Some(2));
        let waiting: Vec<_> = p.clients().map(|c| (c.id, c.held, c.waiting)).collect();
        assert_eq!(waiting, [(a, 3, 0), (b, 0, 3)]);
        let granted: Vec<_> = p.builds().map(|b| (b.held, b.granted)).collect();
        assert_eq!(granted, [(3, 3), (0, 0)]);
        p.release(a, 3).unwrap();
        let granted: Vec<_> = p.builds().map(|b| b.granted).collect();
        assert_eq!(granted, [3, 3]);
    }

    /// A pool whose books `corrupt` spoils: [`Pool::restore`] must refuse
    /// it, and [`Pool::assert_invariants`] must panic.
    fn refused(corrupt: impl FnOnce(&mut Pool<()>)) -> &'static str {
        let mut p = pool(1);
        let [a, b, c] = [p.connect(()), p.connect(()), p.connect(())];
        p.acquire(a, 0, 1).unwrap();
        p.acquire(b, 0, 1).unwrap();
        p.acquire(c, 0, 1).unwrap();
        p.assert_invariants();
        corrupt(&mut p);
        let checked =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| p.assert_invariants()));
        assert!(checked.is_err(), "assert_invariants passed a broken pool");
        p.restore().expect_err("a broken pool was restored").0
    }

    #[test]
    fn a_pool_with_broken_books_is_refused() {
        let said = refused(|p| p.queue[0].tokens = 0);
        assert!(said.contains("asks for nothing"), "{said}");
        let said = refused(|p| p.queue[1].seq = p.next_seq);
        assert!(said.contains("after the last arrival"), "{said}");
        let said = refused(|p| p.queue[1].seq = p.queue[0].seq);
        assert!(said.contains("order of arrival"), "{said}");
        let said = refused(|p| p.next_id -= 1);
        assert!(said.contains("client id"), "{said}");
        let said = refused(|p| p.free += 1);
        assert!(said.contains("free + held"), "{said}");
    }

    #[test]
    fn a_release_wakes_exactly_the_oldest_waiter() {
        let mut p = pool(1);
        let [a, b, c] = [p.connect(()), p.connect(()), p.connect(())];
        p.acquire(a, 0, 1).unwrap();
        assert_eq!(p.acquire(b, 7, 1), Ok(Acquired::Queued));
        assert_eq!(p.acquire(c, 9, 1), Ok(Acquired::Queued));
        let grants = p.release(a, 1).unwrap();
        assert_eq!(
            grants,
            vec![Grant {
                client: b,
                tag: 7,
                tokens: 1
            }]
        );
        assert_eq!(p.free(), 0);
        p.assert_invariants();
    }

    #[test]
    fn a_large_request_is_not_overtaken() {
        let mut p = pool(3);
        let [a, big, small] = [p.connect(()), p.connect(()), p.connect(())];
        p.acquire(a, 0, 2).unwrap();
        assert_eq!(p.acquire(big, 0, 3), Ok(Acquired::Queued));
        assert_eq!(
            p.acquire(small, 0, 1),
            Ok(Acquired::Queued),
            "one token is free but big is first"
        );
        assert_eq!(p.try_acquire(small, 1), Ok(false));
        let grants = p.release(a, 2).unwrap();
        assert_eq!(
            grants,
            vec![Grant {
                client: big,
                tag: 0,
                tokens: 3
            }]
        );
    }

    #[test]
    fn over_release_is_refused_and_changes_nothing() {
        let mut p = pool(4);
        let a = p.connect(());
        p.acquire(a, 0, 1).unwrap();
        assert_eq!(
            p.release(a, 2),
            Err(PoolError::OverRelease { asked: 2, held: 1 })
        );
        assert_eq!((p.free(), p.held_by(a), p.limit()), (3, 1, 4));
    }

    #[test]
    fn requests_beyond_the_limit_are_refused() {
        let mut p = pool(4);
        let a = p.connect(());
        assert_eq!(
            p.acquire(a, 0, 5),
            Err(PoolError::MoreThanLimit { asked: 5, limit: 4 })
        );
        assert_eq!(p.acquire(a, 0, 0), Err(PoolError::ZeroTokens));
        p.acquire(a, 0, 3).unwrap();
        assert_eq!(
            p.acquire(a, 1, 2),
            Err(PoolError::MoreThanLimit { asked: 5, limit: 4 }),
            "held + asked counts"
        );
        assert!(Pool::<()>::new(0).is_err());
    }

    #[test]
    fn disconnect_returns_tokens_to_the_next_waiter() {
        let mut p = pool(2);
        let [a, b] = [p.connect(()), p.connect(())];
        p.acquire(a, 0, 2).unwrap();
        p.acquire(b, 3, 1).unwrap();
        let (held, grants) = p.disconnect(a);
        assert_eq!(held, 2);
        assert_eq!(
            grants,
            vec![Grant {
                client: b,
                tag: 3,
                tokens: 1
            }]
        );
        assert_eq!((p.free(), p.totals().reclaimed), (1, 2));
        p.assert_invariants();
    }

    #[test]
    fn cancelling_the_head_lets_the_next_request_through() {
        let mut p = pool(2);
        let [a, big, small] = [p.connect(()), p.connect(()), p.connect(())];
        p.acquire(a, 0, 1).unwrap();
        p.acquire(big, 1, 2).unwrap();
        p.acquire(small, 2, 1).unwrap();
        let (tokens, grants) = p.cancel(big, 1);
        assert_eq!(tokens, 2);
        assert_eq!(
            grants,
            vec![Grant {
                client: small,
                tag: 2,
                tokens: 1
            }]
        );
        assert_eq!(
            p.cancel(big, 1),
            (0, vec![]),
            "a second cancel finds nothing"
        );
    }

    #[test]
    fn raising_the_limit_by_k_wakes_exactly_k() {
        let mut p = pool(1);
        let holder = p.connect(());
        p.acquire(holder, 0, 1).unwrap();
        let waiters: Vec<_> = (0..10).map(|_| p.connect(())).collect();
        for &w in &waiters {
            p.acquire(w, 0, 1).unwrap();
        }
        let grants = p.set_limit(4).unwrap();
        let woken: Vec<_> = grants.iter().map(|g| g.client).collect();
        assert_eq!(woken, waiters[..3].to_vec());
        p.assert_invariants();
    }

    #[test]
    fn lowering_the_limit_retires_tokens_as_they_come_back() {
        let mut p = pool(4);
        let a = p.connect(());
        p.acquire(a, 0, 3).unwrap();
        p.set_limit(2).unwrap();
        assert_eq!(p.free(), 0);
        p.assert_invariants();
        p.release(a, 1).unwrap();
        assert_eq!(
            p.free(),
            0,
            "held 2 == limit 2: the returned token is retired"
        );
        p.release(a, 1).unwrap();
        assert_eq!(p.free(), 1);
        p.assert_invariants();
    }

    #[test]
    fn the_limit_may_be_lowered_to_what_a_waiter_asks_and_no_lower() {
        let mut p = pool(4);
        let (a, b) = (p.connect(()), p.connect(()));
        p.acquire(a, 0, 2).unwrap();
        assert_eq!(p.acquire(b, 0, 3).unwrap(), Acquired::Queued);
        assert_eq!(
            p.set_limit(2),
            Err(PoolError::MoreThanLimit { asked: 3, limit: 2 }),
            "a waiter of 3 could never be served under a limit of 2"
        );
        assert_eq!(p.limit(), 4, "a refused change changes nothing");
        assert_eq!(p.set_limit(3), Ok(vec![]), "3 can still be served");
        assert_eq!((p.limit(), p.waiting()), (3, 1));
        let grants = p.release(a, 2).unwrap();
        assert_eq!(grants.len(), 1, "the waiter of 3 is served under 3");
        p.assert_invariants();
    }

    #[test]
    fn only_builds_served_first_count_as_waiting_ahead() {
        let mut p = pool(2);
        let [a, b, c] = [p.connect(()), p.connect(()), p.connect(())];
        p.acquire(a, 0, 1).unwrap();
        p.acquire(b, 0, 1).unwrap();
        p.advance(100);
        p.release(b, 1).unwrap();
        p.acquire(a, 1, 1).unwrap(); // a holds 2 from now on
        assert_eq!(p.acquire(b, 0, 1), Ok(Acquired::Queued));
        assert_eq!(p.waiting_ahead(a), 1, "b is behind a: a gives way");
        assert_eq!(p.acquire(c, 0, 1), Ok(Acquired::Queued));
        p.advance(200);
        assert_eq!(
            p.waiting_ahead(b),
            1,
            "c started level with b, and b has used no more since"
        );
        assert_eq!(p.waiting_ahead(c), 1);
        assert_eq!(p.waiting_ahead(a), 2);
    }

    #[test]
    fn duplicate_tags_are_refused() {
        let mut p = pool(3);
        let [a, b] = [p.connect(()), p.connect(())];
        p.acquire(a, 0, 3).unwrap();
        p.acquire(b, 5, 1).unwrap();
        assert_eq!(p.acquire(b, 5, 1), Err(PoolError::DuplicateTag(5)));
        assert_eq!(p.acquire(b, 6, 1), Ok(Acquired::Queued));
    }

    #[test]
    fn an_admission_cap_holds_free_tokens_back_and_never_revokes() {
        let mut p = pool(4);
        let (a, b) = (p.connect(()), p.connect(()));
        assert_eq!(p.acquire(a, 0, 2), Ok(Acquired::Granted));
        assert!(p.set_admission_cap(Some(1)).is_empty());
        assert_eq!(p.held_by(a), 2, "held tokens stay held");
        assert_eq!(p.acquire(b, 0, 1), Ok(Acquired::Queued));
        assert_eq!(p.try_acquire(a, 1), Ok(false));
        p.assert_invariants();
        assert!(p.release(a, 1).unwrap().is_empty(), "held 1 is at the cap");
        let grants = p.set_admission_cap(Some(2));
        assert_eq!(
            grants,
            vec![Grant {
                client: b,
                tag: 0,
                tokens: 1
            }]
        );
        assert_eq!(p.free(), 2);
        p.assert_invariants();
    }

    /// Found by the FUSE waiters' fuzz target: a big request waits ahead of a
    /// small one of another build; time passes, the small one's build is
    /// the one served next, and its token is free.
    #[test]
    fn a_waiter_the_clock_puts_first_gets_the_free_tokens() {
        let mut p = pool(4);
        let [x, y] = [p.connect(()), p.connect(())];
        p.acquire(x, 0, 2).unwrap();
        p.acquire(y, 0, 1).unwrap();
        assert_eq!(
            p.acquire(x, 1, 2),
            Ok(Acquired::Queued),
            "one free: x waits"
        );
        assert_eq!(
            p.acquire(y, 1, 1),
            Ok(Acquired::Queued),
            "x is served first: y waits behind it"
        );
        p.assert_invariants();
        // x holds twice what y holds: y is served first from now on.
        assert_eq!(
            p.advance(100),
            vec![Grant {
                client: y,
                tag: 1,
                tokens: 1
            }]
        );
        p.assert_invariants();
    }

    /// A request of the build served next is not queued behind requests
    /// of builds served after it while its tokens are free.
    #[test]
    fn a_request_of_the_build_served_next_takes_free_tokens_at_once() {
        let mut p = pool(4);
        let [x, y] = [p.connect(()), p.connect(())];
        p.set_weight(y, 10).unwrap();
        p.acquire(x, 0, 2).unwrap();
        p.acquire(y, 0, 1).unwrap();
        p.advance(100);
        assert_eq!(
            p.acquire(x, 1, 2),
            Ok(Acquired::Queued),
            "one free: x waits"
        );
        assert_eq!(
            p.acquire(y, 1, 1),
            Ok(Acquired::Granted),
            "y has used less for its weight: it is served first"
        );
        p.assert_invariants();
    }
}
