//! `baton run` for real, by this crate's own tests: its set-up, the form
//! it gives each tool, its supervision (signals, exit codes, a broker that
//! dies under a build) and its giving back, against a real broker and real
//! GNU make and bmake.
//!
//! The binary's integration tests (crates/baton/tests) cover the same
//! through the baton binary; these exist so that the crate's own tests,
//! which `scripts/mutants` runs per mutant in seconds, reach `run.rs` too
//! (docs/testing.md). The broker and `baton run` each run in a process of
//! their own: this test binary started again in the `serve` or `run`
//! role, on its main thread, as `baton_testkit::harness` explains. Every
//! build's jobs log their start and end, and the limit is checked from
//! that log.

#[path = "../../baton-broker/tests/support/serve_role.rs"]
mod serve_role;

use baton_jobserver::{autostart_log_path, run, Autostart, RunOptions, Style};
use baton_testkit::harness::{self, role_command, spec_lines};
use baton_testkit::{
    bmake, flat_makefile, fuse_should_mount, make43, max_overlap, skip, wait_for, wait_timeout,
    Missing, RunningBroker, SpawnGuarded, TempDir,
};
use serve_role::{served, served_at};
use std::ffi::OsString;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// A hang guard: what must happen soon fails the test after this rather
/// than hanging it (not a timing check).
const PATIENCE: Duration = Duration::from_secs(60);

fn main() {
    match harness::role() {
        Some((role, spec)) if role == "serve" => serve_role::serve_here(&spec),
        Some((role, spec)) if role == "run" => run_here(&spec),
        Some((role, _)) => panic!("unknown role {role}"),
        None => {}
    }
    let tests: &[(&str, fn())] = &[
        (
            "a_make_build_keeps_to_the_limit_in_each_form",
            a_make_build_keeps_to_the_limit_in_each_form,
        ),
        (
            "a_token_freed_while_a_build_runs_reaches_it",
            a_token_freed_while_a_build_runs_reaches_it,
        ),
        (
            "max_caps_a_build_below_the_limit",
            max_caps_a_build_below_the_limit,
        ),
        (
            "the_exit_code_is_the_commands_own",
            the_exit_code_is_the_commands_own,
        ),
        (
            "a_stop_signal_reaches_the_build_and_every_token_comes_back",
            a_stop_signal_reaches_the_build_and_every_token_comes_back,
        ),
        (
            "baton_run_inside_a_build_joins_the_outer_build",
            baton_run_inside_a_build_joins_the_outer_build,
        ),
        (
            "a_build_rides_out_a_broker_killed_and_restarted",
            a_build_rides_out_a_broker_killed_and_restarted,
        ),
        (
            "explain_says_which_form_and_why",
            explain_says_which_form_and_why,
        ),
        (
            "refusals_are_said_and_cost_nothing",
            refusals_are_said_and_cost_nothing,
        ),
        (
            "a_broker_that_will_not_start_is_tried_three_times_and_said_why",
            a_broker_that_will_not_start_is_tried_three_times_and_said_why,
        ),
        (
            "builds_that_find_no_broker_start_one_between_them",
            builds_that_find_no_broker_start_one_between_them,
        ),
        (
            "a_build_waiting_for_its_first_token_waits_for_the_next_broker",
            a_build_waiting_for_its_first_token_waits_for_the_next_broker,
        ),
        (
            "a_python_driver_is_refused_the_pipe_and_tokens_beyond_max_are_refused",
            a_python_driver_is_refused_the_pipe_and_tokens_beyond_max_are_refused,
        ),
        (
            "explain_says_why_make_4_4_did_not_get_the_file",
            explain_says_why_make_4_4_did_not_get_the_file,
        ),
        (
            "bmake_reads_the_token_file_through_its_own_descriptors",
            bmake_reads_the_token_file_through_its_own_descriptors,
        ),
        (
            "stray_bytes_are_taken_out_said_once_and_counted",
            stray_bytes_are_taken_out_said_once_and_counted,
        ),
        (
            "a_sub_make_that_forces_its_own_jobs_late_is_still_reported",
            a_sub_make_that_forces_its_own_jobs_late_is_still_reported,
        ),
        (
            "the_tools_a_build_may_run_are_found_as_a_shell_finds_them",
            the_tools_a_build_may_run_are_found_as_a_shell_finds_them,
        ),
        (
            "bmake_gets_its_own_form_and_keeps_to_the_limit",
            bmake_gets_its_own_form_and_keeps_to_the_limit,
        ),
        (
            "make_4_4_gets_the_token_file_which_goes_with_the_build",
            make_4_4_gets_the_token_file_which_goes_with_the_build,
        ),
    ];
    std::process::exit(harness::run(tests));
}

