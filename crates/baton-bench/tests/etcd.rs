//! The test etcd never outlives what started it: a test process killed
//! outright (a mutation run's timeout, `kill -9`) runs no destructor, and
//! an etcd left behind keeps its ports and data directory for ever.

use baton_bench::etcd::{Etcd, ETCD};
use baton_testkit::{skip, Missing};
use std::path::Path;
use std::time::{Duration, Instant};

/// Only a hang guard.
const GUARD: Duration = Duration::from_secs(60);

/// A member whose starter ends without dropping it (as a killed process
/// never does) is ended by the kernel, not left running.
#[test]
fn an_etcd_whose_starter_ends_without_dropping_it_is_ended() {
    if !Path::new(ETCD).exists() {
        return skip(Missing::Etcd, "no etcd (Debian's etcd-server)");
    }
    let dir = std::env::temp_dir().join(format!("baton-test-etcd-orphan-{}", std::process::id()));
    let started = dir.clone();
    // The starter is a thread of its own: the parent-death signal follows
    // the thread that forked, so its end stands for a killed process.
    let pid = std::thread::spawn(move || {
        let etcd = Etcd::start(1, &started).expect("etcd starts");
        let pid = etcd.members[0].pid().expect("a running member") as libc::pid_t;
        std::mem::forget(etcd);
        pid
    })
    .join()
    .unwrap();
    let ended = wait_for_exit(pid);
    if ended.is_none() {
        // SAFETY: our own child, not yet reaped, so the pid is still its.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        wait_for_exit(pid);
    }
    std::fs::remove_dir_all(&dir).unwrap();
    let signal = ended.expect("etcd still ran after its starter ended");
    assert_eq!(
        signal,
        libc::SIGKILL,
        "etcd ended by signal {signal}, not SIGKILL"
    );
}

/// Reaps `pid` and gives the signal that ended it, or None if it still
/// runs after the guard.
fn wait_for_exit(pid: libc::pid_t) -> Option<i32> {
    let start = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: a plain waitpid on our own child.
        let got = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        assert!(got >= 0, "waitpid: {}", std::io::Error::last_os_error());
        if got == pid {
            return Some(if libc::WIFSIGNALED(status) {
                libc::WTERMSIG(status)
            } else {
                0
            });
        }
        if start.elapsed() > GUARD {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
