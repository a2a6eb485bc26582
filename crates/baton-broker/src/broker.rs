//! The pool plus what the transports need around it: who each client is,
//! since when it holds or waits, and where its grants must be delivered.
//!
//! One `Broker` is shared by every transport behind a mutex. A call that
//! frees tokens returns grants; [`Broker::route`] files each under the
//! transport that owns the client, and that transport's thread is woken to
//! deliver them. Nothing here blocks or does I/O besides reading the clock.

use baton_core::gates::{GateConfig, Gates, Reading};
use baton_core::status::{self, Status};
use baton_core::{Acquired, BuildId, ClientId, Grant, Pool, PoolError, Tag};
use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

/// Which way a client came in. Grants are routed by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    /// A connection to the native socket (including `baton run`).
    Socket,
    /// A process using the FUSE token file.
    Fuse,
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Transport::Socket => "socket",
            Transport::Fuse => "fuse",
        }
    }
}

/// What the broker remembers about a client besides its tokens.
#[derive(Debug, Clone)]
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
        ClientMeta { pid, command, transport, holding_since: None, waiting_since: HashMap::new() }
    }
}

/// Tells a transport's thread that grants wait for it (see [`Broker::on_grants`]).
pub struct GrantHook(Box<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for GrantHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GrantHook")
    }
}

/// The pool with its clients' metadata and undelivered grants.
#[derive(Debug)]
pub struct Broker {
    pool: Pool<ClientMeta>,
    undelivered: HashMap<Transport, Vec<Grant>>,
    hooks: HashMap<Transport, GrantHook>,
    /// The memory and load gates (none configured: no cap).
    gates: Gates,
    /// The clients that started builds (BUILD), by pid: a client whose
    /// process descends from one joins its build.
    roots: HashMap<u32, ClientId>,
    /// Names given with BUILD.
    names: HashMap<BuildId, String>,
    /// The pool's clock and the gates' start here (see [`Pool::advance`]),
    /// with the wall-clock time that instant was.
    started: (Instant, SystemTime),
}

impl Broker {
    pub fn new(limit: u32) -> Result<Self, PoolError> {
        Ok(Broker {
            pool: Pool::new(limit)?,
            undelivered: HashMap::new(),
            hooks: HashMap::new(),
            gates: Gates::new(GateConfig::default()),
            roots: HashMap::new(),
            names: HashMap::new(),
            started: (Instant::now(), SystemTime::now()),
        })
    }

    /// Brings the pool's clock to now, so that what each build held
    /// meanwhile counts towards its share. Called before every change.
    fn tick(&mut self) {
        let grants = self.pool.advance(self.started.0.elapsed().as_nanos() as u64);
        self.route(grants);
    }

    /// Calls `hook` whenever a call files grants for `transport`, so that
    /// whichever thread caused them, the transport's own thread learns of
    /// them. The hook runs under the broker lock: it must only wake.
    pub fn on_grants(&mut self, transport: Transport, hook: impl Fn() + Send + Sync + 'static) {
        self.hooks.insert(transport, GrantHook(Box::new(hook)));
    }

    pub fn pool(&self) -> &Pool<ClientMeta> {
        &self.pool
    }

    /// A new client joins the build of the nearest ancestor process that
    /// started one, or is a build of its own.
    pub fn connect(&mut self, meta: ClientMeta) -> ClientId {
        self.tick();
        // Reading /proc costs a little at every connect: only when a build exists.
        let root = if self.roots.is_empty() {
            None
        } else {
            crate::fuse::procs::ancestors(meta.pid).find_map(|pid| self.roots.get(&pid).copied())
        };
        match root {
            Some(root) => self.pool.connect_beside(root, meta),
            None => self.pool.connect(meta),
        }
    }

    /// The client starts a build (`baton run`): processes under it join
    /// it. A client already in a build started above it (a `baton run`
    /// inside another) stays there, and the outer build's name and weight
    /// hold.
    pub fn start_build(&mut self, id: ClientId, weight: u32, name: String) -> Result<(BuildId, u32), PoolError> {
        let build = self.pool.build_of(id).ok_or(PoolError::UnknownClient(id))?;
        let meta = self.pool.meta(id).expect("the client is connected");
        let (pid, command) = (meta.pid, meta.command.clone());
        let nested = crate::fuse::procs::ancestors(pid).skip(1).any(|p| self.roots.contains_key(&p));
        if !nested {
            self.pool.set_weight(id, weight)?;
            let name = if name.is_empty() { command } else { name };
            self.names.insert(build, name);
            self.roots.insert(pid, id);
        }
        let weight = self.pool.builds().find(|b| b.id == build).map_or(1, |b| b.weight);
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
        let machine = u32::from(self.gates.config().any());
        (self.pool.waiting_ahead(id).max(machine), self.pool.free())
    }

