//! The pool plus what the transports need around it: who each client is,
//! since when it holds or waits, and where its grants must be delivered.
//!
//! One `Broker`, owned by the event loop (crate::owner), serves every
//! transport. A call that frees tokens returns grants; [`Broker::route`]
//! files each under the transport that owns the client, and the loop
//! delivers them at the end of its round. Nothing here blocks or does I/O
//! besides reading the clock.

use crate::log;
use baton_core::cluster::{admission_cap, Contact};
#[cfg(feature = "cluster")]
use baton_core::cluster::{Config, Local};
use baton_core::gates::{GateConfig, Gates, JobMemory, PauseAction, Reading};
use baton_core::metrics::{Histogram, Utilization};
use baton_core::status::{self, Status};
use baton_core::{Acquired, BuildId, ClientId, Grant, Pool, PoolError, Tag};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

/// Which way a client came in. Grants are routed by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Transport {
    /// A connection to the native socket (including `baton run`).
    Socket,
    /// A process using the FUSE token file.
    Fuse,
    /// The tokens a build's fast-path region holds (crate::fastpath): its
    /// lender, one per region, whose grants go into the region.
    Region,
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Transport::Socket => "socket",
            Transport::Fuse => "fuse",
            Transport::Region => "fastpath",
        }
    }
}

/// What the broker remembers about a client besides its tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClientMeta {
    pub pid: u32,
    pub command: String,
    pub transport: Transport,
    /// Set when the client goes from holding nothing to holding something.
    pub holding_since: Option<SystemTime>,
    /// When each pending request started waiting.
    pub waiting_since: HashMap<Tag, SystemTime>,
}

impl ClientMeta {
    pub fn new(pid: u32, command: String, transport: Transport) -> Self {
        ClientMeta {
            pid,
            command,
            transport,
            holding_since: None,
            waiting_since: HashMap::new(),
        }
    }
}

/// What status reports about a build beyond the pool's books.
#[derive(Debug, Clone)]
struct BuildStats {
    began: SystemTime,
    /// How long each of its ACQUIREs waited, in microseconds (0: granted
    /// at once); 2.4 KB from its first ACQUIRE on, whatever the count.
    waits: Histogram,
    /// Stray bytes its `baton run` took out of its jobserver (`STRAY`).
    stray: u32,
    /// Who started it, as status shows them.
    starter: Starter,
}

/// A build's starter (its `baton run`, or its first client) and its uid
/// and cgroup, read from /proc once, when it becomes the starter: status
/// shows them on every call, and two /proc reads per build per STATUS
/// cost a broker with 512 waiting builds about 10 ms a call.
#[derive(Debug, Clone)]
struct Starter {
    pid: u32,
    uid: Option<u32>,
    cgroup: Option<String>,
}

impl Starter {
    fn of(pid: u32) -> Starter {
        Starter {
            pid,
            uid: crate::jobs::uid_of(pid),
            cgroup: crate::sys::cgroup_of(&pid.to_string()),
        }
    }
}

/// The utilization history: the mean tokens held in each second of the
/// last ten minutes (600 × 4 bytes).
const HISTORY_SLOT: Duration = Duration::from_secs(1);
const HISTORY_SLOTS: usize = 600;

/// Wakes another thread from the loop: the gates', the cluster link's,
/// the orphan watcher's. It runs on the loop: it must only wake.
pub struct GrantHook(Box<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for GrantHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GrantHook")
    }
}

/// The broker's books: the pool with its clients' metadata, the grants
/// not yet delivered, and who belongs to which build and where its
/// processes are. Plain values: `serve --replace` hands exactly these to
/// the successor (serialized whole, maps as lists of pairs), so a field
/// added here travels without a copy by hand.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Books {
    pool: Pool<ClientMeta>,
    /// The memory and load gates: their settings travel; what they
    /// measured and learned starts afresh with the successor.
    #[serde(with = "gate_settings")]
    gates: Gates,
    /// When the pool's clock (and the gates') started. It travels as how
    /// long it had run (`clock`): the successor's goes on from there.
    #[serde(rename = "clock", with = "elapsed")]
    began: Instant,
    /// The wall-clock time `began` was.
    started: SystemTime,
    /// The successor's transports deliver them.
    #[serde(with = "grants_by_transport")]
    undelivered: HashMap<Transport, Vec<Grant>>,
    /// The clients that started builds (BUILD), by pid: a client whose
    /// process descends from one joins its build.
    #[serde(with = "crate::pairs")]
    roots: HashMap<u32, ClientId>,
    /// Names given with BUILD.
    #[serde(with = "crate::pairs")]
    names: HashMap<BuildId, String>,
    /// The session of each client that started a build: where its
    /// processes are looked for if it dies before them.
    #[serde(default, with = "crate::pairs")]
    sessions: HashMap<ClientId, u32>,
    /// Where a build's processes are when it is not here: the pid they
    /// carry ([`crate::jobs::RUN_PID_VAR`]: a `baton run` in a container's
    /// PID namespace knows only its pid there) and that namespace. Two
    /// containers started from one session may both have a `baton run`
    /// of pid 2: the namespace tells their processes apart.
    #[serde(default, with = "crate::pairs")]
    carried: HashMap<ClientId, Place>,
    /// Builds whose `baton run` died while their processes run on (#32):
    /// they travel too, as their clients have no connection, and only
    /// this tells the successor when their tokens come back.
    #[serde(default, with = "crate::pairs")]
    orphaned: HashMap<ClientId, Orphaned>,
    /// Since when (on the pool's clock), and for how long, builds of a
    /// broker that died here are given the time to re-attach before
    /// anything new is granted. It travels: a successor that took over
    /// half-way through would otherwise grant at once what a build not yet
    /// re-attached still runs jobs on.
    #[serde(default)]
    reclaim: Option<(Duration, Duration)>,
}

/// The gates as their settings alone.
mod gate_settings {
    use baton_core::gates::{GateConfig, Gates};
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(gates: &Gates, s: S) -> Result<S::Ok, S::Error> {
        gates.config().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Gates, D::Error> {
        Ok(Gates::new(GateConfig::deserialize(d)?))
    }
}

/// An instant as the time since it (a `Duration`): an `Instant` means
/// nothing to another process.
mod elapsed {
    use serde::{de::Error, Deserialize, Deserializer, Serialize, Serializer};
    use std::time::{Duration, Instant};

    pub fn serialize<S: Serializer>(began: &Instant, s: S) -> Result<S::Ok, S::Error> {
        began.elapsed().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Instant, D::Error> {
        let ran = Duration::deserialize(d)?;
        Instant::now().checked_sub(ran).ok_or_else(|| {
            D::Error::custom("the predecessor's clock ran longer than this machine has been up")
        })
    }
}

/// Grants by transport as one list of (transport, grant).
mod grants_by_transport {
    use super::Transport;
    use baton_core::Grant;
    use serde::{Deserialize, Deserializer, Serializer};
    use std::collections::HashMap;

    pub fn serialize<S: Serializer>(
        map: &HashMap<Transport, Vec<Grant>>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_seq(
            map.iter()
                .flat_map(|(&t, grants)| grants.iter().map(move |&g| (t, g))),
        )
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<HashMap<Transport, Vec<Grant>>, D::Error> {
        let mut map: HashMap<Transport, Vec<Grant>> = HashMap::new();
        for (t, g) in Vec::<(Transport, Grant)>::deserialize(d)? {
            map.entry(t).or_default().push(g);
        }
        Ok(map)
    }
}

/// The books, and what the broker keeps beside them while it runs: the
/// transports' wake-ups, the gates' readings, the cluster link, the wait
/// figures and the utilization history.
#[derive(Debug)]
pub struct Broker {
    books: Books,
    /// The cluster pool this broker is in (docs/cluster.md), with the
    /// cluster tokens its link holds: local grants stop there. None: no
    /// cluster pool.
    cluster: Option<ClusterLink>,
    /// Wakes the cluster link when what the local pool needs changes.
    demand_hook: Option<GrantHook>,
    /// Wakes the gates' thread when the gates change: with none set, it
    /// sleeps until then.
    gates_hook: Option<GrantHook>,
    /// What the gates allowed at the last look: the cluster link takes no
    /// token for a request the gates hold back.
    gate_allowance: Option<u32>,
    /// Every build's start and wait times.
    stats: HashMap<BuildId, BuildStats>,
    /// Tokens held over the last minutes, on the pool's clock.
    utilization: Utilization,
    /// Wakes the thread that looks at orphaned builds' processes.
    orphans_hook: Option<GrantHook>,
    /// The fast path's regions, as STATUS reads them (crate::fastpath):
    /// what each seated client holds there, attributed at the moment of
    /// the request.
    fast_views: Vec<crate::fastpath::View>,
    /// What the fast path did that STATUS counts.
    fast_counts: FastCounts,
}

/// The fast path's counts (`totals.fastpath_*` in STATUS).
#[derive(Debug, Default, Clone, Copy)]
pub struct FastCounts {
    /// Seats repaired after their connection closed.
    pub repairs: u64,
    /// Confirmed audit mismatches.
    pub mismatches: u64,
}

/// The cluster pool this broker is in, as its link last told us: what
/// caps its grants (`held`, `contact`), and what STATUS shows of it.
#[derive(Debug, Clone)]
struct ClusterLink {
    pool: String,
    endpoints: Vec<String>,
    limit: u32,
    held: u32,
    contact: Contact,
    watch_events: u64,
}

impl ClusterLink {
    /// As STATUS shows it; `brokers` is `baton status`'s to fill, from
    /// etcd (the broker never waits on etcd).
    fn status(&self) -> status::Cluster {
        status::Cluster {
            pool: self.pool.clone(),
            endpoints: self.endpoints.clone(),
            limit: self.limit,
            held: self.held,
            contact: self.contact.name().to_string(),
            brokers: Vec::new(),
            watch_events: self.watch_events,
        }
    }
}

/// A pid as a build's processes carry it, and their PID namespace (the
/// inode of /proc/PID/ns/pid).
type Place = (u32, u64);

/// `pid`'s place when it is in our own PID namespace.
/// How many tokens an orphaned build that holds `held` keeps: one per
/// job while only jobs are left; everything it holds (and at least one
/// per job) while a build tool of it lives. A sub-make reads the
/// jobserver its `baton run` left: the bytes still in it and those its
/// jobs write back start its next jobs, which no count of jobs at one
/// look can see coming (measured: make 4.4.1's and bmake's sub-makes ran
/// 6 jobs beside another build's under a limit of 4, once the top make
/// was killed and the orphaned build gave back all but its 2 running).
fn kept_for_orphans(found: crate::jobs::Orphans, held: u32) -> u32 {
    match found.tools {
        0 => found.jobs,
        _ => found.jobs.max(held),
    }
}

fn here(pid: u32) -> Place {
    (pid, crate::sys::pid_namespace_of("self").unwrap_or(0))
}

/// A build whose `baton run` died (`kill -9`) while processes it started
/// run on: a sub-make, jobs. Its client stays in the pool, holding as many
/// tokens as those processes run jobs (at most what it held), until the
/// last one ends; so the machine never runs more jobs than the limit
/// because a build lost its `baton run` (docs/jobserver.md).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Orphaned {
    /// The dead `baton run`'s pid, which its processes carry in their
    /// environment ([`crate::jobs::RUN_PID_VAR`]).
    owner: u32,
    session: u32,
    /// Where its processes are, when not in our PID namespace.
    #[serde(default)]
    carried: Option<Place>,
}

/// Everything a broker knows, as its successor (`baton serve --replace`)
/// receives it: its books.
pub type BrokerState = Books;

impl Broker {
    pub fn new(limit: u32) -> Result<Self, PoolError> {
        let books = Books {
            pool: Pool::new(limit)?,
            gates: Gates::new(GateConfig::default()),
            began: Instant::now(),
            started: SystemTime::now(),
            undelivered: HashMap::new(),
            roots: HashMap::new(),
            names: HashMap::new(),
            sessions: HashMap::new(),
            carried: HashMap::new(),
            orphaned: HashMap::new(),
            reclaim: None,
        };
        Ok(Broker::around(books))
    }

