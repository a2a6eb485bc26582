//! `--on-memory-pressure pause` over random runs of readings and jobs: it
//! never stops a job below `min_jobs` running, never stops the first
//! started of the jobs that grow, never stops anything while memory is
//! above the threshold, lets a stopped job go on whenever nothing runs, and
//! lets no new token out while a job is stopped.

use baton_core::gates::{GateConfig, Gates, JobMemory, PauseAction, Reading};
use proptest::prelude::*;
use std::time::Duration;

const MIB: u64 = 1 << 20;
const MIN: u64 = 400 * MIB;

/// One moment: the memory available and the jobs that run then.
#[derive(Debug, Clone)]
struct Moment {
    available: u64,
    jobs: Vec<JobMemory>,
}

fn job() -> impl Strategy<Value = JobMemory> {
    (0u64..20, 0u64..500, proptest::option::of(0u64..500)).prop_map(|(started, mib, before)| {
        JobMemory {
            started,
            resident: mib * MIB,
            resident_before: before.map(|b| b * MIB),
        }
    })
}

fn moment() -> impl Strategy<Value = Moment> {
    (0u64..1000, proptest::collection::vec(job(), 0..6)).prop_map(|(mib, jobs)| Moment {
        available: mib * MIB,
        jobs,
    })
}

proptest! {
    #[test]
    fn pausing_keeps_its_promises(min_jobs in 1u32..3, moments in proptest::collection::vec(moment(), 1..40)) {
        let mut g = Gates::new(GateConfig { min_mem_available: Some(MIN), min_jobs, pause: true, ..GateConfig::default() });
        for (t, m) in moments.iter().enumerate() {
            let held = g.stopped() + m.jobs.len() as u32;
            g.observe(Reading { mem_available: Some(m.available), ..Reading::default() }, held, Duration::from_millis(t as u64 * 10));
            let running = m.jobs.len() as u32;
            match g.pause_action(&m.jobs) {
                PauseAction::Pause(picks) => {
                    prop_assert!(m.available < MIN, "stopped {picks:?} with memory above the threshold");
                    prop_assert!(running - picks.len() as u32 >= min_jobs, "{picks:?} of {running} leaves fewer than {min_jobs} running");
                    let mut sorted = picks.clone();
                    sorted.sort_unstable();
                    sorted.dedup();
                    prop_assert_eq!(sorted.len(), picks.len(), "a job picked twice");
                    prop_assert!(picks.iter().all(|&i| i < m.jobs.len()));
                    let growers: Vec<usize> = (0..m.jobs.len()).filter(|&i| m.jobs[i].growing()).collect();
                    if let Some(first) = growers.iter().map(|&i| m.jobs[i].started).min() {
                        let left = growers.iter().any(|&i| m.jobs[i].started == first && !picks.contains(&i));
                        prop_assert!(left, "every first started grower was stopped: {picks:?}");
                    }
                    g.did_pause(picks.len() as u32, running - picks.len() as u32);
                    prop_assert_eq!(g.allowance(held, None, Duration::from_millis(t as u64 * 10)), Some(held.max(min_jobs)), "a new token while a job is stopped");
                }
                PauseAction::Resume => {
                    prop_assert!(g.stopped() > 0, "resumed with nothing stopped");
                    g.did_resume(running + 1);
                }
                PauseAction::Nothing => {
                    prop_assert!(running > 0 || g.stopped() == 0, "nothing runs, yet a stopped job stays stopped");
                }
            }
        }
    }
}
