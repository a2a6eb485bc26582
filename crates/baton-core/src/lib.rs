//! The heart of baton: a pool of job tokens that hands each freed token to
//! exactly one waiter, and the wire protocol clients use to ask for them.
//!
//! Nothing here does I/O. The broker's transports (Unix socket, GNU
//! jobserver bridge, FUSE token file) and the client libraries drive these
//! types, which keeps the invariants testable step by step.
#![deny(missing_docs)]

pub mod cluster;
pub mod fastpath;
pub mod gates;
pub mod idle;
pub mod metrics;
pub mod paths;
mod pool;
pub mod protocol;
mod share;
pub mod status;

pub use pool::{
    Acquired, BuildView, ClientId, ClientView, Grant, Pool, PoolError, PoolTotals, RestoreError,
    Tag, MAX_LIMIT,
};
pub use share::{BuildId, MAX_WEIGHT};