    /// A broker around `books`: no hooks yet, no cluster link; the wait
    /// figures and the utilization history start afresh.
    fn around(books: Books) -> Self {
        Broker {
            books,
            gates_hook: None,
            cluster: None,
            demand_hook: None,
            gate_allowance: None,
            stats: HashMap::new(),
            utilization: Utilization::new(HISTORY_SLOT.as_nanos() as u64, HISTORY_SLOTS),
            orphans_hook: None,
            fast_views: Vec::new(),
            fast_counts: FastCounts::default(),
        }
    }

    /// Whether this broker's pool is part of a cluster pool (its grants
    /// stop at what its link holds).
    pub fn in_cluster(&self) -> bool {
        self.cluster.is_some()
    }

    /// The fast path's counts, for it to add to.
    pub fn fast_counts(&mut self) -> &mut FastCounts {
        &mut self.fast_counts
    }

    /// The regions STATUS reads, as the loop's fast path changes them.
    pub fn set_fast_views(&mut self, views: Vec<crate::fastpath::View>) {
        self.fast_views = views;
    }

    /// What STATUS reads in the regions: for each client, the tokens to
    /// add to its count (a seated client's tokens there) or take off (a
    /// lender's, whose tokens held by seated clients are listed as
    /// theirs); and the client of each claim waiting in a region.
    fn fast_seen(&self) -> (HashMap<ClientId, i64>, Vec<(ClientId, SystemTime)>) {
        let mut held = HashMap::new();
        let mut waiting = Vec::new();
        for view in &self.fast_views {
            let seen = view.read();
            for (client, tokens) in seen.holdings {
                *held.entry(client).or_insert(0) += i64::from(tokens);
                *held.entry(view.lender).or_insert(0) -= i64::from(tokens);
            }
            waiting.extend(seen.waiting);
        }
        (held, waiting)
    }

    /// STATUS's waiters: the pool's queue, but for the requests lenders
    /// make for claims behind a region's barrier, and the claims waiting
    /// in the regions, each as its client. A region keeps no clock: a
    /// claim's `since` is when the audit or a STATUS first saw it.
    fn waiters(&self, in_regions: &[(ClientId, SystemTime)]) -> Vec<status::Waiter> {
        let lenders: Vec<ClientId> = self.fast_views.iter().map(|v| v.lender).collect();
        let now = SystemTime::now();
        let waiter = |id: ClientId, tokens: u32, since: SystemTime, transport: Transport| {
            let meta = self.books.pool.meta(id).expect("waiters are connected");
            status::Waiter {
                pid: meta.pid,
                command: meta.command.clone(),
                tokens,
                since: epoch_seconds(since),
                transport: transport.name().to_string(),
                build: self.books.pool.build_of(id).map_or(0, |b| b.0),
            }
        };
        let queued = self
            .books
            .pool
            .queue()
            .filter(|(id, _, _)| !lenders.contains(id))
            .map(|(id, tag, tokens)| {
                let meta = self.books.pool.meta(id).expect("waiters are connected");
                let since = meta.waiting_since.get(&tag).copied().unwrap_or(now);
                waiter(id, tokens, since, meta.transport)
            });
        let in_regions = in_regions
            .iter()
            .filter(|&&(id, _)| self.books.pool.meta(id).is_some())
            .map(|&(id, since)| waiter(id, 1, since, Transport::Region));
        queued.chain(in_regions).collect()
    }

    /// What the successor needs to carry on where this broker stops.
    pub fn snapshot(&mut self) -> BrokerState {
        self.tick();
        self.books.clone()
    }

    /// Carries on from a predecessor's books; its pool must balance.
    ///
    /// # Errors
    /// The pool's books do not balance, or a grant not yet delivered is for
    /// no client of its transport.
    pub fn restore(mut books: BrokerState) -> anyhow::Result<Self> {
        books.pool = books.pool.restore()?;
        for (&transport, grants) in &books.undelivered {
            anyhow::ensure!(
                grants.iter().all(|g| books
                    .pool
                    .meta(g.client)
                    .is_some_and(|m| m.transport == transport)),
                "a grant not yet delivered is for no client of its transport"
            );
        }
        // The cluster link is joined anew by the successor; the gates'
        // settings take effect now, as `baton limit` would set them.
        let gates = books.gates.config();
        let mut broker = Broker::around(books);
        broker.set_gates(gates);
        Ok(broker)
    }

    /// Brings the pool's clock to now, so that what each build held
    /// meanwhile counts towards its share. Called before every change.
    fn tick(&mut self) {
        let now = self.books.began.elapsed().as_nanos() as u64;
        // What was held until now counts before the clock's grants change it.
        self.utilization.advance(now, self.books.pool.held());
        let grants = self.books.pool.advance(now);
        self.route(grants);
    }

    pub fn pool(&self) -> &Pool<ClientMeta> {
        &self.books.pool
    }

    /// A new client joins the build of the nearest ancestor process that
    /// started one, or is a build of its own.
    pub fn connect(&mut self, meta: ClientMeta) -> ClientId {
        self.tick();
        let meta_pid = meta.pid;
        // Reading /proc costs a little at every connect: only when a build exists.
        let root = if self.books.roots.is_empty() {
            None
        } else {
            crate::fuse::procs::ancestors(meta.pid)
                .find_map(|pid| self.books.roots.get(&pid).copied())
        };
        let id = match root {
            Some(root) => self.books.pool.connect_beside(root, meta),
            None => self.books.pool.connect(meta),
        };
        let build = self.books.pool.build_of(id).expect("just connected");
        self.stats.entry(build).or_insert_with(|| BuildStats {
            began: SystemTime::now(),
            waits: Histogram::default(),
            stray: 0,
            starter: Starter::of(meta_pid),
        });
        id
    }

    /// The lender of a fast-path region (crate::fastpath): a client of the
    /// build of `peer`, holding the tokens lent to the region, so that the
    /// pool's books, shares and gates count them as that build's.
    pub fn connect_lender(&mut self, peer: ClientId, name: String) -> ClientId {
        self.tick();
        let meta = ClientMeta::new(std::process::id(), name, Transport::Region);
        self.books.pool.connect_beside(peer, meta)
    }

    /// Moves tokens `from` holds to `to` (see [`Pool::transfer`]): what a
    /// fast-path client held in its region, booked on its connection.
    pub fn transfer(&mut self, from: ClientId, to: ClientId, tokens: u32) -> Result<(), PoolError> {
        if tokens == 0 {
            return Ok(());
        }
        self.books.pool.transfer(from, to, tokens)?;
        if let Some(meta) = self.books.pool.meta_mut(to) {
            Self::note_holding(meta);
        }
        Ok(())
    }

    /// Forgets a region's lender: whatever it still holds goes back.
    pub fn drop_lender(&mut self, id: ClientId) -> u32 {
        self.tick();
        let (held, grants) = self.books.pool.disconnect(id);
        self.route(grants);
        self.demand_changed();
        held
    }

    /// The client starts a build (`baton run`): processes under it join
    /// it. A client already in a build started above it (a `baton run`
    /// inside another) stays there, and the outer build's name and weight
    /// hold.
    pub fn start_build(
        &mut self,
        id: ClientId,
        weight: u32,
        name: String,
    ) -> Result<(BuildId, u32), PoolError> {
        let build = self
            .books
            .pool
            .build_of(id)
            .ok_or(PoolError::UnknownClient(id))?;
        let meta = self.books.pool.meta(id).expect("the client is connected");
        let (pid, command) = (meta.pid, meta.command.clone());
        let nested = crate::fuse::procs::ancestors(pid)
            .skip(1)
            .any(|p| self.books.roots.contains_key(&p));
        if !nested {
            self.books.pool.set_weight(id, weight)?;
            let name = if name.is_empty() { command } else { name };
            self.books.names.insert(build, name);
            self.books.roots.insert(pid, id);
            if let Some(stats) = self.stats.get_mut(&build) {
                if stats.starter.pid != pid {
                    stats.starter = Starter::of(pid);
                }
            }
            if let Some(session) = crate::jobs::session_of(pid) {
                self.books.sessions.insert(id, session);
            }
            if let Some(inner) = crate::jobs::pid_in_its_namespace(pid).filter(|&p| p != pid) {
                let ns = crate::sys::pid_namespace_of(&pid.to_string()).unwrap_or(0);
                self.books.carried.insert(id, (inner, ns));
            }
        }
        let weight = self
            .books
            .pool
            .builds()
            .find(|b| b.id == build)
            .map_or(1, |b| b.weight);
        Ok((build, weight))
    }

    /// Tokens that builds served before this one wait for, and tokens
    /// free: a build that sits on tokens it does not use gives them back
    /// to those builds.
    pub fn wanted(&mut self, id: ClientId) -> (u32, u32) {
        self.tick();
        // While a gate is set, the machine wants every token back to decide
        // anew: a build that kept the tokens its jobs wrote back would
        // start new jobs the gates never saw.
        // A cluster pool wants them back too: a token parked in a build's
        // pipe holds a cluster token that another machine may wait for.
        let machine = u32::from(self.books.gates.config().any() || self.cluster.is_some());
        // A lowered limit (or builds re-attached past it) wants back what
        // is held beyond it: tokens parked in a build's FIFO would start
        // jobs past the new limit (issue #32).
        let draining = self
            .books
            .pool
            .held()
            .saturating_sub(self.books.pool.limit());
        let wanted = self.books.pool.waiting_ahead(id).max(machine).max(draining);
        (wanted, self.books.pool.free())
    }

    pub fn acquire(&mut self, id: ClientId, tag: Tag, tokens: u32) -> Result<Acquired, PoolError> {
        self.tick();
        let outcome = self.books.pool.acquire(id, tag, tokens)?;
        let meta = self
            .books
            .pool
            .meta_mut(id)
            .expect("acquire checked the client");
        match outcome {
            Acquired::Granted => {
                Self::note_holding(meta);
                self.note_granted(tokens);
                self.note_wait(id, Duration::ZERO);
            }
            Acquired::Queued => {
                meta.waiting_since.insert(tag, SystemTime::now());
                self.demand_changed();
                self.whole_requests_pass_the_gates();
            }
        }
        Ok(outcome)
    }

    pub fn try_acquire(&mut self, id: ClientId, tokens: u32) -> Result<bool, PoolError> {
        self.tick();
        let granted = self.books.pool.try_acquire(id, tokens)?;
        if granted {
            Self::note_holding(
                self.books
                    .pool
                    .meta_mut(id)
                    .expect("try_acquire checked the client"),
            );
            self.note_granted(tokens);
        }
        Ok(granted)
    }

    /// The client holds `tokens` a predecessor granted (see [`Pool::hold`]).
    pub fn hold(&mut self, id: ClientId, tokens: u32) -> Result<(), PoolError> {
        self.tick();
        self.books.pool.hold(id, tokens)?;
        Self::note_holding(
            self.books
                .pool
                .meta_mut(id)
                .expect("hold checked the client"),
        );
        Ok(())
    }

    /// A client that just got tokens holds since now, unless it already held
    /// some (release clears the time when it holds none).
    fn note_holding(meta: &mut ClientMeta) {
        meta.holding_since.get_or_insert_with(SystemTime::now);
    }