    pub fn acquire(&mut self, id: ClientId, tag: Tag, tokens: u32) -> Result<Acquired, PoolError> {
        self.tick();
        let outcome = self.pool.acquire(id, tag, tokens)?;
        let meta = self.pool.meta_mut(id).expect("acquire checked the client");
        match outcome {
            Acquired::Granted => {
                Self::note_holding(meta);
                self.note_granted(tokens);
            }
            Acquired::Queued => {
                meta.waiting_since.insert(tag, SystemTime::now());
            }
        }
        Ok(outcome)
    }

    pub fn try_acquire(&mut self, id: ClientId, tokens: u32) -> Result<bool, PoolError> {
        self.tick();
        let granted = self.pool.try_acquire(id, tokens)?;
        if granted {
            Self::note_holding(self.pool.meta_mut(id).expect("try_acquire checked the client"));
            self.note_granted(tokens);
        }
        Ok(granted)
    }

    /// A client that just got tokens holds since now, unless it already held
    /// some (release clears the time when it holds none).
    fn note_holding(meta: &mut ClientMeta) {
        meta.holding_since.get_or_insert_with(SystemTime::now);
    }

    /// Gives tokens back; grants that follow are routed to their transports.
    pub fn release(&mut self, id: ClientId, tokens: u32) -> Result<(), PoolError> {
        self.tick();
        let grants = self.pool.release(id, tokens)?;
        if self.pool.held_by(id) == 0 {
            self.pool.meta_mut(id).expect("release checked the client").holding_since = None;
        }
        self.route(grants);
        Ok(())
    }

    /// Withdraws a pending request; returns the tokens it waited for.
    pub fn cancel(&mut self, id: ClientId, tag: Tag) -> u32 {
        // Withdrawn before the clock moves: moving it may grant this very
        // request, which the caller would then answer after CANCELLED.
        let (tokens, grants) = self.pool.cancel(id, tag);
        if let Some(meta) = self.pool.meta_mut(id) {
            meta.waiting_since.remove(&tag);
        }
        self.route(grants);
        self.tick();
        tokens
    }

    /// Forgets a client; returns the tokens reclaimed from it.
    pub fn disconnect(&mut self, id: ClientId) -> u32 {
        self.tick();
        self.roots.retain(|_, &mut root| root != id);
        let (reclaimed, grants) = self.pool.disconnect(id);
        let pool = &self.pool;
        self.names.retain(|&build, _| pool.builds().any(|b| b.id == build));
        self.route(grants);
        reclaimed
    }

    pub fn set_limit(&mut self, limit: u32) -> Result<u32, PoolError> {
        self.tick();
        let old = self.pool.limit();
        let grants = self.pool.set_limit(limit)?;
        self.route(grants);
        Ok(old)
    }

    /// Takes the grants waiting for delivery by one transport.
    pub fn take_grants(&mut self, transport: Transport) -> Vec<Grant> {
        self.undelivered.remove(&transport).unwrap_or_default()
    }

    /// Takes one client's grant that is filed but not yet delivered, if
    /// any: a CANCEL read before the transport delivered it must be
    /// answered after it, so the client learns it holds the tokens.
    pub fn take_grant_of(&mut self, transport: Transport, client: ClientId, tag: Tag) -> Option<Grant> {
        let filed = self.undelivered.get_mut(&transport)?;
        let pos = filed.iter().position(|g| g.client == client && g.tag == tag)?;
        Some(filed.remove(pos))
    }

    /// Configures the gates (`--min-mem-available` and the others); an
    /// empty configuration removes them and lifts the cap they set.
    pub fn set_gates(&mut self, config: GateConfig) {
        let now = self.clock();
        self.gates.set_config(config, now);
        self.refresh_cap();
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
        self.gates.config()
    }

    /// A new measurement of the machine: the gates open or close on it.
    pub fn observe(&mut self, reading: Reading) {
        let (held, now) = (self.pool.held(), self.clock());
        self.gates.observe(reading, held, now);
        self.refresh_cap();
    }

    fn clock(&self) -> Duration {
        self.started.0.elapsed()
    }

