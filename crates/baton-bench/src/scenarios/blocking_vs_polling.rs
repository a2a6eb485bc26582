//! GNU make waits in pselect() and a non-blocking read, so it
//! herds even on a kernel whose pipe wakes one blocked reader per byte.
//! The same job runners wait in each way, on a pipe and on baton.

use super::{job_runners, Bench, Defaults, Findings, Scale};
use crate::mechanisms::Mechanism;
use anyhow::Result;

pub const DEFAULTS: Defaults = Defaults {
    waiters: &[64],
    ops: 2_000,
    tokens: 2,
    job_us: 1_000,
    wake: 1,
};

const MECHANISMS: &[Mechanism] = &[
    Mechanism::PipeBlocking,
    Mechanism::PipePoll,
    Mechanism::BatonNative,
    Mechanism::BatonPoll,
    Mechanism::BatonFastpath,
    Mechanism::BatonFastpathPile,
    Mechanism::BatonFuse,
    Mechanism::BatonFuseNotifyAll,
];

pub fn run(bench: &Bench, scale: &Scale) -> Result<Findings> {
    job_runners::run(bench, scale, "blocking-vs-polling", MECHANISMS)
}