    /// Gives tokens back; grants that follow are routed to their transports.
    pub fn release(&mut self, id: ClientId, tokens: u32) -> Result<(), PoolError> {
        self.tick();
        let grants = self.books.pool.release(id, tokens)?;
        if self.books.pool.held_by(id) == 0 {
            self.books
                .pool
                .meta_mut(id)
                .expect("release checked the client")
                .holding_since = None;
        }
        self.route(grants);
        self.demand_changed();
        self.whole_requests_pass_the_gates();
        Ok(())
    }

    /// Withdraws a pending request; returns the tokens it waited for.
    pub fn cancel(&mut self, id: ClientId, tag: Tag) -> u32 {
        // Withdrawn before the clock moves: moving it may grant this very
        // request, which the caller would then answer after CANCELLED.
        let (tokens, grants) = self.books.pool.cancel(id, tag);
        if let Some(meta) = self.books.pool.meta_mut(id) {
            meta.waiting_since.remove(&tag);
        }
        self.route(grants);
        self.tick();
        self.demand_changed();
        tokens
    }

    /// Forgets a client; returns the tokens reclaimed from it.
    pub fn disconnect(&mut self, id: ClientId) -> u32 {
        self.tick();
        self.books.roots.retain(|_, &mut root| root != id);
        match self.books.sessions.remove(&id) {
            Some(session) if self.outlived_by_its_processes(id, session) => return 0,
            Some(_) => {}
            None => self.hand_to_the_owner(id),
        }
        self.books.carried.remove(&id);
        let build = self.books.pool.build_of(id);
        let (reclaimed, grants) = self.books.pool.disconnect(id);
        let pool = &self.books.pool;
        self.books
            .names
            .retain(|&build, _| pool.builds().any(|b| b.id == build));
        if let Some(build) = build.filter(|&build| !pool.builds().any(|b| b.id == build)) {
            self.stats.remove(&build);
        }
        self.route(grants);
        self.demand_changed();
        reclaimed
    }

    /// A build's `baton run` is gone, holding tokens: if processes it
    /// started still run jobs, its client stays, holding what
    /// [`kept_for_orphans`] says, and the rest go back now.
    fn outlived_by_its_processes(&mut self, id: ClientId, session: u32) -> bool {
        let Some(owner) = self.books.pool.meta(id).map(|m| m.pid) else {
            return false;
        };
        if self.books.pool.held_by(id) == 0 {
            return false;
        }
        let carried = self.books.carried.get(&id).copied();
        let (pid, ns) = carried.unwrap_or_else(|| here(owner));
        let found = crate::jobs::orphans(pid, session, ns);
        if found.jobs == 0 {
            return false;
        }
        let waits: Vec<Tag> = self
            .books
            .pool
            .queue()
            .filter(|&(client, _, _)| client == id)
            .map(|(_, tag, _)| tag)
            .collect();
        for tag in waits {
            let (_, grants) = self.books.pool.cancel(id, tag);
            self.route(grants);
        }
        if let Some(meta) = self.books.pool.meta_mut(id) {
            meta.command = format!("[orphaned] {}", meta.command);
            meta.waiting_since.clear();
        }
        self.books.orphaned.insert(
            id,
            Orphaned {
                owner,
                session,
                carried,
            },
        );
        log::info(format_args!(
            "baton run pid {owner} died while its build runs {} job(s): its tokens come back as they end",
            found.jobs
        ));
        let keep = kept_for_orphans(found, self.books.pool.held_by(id));
        self.hold_for_orphans(id, keep, true);
        if let Some(hook) = &self.orphans_hook {
            (hook.0)();
        }
        true
    }

    /// A process of a build that dies holding tokens (make reading the
    /// FUSE file, killed) while jobs it started run on: as many of its
    /// tokens as the build runs jobs beyond what its other clients hold
    /// pass to the build's owner (its `baton run`'s connection, or what is
    /// left of it if orphaned), counted as HOLD counts before the dying
    /// client's are taken back, so that nothing is granted in between
    /// (found by the soak: make's tokens went to another build 3 ms before
    /// its `baton run`'s death was seen). They come back with the build's.
    fn hand_to_the_owner(&mut self, id: ClientId) {
        let held = self.books.pool.held_by(id);
        let Some(build) = self.books.pool.build_of(id).filter(|_| held > 0) else {
            return;
        };
        let Some((owner, pid, session)) = self.owner_of(build).filter(|o| o.0 != id) else {
            return;
        };
        let (carried, ns) = self
            .books
            .carried
            .get(&owner)
            .copied()
            .unwrap_or_else(|| here(pid));
        let build_held = self
            .books
            .pool
            .builds()
            .find(|b| b.id == build)
            .map_or(0, |b| b.held);
        let covered = build_held.saturating_sub(held);
        let jobs = crate::jobs::orphan_jobs(carried, session, ns);
        let keep = held.min(jobs.saturating_sub(covered));
        if keep > 0 && self.books.pool.hold(owner, keep).is_ok() {
            log::info(format_args!(
                "pid {} of baton run pid {pid}'s build exited holding {held} token(s) while the build \
                 runs {jobs} job(s): {keep} stay with the build",
                self.books.pool.meta(id).map_or(0, |m| m.pid)
            ));
        }
    }

    /// The client that owns a build (its `baton run`, alive or orphaned),
    /// with the pid and session its processes are found by.
    fn owner_of(&self, build: BuildId) -> Option<(ClientId, u32, u32)> {
        let live = self
            .books
            .sessions
            .iter()
            .map(|(&id, &session)| (id, session));
        let orphaned = self.books.orphaned.iter().map(|(&id, o)| (id, o.session));
        live.chain(orphaned)
            .find(|&(id, _)| self.books.pool.build_of(id) == Some(build))
            .and_then(|(id, session)| Some((id, self.books.pool.meta(id)?.pid, session)))
    }

    /// Keeps `jobs` of an orphaned build's tokens and gives the rest back.
    ///
    /// At the moment a build is orphaned (`at_death`) it holds as many as
    /// its jobs, even more than its owner held: in the FUSE form the tokens
    /// make read through the file come back as make dies (they were its
    /// process's), while the jobs it started run on. They are counted as
    /// HOLD counts (the pool drains; nothing is created). Later looks only
    /// give back: a job started since took a token the pool already counts.
    fn hold_for_orphans(&mut self, id: ClientId, jobs: u32, at_death: bool) {
        let held = self.books.pool.held_by(id);
        if at_death && jobs > held {
            // Refused only past MAX_LIMIT held in all: then the pool
            // already grants nothing, and what it holds is what it has.
            let _ = self
                .books
                .pool
                .hold(id, (jobs - held).min(self.books.pool.limit()));
        }
        let spare = self.books.pool.held_by(id).saturating_sub(jobs);
        if spare > 0 {
            let grants = self.books.pool.release(id, spare).unwrap_or_default();
            self.route(grants);
            self.demand_changed();
        }
    }

    /// Looks at every orphaned build's processes again: tokens come back as
    /// their jobs end, and the build goes when the last one has. Returns
    /// whether any orphaned build is left.
    pub fn watch_orphans(&mut self) -> bool {
        self.tick();
        let orphaned: Vec<(ClientId, Orphaned)> = self
            .books
            .orphaned
            .iter()
            .map(|(&id, &o)| (id, o))
            .collect();
        for (id, o) in orphaned {
            let (pid, ns) = o.carried.unwrap_or_else(|| here(o.owner));
            let found = crate::jobs::orphans(pid, o.session, ns);
            match found.jobs {
                0 => {
                    self.books.orphaned.remove(&id);
                    let held = self.disconnect(id);
                    log::info(format_args!(
                        "the last job of baton run pid {}'s build ended: {held} token(s) back",
                        o.owner
                    ));
                }
                _ => {
                    let keep = kept_for_orphans(found, self.books.pool.held_by(id));
                    self.hold_for_orphans(id, keep, false)
                }
            }
        }
        !self.books.orphaned.is_empty()
    }

    /// Whether an orphaned build waits to be looked at.
    pub fn has_orphans(&self) -> bool {
        !self.books.orphaned.is_empty()
    }

    /// Calls `hook` when a build becomes orphaned, to wake the thread that
    /// calls [`Broker::watch_orphans`].
    pub fn on_orphans(&mut self, hook: impl Fn() + Send + Sync + 'static) {
        self.orphans_hook = Some(GrantHook(Box::new(hook)));
    }

    pub fn set_limit(&mut self, limit: u32) -> Result<u32, PoolError> {
        self.tick();
        let old = self.books.pool.limit();
        let grants = self.books.pool.set_limit(limit)?;
        self.route(grants);
        self.demand_changed();
        Ok(old)
    }

    /// Whether grants wait for delivery by `transport`.
    pub fn has_grants_for(&self, transport: Transport) -> bool {
        self.books
            .undelivered
            .get(&transport)
            .is_some_and(|grants| !grants.is_empty())
    }

    /// Takes the grants waiting for delivery by one transport.
    pub fn take_grants(&mut self, transport: Transport) -> Vec<Grant> {
        self.books
            .undelivered
            .remove(&transport)
            .unwrap_or_default()
    }

    /// Takes one client's grant that is filed but not yet delivered, if
    /// any: a CANCEL read before the transport delivered it must be
    /// answered after it, so the client learns it holds the tokens.
    pub fn take_grant_of(
        &mut self,
        transport: Transport,
        client: ClientId,
        tag: Tag,
    ) -> Option<Grant> {
        let filed = self.books.undelivered.get_mut(&transport)?;
        let pos = filed
            .iter()
            .position(|g| g.client == client && g.tag == tag)?;
        Some(filed.remove(pos))
    }

    /// Configures the gates (`--min-mem-available` and the others); an
    /// empty configuration removes them and lifts the cap they set.
    pub fn set_gates(&mut self, config: GateConfig) {
        let now = self.clock();
        self.books.gates.set_config(config, now);
        self.refresh_cap();
        if let Some(GrantHook(hook)) = &self.gates_hook {
            hook();
        }
    }

    /// Calls `hook` whenever the gates' configuration is set. It runs on the
    /// loop: it must only wake.
    pub fn on_gates_set(&mut self, hook: impl Fn() + Send + Sync + 'static) {
        self.gates_hook = Some(GrantHook(Box::new(hook)));
    }

    /// Sets one gate by its protocol name; returns its threshold now.
    ///
    /// # Errors
    /// The name or the value is not valid, in words for the client.
    pub fn set_gate(&mut self, name: &str, value: Option<f64>) -> Result<Option<f64>, String> {
        let config = self.gate_config().with(name, value)?;
        self.set_gates(config);
        Ok(config.value_of(name))
    }

    /// The gates' configuration (all off if none).
    pub fn gate_config(&self) -> GateConfig {
        self.books.gates.config()
    }

    /// A new measurement of the machine: the gates open or close on it.
    pub fn observe(&mut self, reading: Reading) {
        let (held, now) = (self.books.pool.held(), self.clock());
        self.books.gates.observe(reading, held, now);
        self.refresh_cap();
    }

    fn demand_changed(&self) {
        if let Some(GrantHook(hook)) = &self.demand_hook {
            hook();
        }
    }

    /// Whether the gates want the machine measured often now.
    pub fn gates_urgent(&self) -> bool {
        self.books.gates.urgent()
    }

    /// What the pause policy wants done with the `running` jobs.
    pub fn pause_action(&self, running: &[JobMemory]) -> PauseAction {
        self.books.gates.pause_action(running)
    }

    /// `jobs` of the `running` jobs shown to `pause_action` were stopped.
    pub fn did_pause(&mut self, jobs: u32, running: u32) {
        self.books.gates.did_pause(jobs, running);
        self.refresh_cap();
    }

