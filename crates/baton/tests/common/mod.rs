//! The fixtures baton's integration tests share live in baton-testkit
//! (crates/baton-testkit), with those of baton-bench and baton-broker;
//! each test file's `mod common;` reaches them here.
#![allow(unused_imports)] // each test file uses a different part

pub use baton_testkit::*;
