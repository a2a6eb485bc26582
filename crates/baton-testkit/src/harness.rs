//! A small test runner for test binaries that must keep their main thread
//! (`harness = false`): the broker and `baton run` block SIGTERM and read
//! it from a signalfd on the thread that serves, which works only if no
//! other thread of the process takes it first. Under libtest, each test
//! runs on a thread of its own and the main thread does not block it. A
//! binary with this runner serves on its main thread when started again
//! in a role ([`role`]), and otherwise runs its tests.
//!
//! It prints libtest's lines (`test NAME ... ok`, `test result: ...`),
//! which scripts/test tallies.

use std::process::Command;

/// The environment variable that names a re-executed binary's role.
const ROLE: &str = "BATON_TEST_ROLE";
/// And the role's specification (its options, one `key=value` a line).
const SPEC: &str = "BATON_TEST_SPEC";

/// This binary's role and its specification, when a test started it in
/// one ([`role_command`]).
pub fn role() -> Option<(String, String)> {
    let role = std::env::var(ROLE).ok()?;
    Some((role, std::env::var(SPEC).unwrap_or_default()))
}

/// This test binary, to be started in `role` with `spec`; it is sent
/// SIGTERM if the test that started it ends without stopping it
/// ([`dies_with_its_test`]).
pub fn role_command(role: &str, spec: &str) -> Command {
    let mut command = Command::new(std::env::current_exe().expect("the test binary"));
    command.env(ROLE, role).env(SPEC, spec);
    dies_with_its_test(&mut command);
    command
}

/// The process `command` starts is sent SIGTERM when the thread that
/// starts it (the test's) ends: a test killed at its timeout (cargo-mutants
/// kills a test binary that hangs) leaves no broker behind. SIGTERM, not
/// SIGKILL, so that a broker still unmounts its token files.
pub fn dies_with_its_test(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// The `key=value` lines of a specification.
pub fn spec_lines(spec: &str) -> impl Iterator<Item = (&str, &str)> {
    spec.lines()
        .map(|line| line.split_once('=').expect("a key=value line"))
}

/// Runs each test named by the filter (the first argument that is not an
/// option; all without one), one after another, each on a thread named
/// after it as libtest does (the skip record reads the name), and prints
/// libtest's lines. Returns the exit code: 101 if any failed, as libtest.
///
/// With `BATON_TEST_FAIL_FAST` set (scripts/mutants sets it), stops at
/// the first failure: a mutant is caught by one failing test, and each
/// further test that waits for what the mutant broke would spend its
/// whole hang guard before failing too, turning a catch into a timeout.
pub fn run(tests: &[(&str, fn())]) -> i32 {
    let filter = filter(std::env::args().skip(1));
    let fail_fast = std::env::var_os("BATON_TEST_FAIL_FAST").is_some();
    let chosen: Vec<_> = tests.iter().filter(|(n, _)| n.contains(&filter)).collect();
    println!("\nrunning {} tests", chosen.len());
    let started = std::time::Instant::now();
    let outcome = run_in_turn(&chosen, fail_fast);
    if !outcome.failed.is_empty() {
        println!("\nfailures:");
        for name in &outcome.failed {
            println!("    {name}");
        }
    }
    if outcome.not_run > 0 {
        println!(
            "\nstopped at the first failure (BATON_TEST_FAIL_FAST): {} not run",
            outcome.not_run
        );
    }
    let verdict = if outcome.failed.is_empty() {
        "ok"
    } else {
        "FAILED"
    };
    println!(
        "\ntest result: {verdict}. {} passed; {} failed; 0 ignored; 0 measured; {} filtered out; finished in {:.2}s\n",
        chosen.len() - outcome.failed.len() - outcome.not_run,
        outcome.failed.len(),
        tests.len() - chosen.len(),
        started.elapsed().as_secs_f64()
    );
    if outcome.failed.is_empty() {
        0
    } else {
        101
    }
}

/// What running the chosen tests came to.
struct Outcome<'a> {
    failed: Vec<&'a str>,
    /// Tests left after a failure, with fail-fast.
    not_run: usize,
}

/// Runs `chosen` one after another, printing each one's line; with
/// `fail_fast`, none after the first that fails.
fn run_in_turn<'a>(chosen: &[&(&'a str, fn())], fail_fast: bool) -> Outcome<'a> {
    let mut failed = Vec::new();
    for (ran, (name, test)) in chosen.iter().enumerate() {
        let passed = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(*test)
            .expect("a thread for the test")
            .join()
            .is_ok();
        println!("test {name} ... {}", if passed { "ok" } else { "FAILED" });
        if !passed {
            failed.push(*name);
            if fail_fast {
                let not_run = chosen.len() - ran - 1;
                return Outcome { failed, not_run };
            }
        }
    }
    Outcome { failed, not_run: 0 }
}

/// The filter among libtest's arguments: options that take a value as the
/// next argument skip it; the others (`--test-threads=2`, `--nocapture`)
/// change nothing here.
fn filter(args: impl Iterator<Item = String>) -> String {
    const WITH_VALUE: &[&str] = &["--test-threads", "--skip", "--format", "--color", "-Z"];
    let mut args = args;
    while let Some(arg) = args.next() {
        if WITH_VALUE.contains(&arg.as_str()) {
            args.next();
        } else if !arg.starts_with('-') {
            return arg;
        }
    }
    String::new()
}

#[cfg(test)]
mod tests {
    use super::{filter, run_in_turn};
    use std::sync::atomic::{AtomicUsize, Ordering};

    static RUNS: AtomicUsize = AtomicUsize::new(0);

    fn passes() {
        RUNS.fetch_add(1, Ordering::SeqCst);
    }

    fn fails() {
        RUNS.fetch_add(1, Ordering::SeqCst);
        panic!("planted failure");
    }

    /// Both ways in one test, since they share the counter.
    #[test]
    fn fail_fast_stops_at_the_first_failure_and_without_it_every_test_runs() {
        let tests: [(&str, fn()); 4] = [("a", passes), ("b", fails), ("c", passes), ("d", fails)];
        let chosen: Vec<_> = tests.iter().collect();
        let outcome = run_in_turn(&chosen, true);
        assert_eq!((outcome.failed, outcome.not_run), (vec!["b"], 2));
        assert_eq!(
            RUNS.swap(0, Ordering::SeqCst),
            2,
            "a and b ran, c and d not"
        );
        let outcome = run_in_turn(&chosen, false);
        assert_eq!((outcome.failed, outcome.not_run), (vec!["b", "d"], 0));
        assert_eq!(RUNS.load(Ordering::SeqCst), 4);
    }

    fn of(args: &[&str]) -> String {
        filter(args.iter().map(|a| a.to_string()))
    }

    #[test]
    fn the_filter_is_the_first_word_that_is_no_option_nor_an_options_value() {
        assert_eq!(of(&[]), "");
        assert_eq!(of(&["--test-threads=2", "stop"]), "stop");
        assert_eq!(of(&["--test-threads", "2"]), "");
        assert_eq!(
            of(&["--test-threads", "2", "--nocapture", "fuse", "x"]),
            "fuse"
        );
    }
}