    /// A stopped job goes on beside the `running` jobs shown to
    /// `pause_action`.
    pub fn did_resume(&mut self, running: u32) {
        self.books.gates.did_resume(running);
        self.refresh_cap();
    }

    /// The pids of every client: their jobs are under them.
    pub fn client_pids(&self) -> Vec<u32> {
        self.books.pool.clients().map(|c| c.meta.pid).collect()
    }

    fn clock(&self) -> Duration {
        self.books.began.elapsed()
    }

    /// Tokens just handed out count as young jobs for the memory gate, and
    /// use up part of what it allows.
    fn note_granted(&mut self, tokens: u32) {
        if self.books.gates.config().any() {
            let now = self.clock();
            self.books.gates.granted(tokens, now);
            self.refresh_cap();
        }
    }

    /// Sets the pool's admission cap to what the gates allow now, and
    /// delivers any grants a higher cap lets through.
    fn refresh_cap(&mut self) {
        let gates = self.books.gates.allowance(
            self.books.pool.held(),
            self.books.pool.next_request(),
            self.books.began.elapsed(),
        );
        if gates != self.gate_allowance {
            self.gate_allowance = gates;
            self.demand_changed();
        }
        let cluster = self
            .cluster
            .as_ref()
            .map(|c| admission_cap(c.held, c.contact));
        // While builds re-attach, nothing new: a cap of 0 lets no request
        // through (HOLD is not a request).
        let reclaim = self.books.reclaim.map(|_| 0);
        let cap = [gates, cluster, reclaim].into_iter().flatten().min();
        let grants = self.books.pool.set_admission_cap(cap);
        self.route(grants);
    }

    /// A request too wide for what the gates allow passes once nothing is
    /// held (`Gates::allowance`): looked at as the queue or the holdings
    /// change, not at the next reading.
    fn whole_requests_pass_the_gates(&mut self) {
        if self.books.pool.held() == 0 && self.books.gates.config().any() {
            self.refresh_cap();
        }
    }

    /// A broker died at this socket without cleaning up: builds it fed
    /// may still run jobs on its tokens, and re-attach within moments
    /// (`baton run` looks every 200 ms) to say what they hold (`HOLD`).
    /// Until [`Broker::end_reclaim`], nothing new is granted, so that what
    /// they hold is counted before any of it is handed out again, as an
    /// NFS server after a restart lets clients reclaim their locks in a
    /// grace period before it grants new ones (RFC 8881, "Server Failure and
    /// Recovery").
    pub fn start_reclaim(&mut self, grace: Duration) {
        self.books.reclaim = Some((self.clock(), grace));
        self.refresh_cap();
    }

    /// How much of the grace [`Broker::start_reclaim`] began is left:
    /// a successor that took over during it ends it on time.
    pub fn reclaim_left(&self) -> Option<Duration> {
        let (since, grace) = self.books.reclaim?;
        Some((since + grace).saturating_sub(self.clock()))
    }

    /// Ends the grace [`Broker::start_reclaim`] began: waiting requests
    /// are served from what the re-attached builds left free.
    pub fn end_reclaim(&mut self) {
        if self.books.reclaim.take().is_some() {
            let t = self.books.pool.totals();
            log::info(format_args!(
                "re-attach time over: {} token(s) counted for builds of the broker before; serving {} waiting request(s)",
                t.held_again,
                self.books.pool.waiting()
            ));
            self.refresh_cap();
        }
    }

    fn route(&mut self, grants: Vec<Grant>) {
        if grants.is_empty() {
            return;
        }
        let granted = grants.iter().map(|g| g.tokens).sum();
        self.file(grants);
        self.note_granted(granted);
    }

    /// Counts the stray bytes the client's `baton run` took out of its
    /// build's jobserver; returns the build's count so far.
    pub fn note_stray(&mut self, id: ClientId, bytes: u32) -> u32 {
        let build = self
            .books
            .pool
            .build_of(id)
            .expect("the client is connected");
        self.stats.get_mut(&build).map_or(bytes, |stats| {
            stats.stray = stats.stray.saturating_add(bytes);
            stats.stray
        })
    }

    /// Counts how long one of the client's ACQUIREs waited.
    fn note_wait(&mut self, id: ClientId, waited: Duration) {
        let build = self
            .books
            .pool
            .build_of(id)
            .expect("the client is connected");
        if let Some(stats) = self.stats.get_mut(&build) {
            stats.waits.record(waited.as_micros() as u64);
        }
    }

    /// Files each grant under its client's transport, for the loop to
    /// deliver.
    fn file(&mut self, grants: Vec<Grant>) {
        let now = SystemTime::now();
        for grant in grants {
            let meta = self
                .books
                .pool
                .meta_mut(grant.client)
                .expect("grants go to connected clients");
            let since = meta.waiting_since.remove(&grant.tag);
            meta.holding_since.get_or_insert(now);
            let transport = meta.transport;
            if let Some(since) = since {
                self.note_wait(grant.client, now.duration_since(since).unwrap_or_default());
            }
            self.books
                .undelivered
                .entry(transport)
                .or_default()
                .push(grant);
        }
    }

    /// Every build, for status. One pass over the clients, whatever the
    /// number of builds: a broker may have a thousand single-client ones.
    fn builds(&self) -> Vec<status::Build> {
        let mut first: HashMap<BuildId, &ClientMeta> = HashMap::new();
        for c in self.books.pool.clients() {
            first.entry(c.build).or_insert(c.meta);
        }
        let roots: HashMap<BuildId, &ClientMeta> = self
            .books
            .roots
            .values()
            .filter_map(|&root| {
                Some((self.books.pool.build_of(root)?, self.books.pool.meta(root)?))
            })
            .collect();
        let running = self.running_jobs();
        let own_uid = nix::unistd::getuid().as_raw();
        let own_cgroup = crate::sys::cgroup_of("self");
        self.books
            .pool
            .builds()
            // A client that only asks (`baton status`, `baton top`, a
            // scraper's exporter) is not a build: listed only once it
            // said BUILD or used tokens.
            .filter(|b| roots.contains_key(&b.id) || b.held + b.waiting > 0 || b.granted > 0)
            .map(|b| {
                let starter = roots.get(&b.id).or(first.get(&b.id));
                let stats = self.stats.get(&b.id);
                let starter = starter.map(|m| Self::starter_of(stats, m.pid));
                let name = self
                    .books
                    .names
                    .get(&b.id)
                    .cloned()
                    .or_else(|| first.get(&b.id).map(|m| m.command.clone()))
                    .unwrap_or_default();
                let waits = stats.map(|s| &s.waits);
                let ms = |micros: u64| micros as f64 / 1000.0;
                status::Build {
                    id: b.id.0,
                    name,
                    pid: starter.as_ref().map_or(0, |s| s.pid),
                    weight: b.weight,
                    held: b.held,
                    waiting: b.waiting,
                    grants: b.granted,
                    token_seconds: b.token_time as f64 / 1e9,
                    since: stats.map_or(0.0, |s| epoch_seconds(s.began)),
                    waits: waits.map_or(0, Histogram::count),
                    wait_ms_total: waits.map_or(0.0, |w| ms(w.sum())),
                    wait_ms_p50: waits.and_then(|w| w.percentile(0.5)).map(ms),
                    wait_ms_p99: waits.and_then(|w| w.percentile(0.99)).map(ms),
                    running: roots
                        .get(&b.id)
                        .and_then(|m| running.as_ref()?.get(&m.pid).copied()),
                    stray: stats.map_or(0, |s| s.stray),
                    uid: starter
                        .as_ref()
                        .and_then(|s| s.uid)
                        .filter(|&u| u != own_uid),
                    cgroup: starter
                        .and_then(|s| s.cgroup)
                        .filter(|c| Some(c) != own_cgroup.as_ref()),
                }
            })
            .collect()
    }

    /// The build's starter as read when it became one; read afresh only
    /// if its first client left and another is now the one shown.
    fn starter_of(stats: Option<&BuildStats>, pid: u32) -> Starter {
        match stats {
            Some(stats) if stats.starter.pid == pid => stats.starter.clone(),
            _ => Starter::of(pid),
        }
    }

    /// The jobs each `baton run`'s build runs now, by its pid, counted
    /// from /proc (one pass); None with no build whose processes we can
    /// find. A build running no job is there with 0.
    fn running_jobs(&self) -> Option<HashMap<u32, u32>> {
        let owners: HashMap<(u32, u32, u64), u32> = self
            .books
            .roots
            .iter()
            .filter_map(|(&pid, id)| {
                let (carried, ns) = self
                    .books
                    .carried
                    .get(id)
                    .copied()
                    .unwrap_or_else(|| here(pid));
                Some(((carried, *self.books.sessions.get(id)?, ns), pid))
            })
            .collect();
        if owners.is_empty() {
            return None;
        }
        let mut jobs = crate::jobs::running_jobs(&owners);
        for pid in owners.values() {
            jobs.entry(*pid).or_insert(0);
        }
        Some(jobs)
    }

    /// The mean tokens held in each second of the last ten minutes.
    fn utilization(&self) -> status::Utilization {
        let now = self.books.began.elapsed().as_nanos() as u64;
        let held = self
            .utilization
            .samples(now, self.books.pool.held())
            .into_iter()
            .map(|m| (f64::from(m) * 100.0).round() / 100.0)
            .collect();
        status::Utilization {
            interval_s: HISTORY_SLOT.as_secs_f64(),
            held,
        }
    }

    /// The status document with each build's token-time brought to now,
    /// for a reader that connects no client (the metrics endpoint): a
    /// client's connect does that for STATUS.
    pub fn status_now(&mut self) -> Status {
        self.tick();
        self.status()
    }

    /// The document `STATUS` returns.
    pub fn status(&self) -> Status {
        let (fast, waiting_in_regions) = self.fast_seen();
        let held = |c: &baton_core::ClientView<'_, ClientMeta>| {
            let moved = fast.get(&c.id).copied().unwrap_or(0);
            (i64::from(c.held) + moved).max(0) as u32
        };
        let mut holders: Vec<_> = self
            .books
            .pool
            .clients()
            .filter(|c| held(c) > 0)
            .map(|c| status::Holder {
                pid: c.meta.pid,
                command: c.meta.command.clone(),
                tokens: held(&c),
                since: epoch_seconds(c.meta.holding_since.unwrap_or(SystemTime::now())),
                transport: c.meta.transport.name().to_string(),
                build: c.build.0,
                stopped: crate::jobs::is_stopped(c.meta.pid),
            })
            .collect();
        holders.sort_by(|a, b| a.since.total_cmp(&b.since));
        let waiters = self.waiters(&waiting_in_regions);
        let t = self.books.pool.totals();
        let mut gates: Vec<status::Gate> = self
            .books
            .gates
            .views()
            .into_iter()
            .map(|v| self.gate_status(v))
            .collect();
        if let Some((since, grace)) = self.books.reclaim {
            gates.push(status::Gate {
                name: "reclaim".to_string(),
                open: false,
                value: Some((self.clock() - since).as_secs_f64()),
                threshold: grace.as_secs_f64(),
                closed_since: Some(epoch_seconds(self.books.started + since)),
            });
        }
        Status {
            builds: self.builds(),
            version: baton_core::protocol::VERSION,
            broker_pid: std::process::id(),
            limit: self.books.pool.limit(),
            free: self.books.pool.free(),
            held: self.books.pool.held(),
            holders,
            waiters,
            totals: status::Totals {
                granted: t.granted,
                released: t.released,
                reclaimed: t.reclaimed,
                waits: t.waits,
                clients: self.books.pool.clients().count() as u64,
                held_again: t.held_again,
                fastpath_repairs: self.fast_counts.repairs,
                fastpath_mismatches: self.fast_counts.mismatches,
            },
            gates,
            cluster: self.cluster.as_ref().map(ClusterLink::status),
            utilization: self.utilization(),
        }
    }