/// `baton run` with the options of `spec` (`key=value` lines: socket,
/// style, tokens, max, name, explain, force, and `arg` once per word of
/// the command), exiting as `baton run` does.
fn run_here(spec: &str) -> ! {
    let mut opts = RunOptions {
        socket: None,
        tokens: 1,
        max: None,
        style: Style::Auto,
        name: None,
        weight: 1,
        command: Vec::new(),
        explain: false,
        autostart: None,
        force: false,
    };
    for (key, value) in spec_lines(spec) {
        match key {
            "socket" => opts.socket = Some(value.into()),
            "style" => {
                opts.style = match value {
                    "pipe" => Style::Pipe,
                    "fifo" => Style::Fifo,
                    "fuse" => Style::Fuse,
                    "auto" => Style::Auto,
                    "none" => Style::None,
                    other => panic!("style {other}"),
                }
            }
            "tokens" => opts.tokens = value.parse().unwrap(),
            "max" => opts.max = Some(value.parse().unwrap()),
            "name" => opts.name = Some(value.to_string()),
            "explain" => opts.explain = true,
            "force" => opts.force = true,
            "arg" => opts.command.push(OsString::from(value)),
            // Start this binary in the serve role if no broker answers,
            // as `baton run` starts `baton serve`.
            "autostart_jobs" => {
                let jobs = value.to_string();
                let socket = opts.socket.clone().expect("socket= before autostart_jobs=");
                opts.autostart = Some(Box::new(move || {
                    let spec = format!("socket={}\njobs={jobs}\nidle_ms=300", socket.display());
                    Ok(Autostart {
                        program: "env".into(),
                        args: vec![
                            "BATON_TEST_ROLE=serve".into(),
                            format!("BATON_TEST_SPEC={spec}").into(),
                            std::env::current_exe()?.into(),
                        ],
                        announce: Some("started a broker here".to_string()),
                    })
                }))
            }
            // Start `sh -c VALUE` as the broker if none answers.
            "autostart_sh" => {
                let script = value.to_string();
                opts.autostart = Some(Box::new(move || {
                    Ok(Autostart {
                        program: "sh".into(),
                        args: vec!["-c".into(), script.clone().into()],
                        announce: None,
                    })
                }))
            }
            other => panic!("the run role: unknown key {other}"),
        }
    }
    match run(opts) {
        Ok(code) => std::process::exit(i32::from(u8::try_from(code).unwrap_or(1))),
        Err(e) => {
            eprintln!("baton: {e:#}");
            std::process::exit(1)
        }
    }
}

/// The run role's specification: `baton run --socket S OPTIONS -- COMMAND`.
fn run_spec(socket: &Path, options: &str, command: &[&str]) -> String {
    let mut spec = format!("socket={}\n{options}", socket.display());
    for word in command {
        // The specification is one key a line: a word with a newline would
        // end its own line and add keys (a nested test's inner spec did,
        // and the test passed without running it).
        assert!(
            !word.contains('\n'),
            "a command word with a newline: {word:?}"
        );
        spec.push_str(&format!("\narg={word}"));
    }
    spec
}

/// `baton run` against `broker` with `options`, in `dir`, as it is started
/// by a shell (no MAKEFLAGS of ours).
fn baton_run(broker: &RunningBroker, dir: &Path, options: &str, command: &[&str]) -> Command {
    let mut run = role_command("run", &run_spec(&broker.socket, options, command));
    run.current_dir(dir)
        .env_remove("MAKEFLAGS")
        .env_remove("MAKELEVEL")
        .env_remove("BATON_RUN_PID")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    run
}

/// Runs it to the end (killed after PATIENCE if it hangs).
fn finished(mut run: Command) -> Output {
    output_of(run.spawn_guarded().unwrap())
}

/// What a started `baton run` says, to its end (killed after PATIENCE if
/// it hangs).
fn output_of(mut child: baton_testkit::Guarded) -> Output {
    let out = std::thread::spawn({
        let mut stdout = child.stdout.take().unwrap();
        move || {
            let mut text = Vec::new();
            std::io::Read::read_to_end(&mut stdout, &mut text).unwrap();
            text
        }
    });
    let err = std::thread::spawn({
        let mut stderr = child.stderr.take().unwrap();
        move || {
            let mut text = Vec::new();
            std::io::Read::read_to_end(&mut stderr, &mut text).unwrap();
            text
        }
    });
    let status = wait_timeout(&mut child, PATIENCE);
    if status.is_none() {
        let _ = child.kill();
    }
    let output = Output {
        status: child.wait().unwrap(),
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    };
    assert!(status.is_some(), "baton run hung: {}", said(&output));
    output
}