    /// Tokens just handed out count as young jobs for the memory gate, and
    /// use up part of what it allows.
    fn note_granted(&mut self, tokens: u32) {
        if self.gates.config().any() {
            let now = self.clock();
            self.gates.granted(tokens, now);
            self.refresh_cap();
        }
    }

    /// Sets the pool's admission cap to what the gates allow now, and
    /// delivers any grants a higher cap lets through.
    fn refresh_cap(&mut self) {
        let cap = self.gates.allowance(self.pool.held(), self.started.0.elapsed());
        let grants = self.pool.set_admission_cap(cap);
        self.route(grants);
    }

    fn route(&mut self, grants: Vec<Grant>) {
        if grants.is_empty() {
            return;
        }
        let granted = grants.iter().map(|g| g.tokens).sum();
        self.file(grants);
        self.note_granted(granted);
    }

    /// Files each grant under its client's transport and wakes those.
    fn file(&mut self, grants: Vec<Grant>) {
        let now = SystemTime::now();
        let mut woken = Vec::new();
        for grant in grants {
            let meta = self.pool.meta_mut(grant.client).expect("grants go to connected clients");
            meta.waiting_since.remove(&grant.tag);
            meta.holding_since.get_or_insert(now);
            self.undelivered.entry(meta.transport).or_default().push(grant);
            if !woken.contains(&meta.transport) {
                woken.push(meta.transport);
            }
        }
        for transport in woken {
            if let Some(GrantHook(hook)) = self.hooks.get(&transport) {
                hook();
            }
        }
    }

    /// Every build, for status.
    fn builds(&self) -> Vec<status::Build> {
        // One pass over the clients, not one per build.
        let mut firsts = HashMap::new();
        for c in self.pool.clients() {
            firsts.entry(c.build).or_insert(c);
        }
        self.pool
            .builds()
            .map(|b| {
                let first = firsts.remove(&b.id);
                let root = self.roots.values().find(|&&root| self.pool.build_of(root) == Some(b.id));
                let pid = root.and_then(|&r| self.pool.meta(r)).or(first.as_ref().map(|c| c.meta)).map_or(0, |m| m.pid);
                let name = self.names.get(&b.id).cloned().or_else(|| first.map(|c| c.meta.command.clone())).unwrap_or_default();
                status::Build {
                    name,
                    pid,
                    weight: b.weight,
                    held: b.held,
                    waiting: b.waiting,
                    grants: b.granted,
                    token_seconds: b.token_time as f64 / 1e9,
                }
            })
            .collect()
    }

    /// The document `STATUS` returns.
    pub fn status(&self) -> Status {
        let mut holders: Vec<_> = self
            .pool
            .clients()
            .filter(|c| c.held > 0)
            .map(|c| status::Holder {
                pid: c.meta.pid,
                command: c.meta.command.clone(),
                tokens: c.held,
                since: epoch_seconds(c.meta.holding_since.unwrap_or(SystemTime::now())),
                transport: c.meta.transport.name().to_string(),
            })
            .collect();
        holders.sort_by(|a, b| a.since.total_cmp(&b.since));
        let waiters = self
            .pool
            .queue()
            .map(|(id, tag, tokens)| {
                let meta = self.pool.meta(id).expect("waiters are connected");
                status::Waiter {
                    pid: meta.pid,
                    command: meta.command.clone(),
                    tokens,
                    since: epoch_seconds(meta.waiting_since.get(&tag).copied().unwrap_or(SystemTime::now())),
                    transport: meta.transport.name().to_string(),
                }
            })
            .collect();
        let t = self.pool.totals();
        let gates = self.gates.views().into_iter().map(|v| self.gate_status(v)).collect();
        Status {
            builds: self.builds(),
            version: baton_core::protocol::VERSION,
            broker_pid: std::process::id(),
            limit: self.pool.limit(),
            free: self.pool.free(),
            held: self.pool.held(),
            holders,
            waiters,
            totals: status::Totals {
                granted: t.granted,
                released: t.released,
                reclaimed: t.reclaimed,
                waits: t.waits,
                clients: self.pool.clients().count() as u64,
            },
            gates,
        }
    }

    fn gate_status(&self, view: baton_core::gates::GateView) -> status::Gate {
        status::Gate {
            name: view.kind.name().to_string(),
            open: view.open,
            value: view.value,
            threshold: view.threshold,
            closed_since: view.closed_since.map(|d| epoch_seconds(self.started.1 + d)),
        }
    }
}

fn epoch_seconds(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH).map_or(0.0, |d| (d.as_secs_f64() * 1000.0).round() / 1000.0)
}