    fn gate_status(&self, view: baton_core::gates::GateView) -> status::Gate {
        status::Gate {
            name: view.kind.name().to_string(),
            open: view.open,
            value: view.value,
            threshold: view.threshold,
            closed_since: view
                .closed_since
                .map(|d| epoch_seconds(self.books.started + d)),
        }
    }
}

/// What the cluster link (docs/cluster.md) asks of the broker.
#[cfg(feature = "cluster")]
impl Broker {
    /// Joins a cluster pool: no grant until the link holds cluster tokens.
    pub fn join_cluster(&mut self, config: &Config) {
        self.cluster = Some(ClusterLink {
            pool: config.pool.clone(),
            endpoints: config.endpoints.clone(),
            limit: config.jobs,
            held: 0,
            contact: Contact::Reachable,
            watch_events: 0,
        });
        self.refresh_cap();
    }

    /// The cluster link holds `held` cluster tokens, as sure as `contact`
    /// says (docs/cluster.md): grants stop at what that allows. Returns
    /// the demand under the new cap.
    pub fn set_cluster_held(&mut self, held: u32, contact: Contact) -> Local {
        self.tick();
        if let Some(cluster) = &mut self.cluster {
            cluster.held = held;
            cluster.contact = contact;
        }
        self.refresh_cap();
        self.cluster_demand()
    }

    /// The cluster link received `events` watch events.
    pub fn note_watch_events(&mut self, events: u64) {
        if let Some(cluster) = &mut self.cluster {
            cluster.watch_events += events;
        }
    }

    /// What the local pool holds and waits for, for the cluster link.
    pub fn cluster_demand(&self) -> Local {
        let held = self.books.pool.held();
        let waiting: u32 = self.books.pool.queue().map(|(_, _, tokens)| tokens).sum();
        let room = self
            .gate_allowance
            .map_or(u32::MAX, |allowed| allowed.saturating_sub(held));
        Local {
            held,
            waiting: waiting.min(room),
            limit: self.books.pool.limit(),
        }
    }

