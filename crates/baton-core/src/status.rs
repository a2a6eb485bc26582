//! The document `STATUS` returns and `baton status --json` prints. Its
//! fields are documented in docs/protocol.md; add fields, never rename.

use serde::{Deserialize, Serialize};

/// The broker's state at one moment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Status {
    /// Protocol version the broker speaks.
    pub version: u32,
    /// Process id of the broker.
    pub broker_pid: u32,
    /// The pool's limit: how many tokens exist.
    pub limit: u32,
    /// Tokens nobody holds.
    pub free: u32,
    /// Tokens held, over all holders (may exceed `limit` while a lowered
    /// limit drains).
    pub held: u32,
    /// Clients holding at least one token, longest-holding first.
    pub holders: Vec<Holder>,
    /// Pending requests, oldest first.
    pub waiters: Vec<Waiter>,
    /// Every build (a `baton run` and the clients under it, or a native
    /// client on its own), in the order they began. Absent from brokers
    /// that predate builds.
    #[serde(default)]
    pub builds: Vec<Build>,
    /// Running totals since the broker started.
    pub totals: Totals,
    /// The memory and load gates that are configured (docs/adaptive.md);
    /// empty if none.
    #[serde(default)]
    pub gates: Vec<Gate>,
    /// The cluster pool the broker is in (docs/cluster.md); absent if none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<Cluster>,
    /// Tokens held over the last minutes. Absent from brokers that
    /// predate it.
    #[serde(default)]
    pub utilization: Utilization,
}

/// A pool shared with other brokers through etcd.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    /// The pool's name.
    pub pool: String,
    /// The etcd endpoints the broker uses.
    pub endpoints: Vec<String>,
    /// Tokens in the pool, across every broker.
    pub limit: u32,
    /// Cluster tokens this broker holds.
    pub held: u32,
    /// "reachable"; "unreachable" (etcd does not answer, the lease surely
    /// lives: grants go on within what is held); "lost" (the lease may
    /// have expired: no grant).
    pub contact: String,
    /// Every broker of the pool that holds or waits, as etcd has them.
    /// The broker sends it empty (it never waits on etcd to answer);
    /// `baton status` fills it by asking etcd itself.
    #[serde(default)]
    pub brokers: Vec<ClusterBroker>,
    /// Watch events the broker's link has received from etcd: each one
    /// woke it (`baton bench cluster` counts them per grant).
    #[serde(default)]
    pub watch_events: u64,
}

/// One broker of a cluster pool, as etcd has it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterBroker {
    /// The machine it runs on.
    pub host: String,
    /// Its process id there.
    pub pid: u32,
    /// Cluster tokens it holds.
    pub held: u32,
    /// Whether it is queued for one more.
    pub waiting: bool,
}

/// The pool's use over time: the mean tokens held in each interval.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Utilization {
    /// The length of an interval, in seconds.
    pub interval_s: f64,
    /// Mean tokens held in each completed interval, oldest first; at most
    /// ten minutes' worth.
    pub held: Vec<f64>,
}

/// A gate that holds tokens back while the machine is short of memory or
/// CPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gate {
    /// "mem-available", "mem-pressure" or "load".
    pub name: String,
    /// Whether it lets new tokens out.
    pub open: bool,
    /// The last reading: bytes, percent, or runnable tasks; null if this
    /// machine does not offer the figure.
    pub value: Option<f64>,
    /// The configured threshold, in the same unit.
    pub threshold: f64,
    /// When it closed: seconds since the Unix epoch; null while open.
    pub closed_since: Option<f64>,
}

