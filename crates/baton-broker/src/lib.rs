//! The baton broker: one process that owns a pool of job tokens and serves
//! it over a Unix socket (the native protocol, docs/protocol.md) and a FUSE
//! token file (docs/fuse.md).
//!
//! Its public face is what `baton serve` needs and no more: a
//! [`ServeOptions`] value and [`serve`], which runs until SIGTERM or SIGINT.
//! The pool and its policy live in `baton-core`; this crate turns sockets,
//! FUSE requests and process exits into calls on it.
//!
//! - `broker`: the pool with each client's metadata and the grants each
//!   transport still has to deliver.
//! - `mailbox`: the event loop owns the broker and the token files; other
//!   threads reach the broker by errands through a mailbox.
//! - `socket`: the event loop (mio): the native protocol's connections, the
//!   FUSE device, errands; with `spin` (when to look for the next message
//!   before sleeping) and `uring` (send replies and sleep in one system
//!   call).
//! - `session`: one connection's side of the protocol, with no I/O.
//! - `fuse`: the FUSE token file server.
//! - `sys`: the one door to /proc and the process system calls.
//! - `gates`: measuring memory, memory pressure and the run queue for
//!   the gates (`baton_core::gates` decides).
//! - `jobs`: the jobs under the clients, in /proc, for pausing.
//! - `triggers`: kernel notifications (PSI triggers, cgroup v1 memory
//!   thresholds) that wake the gates' thread.
//! - `paths`: the socket's directory, lock and stale-socket checks.
//! - `admission`: who may connect (SO_PEERCRED; `--allow-uid`,
//!   `--allow-group`), and what others admitted may do.
//! - `activation`: the listening socket systemd passes (socket activation).
//! - `cluster`: joining a cluster pool in etcd (the `cluster` feature).
//! - `handover`: passing the running state to a successor (`--replace`).
//! - `metrics`: the figures in the Prometheus text format, and the HTTP
//!   endpoint `--metrics-listen` serves them on.
// The fuzzing feature makes undocumented internals public.
#![cfg_attr(not(feature = "fuzzing"), deny(missing_docs))]

mod activation;
mod admission;
mod broker;
mod cluster;
mod fastpath;
mod fuse;
mod gates;
mod handover;
mod jobs;
mod log;
mod mailbox;
pub mod metrics;
mod pairs;
mod paths;
mod serve;
mod session;
mod socket;
mod spin;
mod sys;
mod triggers;
mod uring;

pub use fuse::{Mode as FuseMode, Options as FuseOptions, ORPHAN_GRACE as FUSE_ORPHAN_GRACE};
pub use log::LogLevel;

/// Says why `baton serve` stops, as a line of the broker's log (with its
/// time and ERROR), so that the reason sits with the events before it.
pub fn log_fatal(message: &str) {
    log::error(format_args!("{message}"));
}
pub use admission::resolve_group;
pub use serve::{serve, ServeOptions};
pub use socket::MAX_CLIENTS;

/// The FUSE server's pure parts (who waits, reservations) and the native
/// protocol's sessions, with the pool they act on, for the fuzz targets
/// (fuzz/) only.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::admission::{Access, Admission};
    pub use crate::broker::{Broker, ClientMeta, Transport};
    pub use crate::fuse::waiters::{
        Caller, Fh, Mode, Pid, PollAnswer, PollCall, PollWaker, ReadReply, Waiters, HOLD,
        RESERVATION,
    };
    pub use crate::log::set_level as set_log_level;
    pub use crate::session::{Context, Session};
}