    /// Calls `hook` whenever what the local pool holds or waits for may
    /// have changed. It runs on the loop: it must only wake.
    pub fn on_demand(&mut self, hook: impl Fn() + Send + Sync + 'static) {
        self.demand_hook = Some(GrantHook(Box::new(hook)));
    }
}

fn epoch_seconds(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| (d.as_secs_f64() * 1000.0).round() / 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(broker: &mut Broker, pid: u32) -> ClientId {
        broker.connect(ClientMeta::new(
            pid,
            format!("client {pid}"),
            Transport::Socket,
        ))
    }

    /// A build's starter is read from /proc once, but only for the process
    /// it was read for: once another client is the one shown (the first
    /// left), its own uid and cgroup are read, not the first one's.
    #[test]
    fn the_starter_shown_is_read_for_the_process_shown() {
        let first = Starter {
            pid: 1,
            uid: Some(4242),
            cgroup: Some("/the-first-one".into()),
        };
        let stats = BuildStats {
            began: SystemTime::now(),
            waits: Histogram::default(),
            stray: 0,
            starter: first,
        };
        let cached = Broker::starter_of(Some(&stats), 1);
        assert_eq!(
            (cached.uid, cached.cgroup.as_deref()),
            (Some(4242), Some("/the-first-one"))
        );
        let me = std::process::id();
        let shown = Broker::starter_of(Some(&stats), me);
        assert_eq!(shown.pid, me);
        assert_eq!(shown.uid, crate::jobs::uid_of(me));
        assert_eq!(shown.cgroup, crate::sys::cgroup_of(&me.to_string()));
        assert_ne!(
            shown.uid,
            Some(4242),
            "the first starter's uid, for another process"
        );
    }

    /// While builds of a dead broker re-attach, their HOLDs count and no
    /// request is served; after, requests are served from what is left.
    #[test]
    fn nothing_is_granted_while_builds_re_attach() {
        let mut broker = Broker::new(2).unwrap();
        broker.start_reclaim(Duration::from_secs(60));
        let (newcomer, old_build) = (client(&mut broker, 1), client(&mut broker, 2));
        assert!(!broker.try_acquire(newcomer, 1).unwrap());
        assert_eq!(broker.acquire(newcomer, 1, 1).unwrap(), Acquired::Queued);
        assert!(broker
            .status()
            .gates
            .iter()
            .any(|g| g.name == "reclaim" && !g.open));

        broker.hold(old_build, 2).unwrap();
        broker.end_reclaim();
        assert!(
            broker.take_grants(Transport::Socket).is_empty(),
            "the old build holds both tokens"
        );
        assert!(broker.status().gates.is_empty());

        broker.release(old_build, 1).unwrap();
        let grants = broker.take_grants(Transport::Socket);
        assert_eq!(
            grants
                .iter()
                .map(|g| (g.client, g.tokens))
                .collect::<Vec<_>>(),
            [(newcomer, 1)]
        );
        assert_eq!((broker.pool().held(), broker.pool().free()), (2, 0));
    }

    /// The memory gate's slow start allows one job while nothing has
    /// settled: a request for two, with nothing held, passes whole rather
    /// than never; with tokens held, it waits until they come back.
    #[test]
    fn a_request_wider_than_the_gates_allow_passes_once_nothing_is_held() {
        let mut broker = Broker::new(4).unwrap();
        broker.set_gates(GateConfig {
            min_mem_available: Some(1 << 20),
            ..GateConfig::default()
        });
        broker.observe(Reading {
            mem_available: Some(1 << 40),
            mem_pressure: None,
            runnable: None,
        });
        let (a, b) = (client(&mut broker, 1), client(&mut broker, 2));
        let granted = |broker: &mut Broker| {
            broker
                .take_grants(Transport::Socket)
                .iter()
                .map(|g| (g.client, g.tokens))
                .collect::<Vec<_>>()
        };

        broker.acquire(a, 1, 2).unwrap();
        assert_eq!(granted(&mut broker), [(a, 2)]);
        assert_eq!(broker.acquire(b, 1, 2).unwrap(), Acquired::Queued);
        assert!(
            granted(&mut broker).is_empty(),
            "a's young jobs use up what the slow start allows"
        );
        broker.release(a, 2).unwrap();
        assert_eq!(granted(&mut broker), [(b, 2)]);
        broker.release(b, 2).unwrap();
        assert_eq!((broker.pool().held(), broker.pool().free()), (0, 4));
    }

    fn joined(broker: &mut Broker, pid: u32, transport: Transport) -> ClientId {
        broker.connect(ClientMeta::new(pid, format!("client {pid}"), transport))
    }

    /// Seconds since the epoch, computed apart from `epoch_seconds`.
    fn epoch_now() -> f64 {
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
    }

    /// Processes started for a test, killed and reaped when it ends.
    struct Procs(Vec<std::process::Child>);

    impl Procs {
        /// A process as a build's `baton run` (no marker), or one of its
        /// jobs (`owner` in its environment).
        fn spawn(&mut self, owner: Option<u32>) -> u32 {
            let mut cmd = std::process::Command::new("sleep");
            cmd.arg("60");
            if let Some(owner) = owner {
                cmd.env(crate::jobs::RUN_PID_VAR, owner.to_string());
            }
            self.start(&mut cmd)
        }

        fn start(&mut self, cmd: &mut std::process::Command) -> u32 {
            let child = crate::jobs::spawn_copied_tool(cmd);
            let pid = child.id();
            self.0.push(child);
            pid
        }

        /// A build tool of `owner`'s build (a `sleep` called make) from
        /// `dir`.
        fn spawn_make(&mut self, dir: &std::path::Path, owner: u32) -> u32 {
            let make = dir.join("make");
            std::fs::create_dir_all(dir).unwrap();
            std::fs::copy("/bin/sleep", &make).unwrap();
            let mut cmd = std::process::Command::new(&make);
            cmd.arg("60")
                .env(crate::jobs::RUN_PID_VAR, owner.to_string());
            self.start(&mut cmd)
        }

        /// Waits until `jobs` processes of `owner`'s build are seen in
        /// /proc: a process just spawned may not show its environment yet.
        fn await_jobs(&self, owner: u32, jobs: u32) {
            let session = crate::jobs::session_of(std::process::id()).unwrap();
            let ns = crate::sys::pid_namespace_of("self").unwrap();
            let deadline = Instant::now() + Duration::from_secs(30);
            while crate::jobs::orphan_jobs(owner, session, ns) != jobs {
                assert!(Instant::now() < deadline, "the jobs never showed");
                std::thread::yield_now();
            }
        }

        fn kill(&mut self, pid: u32) {
            let i = self.0.iter().position(|c| c.id() == pid).unwrap();
            let mut child = self.0.remove(i);
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    impl Drop for Procs {
        fn drop(&mut self) {
            for child in &mut self.0 {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }

    #[test]
    fn status_names_each_holders_transport() {
        let mut broker = Broker::new(4).unwrap();
        let (s, f) = (
            joined(&mut broker, 1, Transport::Socket),
            joined(&mut broker, 2, Transport::Fuse),
        );
        broker.try_acquire(s, 1).unwrap();
        broker.try_acquire(f, 1).unwrap();
        let mut seen: Vec<(u32, String)> = broker
            .status()
            .holders
            .into_iter()
            .map(|h| (h.pid, h.transport))
            .collect();
        seen.sort();
        assert_eq!(seen, [(1, "socket".into()), (2, "fuse".into())]);
    }

    #[test]
    fn status_lists_as_holders_only_clients_that_hold_tokens() {
        let mut broker = Broker::new(4).unwrap();
        let (a, _idle) = (client(&mut broker, 1), client(&mut broker, 2));
        broker.acquire(a, 1, 3).unwrap();
        let holders = broker.status().holders;
        assert_eq!(
            holders
                .iter()
                .map(|h| (h.pid, h.tokens))
                .collect::<Vec<_>>(),
            [(1, 3)]
        );
    }

    #[test]
    fn a_holder_holds_since_the_wall_clock_time_of_its_grant() {
        let mut broker = Broker::new(4).unwrap();
        let a = client(&mut broker, 1);
        let before = epoch_now();
        broker.acquire(a, 1, 1).unwrap();
        let after = epoch_now();
        let since = broker.status().holders[0].since;
        assert!(
            since >= before - 0.01 && since <= after + 0.01,
            "{before} <= {since} <= {after}"
        );
    }

    #[test]
    fn holding_since_is_set_by_a_grant_or_hold_and_cleared_when_all_is_released() {
        let mut broker = Broker::new(4).unwrap();
        let (a, b) = (client(&mut broker, 1), client(&mut broker, 2));
        let since = |broker: &Broker, id| broker.pool().meta(id).unwrap().holding_since;
        broker.acquire(a, 1, 2).unwrap();
        let first = since(&broker, a).expect("a holds since its grant");
        broker.try_acquire(a, 1).unwrap();
        assert_eq!(since(&broker, a), Some(first), "a held already");
        broker.release(a, 1).unwrap();
        assert_eq!(since(&broker, a), Some(first), "a still holds 2");
        broker.release(a, 2).unwrap();
        assert_eq!(since(&broker, a), None);
        assert!(broker.try_acquire(a, 1).unwrap());
        assert!(since(&broker, a).is_some());
        broker.hold(b, 1).unwrap();
        assert!(since(&broker, b).is_some(), "a HOLD holds too");
    }

    #[test]
    fn wanted_counts_requests_waiting_free_tokens_a_gate_and_a_lowered_limit() {
        let mut broker = Broker::new(4).unwrap();
        let (a, b) = (client(&mut broker, 1), client(&mut broker, 2));
        assert_eq!(broker.wanted(a), (0, 4));
        broker.acquire(a, 1, 3).unwrap();
        assert_eq!(broker.wanted(a), (0, 1));
        assert_eq!(broker.acquire(b, 1, 2).unwrap(), Acquired::Queued);
        assert_eq!(broker.wanted(a), (2, 1), "b waits for 2");
        broker.cancel(b, 1);
        assert_eq!(broker.wanted(a), (0, 1));
        broker.set_gate("load", Some(100.0)).unwrap();
        assert_eq!(broker.wanted(a), (1, 1), "a gate wants every token back");
        broker.set_gate("load", None).unwrap();
        broker.set_limit(1).unwrap();
        assert_eq!(broker.wanted(a), (2, 0), "3 held past a limit of 1");
    }

    #[test]
    fn cancel_returns_the_tokens_the_request_waited_for_and_drops_the_waiter() {
        let mut broker = Broker::new(2).unwrap();
        let (a, b) = (client(&mut broker, 1), client(&mut broker, 2));
        broker.acquire(a, 1, 2).unwrap();
        assert_eq!(broker.acquire(b, 7, 2).unwrap(), Acquired::Queued);
        assert_eq!(broker.status().waiters.len(), 1);
        assert_eq!(broker.cancel(b, 7), 2);
        assert!(broker.status().waiters.is_empty());
        assert_eq!(broker.cancel(b, 7), 0, "nothing waits under that tag now");
        broker.release(a, 2).unwrap();
        assert!(broker.take_grants(Transport::Socket).is_empty());
    }

    #[test]
    fn set_limit_returns_the_old_limit_and_grants_what_a_higher_one_frees() {
        let mut broker = Broker::new(2).unwrap();
        let (a, b) = (client(&mut broker, 1), client(&mut broker, 2));
        broker.acquire(a, 1, 2).unwrap();
        assert_eq!(broker.acquire(b, 1, 2).unwrap(), Acquired::Queued);
        assert_eq!(broker.set_limit(5), Ok(2));
        let grants = broker.take_grants(Transport::Socket);
        assert_eq!(
            grants
                .iter()
                .map(|g| (g.client, g.tokens))
                .collect::<Vec<_>>(),
            [(b, 2)]
        );
        assert_eq!(broker.set_limit(3), Ok(5));
        assert_eq!(broker.status().limit, 3);
    }

    #[test]
    fn set_gate_returns_the_threshold_set_and_refuses_bad_names_and_values() {
        let mut broker = Broker::new(2).unwrap();
        assert_eq!(broker.set_gate("load", Some(3.5)), Ok(Some(3.5)));
        assert_eq!(broker.gate_config().max_load, Some(3.5));
        assert_eq!(broker.set_gate("load", None), Ok(None));
        assert_eq!(broker.gate_config().max_load, None);
        assert!(broker.set_gate("load", Some(-1.0)).is_err());
        assert!(broker.set_gate("no-such-gate", Some(1.0)).is_err());
    }

    #[test]
    fn the_gates_are_urgent_while_any_job_is_stopped() {
        // The gates' thread goes on resuming stopped jobs only while this
        // says urgent, whatever the memory gate says.
        let mut broker = Broker::new(2).unwrap();
        assert!(!broker.gates_urgent());
        broker.did_pause(3, 1);
        assert_eq!(broker.books.gates.stopped(), 3);
        broker.did_resume(2);
        assert_eq!(broker.books.gates.stopped(), 2);
        assert!(broker.gates_urgent());
        broker.did_resume(3);
        assert!(broker.gates_urgent(), "one still stopped");
        broker.did_resume(4);
        assert_eq!(broker.books.gates.stopped(), 0);
        assert!(!broker.gates_urgent());
    }

    #[test]
    fn client_pids_are_every_connected_clients_pid() {
        let mut broker = Broker::new(2).unwrap();
        let a = client(&mut broker, 11);
        client(&mut broker, 12);
        let mut pids = broker.client_pids();
        pids.sort_unstable();
        assert_eq!(pids, [11, 12]);
        broker.disconnect(a);
        assert_eq!(broker.client_pids(), [12]);
    }

    #[test]
    fn status_lists_builds_that_hold_wait_or_were_granted_but_not_idle_askers() {
        let mut broker = Broker::new(1).unwrap();
        let (done, holder, waiter, _asker) = (
            client(&mut broker, 1),
            client(&mut broker, 2),
            client(&mut broker, 3),
            client(&mut broker, 4),
        );
        broker.acquire(done, 1, 1).unwrap();
        broker.release(done, 1).unwrap();
        broker.acquire(holder, 1, 1).unwrap();
        assert_eq!(broker.acquire(waiter, 1, 1).unwrap(), Acquired::Queued);
        let mut listed: Vec<u32> = broker.status().builds.iter().map(|b| b.pid).collect();
        listed.sort_unstable();
        assert_eq!(listed, [1, 2, 3], "4 only asked");
    }

    #[test]
    fn a_builds_wait_figures_stay_while_another_of_its_clients_remains() {
        let mut broker = Broker::new(4).unwrap();
        // A pid no process has: its only ancestor is itself.
        let pid = 4_000_000_000 - std::process::id();
        let root = client(&mut broker, pid);
        broker.start_build(root, 1, "the build".into()).unwrap();
        let member = client(&mut broker, pid);
        assert_eq!(broker.pool().build_of(member), broker.pool().build_of(root));
        broker.acquire(member, 1, 1).unwrap();
        broker.acquire(member, 2, 1).unwrap();
        assert_eq!(broker.disconnect(member), 2);
        let builds = broker.status().builds;
        assert_eq!(builds.len(), 1);
        assert_eq!((builds[0].name.as_str(), builds[0].waits), ("the build", 2));
        assert!(builds[0].since > 0.0);
    }

    #[test]
    fn status_now_charges_each_build_for_the_time_it_held_tokens() {
        let mut broker = Broker::new(4).unwrap();
        let a = client(&mut broker, 1);
        let began = Instant::now();
        broker.acquire(a, 1, 2).unwrap();
        let status = broker.status_now();
        let held_for = began.elapsed().as_secs_f64();
        let charged = status.builds[0].token_seconds;
        assert!(
            charged > 0.0 && charged <= 2.0 * held_for,
            "{charged} token-seconds for 2 tokens over {held_for} s"
        );
    }

    #[test]
    fn utilization_is_reported_per_second_over_ten_minutes() {
        let broker = Broker::new(4).unwrap();
        let u = broker.status().utilization;
        assert_eq!(u.interval_s, 1.0);
    }

    /// A successor gets the books as the JSON brokers before this one
    /// wrote them (a successor may be newer than its predecessor, or
    /// older): the same keys, maps as lists of pairs, grants by transport
    /// as one list; and it carries on with the same books.
    #[test]
    fn the_books_travel_under_the_names_and_shapes_they_always_had() {
        let mut broker = Broker::new(1).unwrap();
        let (a, b) = (client(&mut broker, 1), client(&mut broker, 2));
        broker.start_build(a, 3, "named".into()).unwrap();
        broker.acquire(a, 1, 1).unwrap();
        assert_eq!(broker.acquire(b, 1, 1).unwrap(), Acquired::Queued);
        broker.release(a, 1).unwrap(); // a grant for b, not yet delivered
        let json = serde_json::to_value(broker.snapshot()).unwrap();
        let mut keys: Vec<&str> = json
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.as_str())
            .collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "carried",
                "clock",
                "gates",
                "names",
                "orphaned",
                "pool",
                "reclaim",
                "roots",
                "sessions",
                "started",
                "undelivered"
            ]
        );
        assert_eq!(json["roots"], serde_json::json!([[1, a.0]]), "{json}");
        let build = broker.books.pool.build_of(a).unwrap().0;
        assert_eq!(json["names"], serde_json::json!([[build, "named"]]));
        assert_eq!(json["undelivered"][0][0], serde_json::json!("Socket"));
        assert_eq!(json["undelivered"][0][1]["client"], serde_json::json!(b.0));
        let state: BrokerState = serde_json::from_value(json).unwrap();
        let mut next = Broker::restore(state).unwrap();
        assert_eq!(next.books.roots, broker.books.roots);
        assert_eq!(next.books.names, broker.books.names);
        let grants = next.take_grants(Transport::Socket);
        assert_eq!(grants.len(), 1, "the grant is the successor's to deliver");
        assert_eq!(grants[0].client, b);
        assert_eq!(next.pool().held_by(b), 1);
    }

    /// A broker replaced while builds of a dead one re-attach: the
    /// successor grants nothing new until the grace it took over ends
    /// (the soak caught a newcomer granted the token a build still ran a
    /// job on, when a replacement came 160 ms after a restart).
    #[test]
    fn the_reclaim_grace_travels_to_a_successor() {
        let mut broker = Broker::new(2).unwrap();
        broker.start_reclaim(Duration::from_secs(60));
        let json = serde_json::to_value(broker.snapshot()).unwrap();
        let mut next = Broker::restore(serde_json::from_value(json).unwrap()).unwrap();
        let left = next.reclaim_left().expect("the grace goes on");
        assert!(
            left <= Duration::from_secs(60) && left > Duration::from_secs(50),
            "{left:?}"
        );
        let newcomer = client(&mut next, 1);
        assert!(
            !next.try_acquire(newcomer, 1).unwrap(),
            "nothing new in the grace"
        );
        assert!(next
            .status()
            .gates
            .iter()
            .any(|g| g.name == "reclaim" && !g.open));
        next.end_reclaim();
        assert_eq!(next.reclaim_left(), None);
        assert!(next.try_acquire(newcomer, 1).unwrap());
        assert_eq!(Broker::new(2).unwrap().reclaim_left(), None);
    }

    #[test]
    fn the_reclaim_gate_closed_when_the_grace_began_not_before() {
        let mut state = Broker::new(2).unwrap().snapshot();
        // A predecessor whose clock ran 100 s: the pool's clock goes on
        // from there.
        state.began = Instant::now() - Duration::from_secs(100);
        state.started = SystemTime::now() - Duration::from_secs(100);
        let mut broker = Broker::restore(state).unwrap();
        let before = epoch_now();
        broker.start_reclaim(Duration::from_secs(30));
        let after = epoch_now();
        let gate = broker
            .status()
            .gates
            .into_iter()
            .find(|g| g.name == "reclaim")
            .unwrap();
        let closed = gate.closed_since.unwrap();
        assert!(
            closed >= before - 1.0 && closed <= after + 1.0,
            "{before} <= {closed} <= {after}"
        );
        assert_eq!(gate.threshold, 30.0);
        // Its value is how long the grace has run: not the pool's age.
        let value = gate.value.unwrap();
        assert!((0.0..30.0).contains(&value), "{value} s");
    }

    /// A memory gate that closes on a broker whose clock ran 100 s says
    /// when it closed as a time of day, now.
    #[test]
    fn a_closed_gate_says_when_it_closed() {
        let mut state = Broker::new(2).unwrap().snapshot();
        state.began = Instant::now() - Duration::from_secs(100);
        state.started = SystemTime::now() - Duration::from_secs(100);
        let mut broker = Broker::restore(state).unwrap();
        broker.set_gates(GateConfig {
            min_mem_available: Some(1 << 30),
            ..GateConfig::default()
        });
        let before = epoch_now();
        broker.observe(Reading {
            mem_available: Some(1 << 20),
            ..Reading::default()
        });
        let after = epoch_now();
        let gate = broker.status().gates.remove(0);
        assert_eq!((gate.name.as_str(), gate.open), ("mem-available", false));
        let closed = gate.closed_since.unwrap();
        assert!(
            closed >= before - 1.0 && closed <= after + 1.0,
            "{before} <= {closed} <= {after}"
        );
    }

    #[test]
    fn watch_orphans_says_none_is_left_when_no_build_was_orphaned() {
        let mut broker = Broker::new(2).unwrap();
        client(&mut broker, 1);
        assert!(!broker.has_orphans());
        assert!(!broker.watch_orphans());
    }

    /// A `baton run` killed while its build runs 5 jobs on the 2 tokens
    /// it held: its client stays, holding one token per job, and gives
    /// them back as the jobs end.
    /// A sub-make left running reads the jobserver its `baton run` left:
    /// while it lives, no job's end gives a token back; once it is gone,
    /// one per job stays until the last ends.
    #[test]
    fn an_orphaned_build_keeps_all_it_holds_while_a_build_tool_of_it_lives() {
        let dir = std::env::temp_dir().join(format!("baton-orphan-make-{}", std::process::id()));
        let mut procs = Procs(Vec::new());
        let owner = procs.spawn(None);
        let jobs: Vec<u32> = (0..2).map(|_| procs.spawn(Some(owner))).collect();
        let make = procs.spawn_make(&dir, owner);
        procs.await_jobs(owner, 3);
        let mut broker = Broker::new(8).unwrap();
        let run = client(&mut broker, owner);
        broker.start_build(run, 1, "orphan".into()).unwrap();
        broker.acquire(run, 1, 5).unwrap();
        assert_eq!(broker.disconnect(run), 0, "it keeps its tokens");
        assert_eq!(broker.pool().held(), 5, "all it held, though 3 run");
        procs.kill(jobs[0]);
        assert!(broker.watch_orphans());
        assert_eq!(broker.pool().held(), 5, "a job's end gives none back");
        procs.kill(make);
        assert!(broker.watch_orphans());
        assert_eq!(broker.pool().held(), 1, "one for the job left");
        procs.kill(jobs[1]);
        assert!(!broker.watch_orphans());
        assert_eq!(broker.pool().held(), 0);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn an_orphaned_build_holds_a_token_per_job_until_its_last_job_ends() {
        let mut procs = Procs(Vec::new());
        let owner = procs.spawn(None);
        let jobs: Vec<u32> = (0..5).map(|_| procs.spawn(Some(owner))).collect();
        procs.await_jobs(owner, 5);
        let mut broker = Broker::new(8).unwrap();
        let run = client(&mut broker, owner);
        broker.start_build(run, 1, "orphan".into()).unwrap();
        broker.acquire(run, 1, 2).unwrap();
        assert_eq!(broker.disconnect(run), 0, "it keeps its tokens");
        assert!(broker.has_orphans());
        assert_eq!(broker.pool().held(), 5, "one per job, more than it held");
        let holders = broker.status().holders;
        assert_eq!(holders.len(), 1);
        assert!(holders[0].command.starts_with("[orphaned] "));
        for &job in &jobs[..3] {
            procs.kill(job);
        }
        assert!(broker.watch_orphans());
        assert_eq!(broker.pool().held(), 2);
        for &job in &jobs[3..] {
            procs.kill(job);
        }
        assert!(!broker.watch_orphans());
        assert!(!broker.has_orphans());
        assert_eq!(
            (broker.pool().held(), broker.pool().clients().count()),
            (0, 0)
        );
    }

    /// A build's root is forgotten with its own connection, and only
    /// then: after another build's root leaves, a process under the first
    /// still joins the first build.
    #[test]
    fn a_builds_root_outlives_another_builds_departure() {
        let mut broker = Broker::new(2).unwrap();
        let ours = client(&mut broker, std::process::id());
        broker.start_build(ours, 1, "ours".into()).unwrap();
        let other = client(&mut broker, 1);
        broker.start_build(other, 1, "other".into()).unwrap();
        broker.disconnect(other);
        let later = client(&mut broker, std::process::id());
        assert_eq!(
            broker.pool().build_of(later),
            broker.pool().build_of(ours),
            "still a member of the first build"
        );
    }

    /// Orphaned with 2 jobs on the 4 tokens it held: 2 come back at once;
    /// a job started later takes no token at the next look (only the
    /// moment of death may count more than it held), and a request the
    /// build had waiting goes with its `baton run`, while another build's
    /// stays.
    #[test]
    fn an_orphaned_build_gives_back_what_its_jobs_do_not_use_and_takes_no_more() {
        let mut procs = Procs(Vec::new());
        let owner = procs.spawn(None);
        procs.spawn(Some(owner));
        procs.spawn(Some(owner));
        procs.await_jobs(owner, 2);
        let mut broker = Broker::new(5).unwrap();
        let woken = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        broker.on_orphans({
            let woken = woken.clone();
            move || woken.store(true, std::sync::atomic::Ordering::SeqCst)
        });
        let run = client(&mut broker, owner);
        broker.start_build(run, 1, "orphan".into()).unwrap();
        broker.acquire(run, 1, 4).unwrap();
        let other = client(&mut broker, 1);
        broker.acquire(other, 1, 1).unwrap();
        assert_eq!(broker.acquire(run, 2, 1).unwrap(), Acquired::Queued);
        // Another tag than run's: the request cancelled must be run's own,
        // not whichever has its tag.
        assert_eq!(broker.acquire(other, 3, 1).unwrap(), Acquired::Queued);
        assert_eq!(broker.disconnect(run), 0);
        assert!(
            woken.load(std::sync::atomic::Ordering::SeqCst),
            "the watcher is woken"
        );
        // 2 of its 4 back, to the other build's waiting request.
        assert_eq!(broker.pool().held_by(run), 2);
        assert_eq!(broker.pool().held_by(other), 2);
        let waiters = broker.status().waiters;
        assert!(waiters.is_empty(), "{waiters:?}");
        procs.spawn(Some(owner));
        procs.await_jobs(owner, 3);
        assert!(broker.watch_orphans());
        assert_eq!(broker.pool().held_by(run), 2, "a later job takes no token");
        assert_eq!(
            broker.status().totals.held_again,
            0,
            "nothing counted again"
        );
    }

    /// At its death the build runs more jobs than it held: the difference
    /// is counted again (as HOLD counts), exactly.
    #[test]
    fn an_orphaned_build_counts_again_only_the_jobs_beyond_what_it_held() {
        let mut procs = Procs(Vec::new());
        let owner = procs.spawn(None);
        for _ in 0..5 {
            procs.spawn(Some(owner));
        }
        procs.await_jobs(owner, 5);
        let mut broker = Broker::new(8).unwrap();
        let run = client(&mut broker, owner);
        broker.start_build(run, 1, "orphan".into()).unwrap();
        broker.acquire(run, 1, 2).unwrap();
        broker.disconnect(run);
        assert_eq!(broker.pool().held_by(run), 5);
        assert_eq!(broker.status().totals.held_again, 3);
    }

    /// make dies holding 2 while its build runs 2 jobs and its `baton
    /// run` holds 1 of its own: the jobs beyond what the build's others
    /// hold (2 - 1) stay with the build, the rest come back.
    #[test]
    fn a_dying_member_leaves_the_build_only_what_its_others_do_not_cover() {
        let mut procs = Procs(Vec::new());
        let owner = procs.spawn(None);
        procs.spawn(Some(owner));
        procs.spawn(Some(owner));
        procs.await_jobs(owner, 2);
        let mut broker = Broker::new(8).unwrap();
        let run = client(&mut broker, owner);
        broker.start_build(run, 1, "covered".into()).unwrap();
        broker.acquire(run, 1, 1).unwrap();
        let make = client(&mut broker, owner);
        broker.acquire(make, 1, 2).unwrap();
        broker.disconnect(make);
        assert_eq!(broker.pool().held_by(run), 2, "its own 1 and 1 of make's");
        assert_eq!(broker.pool().held(), 2);
    }

    #[test]
    fn a_build_is_given_the_weight_it_asks_for() {
        let mut broker = Broker::new(4).unwrap();
        let run = client(&mut broker, std::process::id());
        let (_, weight) = broker.start_build(run, 3, "heavy".into()).unwrap();
        assert_eq!(weight, 3);
    }

    /// A build's figures go with its last client; another's stay.
    #[test]
    fn a_builds_figures_are_forgotten_when_it_ends() {
        let mut broker = Broker::new(2).unwrap();
        let (a, b) = (client(&mut broker, 1), client(&mut broker, 2));
        broker.acquire(a, 1, 1).unwrap();
        broker.acquire(b, 1, 1).unwrap();
        assert_eq!(broker.stats.len(), 2);
        broker.disconnect(a);
        let left: Vec<BuildId> = broker.stats.keys().copied().collect();
        assert_eq!(left, vec![broker.pool().build_of(b).unwrap()]);
        broker.disconnect(b);
        assert!(broker.stats.is_empty());
    }

    /// The gates' sampler is woken when the gates are set, and only then.
    #[test]
    fn setting_the_gates_wakes_their_thread() {
        use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
        let mut broker = Broker::new(1).unwrap();
        let woken = std::sync::Arc::new(AtomicU32::new(0));
        broker.on_gates_set({
            let n = woken.clone();
            move || {
                n.fetch_add(1, SeqCst);
            }
        });
        let a = client(&mut broker, 1);
        broker.acquire(a, 1, 1).unwrap();
        broker.set_limit(2).unwrap();
        assert_eq!(woken.load(SeqCst), 0);
        broker.set_gate("load", Some(50.0)).unwrap();
        assert_eq!(woken.load(SeqCst), 1);
    }

    /// A cluster's link is woken whenever what the pool holds or waits
    /// for may have changed.
    #[cfg(feature = "cluster")]
    #[test]
    fn demand_changes_wake_the_cluster_link() {
        use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
        let mut broker = Broker::new(1).unwrap();
        let woken = std::sync::Arc::new(AtomicU32::new(0));
        broker.on_demand({
            let n = woken.clone();
            move || {
                n.fetch_add(1, SeqCst);
            }
        });
        let (a, b) = (client(&mut broker, 1), client(&mut broker, 2));
        broker.acquire(a, 1, 1).unwrap();
        assert_eq!(broker.acquire(b, 1, 1).unwrap(), Acquired::Queued);
        let after_wait = woken.load(SeqCst);
        assert!(after_wait >= 1, "a request that waits changes demand");
        broker.release(a, 1).unwrap();
        assert!(woken.load(SeqCst) > after_wait, "so does a release");
        let before = woken.load(SeqCst);
        broker.set_limit(2).unwrap();
        assert!(woken.load(SeqCst) > before, "and a new limit");
    }

    /// A broker of 4 tokens whose memory gate (1 GiB) has seen 8 GiB free
    /// and counts a grant as young for an hour.
    fn broker_with_a_memory_gate() -> Broker {
        let mut broker = Broker::new(4).unwrap();
        broker.set_gates(GateConfig {
            min_mem_available: Some(1 << 30),
            settle: Duration::from_secs(3600),
            ..GateConfig::default()
        });
        broker.observe(Reading {
            mem_available: Some(8 << 30),
            ..Reading::default()
        });
        broker
    }

    /// Before the memory gate knows what a job takes, one job at a time
    /// starts: a grant counts as a young job until it settles.
    #[test]
    fn a_grant_counts_as_a_young_job_for_the_memory_gate() {
        let mut broker = broker_with_a_memory_gate();
        let (a, b) = (client(&mut broker, 1), client(&mut broker, 2));
        assert_eq!(broker.acquire(a, 1, 1).unwrap(), Acquired::Granted);
        // A fresh reading recomputes the cap: it must still count the
        // grant as young (not only the cap computed before it).
        broker.observe(Reading {
            mem_available: Some(8 << 30),
            ..Reading::default()
        });
        assert_eq!(
            broker.acquire(b, 1, 1).unwrap(),
            Acquired::Queued,
            "the first job is still young"
        );
    }

    /// What the cluster link asks of the cluster is what the gates would
    /// let through, not every token waited for.
    #[cfg(feature = "cluster")]
    #[test]
    fn the_cluster_is_asked_only_for_what_the_gates_let_through() {
        let mut broker = broker_with_a_memory_gate();
        let (a, b) = (client(&mut broker, 1), client(&mut broker, 2));
        broker.acquire(a, 1, 1).unwrap();
        assert_eq!(broker.acquire(b, 1, 3).unwrap(), Acquired::Queued);
        let local = broker.cluster_demand();
        assert_eq!((local.held, local.waiting), (1, 0));
    }

    /// Utilization is reported per slot, to the hundredth of a token.
    #[test]
    fn utilization_is_the_mean_held_per_second_to_two_places() {
        let mut broker = Broker::new(4).unwrap();
        let second = HISTORY_SLOT.as_nanos() as u64;
        broker.utilization = Utilization::new(second, HISTORY_SLOTS);
        // [0, 0.5 s): none; [0.5 s, 1 s): 3; then a third of a second of 1.
        broker.utilization.advance(second / 2, 0);
        broker.utilization.advance(second, 3);
        broker.utilization.advance(second + second / 3, 1);
        broker.utilization.advance(2 * second, 0);
        let report = broker.utilization();
        assert_eq!(report.interval_s, 1.0);
        assert_eq!(report.held, vec![1.5, 0.33]);
    }

    /// A build started by another user, or from another cgroup (a
    /// container's), says so in status; one of the broker's own does not.
    #[test]
    fn a_builds_uid_and_cgroup_are_shown_only_when_not_the_brokers() {
        if !nix::unistd::getuid().is_root() {
            return baton_testkit::skip(
                baton_testkit::Missing::Root,
                "setuid and cgroups need root",
            );
        }
        let Some(unified) = std::fs::read_to_string("/proc/self/mounts")
            .unwrap()
            .lines()
            .find(|l| l.split(' ').nth(2) == Some("cgroup2"))
            .and_then(|l| l.split(' ').nth(1).map(std::path::PathBuf::from))
        else {
            return baton_testkit::skip(baton_testkit::Missing::Cgroup, "no cgroup2 mount");
        };
        let name = format!("baton-broker-test-{}", std::process::id());
        let group = unified.join(&name);
        std::fs::create_dir(&group).unwrap();
        struct Removed(std::path::PathBuf);
        impl Drop for Removed {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir(&self.0);
            }
        }
        let _removed = Removed(group.clone());
        let mut stranger = std::process::Command::new("sleep");
        stranger.arg("60");
        std::os::unix::process::CommandExt::uid(&mut stranger, 65534);
        let mut procs = Procs(vec![stranger.spawn().unwrap()]);
        let stranger = procs.0[0].id();
        std::fs::write(group.join("cgroup.procs"), stranger.to_string()).unwrap();
        let own = procs.spawn(None);
        let mut broker = Broker::new(4).unwrap();
        let (theirs, ours) = (client(&mut broker, stranger), client(&mut broker, own));
        broker.start_build(theirs, 1, "theirs".into()).unwrap();
        broker.start_build(ours, 1, "ours".into()).unwrap();
        let builds = broker.status().builds;
        let of = |name: &str| builds.iter().find(|b| b.name == name).unwrap();
        assert_eq!(of("theirs").uid, Some(65534));
        assert_eq!(
            of("theirs").cgroup.as_deref(),
            Some(format!("/{name}").as_str())
        );
        assert_eq!((of("ours").uid, of("ours").cgroup.clone()), (None, None));
        drop(procs);
    }

    /// A broker that joins a cluster pool grants nothing until its link
    /// holds cluster tokens, and then no more than it holds; the link's
    /// watch events add up in status.
    #[cfg(feature = "cluster")]
    #[test]
    fn a_cluster_member_grants_only_what_its_link_holds() {
        let mut broker = Broker::new(4).unwrap();
        broker.join_cluster(&Config {
            endpoints: vec!["http://127.0.0.1:1".into()],
            pool: "test".into(),
            jobs: 8,
            ttl: Duration::from_secs(10),
            linger: Duration::from_secs(1),
            watch_all: false,
        });
        let a = client(&mut broker, 1);
        assert_eq!(broker.acquire(a, 1, 2).unwrap(), Acquired::Queued);
        let local = broker.set_cluster_held(1, Contact::Reachable);
        assert_eq!((local.held, local.waiting, local.limit), (0, 2, 4));
        let b = client(&mut broker, 2);
        assert_eq!(
            broker.acquire(b, 1, 1).unwrap(),
            Acquired::Queued,
            "one held, none free"
        );
        let local = broker.set_cluster_held(3, Contact::Reachable);
        assert_eq!(local.held, 3, "the wide request, then the next");
        broker.note_watch_events(2);
        broker.note_watch_events(3);
        let cluster = broker.status().cluster.unwrap();
        assert_eq!(
            (cluster.held, cluster.limit, cluster.watch_events),
            (3, 8, 5)
        );
    }

    #[test]
    fn stray_bytes_add_up_per_build() {
        let mut broker = Broker::new(2).unwrap();
        let (a, b) = (client(&mut broker, 1), client(&mut broker, 2));
        broker.acquire(a, 1, 1).unwrap();
        broker.acquire(b, 1, 1).unwrap();
        assert_eq!(broker.note_stray(a, 3), 3);
        assert_eq!(broker.note_stray(a, 2), 5);
        assert_eq!(broker.note_stray(b, 1), 1, "another build's count");
    }

    /// Memory is measured often while the pause policy may have to act.
    #[test]
    fn the_gates_are_urgent_below_the_memory_threshold_with_pausing_on() {
        let mut broker = Broker::new(4).unwrap();
        assert!(!broker.gates_urgent());
        broker.set_gates(GateConfig {
            min_mem_available: Some(1 << 30),
            pause: true,
            ..GateConfig::default()
        });
        broker.observe(Reading {
            mem_available: Some(8 << 30),
            ..Reading::default()
        });
        assert!(!broker.gates_urgent(), "plenty of memory");
        broker.observe(Reading {
            mem_available: Some(1 << 20),
            ..Reading::default()
        });
        assert!(broker.gates_urgent(), "below the threshold");
    }

    /// A CANCEL that meets a grant not yet delivered takes exactly that
    /// client's grant for that request.
    #[test]
    fn a_filed_grant_is_taken_by_its_client_and_request_only() {
        let mut broker = Broker::new(2).unwrap();
        let (a, b, c) = (
            client(&mut broker, 1),
            client(&mut broker, 2),
            client(&mut broker, 3),
        );
        broker.acquire(a, 1, 2).unwrap();
        assert_eq!(broker.acquire(b, 7, 1).unwrap(), Acquired::Queued);
        assert_eq!(broker.acquire(c, 7, 1).unwrap(), Acquired::Queued);
        broker.release(a, 2).unwrap();
        assert_eq!(
            broker.take_grant_of(Transport::Socket, b, 8),
            None,
            "another request"
        );
        assert_eq!(
            broker.take_grant_of(Transport::Fuse, b, 7),
            None,
            "another transport"
        );
        let taken = broker.take_grant_of(Transport::Socket, b, 7).unwrap();
        assert_eq!((taken.client, taken.tag), (b, 7));
        let left = broker.take_grants(Transport::Socket);
        assert_eq!(left.len(), 1);
        assert_eq!((left[0].client, left[0].tag), (c, 7));
    }

    #[test]
    fn grants_wait_for_the_transport_that_delivers_them() {
        let mut broker = Broker::new(1).unwrap();
        let (a, b) = (client(&mut broker, 1), client(&mut broker, 2));
        assert!(!broker.has_grants_for(Transport::Socket));
        broker.acquire(a, 1, 1).unwrap();
        assert_eq!(broker.acquire(b, 1, 1).unwrap(), Acquired::Queued);
        broker.release(a, 1).unwrap();
        assert!(broker.has_grants_for(Transport::Socket));
        assert!(!broker.has_grants_for(Transport::Fuse));
        assert_eq!(broker.take_grants(Transport::Socket).len(), 1);
        assert!(!broker.has_grants_for(Transport::Socket));
    }

    #[test]
    fn a_build_that_holds_nothing_is_not_kept_for_its_running_jobs() {
        let mut procs = Procs(Vec::new());
        let owner = procs.spawn(None);
        procs.spawn(Some(owner));
        procs.await_jobs(owner, 1);
        let mut broker = Broker::new(8).unwrap();
        let run = client(&mut broker, owner);
        broker.start_build(run, 1, "idle".into()).unwrap();
        assert_eq!(broker.disconnect(run), 0);
        assert!(!broker.has_orphans());
        assert_eq!(broker.pool().clients().count(), 0);
    }

    #[test]
    fn a_build_whose_run_ends_with_no_job_running_gives_its_tokens_back() {
        let mut procs = Procs(Vec::new());
        let owner = procs.spawn(None);
        let mut broker = Broker::new(8).unwrap();
        let run = client(&mut broker, owner);
        broker.start_build(run, 1, "done".into()).unwrap();
        broker.acquire(run, 1, 3).unwrap();
        assert_eq!(broker.disconnect(run), 3);
        assert!(!broker.has_orphans());
        assert_eq!(broker.pool().held(), 0);
    }

    /// make (another client of the build) dies holding 2 tokens while the
    /// build runs 2 jobs: they pass to the build's `baton run`, and the
    /// status counts those jobs as running.
    #[test]
    fn tokens_of_a_dying_member_pass_to_the_builds_owner_while_its_jobs_run() {
        let mut procs = Procs(Vec::new());
        let owner = procs.spawn(None);
        procs.spawn(Some(owner));
        procs.spawn(Some(owner));
        procs.await_jobs(owner, 2);
        let mut broker = Broker::new(8).unwrap();
        let run = client(&mut broker, owner);
        broker.start_build(run, 1, "handed".into()).unwrap();
        let make = client(&mut broker, owner);
        assert_eq!(broker.pool().build_of(make), broker.pool().build_of(run));
        broker.acquire(make, 1, 2).unwrap();
        assert_eq!(broker.status().builds[0].running, Some(2));
        broker.disconnect(make);
        assert_eq!(broker.pool().held_by(run), 2);
        assert_eq!(broker.pool().held(), 2);
    }

    /// A request that waited 1.5 s is counted in the build's wait figures
    /// as 1500 ms.
    #[test]
    fn a_builds_waits_are_reported_in_milliseconds() {
        let mut broker = Broker::new(1).unwrap();
        let (a, b) = (client(&mut broker, 1), client(&mut broker, 2));
        broker.acquire(a, 1, 1).unwrap();
        let began = Instant::now();
        assert_eq!(broker.acquire(b, 1, 1).unwrap(), Acquired::Queued);
        // As if b had asked 1.5 s ago.
        let asked = SystemTime::now() - Duration::from_millis(1500);
        broker
            .books
            .pool
            .meta_mut(b)
            .unwrap()
            .waiting_since
            .insert(1, asked);
        broker.release(a, 1).unwrap();
        let took_ms = began.elapsed().as_secs_f64() * 1000.0;
        let status = broker.status();
        let build = status.builds.iter().find(|x| x.pid == 2).unwrap();
        assert_eq!(build.waits, 1);
        let total = build.wait_ms_total;
        assert!(
            total >= 1500.0 && total <= 1500.0 + took_ms + 1.0,
            "{total} ms"
        );
        let p99 = build.wait_ms_p99.unwrap();
        assert!((1500.0..2000.0).contains(&p99), "{p99} ms");
    }
}
