//! baton as a service: brokers started on demand by `baton run`, the config
//! file, socket activation, and the shell integration, against the real
//! binary (and real make 4.3 and 4.4.1, systemd-socket-activate, bash).

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// A temporary home for one test: its own config directory and socket, so
/// that neither the user's config nor their broker takes part.
struct Home {
    dir: TempDir,
}

impl Home {
    fn new(name: &str) -> Self {
        let home = Home {
            dir: TempDir::new(name),
        };
        std::fs::create_dir_all(home.config_file().parent().unwrap()).unwrap();
        home
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("run").join("socket")
    }

    fn config_file(&self) -> PathBuf {
        self.dir
            .path()
            .join("config")
            .join("baton")
            .join("config.toml")
    }

    fn write_config(&self, text: &str) {
        std::fs::write(self.config_file(), text).unwrap();
    }

    /// The broker log `baton run` gives the brokers it starts.
    fn broker_log(&self) -> String {
        std::fs::read_to_string(self.socket().with_file_name("broker.log")).unwrap_or_default()
    }

    /// `baton ARGS` in this home, auto-start allowed.
    fn baton(&self, args: &[&str]) -> Command {
        let mut cmd = baton();
        cmd.args(args)
            .env("BATON_SOCKET", self.socket())
            .env("XDG_CONFIG_HOME", self.dir.path().join("config"))
            .env_remove("BATON_NO_AUTOSTART")
            .env_remove("MAKEFLAGS")
            .env_remove("MFLAGS");
        cmd
    }

    /// The pids of the brokers that logged that they serve here.
    fn brokers_started(&self) -> Vec<u32> {
        self.broker_log()
            .lines()
            .filter(|l| l.contains("serving"))
            .map(|l| logged_pid(l).expect("a pid in the serving line"))
            .collect()
    }
}

fn logged_pid(line: &str) -> Option<u32> {
    let (_, after) = line.rsplit_once("(pid ")?;
    after.trim_end_matches(')').parse().ok()
}

