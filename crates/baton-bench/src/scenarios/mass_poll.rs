//! FreeBSD's `make universe` (scalebsd.org, 2018): hundreds of sub-makes poll one token
//! pipe, and every freed token wakes them all. Measured against N, beside
//! baton's ways in and, where installed, stress-ng's pipe-herd figure.

use super::{job_runners, Bench, Defaults, Findings, Scale};
use crate::mechanisms::Mechanism;
use crate::stress_ng;
use anyhow::Result;

pub const DEFAULTS: Defaults = Defaults {
    waiters: &[16, 64, 256, 1024],
    ops: 2_000,
    tokens: 2,
    job_us: 1_000,
    wake: 1,
};

// baton's FUSE token file joins this list when it exists.
const MECHANISMS: &[Mechanism] = &[
    Mechanism::PipePoll,
    Mechanism::PosixSemaphore,
    Mechanism::FutexFifo,
    Mechanism::BatonNative,
    Mechanism::BatonNativeNoSpin,
    Mechanism::BatonNativeNoUring,
    Mechanism::BatonPoll,
    Mechanism::BatonFastpath,
    Mechanism::FastpathPile,
    Mechanism::BatonFastpathPile,
    Mechanism::BatonFuse,
];

pub fn run(bench: &Bench, scale: &Scale) -> Result<Findings> {
    let mut findings = job_runners::run(bench, scale, "mass-poll", MECHANISMS)?;
    match stress_ng::pipeherd()? {
        Some(row) => findings.rows.push(row),
        None => findings
            .notes
            .push("stress-ng is not installed: no --pipeherd figure".to_string()),
    }
    Ok(findings)
}