fn said(out: &Output) -> String {
    format!(
        "{:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn make(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn a_make_build_keeps_to_the_limit_in_each_form() {
    let broker = served(3, "");
    // make 4.3 reads only the pipe: fifo is refused it (below).
    for style in ["pipe", "auto", "none"] {
        let dir = TempDir::new("run-served-make");
        let log = dir.path().join("jobs.log");
        flat_makefile(dir.path(), &log, 8, "0.1");
        let make = make43();
        let out = finished(baton_run(
            &broker,
            dir.path(),
            &format!("style={style}"),
            &[self::make(&make)],
        ));
        assert!(out.status.success(), "{style}: {}", said(&out));
        assert!(
            !String::from_utf8_lossy(&out.stderr).contains("stray"),
            "{style}: no stray byte, and nothing said of any: {}",
            said(&out)
        );
        let (most, started) = max_overlap(&log);
        assert_eq!(started, 8, "{style}: every job ran");
        assert!(most <= 3, "{style}: {most} jobs at once under a limit of 3");
        match style {
            "none" => assert_eq!(most, 1, "without a jobserver make runs one job"),
            _ => assert!(
                most >= 2,
                "{style}: the build got more than its own token ({most})"
            ),
        }
        broker.wait_all_free();
    }
    // A build that lost no broker never re-attached (HOLD) and had nothing
    // taken back: every token was given back.
    let totals = broker.status().totals;
    assert_eq!((totals.held_again, totals.reclaimed), (0, 0), "{totals:?}");
    assert_eq!(totals.released, totals.granted, "{totals:?}");
}

fn max_caps_a_build_below_the_limit() {
    let broker = served(6, "");
    let dir = TempDir::new("run-served-max");
    let log = dir.path().join("jobs.log");
    flat_makefile(dir.path(), &log, 6, "0.1");
    let make = make43();
    let out = finished(baton_run(
        &broker,
        dir.path(),
        "style=pipe\nmax=2",
        &[self::make(&make)],
    ));
    assert!(out.status.success(), "{}", said(&out));
    let (most, started) = max_overlap(&log);
    assert_eq!(started, 6);
    assert!(most <= 2, "{most} jobs at once under --max 2");
    assert_eq!(most, 2, "the build used its second token");
    broker.wait_all_free();
}

fn the_exit_code_is_the_commands_own() {
    let broker = served(2, "");
    let dir = TempDir::new("run-served-exit");
    let not_executable = dir.path().join("data");
    std::fs::write(&not_executable, "not a program").unwrap();
    // The command's own token is given back when it exits, and left to
    // the broker when a signal killed it (jobs it started may run on: the
    // broker keeps a token per job, and takes back the rest).
    let cases: [(&[&str], i32, bool); 5] = [
        (&["sh", "-c", "exit 0"], 0, true),
        (&["sh", "-c", "exit 7"], 7, true),
        (&["sh", "-c", "kill -TERM $$"], 128 + 15, false),
        (&["/nonexistent/program"], 127, true),
        (&[not_executable.to_str().unwrap()], 126, true),
    ];
    for (command, code, given_back) in cases {
        let before = broker.status().totals;
        let out = finished(baton_run(&broker, dir.path(), "style=fifo", command));
        assert_eq!(out.status.code(), Some(code), "{command:?}: {}", said(&out));
        broker.wait_all_free();
        let after = broker.status().totals;
        assert_eq!(
            (
                after.released - before.released,
                after.reclaimed - before.reclaimed
            ),
            if given_back { (1, 0) } else { (0, 1) },
            "{command:?}"
        );
    }
}

fn a_stop_signal_reaches_the_build_and_every_token_comes_back() {
    let broker = served(3, "");
    let dir = TempDir::new("run-served-signal");
    let ready = dir.path().join("ready");
    let script = format!(
        "trap 'echo TERM; exit 3' TERM; touch {}; while :; do sleep 0.05; done",
        ready.display()
    );
    let mut child = baton_run(
        &broker,
        dir.path(),
        "style=fifo\ntokens=2",
        &["sh", "-c", &script],
    )
    .spawn_guarded()
    .unwrap();
    wait_for(PATIENCE, "the command to start", || ready.exists());
    assert_eq!(broker.status().held, 2, "the command's own tokens");
    // SAFETY: kill(2) has no memory effects.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = wait_timeout(&mut child, PATIENCE).expect("baton run ends");
    assert_eq!(
        status.code(),
        Some(3),
        "the command's own exit, after its trap"
    );
    let mut out = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut out).unwrap();
    assert_eq!(out, "TERM\n", "the command got SIGTERM, once");
    broker.wait_all_free();
}

