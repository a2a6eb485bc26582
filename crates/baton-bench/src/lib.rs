//! baton bench.
