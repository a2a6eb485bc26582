//! `baton bench` as a user runs it, through the real binary: a scenario
//! that cannot run fails at once and says why, and an interrupted bench
//! (Ctrl-C's SIGINT, `timeout`'s SIGTERM) leaves no temporary directory.
//! The binary is `BATON_BIN`, else the workspace's target/debug/baton.

use baton_testkit::{skip, Missing};
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Long enough for anything on a loaded machine; only a hang guard.
const GUARD: Duration = Duration::from_secs(120);

fn baton() -> Option<PathBuf> {
    let path = std::env::var_os("BATON_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/baton")
        });
    if path.is_file() {
        return Some(path);
    }
    skip(
        Missing::Baton,
        &format!(
            "no baton binary at {} (set BATON_BIN or build it)",
            path.display()
        ),
    );
    None
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < GUARD, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits for `child` to exit, killing it (by pid) if it outlives GUARD.
fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > GUARD {
            let _ = child.kill();
            let _ = child.wait();
            panic!("baton bench did not exit within {GUARD:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A bench stopped by `signal` while it measures: its directory, with the
/// broker's socket and log under it, is gone once it has stopped.
fn interrupted_bench_leaves_nothing(baton: &Path, signal: i32) {
    let mut bench = Command::new(baton);
    // As a terminal's Ctrl-C finds it: a shell that started the suite in
    // the background (`cmd &` without job control) leaves SIGINT ignored,
    // and an ignored disposition is inherited across exec.
    // SAFETY: signal(2) is async-signal-safe; nothing else runs between
    // fork and exec.
    unsafe {
        bench.pre_exec(move || {
            libc::signal(signal, libc::SIG_DFL);
            Ok(())
        })
    };
    let mut bench = bench
        .args([
            "bench",
            "token-ring",
            "--waiters",
            "4",
            "--ops",
            "1000000000",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start baton bench");
    let tmp = std::env::temp_dir().join(format!("baton-bench-{}", bench.id()));
    // Its first step's line: the directory exists and a measurement runs.
    let mut stderr = BufReader::new(bench.stderr.take().unwrap());
    let mut line = String::new();
    while !line.starts_with("[1/") {
        line.clear();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "baton bench ended before its first step"
        );
    }
    assert!(
        tmp.is_dir(),
        "{} exists while the bench runs",
        tmp.display()
    );
    // SAFETY: a signal to our own child, by pid.
    unsafe { libc::kill(bench.id() as i32, signal) };
    let status = wait_exit(&mut bench);
    assert!(!status.success(), "an interrupted bench does not succeed");
    wait_for(&format!("{} to be removed", tmp.display()), || {
        !tmp.exists()
    });
}

#[test]
fn an_interrupted_bench_leaves_no_temporary_directory() {
    let Some(baton) = baton() else { return };
    interrupted_bench_leaves_nothing(&baton, libc::SIGINT);
    interrupted_bench_leaves_nothing(&baton, libc::SIGTERM);
}

/// The cluster scenario with a broker that refuses `--etcd`, as a baton
/// built without the cluster feature does: the bench says the scenario
/// cannot run, quotes the broker, and exits non-zero, without waiting.
#[test]
fn a_scenario_that_cannot_run_says_so_and_fails() {
    let Some(_) = baton() else { return };
    if !Path::new(baton_bench::etcd::ETCD).exists() {
        return skip(
            Missing::Etcd,
            "no etcd (Debian's etcd-server): the cluster scenario starts one first",
        );
    }
    let dir = std::env::temp_dir().join(format!("baton-bench-refusal-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let refusing = dir.join("baton");
    std::fs::write(
        &refusing,
        "#!/bin/sh\necho 'baton: this baton was built without cluster pools' >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(
        &refusing,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let mut bench = Command::new(baton().unwrap())
        .args([
            "bench",
            "cluster",
            "--waiters",
            "1",
            "--ops",
            "5",
            "--baton-bin",
        ])
        .arg(&refusing)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start baton bench");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut bench.stderr.take().unwrap(), &mut err).unwrap();
    let status = wait_exit(&mut bench);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("the cluster scenario cannot run")
            && err.contains("built without cluster pools"),
        "{err}"
    );
}