fn baton_run_inside_a_build_joins_the_outer_build() {
    let broker = served(4, "");
    let dir = TempDir::new("run-served-nested");
    let said_pid = dir.path().join("run-pid");
    // The inner `baton run` (this binary in the run role again, with a
    // specification of its own) runs a command that says which build it
    // belongs to, and exits 5.
    let inner = run_spec(
        &broker.socket,
        "style=fifo",
        &[
            "sh",
            "-c",
            &format!("echo $BATON_RUN_PID > {}; exit 5", said_pid.display()),
        ],
    );
    // The outer build runs this binary again in the run role, with the
    // inner specification (read from a file: it spans lines).
    let me = std::env::current_exe().unwrap();
    let inner_in = |spec: &str, name: &str| {
        let file = dir.path().join(name);
        std::fs::write(&file, spec).unwrap();
        format!(
            "BATON_TEST_SPEC=\"$(cat {})\" exec {}",
            file.display(),
            me.display()
        )
    };
    let outer = baton_run(
        &broker,
        dir.path(),
        "style=fifo",
        &["sh", "-c", &inner_in(&inner, "inner.spec")],
    )
    .spawn_guarded()
    .unwrap();
    let outer_pid = outer.id();
    let out = output_of(outer);
    assert_eq!(out.status.code(), Some(5), "{}", said(&out));
    // The inner command ran in the outer build, not in one of its own.
    let run_pid = std::fs::read_to_string(&said_pid).unwrap();
    assert_eq!(run_pid.trim(), outer_pid.to_string());
    // A command it cannot start there is said as baton run says it: 127.
    let missing = run_spec(&broker.socket, "style=fifo", &["/nonexistent/program"]);
    let out = finished(baton_run(
        &broker,
        dir.path(),
        "style=fifo",
        &["sh", "-c", &inner_in(&missing, "missing.spec")],
    ));
    assert_eq!(out.status.code(), Some(127), "{}", said(&out));
    broker.wait_all_free();
}

fn a_build_rides_out_a_broker_killed_and_restarted() {
    let mut first = served(2, "");
    let dir = TempDir::new("run-served-restart");
    let log = dir.path().join("jobs.log");
    flat_makefile(dir.path(), &log, 6, "0.2");
    let make = make43();
    let mut child = baton_run(&first, dir.path(), "style=pipe", &[self::make(&make)])
        .spawn_guarded()
        .unwrap();
    let run_pid = child.id();
    wait_for(PATIENCE, "the first jobs", || max_overlap(&log).1 >= 1);
    // SAFETY: kill(2) has no memory effects.
    unsafe { libc::kill(first.pid() as i32, libc::SIGKILL) };
    first.wait_exit(PATIENCE);
    let second = served_at(&first.socket, "jobs=2\nreclaim_ms=1000");
    let status = wait_timeout(&mut child, PATIENCE).expect("the build ends");
    assert!(status.success(), "{status:?}");
    let (most, started) = max_overlap(&log);
    assert_eq!(started, 6, "every job ran");
    assert!(most <= 2, "{most} jobs at once under a limit of 2");
    second.wait_all_free();
    // It came back to the new broker and said what it held (HOLD).
    assert!(
        second
            .log()
            .contains(&format!("connection from pid {run_pid}")),
        "{}",
        second.log()
    );
    assert!(second.status().totals.held_again >= 1, "{}", second.log());
}

fn explain_says_which_form_and_why() {
    let broker = served(3, "");
    let dir = TempDir::new("run-served-explain");
    let log = dir.path().join("jobs.log");
    flat_makefile(dir.path(), &log, 2, "0");
    let make = make43();
    let out = finished(baton_run(
        &broker,
        dir.path(),
        "explain=1",
        &[self::make(&make)],
    ));
    assert!(out.status.success(), "{}", said(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("jobserver: pipe (R,W) (auto)"), "{err}");
    assert!(err.contains("  because make 4.3 ("), "{err}");
    assert!(
        !err.contains("not fuse"),
        "auto never chose the file here: {err}"
    );
    let out = finished(baton_run(
        &broker,
        dir.path(),
        "explain=1\nstyle=pipe",
        &[self::make(&make)],
    ));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("jobserver: pipe (R,W), as --jobserver-style asked"),
        "{err}"
    );
    broker.wait_all_free();
}