fn status_json(home: &Home) -> serde_json::Value {
    let out = home.baton(&["status", "--json"]).output().unwrap();
    assert!(
        out.status.success(),
        "baton status: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn assert_all_free(status: &serde_json::Value) {
    assert_eq!(
        status["free"], status["limit"],
        "tokens missing at the end: {status:#}"
    );
    assert_eq!(status["held"], 0, "tokens missing at the end: {status:#}");
}

#[test]
fn concurrent_first_runs_start_exactly_one_broker() {
    let home = Home::new("autostart");
    home.write_config("jobs = 2\n");
    let log = home.dir.path().join("jobs.log");
    let job = logged_job(&log, "0.2");
    let runs: Vec<Guarded> = (0..8)
        .map(|_| {
            home.baton(&["run", "--", "sh", "-c", &job])
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn_guarded()
                .unwrap()
        })
        .collect();
    let outputs: Vec<Output> = runs
        .into_iter()
        .map(|run| run.wait_with_output().unwrap())
        .collect();

    let status = status_json(&home);
    let _broker = Started {
        pid: status["broker_pid"].as_u64().unwrap() as u32,
    };
    for out in &outputs {
        assert!(out.status.success(), "a baton run failed: {}", stderr(out));
    }
    assert_eq!(
        home.brokers_started(),
        vec![_broker.pid],
        "broker log:\n{}",
        home.broker_log()
    );
    assert!(
        !home.broker_log().contains("already running"),
        "a second broker was started:\n{}",
        home.broker_log()
    );
    let (most, started) = max_overlap(&log);
    assert_eq!(started, 8);
    assert!(
        most <= 2,
        "{most} jobs ran at once under a limit of 2 (the config file's jobs)"
    );
    assert_eq!(status["limit"], 2);
    assert_all_free(&status);
}

#[test]
fn without_a_config_file_the_started_broker_has_a_token_per_cpu() {
    let home = Home::new("autostart-cpus");
    let out = home.baton(&["run", "--", "true"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let status = status_json(&home);
    let _broker = Started {
        pid: status["broker_pid"].as_u64().unwrap() as u32,
    };
    let cpus = std::thread::available_parallelism().unwrap().get();
    assert_eq!(status["limit"], cpus as u64);
    assert_all_free(&status);
}

#[test]
fn no_autostart_keeps_the_no_broker_error() {
    let home = Home::new("no-autostart");
    let out = home
        .baton(&["run", "--", "true"])
        .env("BATON_NO_AUTOSTART", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("no broker at") && stderr(&out).contains("baton serve --jobs"),
        "{}",
        stderr(&out)
    );
    assert!(
        !home.socket().exists() && home.broker_log().is_empty(),
        "a broker was started"
    );
}

#[test]
fn a_started_broker_stops_once_idle_and_not_while_used() {
    let home = Home::new("idle");
    home.write_config("jobs = 2\nidle-timeout = 1\n");
    // Busy for three idle timeouts: the broker must stay for the whole run.
    let out = home.baton(&["run", "--", "sleep", "3"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        !stderr(&out).contains("lost the broker"),
        "the broker stopped while in use: {}",
        stderr(&out)
    );
    let pids = home.brokers_started();
    assert_eq!(pids.len(), 1, "broker log:\n{}", home.broker_log());
    let pid = pids[0];
    let _broker = Started { pid };
    wait_for(Duration::from_secs(20), "the idle broker to stop", || {
        !pid_alive(pid)
    });
    assert!(
        home.broker_log().contains("no clients for 1 s: stopping"),
        "{}",
        home.broker_log()
    );
    assert!(
        !home.socket().exists(),
        "the stopped broker left its socket"
    );

    // The next build starts a fresh one.
    let out = home.baton(&["run", "--", "true"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let pids = home.brokers_started();
    assert_eq!(pids.len(), 2, "broker log:\n{}", home.broker_log());
    let _second = Started { pid: pids[1] };
    wait_for(
        Duration::from_secs(20),
        "the second idle broker to stop",
        || !pid_alive(pids[1]),
    );
}

#[test]
fn a_bad_config_file_is_refused_naming_file_line_and_key() {
    let home = Home::new("bad-config");
    let file = home.config_file();
    let cases = [
        (
            "jobs = 4\njbos = 8\n",
            "line 2, key jbos: unknown field `jbos`",
        ),
        (
            "# limits\nidle-timeout = -5\n",
            "line 2, key idle-timeout: invalid value",
        ),
        ("jobs = 4\n\nthis is not toml\n", "line 3: "),
        ("jobs = 0\n", "line 1, key jobs: jobs must be between 1 and"),
    ];
    for (text, expected) in cases {
        home.write_config(text);
        let expected = format!("baton: bad config file {}, {expected}", file.display());
        // `baton run` only warns (tests/first_day.rs): a typo must not
        // break every build.
        for args in [&["config"][..], &["serve"]] {
            let out = home.baton(args).output().unwrap();
            assert_eq!(out.status.code(), Some(1), "baton {args:?} with {text:?}");
            assert!(
                stderr(&out).starts_with(&expected),
                "baton {args:?} with {text:?}: {}",
                stderr(&out)
            );
        }
        assert!(
            !home.socket().exists() && home.broker_log().is_empty(),
            "a broker started on a bad config"
        );
    }
}

#[test]
fn baton_config_says_where_each_value_comes_from() {
    let home = Home::new("config");
    home.write_config("# shared box\nidle-timeout = 90\n");
    let out = home.baton(&["config"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{}", stderr(&out));
    let row = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
            .to_string()
    };
    assert!(
        row("config file").contains(&home.config_file().display().to_string()),
        "{text}"
    );
    assert!(
        row("socket").contains(&home.socket().display().to_string())
            && row("socket").contains("($BATON_SOCKET)"),
        "{text}"
    );
    assert!(row("jobs").ends_with("(the number of CPUs)"), "{text}");
    assert!(
        row("idle-timeout").contains("90 s")
            && row("idle-timeout").ends_with("(config file, line 2)"),
        "{text}"
    );
    assert!(row("weight").ends_with("(default)"), "{text}");
}

#[test]
fn the_command_line_beats_the_config_file() {
    let home = Home::new("cli-wins");
    home.write_config("jobs = 5\n");
    let log = std::fs::File::create(home.dir.path().join("serve.log")).unwrap();
    let mut serve = home
        .baton(&["serve", "--no-fuse", "--jobs", "3"])
        .stderr(log)
        .spawn_guarded()
        .unwrap();
    wait_for(Duration::from_secs(10), "the broker to listen", || {
        std::os::unix::net::UnixStream::connect(home.socket()).is_ok()
    });
    let limit = status_json(&home)["limit"].clone();
    unsafe { libc::kill(serve.id() as i32, libc::SIGTERM) };
    wait_timeout(&mut serve, Duration::from_secs(10)).expect("the broker stops");
    assert_eq!(limit, 3);
}

#[test]
fn serve_takes_the_socket_systemd_passes() {
    let activate = Path::new("/usr/bin/systemd-socket-activate");
    assert!(
        activate.exists(),
        "{} not installed (Debian package systemd; scripts/test installs it)",
        activate.display()
    );
    let home = Home::new("activation");
    std::fs::create_dir_all(home.socket().parent().unwrap()).unwrap();
    let log = std::fs::File::create(home.dir.path().join("serve.log")).unwrap();
    let mut activator = Command::new(activate)
        .arg("-l")
        .arg(home.socket())
        .args([baton_bin(), "serve", "--jobs", "2", "--no-fuse"])
        .env("XDG_CONFIG_HOME", home.dir.path().join("config"))
        .env_remove("BATON_SOCKET")
        .stderr(log)
        .spawn_guarded()
        .unwrap();
    // systemd-socket-activate binds first and starts baton on the first
    // connection, so a client finds the socket before the broker runs.
    // The path appears at bind(), before listen(): wait for a connect to
    // go through (this bare connect is the one that starts baton).
    wait_for(Duration::from_secs(10), "the socket to listen", || {
        std::os::unix::net::UnixStream::connect(home.socket()).is_ok()
    });
    let mut client = baton_client::Client::connect(home.socket(), "activated")
        .expect("a client is served on the passed socket");
    client.acquire(2).unwrap();
    let status = client.status().unwrap();
    assert_eq!((status.limit, status.held), (2, 2));
    assert_eq!(
        status.broker_pid,
        activator.id(),
        "the activator execs baton in place"
    );
    client.release(2).unwrap();
    drop(client);
    let status = status_json(&home);
    assert_all_free(&status);

    unsafe { libc::kill(activator.id() as i32, libc::SIGTERM) };
    let stopped = wait_timeout(&mut activator, Duration::from_secs(10)).expect("the broker stops");
    assert!(
        stopped.success(),
        "{stopped:?}: {}",
        std::fs::read_to_string(home.dir.path().join("serve.log")).unwrap()
    );
    assert!(
        home.socket().exists(),
        "the broker removed the socket systemd owns"
    );
}

#[test]
fn systemd_units_verify() {
    let units = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../contrib/systemd");
    // A home where `cargo install` put baton (%h/.cargo/bin/baton), and the
    // runtime directory a user manager would have.
    let home = TempDir::new("units");
    let bin = home.path().join(".cargo/bin");
    let runtime = home.path().join("runtime");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(&runtime).unwrap();
    std::os::unix::fs::symlink(baton_bin(), bin.join("baton")).unwrap();
    let analyze = Command::new("systemd-analyze")
        .args(["--user", "verify"])
        .arg(units.join("baton.socket"))
        .arg(units.join("baton.service"))
        .env("HOME", home.path())
        .env("XDG_RUNTIME_DIR", &runtime)
        .output();
    let out = match analyze {
        Ok(out) => out,
        Err(e) => {
            return skip(
                Missing::Systemd,
                &format!("systemd-analyze cannot run here ({e}; Debian package systemd)"),
            )
        }
    };
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    if text.contains("Failed to initialize manager") {
        return skip(
            Missing::Systemd,
            &format!(
                "systemd-analyze verify cannot start a user manager here: {}",
                text.trim()
            ),
        );
    }
    assert!(
        out.status.success() && text.trim().is_empty(),
        "systemd-analyze verify: {text}"
    );
}

/// baton.socket listens where every baton command looks by default, and
/// as privately as baton's own directory: `ListenStream=` with `%t` as the
/// user manager's `$XDG_RUNTIME_DIR` is the socket `baton config` names
/// there, and neither `SocketMode=` nor `DirectoryMode=` opens it to group
/// or others (a client refuses a default directory that is: docs/security.md).
/// systemd-analyze verify checks only that the unit is well formed.
#[test]
fn the_socket_unit_listens_at_the_default_socket_and_privately() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../contrib/systemd/baton.socket");
    let unit = std::fs::read_to_string(&path).unwrap();
    let value = |key: &str| {
        unit.lines()
            .find_map(|l| l.trim().strip_prefix(key)?.strip_prefix('='))
            .unwrap_or_else(|| panic!("{} has no {key}=", path.display()))
            .trim()
            .to_string()
    };
    let home = TempDir::new("socket-unit");
    let runtime = home.path().join("runtime");
    std::fs::create_dir_all(&runtime).unwrap();
    let out = baton()
        .arg("config")
        .env("XDG_RUNTIME_DIR", &runtime)
        .env("XDG_CONFIG_HOME", home.path().join("config"))
        .env_remove("BATON_SOCKET")
        .output()
        .unwrap();
    assert!(out.status.success(), "baton config: {}", stderr(&out));
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    let default = said
        .lines()
        .find_map(|l| l.strip_prefix("socket")?.split_whitespace().next())
        .unwrap_or_else(|| panic!("no socket line in baton config: {said}"))
        .to_string();
    let listen = value("ListenStream").replace("%t", runtime.to_str().unwrap());
    assert_eq!(
        listen, default,
        "baton.socket listens elsewhere than baton looks"
    );
    for key in ["SocketMode", "DirectoryMode"] {
        let mode = u32::from_str_radix(&value(key), 8).unwrap();
        assert_eq!(
            mode & 0o077,
            0,
            "{key}={mode:04o} opens the socket to others"
        );
    }
}

/// The unit's `LimitNOFILE=` is enough for the broker's default
/// `--max-clients`, by the broker's own account: started with a low
/// open-file limit (lowering needs no privilege; raising would), it warns
/// how many clients that limit serves against how many it wants, which
/// gives what it needs in all; the unit must give at least that.
#[test]
fn the_service_units_open_file_limit_is_what_the_broker_wants() {
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../contrib/systemd/baton.service");
    let text = std::fs::read_to_string(&unit).unwrap();
    let value = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("LimitNOFILE="))
        .unwrap_or_else(|| panic!("{} has no LimitNOFILE=", unit.display()));
    let given: u64 = value
        .parse()
        .unwrap_or_else(|_| panic!("LimitNOFILE={value}: expected one number"));

    const LOW: u64 = 1024;
    let dir = TempDir::new("nofile");
    let log_path = dir.path().join("broker.log");
    let mut serve = baton();
    serve
        .args(["serve", "--jobs", "1", "--no-fuse", "--socket"])
        .arg(dir.path().join("socket"))
        .stderr(std::fs::File::create(&log_path).unwrap());
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut serve, || {
            let low = libc::rlimit {
                rlim_cur: LOW as libc::rlim_t,
                rlim_max: LOW as libc::rlim_t,
            };
            match libc::setrlimit(libc::RLIMIT_NOFILE, &low) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
    let mut broker = serve.spawn_guarded().expect("start the broker");
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    wait_for(Duration::from_secs(30), "the broker to serve", || {
        log().contains("serving 1 token")
    });
    unsafe { libc::kill(broker.id() as i32, libc::SIGTERM) };
    wait_timeout(&mut broker, Duration::from_secs(30)).expect("the broker stops");

    // "the open-file limit (1024) lets the broker serve about 960 clients,
    // not --max-clients 60000 (...)"
    let log = log();
    let numbers: Vec<u64> = log
        .lines()
        .find(|l| l.contains(&format!("the open-file limit ({LOW})")))
        .unwrap_or_else(|| panic!("no open-file warning at a limit of {LOW}: {log}"))
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    let [.., serves, max_clients] = numbers[..] else {
        panic!("unexpected warning: {log}")
    };
    let wanted = max_clients + (LOW - serves);
    assert!(
        given >= wanted,
        "LimitNOFILE={given} in {}: the broker wants {wanted} ({max_clients} clients and {} of its own)",
        unit.display(),
        LOW - serves
    );
}

/// `SHELL -c` that read `baton shell-init SHELL`, then runs `line` with
/// `tool_dir` first on PATH; the broker at `socket`, none started on demand.
fn shell_with_init(shell: &str, socket: &Path, tool_dir: &Path, line: &str) -> Command {
    let init = match shell {
        "fish" => format!("'{}' shell-init fish | source", baton_bin()),
        _ => format!("eval \"$('{}' shell-init {shell})\"", baton_bin()),
    };
    let path = format!(
        "{}:{}",
        tool_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = Command::new(shell);
    cmd.args(["-c", &format!("{init}\n{line}\n")])
        .env("PATH", path)
        .env("BATON_SOCKET", socket)
        .env("BATON_NO_AUTOSTART", "1")
        .env_remove("MAKEFLAGS")
        .env_remove("MFLAGS");
    cmd
}

/// A directory holding `name`, a link to the real `tool`.
fn tool_dir(name: &str, tool: &Path) -> TempDir {
    let dir = TempDir::new("tools");
    std::os::unix::fs::symlink(tool, dir.path().join(name)).unwrap();
    dir
}

#[test]
fn plain_make_in_shells_with_shell_init_shares_one_limit() {
    let broker = RunningBroker::start(3);
    let work = TempDir::new("shell-init");
    let log = work.path().join("jobs.log");
    let flags = work.path().join("makeflags.log");
    let mut builds = Vec::new();
    let mut tool_dirs = Vec::new();
    for (name, make) in [("make44", make44()), ("make43", make43())] {
        let dir = work.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        flat_makefile(&dir, &log, 6, "0.3");
        // Each job also notes the jobserver it was given.
        let makefile = std::fs::read_to_string(dir.join("Makefile")).unwrap();
        let makefile = makefile.replace(
            "\t@",
            &format!("\t@echo \"$$MAKEFLAGS\" >> {}; ", flags.display()),
        );
        std::fs::write(dir.join("Makefile"), makefile).unwrap();
        let tools = tool_dir("make", &make);
        builds.push(
            shell_with_init("bash", &broker.socket, tools.path(), "make -s")
                .current_dir(&dir)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn_guarded()
                .unwrap(),
        );
        tool_dirs.push(tools);
    }
    for build in builds {
        let out = build.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "a make in a shell failed: {}",
            stderr(&out)
        );
    }
    let given = std::fs::read_to_string(&flags).unwrap();
    assert_eq!(given.lines().count(), 12, "{given}");
    assert!(
        given.lines().all(|l| l.contains("--jobserver-auth=")),
        "a plain make ran without baton's jobserver:\n{given}"
    );
    let (most, started) = max_overlap(&log);
    assert_eq!(started, 12);
    assert!(
        most <= 3,
        "{most} jobs ran at once across two builds under a limit of 3"
    );
    broker.assert_all_free();
}

#[test]
fn shell_init_wraps_tools_in_every_shell_but_not_inside_a_build() {
    let nobody = TempDir::new("no-broker");
    let socket = nobody.path().join("socket");
    let tools = tool_dir("ninja", &ninja());
    for shell in ["bash", "zsh", "fish"] {
        let found = Command::new(shell).args(["-c", "exit 0"]).status();
        assert!(
            found.is_ok_and(|s| s.success()),
            "{shell} not found: run scripts/test, which installs it"
        );
        // Outside a build the wrapper goes through baton run, which finds no
        // broker here (and may not start one).
        let out = shell_with_init(shell, &socket, tools.path(), "ninja --version")
            .output()
            .unwrap();
        assert!(
            !out.status.success() && stderr(&out).contains("no broker at"),
            "{shell}: {}",
            stderr(&out)
        );
        // Inside one (MAKEFLAGS names a jobserver) it runs ninja itself.
        let inside = match shell {
            "fish" => "set -x MAKEFLAGS ' -j --jobserver-auth=fifo:/nonexistent'; ninja --version",
            _ => "export MAKEFLAGS=' -j --jobserver-auth=fifo:/nonexistent'; ninja --version",
        };
        let out = shell_with_init(shell, &socket, tools.path(), inside)
            .output()
            .unwrap();
        assert!(out.status.success(), "{shell}: {}", stderr(&out));
        assert!(
            String::from_utf8_lossy(&out.stdout).starts_with("1.13"),
            "{shell}"
        );
    }
}

#[test]
fn completions_and_man_page_come_from_the_command_line() {
    let home = Home::new("completions");
    for shell in ["bash", "zsh", "fish"] {
        let out = home.baton(&["completions", shell]).output().unwrap();
        let script = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success() && script.contains("shell-init"),
            "{shell}: {script}"
        );
        // Parsed, not run: -n reads the script and reports syntax errors.
        let check = Command::new(shell)
            .args(["-n", "-c", &script])
            .output()
            .unwrap();
        assert!(check.status.success(), "{shell} -n: {}", stderr(&check));
    }
    let out = home.baton(&["man"]).output().unwrap();
    let page = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success() && page.contains(".TH baton"), "{page}");
    assert!(page.contains("shell\\-init"), "{page}");
}

/// `baton man | head`: the reader leaves before the page is written.
#[test]
fn generated_text_to_a_reader_that_left_is_no_error() {
    let home = Home::new("epipe");
    for args in [
        &["man"][..],
        &["completions", "bash"],
        &["shell-init", "bash"],
        &["config"],
    ] {
        let (reader, writer) = nix::unistd::pipe().unwrap();
        drop(reader); // every write now fails with EPIPE
        let out = home
            .baton(args)
            .stdout(std::process::Stdio::from(writer))
            .output()
            .unwrap();
        assert!(
            out.status.success() && out.stderr.is_empty(),
            "{args:?}: {}",
            stderr(&out)
        );
    }
}

#[test]
fn a_long_broker_log_is_moved_aside_when_the_next_broker_starts() {
    let home = Home::new("log");
    home.write_config("jobs = 2\nidle-timeout = 1\n");
    let log = home.socket().with_file_name("broker.log");
    std::fs::create_dir_all(log.parent().unwrap()).unwrap();
    let old = "an old line\n".repeat(100_000); // past the 1 MiB kept
    std::fs::write(&log, &old).unwrap();
    let out = home.baton(&["run", "--", "true"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let pids = home.brokers_started();
    assert_eq!(
        pids.len(),
        1,
        "the new log has only the new broker: {}",
        home.broker_log()
    );
    let _broker = Started { pid: pids[0] };
    assert_eq!(
        std::fs::read_to_string(log.with_extension("log.old")).unwrap(),
        old
    );
}

#[cfg(feature = "cluster")]
#[test]
fn a_cluster_table_joins_the_brokers_baton_run_starts() {
    let etcd_dir = TempDir::new("etcd");
    let etcd = baton_bench::etcd::Etcd::start(1, etcd_dir.path()).unwrap();
    let home = Home::new("cluster");
    home.write_config(&format!("jobs = 2\nidle-timeout = 1\n\n[cluster]\netcd = [\"{}\"]\npool = \"from-file\"\njobs = 3\n", etcd.endpoints()));
    let out = home.baton(&["run", "--", "true"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let pids = home.brokers_started();
    assert_eq!(pids.len(), 1, "broker log:\n{}", home.broker_log());
    let _broker = Started { pid: pids[0] };
    assert!(
        home.broker_log()
            .contains("cluster pool from-file: 3 tokens across every broker"),
        "{}",
        home.broker_log()
    );
    let limit = etcd
        .etcdctl(&["get", "--print-value-only", "/baton/from-file/limit"])
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&limit.stdout).trim(), "3");
}