/// A client holding tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Holder {
    /// Process id of the holder (from the socket's peer credentials, or the
    /// process reading the FUSE token file).
    pub pid: u32,
    /// Its command line or the label it gave in HELLO.
    pub command: String,
    /// Tokens it holds.
    pub tokens: u32,
    /// When it went from holding none to holding some: seconds since the
    /// Unix epoch.
    pub since: f64,
    /// Which way it came in: "socket", "jobserver" or "fuse".
    pub transport: String,
    /// The `id` of its build.
    #[serde(default)]
    pub build: u64,
    /// The holder, or a process it started, is stopped (SIGSTOP, `^Z`):
    /// its tokens wait with it while other builds may wait for them.
    /// Absent (false) from brokers that predate it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stopped: bool,
}

/// A request waiting for tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Waiter {
    /// Process id of the waiting client.
    pub pid: u32,
    /// Its command line or label.
    pub command: String,
    /// Tokens it waits for.
    pub tokens: u32,
    /// When it started waiting: seconds since the Unix epoch.
    pub since: f64,
    /// Which way it came in.
    pub transport: String,
    /// The `id` of its build.
    #[serde(default)]
    pub build: u64,
}

/// A build and its use of the pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Build {
    /// Identifies it among the builds of this broker (holders and waiters
    /// name it).
    #[serde(default)]
    pub id: u64,
    /// Its name (`baton run --name`), or its first client's label.
    pub name: String,
    /// Process id of the client that started it.
    pub pid: u32,
    /// Its share of a busy pool is in proportion to this.
    pub weight: u32,
    /// Tokens its clients hold.
    pub held: u32,
    /// Tokens its clients wait for.
    pub waiting: u32,
    /// Tokens granted to it so far.
    pub grants: u64,
    /// Tokens held × seconds, so far: its use of the pool.
    pub token_seconds: f64,
    /// When it began: seconds since the Unix epoch.
    #[serde(default)]
    pub since: f64,
    /// Its ACQUIREs answered so far (TRY does not wait, and is not counted).
    #[serde(default)]
    pub waits: u64,
    /// How long they waited in all, in milliseconds.
    #[serde(default)]
    pub wait_ms_total: f64,
    /// Half of them waited at most this long, in milliseconds (0: granted
    /// at once); null before the first. Read from buckets 1/8 wide: at
    /// most 12.5% above the true figure.
    #[serde(default)]
    pub wait_ms_p50: Option<f64>,
    /// 99% of them waited at most this long, likewise.
    #[serde(default)]
    pub wait_ms_p99: Option<f64>,
    /// Jobs its processes run now, counted from /proc beside the tokens
    /// it holds (issue #32): processes of the build with no child among
    /// them, build tools (make, ninja, cargo...) not counted. Absent where
    /// the broker cannot see the build's processes (not a `baton run`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running: Option<u32>,
    /// Bytes its jobserver held that the pool never lent, taken out by
    /// `baton run` so far (`STRAY`, issue #32).
    #[serde(default)]
    pub stray: u32,
    /// The uid its starter runs as, as the broker sees it (a container's
    /// mapped uid is its uid on the host); absent when it is the broker's
    /// own, or the process is gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Its starter's cgroup (the cgroup v2 path in /proc/PID/cgroup, as
    /// the broker sees it: a container's, say); absent when it is the
    /// broker's own, or unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
}

/// Counters since the broker started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Totals {
    /// Tokens granted.
    pub granted: u64,
    /// Tokens given back by their holders.
    pub released: u64,
    /// Tokens taken back from clients that went away holding them.
    pub reclaimed: u64,
    /// Requests that had to wait.
    pub waits: u64,
    /// Clients connected now.
    pub clients: u64,
    /// Tokens counted again (`HOLD`) for builds re-attaching after their
    /// broker died: held above the limit for a while, never created.
    #[serde(default)]
    pub held_again: u64,
    /// Fast-path seats repaired after their client's connection closed
    /// (docs/fastpath.md): every seat's end, a kill's included.
    #[serde(default)]
    pub fastpath_repairs: u64,
    /// Fast-path audits that found a region's count and the books apart,
    /// twice in a row: each one closed its region for good.
    #[serde(default)]
    pub fastpath_mismatches: u64,
}