fn refusals_are_said_and_cost_nothing() {
    let broker = served(2, "");
    let dir = TempDir::new("run-served-refused");
    let out = finished(baton_run(
        &broker,
        dir.path(),
        "style=fuse\nmax=2",
        &["true"],
    ));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("--max works with the pipe and fifo styles, not with fuse"),
        "{}",
        said(&out)
    );
    // The file asked of a broker without a mount.
    let out = finished(baton_run(&broker, dir.path(), "style=fuse", &["true"]));
    assert_eq!(out.status.code(), Some(1), "{}", said(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("has no FUSE mount we may use"),
        "{}",
        said(&out)
    );
    broker.wait_all_free();
    assert_eq!(
        broker.status().totals.clients,
        1,
        "nobody but us left connected"
    );
    // No broker at all, and none to start.
    let nowhere = dir.path().join("nobody").join("socket");
    let mut run = role_command("run", &run_spec(&nowhere, "style=fifo", &["true"]));
    run.stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = finished(run);
    assert_eq!(out.status.code(), Some(1), "{}", said(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!(
            "no broker at {} (start one with: baton serve --jobs N)",
            nowhere.display()
        )),
        "{}",
        said(&out)
    );
}

fn a_broker_that_will_not_start_is_tried_three_times_and_said_why() {
    let dir = TempDir::new("run-served-no-start");
    let socket = dir.path().join("private").join("socket");
    let tries = dir.path().join("tries");
    let script = format!(
        "echo try >> {}; echo 'cannot serve: planted' >&2; exit 1",
        tries.display()
    );
    let mut run = role_command(
        "run",
        &run_spec(
            &socket,
            &format!("style=fifo\nautostart_sh={script}"),
            &["true"],
        ),
    );
    run.stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = finished(run);
    assert_eq!(out.status.code(), Some(1), "{}", said(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("stopped (exit status: 1): cannot serve: planted"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&tries).unwrap(), "try\n".repeat(3));
}

fn builds_that_find_no_broker_start_one_between_them() {
    let dir = TempDir::new("run-served-autostart");
    let socket = dir.path().join("private").join("socket");
    let runs: Vec<_> = (0..3)
        .map(|_| {
            let mut run = role_command(
                "run",
                &run_spec(
                    &socket,
                    "style=fifo\nautostart_jobs=2",
                    &["sh", "-c", "exit 4"],
                ),
            );
            run.stdout(Stdio::piped()).stderr(Stdio::piped());
            run.spawn_guarded().unwrap()
        })
        .collect();
    let outs: Vec<Output> = runs.into_iter().map(output_of).collect();
    let log = std::fs::read_to_string(autostart_log_path(&socket)).unwrap_or_default();
    // Whatever else happens, the broker started is stopped by pid.
    let _broker = log
        .split("(pid ")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .and_then(|pid| pid.parse().ok())
        .map(|pid| baton_testkit::Started { pid });
    for out in &outs {
        assert_eq!(out.status.code(), Some(4), "{}", said(out));
    }
    let announced = outs
        .iter()
        .filter(|o| String::from_utf8_lossy(&o.stderr).contains("baton: started a broker here"))
        .count();
    assert_eq!(announced, 1, "one of them started the broker and said so");
    assert_eq!(
        log.matches("INFO baton: serving 2 tokens").count(),
        1,
        "{log}"
    );
    // Started on demand, it leaves once idle, and takes its socket along.
    wait_for(PATIENCE, "the idle broker to go", || !socket.exists());
}

fn bmake_gets_its_own_form_and_keeps_to_the_limit() {
    let broker = served(3, "");
    let dir = TempDir::new("run-served-bmake");
    let log = dir.path().join("jobs.log");
    flat_makefile(dir.path(), &log, 6, "0.1");
    let bmake = bmake();
    let out = finished(baton_run(&broker, dir.path(), "explain=1", &[make(&bmake)]));
    assert!(out.status.success(), "{}", said(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("jobserver: fifo (bmake's -J R,W"), "{err}");
    assert!(err.contains("because bmake 2"), "{err}");
    let (most, started) = max_overlap(&log);
    assert_eq!(started, 6);
    assert!(most <= 3, "{most} jobs at once under a limit of 3");
    assert!(most >= 2, "bmake ran jobs side by side ({most})");
    broker.wait_all_free();
}

fn make_4_4_gets_the_token_file_which_goes_with_the_build() {
    if !fuse_should_mount() {
        return skip(
            Missing::Fuse,
            "no /dev/fuse, or neither root nor fusermount3",
        );
    }
    let make = std::env::var_os("BATON_TEST_MAKE44").map(std::path::PathBuf::from);
    let Some(make) = make.filter(|m| m.exists()) else {
        return skip(
            Missing::Make44,
            "no make 4.4.1 at BATON_TEST_MAKE44 (scripts/test installs it and sets it)",
        );
    };
    let broker = served(32, "fuse=1");
    assert!(
        broker.log().contains("FUSE token files at"),
        "the broker did not mount: {}",
        broker.log()
    );
    let dir = TempDir::new("run-served-fuse");
    let log = dir.path().join("jobs.log");
    flat_makefile(dir.path(), &log, 6, "0.1");
    // One more job says how the build's file answers polls: make's are
    // held (docs/fuse.md, "Held polls").
    let polls = dir.path().join("polls");
    let read_polls = format!(
        "python3 -c \"import os, re; path = re.search(r'fifo:(\\S+)', os.environ['MAKEFLAGS']).group(1); \
         print(os.getxattr(path, 'user.baton.polls').decode())\" > {}",
        polls.display()
    );
    let makefile = std::fs::read_to_string(dir.path().join("Makefile")).unwrap();
    std::fs::write(
        dir.path().join("Makefile"),
        makefile.replacen("all:", "all: polls", 1)
            + &format!("polls:\n\t@{read_polls}\n.PHONY: polls\n"),
    )
    .unwrap();
    let mount = broker.socket.with_file_name("fuse");
    let out = finished(baton_run(
        &broker,
        dir.path(),
        // auto would choose the pipe: make 4.3 is on PATH, for scripts.
        "explain=1\nname=fused\nstyle=fuse",
        &[self::make(&make)],
    ));
    assert!(out.status.success(), "{}", said(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("jobserver: fuse"), "{err}");
    assert!(err.contains("as --jobserver-style asked"), "{err}");
    assert_eq!(max_overlap(&log).1, 6);
    assert_eq!(std::fs::read_to_string(&polls).unwrap(), "hold\n");
    // Any other command may poll the file from several processes: its
    // polls are notified, not held.
    let out = finished(baton_run(
        &broker,
        dir.path(),
        "name=scripted\nstyle=fuse",
        &["/bin/sh", "-c", &read_polls],
    ));
    assert!(out.status.success(), "{}", said(&out));
    assert_eq!(std::fs::read_to_string(&polls).unwrap(), "notify\n");
    let left: Vec<_> = std::fs::read_dir(&mount).unwrap().collect();
    assert!(left.is_empty(), "the build's file is gone: {left:?}");
    broker.wait_all_free();
}

/// The broker goes away (kill -9) while `baton run` waits for the token
/// its command needs first: it waits for the next broker at the socket,
/// and runs there.
fn a_build_waiting_for_its_first_token_waits_for_the_next_broker() {
    let mut first = served(1, "");
    let mut holder = baton_client::Client::connect(&first.socket, "holder").unwrap();
    holder.acquire(1).unwrap();
    let dir = TempDir::new("run-served-first-token");
    let ran = dir.path().join("ran");
    let mut run = baton_run(
        &first,
        dir.path(),
        "style=fifo",
        &["sh", "-c", &format!("touch {}", ran.display())],
    );
    let run = run.spawn_guarded().unwrap();
    wait_for(PATIENCE, "baton run to wait", || {
        first.status().waiters.len() == 1
    });
    // SAFETY: kill(2) has no memory effects.
    unsafe { libc::kill(first.pid() as i32, libc::SIGKILL) };
    first.wait_exit(PATIENCE);
    drop(holder);
    assert!(!ran.exists(), "nothing ran without its token");
    let second = served_at(&first.socket, "jobs=1");
    let out = output_of(run);
    assert!(out.status.success(), "{}", said(&out));
    assert!(ran.exists());
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("went away while we waited for our first token; waiting for the next one"),
        "{}",
        said(&out)
    );
    second.wait_all_free();
}

fn a_python_driver_is_refused_the_pipe_and_tokens_beyond_max_are_refused() {
    let broker = served(4, "");
    let dir = TempDir::new("run-served-refusals");
    let out = finished(baton_run(
        &broker,
        dir.path(),
        "style=pipe",
        &["python3", "-c", "pass"],
    ));
    assert_eq!(out.status.code(), Some(1), "{}", said(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is a Python program"),
        "{}",
        said(&out)
    );
    let forced = finished(baton_run(
        &broker,
        dir.path(),
        "style=pipe\nforce=1",
        &["python3", "-c", "pass"],
    ));
    assert!(
        forced.status.success(),
        "--force runs it: {}",
        said(&forced)
    );
    let out = finished(baton_run(
        &broker,
        dir.path(),
        "style=fifo\ntokens=3\nmax=2",
        &["true"],
    ));
    assert_eq!(out.status.code(), Some(1), "{}", said(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("--max 2 is below --tokens 3: the build could never start"),
        "{}",
        said(&out)
    );
    broker.wait_all_free();
}

/// The venv's make 4.4.1 first on PATH, no gcc (CC names no compiler):
/// auto would give the token file, and `--explain` says why it did not.
fn explain_says_why_make_4_4_did_not_get_the_file() {
    let Some(make) = std::env::var_os("BATON_TEST_MAKE44").map(std::path::PathBuf::from) else {
        return skip(
            Missing::Make44,
            "BATON_TEST_MAKE44 unset (scripts/test sets it)",
        );
    };
    if !make.exists() {
        return skip(Missing::Make44, "no make 4.4.1 at BATON_TEST_MAKE44");
    }
    let path = format!(
        "{}:{}",
        make.parent().unwrap().display(),
        std::env::var("PATH").unwrap()
    );
    let dir = TempDir::new("run-served-explain-fuse");
    flat_makefile(dir.path(), &dir.path().join("jobs.log"), 1, "0");
    let explained = |broker: &RunningBroker, options: &str| {
        let mut run = baton_run(broker, dir.path(), options, &[self::make(&make)]);
        run.env("PATH", &path).env("CC", "/bin/true");
        let out = finished(run);
        assert!(out.status.success(), "{}", said(&out));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let small = served(4, "");
    let said_small = explained(&small, "explain=1");
    assert!(
        said_small.contains("  not fuse: 4 tokens: below 32"),
        "{said_small}"
    );
    let big = served(32, "");
    let said_big = explained(&big, "explain=1");
    assert!(
        said_big.contains("  not fuse: the broker has no FUSE mount"),
        "{said_big}"
    );
    let capped = explained(&big, "explain=1\nmax=8");
    assert!(
        capped.contains("  not fuse: --max needs the bridge"),
        "{capped}"
    );
}

/// bmake reads no `fifo:` path: asked for the token file, it gets its
/// own -J R,W on descriptors opened on the file, and keeps to the limit.
fn bmake_reads_the_token_file_through_its_own_descriptors() {
    if !fuse_should_mount() {
        return skip(
            Missing::Fuse,
            "no /dev/fuse, or neither root nor fusermount3",
        );
    }
    let broker = served(3, "fuse=1");
    let dir = TempDir::new("run-served-bmake-fuse");
    let log = dir.path().join("jobs.log");
    flat_makefile(dir.path(), &log, 6, "0.1");
    let bmake = bmake();
    let out = finished(baton_run(
        &broker,
        dir.path(),
        "explain=1\nstyle=fuse",
        &[make(&bmake)],
    ));
    assert!(out.status.success(), "{}", said(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("jobserver: fuse"), "{err}");
    let (most, started) = max_overlap(&log);
    assert_eq!(started, 6);
    assert!(
        (2..=3).contains(&most),
        "{most} jobs at once under a limit of 3"
    );
    broker.wait_all_free();
}

/// A command that writes bytes the pool never lent into its FIFO: they
/// are taken out, the first time said at once, and all counted at the
/// end. The FIFO is beside the broker's socket, and the command inherits
/// no descriptor of it (it opens the path itself, as make does).
fn stray_bytes_are_taken_out_said_once_and_counted() {
    let broker = served(2, "");
    let dir = TempDir::new("run-served-stray");
    let go = dir.path().join("go");
    // Three bytes, then (once the broker has counted them) two more.
    let script = format!(
        "fifo=${{MAKEFLAGS##*fifo:}}; fifo=${{fifo%% *}}; echo \"$fifo\"; \
         ls -l /proc/$$/fd | grep -c \"$fifo\" || true; \
         printf +++ > \"$fifo\"; while [ ! -e {go} ]; do sleep 0.01; done; \
         printf ++ > \"$fifo\"; while [ ! -e {go}2 ]; do sleep 0.01; done",
        go = go.display()
    );
    let run = baton_run(
        &broker,
        dir.path(),
        "style=fifo\nname=stray",
        &["sh", "-c", &script],
    )
    .spawn_guarded()
    .unwrap();
    let counted = |n: u64| {
        broker
            .status()
            .builds
            .iter()
            .any(|b| b.name == "stray" && u64::from(b.stray) == n)
    };
    wait_for(PATIENCE, "the first three counted", || counted(3));
    std::fs::write(&go, "").unwrap();
    wait_for(PATIENCE, "all five counted", || counted(5));
    std::fs::write(dir.path().join("go2"), "").unwrap();
    let out = output_of(run);
    assert!(out.status.success(), "{}", said(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut lines = stdout.lines();
    let fifo = Path::new(lines.next().unwrap());
    assert_eq!(
        fifo.parent(),
        broker.socket.parent(),
        "the FIFO is beside the socket"
    );
    assert_eq!(
        lines.next(),
        Some("0"),
        "no descriptor of the FIFO inherited"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        err.matches("more than the pool lent it").count(),
        1,
        "said once: {err}"
    );
    assert!(
        err.contains("held 3 byte(s) more than the pool lent it"),
        "said at the first: {err}"
    );
    assert!(
        err.contains("5 stray byte(s) were taken out of the build's jobserver in all"),
        "{err}"
    );
    broker.wait_all_free();
}

/// A sub-make started after the first look, with its own -j2: reported
/// at the end all the same (the tree is looked at until the build ends).
fn a_sub_make_that_forces_its_own_jobs_late_is_still_reported() {
    let broker = served(2, "");
    let dir = TempDir::new("run-served-submake");
    std::fs::write(
        dir.path().join("Makefile"),
        "all:\n\tsleep 0.7; $(MAKE) -j2 -f sub.mk\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("sub.mk"),
        "all: a b\na b:\n\tsleep 0.6\n.PHONY: all a b\n",
    )
    .unwrap();
    let make = make43();
    let out = finished(baton_run(
        &broker,
        dir.path(),
        "style=pipe",
        &[self::make(&make)],
    ));
    assert!(out.status.success(), "{}", said(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("a sub-make forced -j2 and ignored the jobserver"),
        "{err}"
    );
    broker.wait_all_free();
}

/// `auto` looks for the make a build's scripts run and for the C compiler
/// as a shell would: the first executable `make` on PATH (a file that is
/// not executable is passed over), and `$CC`.
fn the_tools_a_build_may_run_are_found_as_a_shell_finds_them() {
    let Some(make44) = std::env::var_os("BATON_TEST_MAKE44")
        .map(std::path::PathBuf::from)
        .filter(|m| m.exists())
    else {
        return skip(Missing::Make44, "no make 4.4.1 at BATON_TEST_MAKE44");
    };
    let broker = served(4, "");
    let dir = TempDir::new("run-served-tools");
    let decoy = dir.path().join("decoy");
    std::fs::create_dir(&decoy).unwrap();
    std::fs::write(decoy.join("make"), "not a program").unwrap();
    flat_makefile(dir.path(), &dir.path().join("jobs.log"), 1, "0");
    let gcc_major: u32 = Command::new("gcc")
        .arg("-dumpversion")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .trim()
                .split('.')
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(99);
    let mut run = baton_run(&broker, dir.path(), "explain=1", &[make(&make44)]);
    run.env("PATH", format!("{}:/usr/bin:/bin", decoy.display()))
        .env("CC", "gcc");
    let out = finished(run);
    assert!(out.status.success(), "{}", said(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("make 4.3 (/usr/bin/make), which scripts and build scripts run"),
        "the decoy passed over: {err}"
    );
    if gcc_major < 13 {
        assert!(
            err.contains(&format!("because gcc {gcc_major}.")),
            "$CC looked at: {err}"
        );
    }
    broker.wait_all_free();
}

/// The build starts with only its own token (another client holds the
/// rest); when those come free, the bridge's waiting request is granted
/// and the build runs jobs side by side.
fn a_token_freed_while_a_build_runs_reaches_it() {
    let broker = served(3, "");
    let mut holder = baton_client::Client::connect(&broker.socket, "holder").unwrap();
    holder.acquire(2).unwrap();
    let dir = TempDir::new("run-served-freed");
    let log = dir.path().join("jobs.log");
    flat_makefile(dir.path(), &log, 6, "0.3");
    let make = make43();
    let run = baton_run(&broker, dir.path(), "style=pipe", &[self::make(&make)])
        .spawn_guarded()
        .unwrap();
    wait_for(PATIENCE, "the first job", || max_overlap(&log).1 >= 1);
    holder.release(2).unwrap();
    let out = output_of(run);
    assert!(out.status.success(), "{}", said(&out));
    let (most, started) = max_overlap(&log);
    assert_eq!(started, 6);
    assert!(
        (2..=3).contains(&most),
        "{most} jobs at once once two tokens came free"
    );
    broker.wait_all_free();
}
