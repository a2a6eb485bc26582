//! One host broker for builds in containers (issue #37, docs/containers.md),
//! through the real binary. Containers are made with `unshare`: a PID
//! namespace with its own /proc, a mount namespace in which the broker's
//! socket directory is bind-mounted at /run/baton, a network namespace (a
//! socket on the file system still connects), and for some a user
//! namespace made by another host uid (`setpriv` then `unshare
//! --map-root-user`: root inside, uid 100000 or 200000 outside, as a
//! rootless container is). Jobs log their own start and end to one file
//! bound in from the host; that log, not the broker, says how many ran at
//! once. The `podman_*` tests do the same with real podman containers, of
//! an image imported from a tar of a minimal root file system.

mod common;

use common::{baton_bin, can_act_as_another_user, max_overlap, wait_for, RunningBroker, TempDir};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

/// Host uids the user-namespace containers run as (root inside).
const RUNNER: u32 = 100_000;
const GROUPED: u32 = 200_000;
const STRANGER: u32 = 300_000;

/// How a container is made.
#[derive(Clone, Copy)]
enum Userns {
    /// No user namespace: root inside is root outside.
    None,
    /// Made by host uid (and gid) N, mapped to root inside.
    MappedFrom(u32),
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn unshare_present() -> bool {
    let ok = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "--net", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        common::skip(
            common::Missing::Root,
            "needs unshare (util-linux) and namespaces",
        );
    }
    ok
}

/// A container running `script` (sh), its broker socket directory bound
/// at /run/baton and BATON_SOCKET pointing there; `cgroup` (a cgroup v2
/// directory) is entered first on the host. Ended by pid on drop: killing
/// unshare (--kill-child) kills the container's init, and with it every
/// process of its PID namespace.
struct Container {
    child: Child,
    cgroup: Option<PathBuf>,
}

impl Container {
    fn command(
        broker: &RunningBroker,
        userns: Userns,
        cgroup: Option<&Path>,
        env: &[(&str, &str)],
        script: &str,
    ) -> Command {
        Self::command_binding(broker, userns, cgroup, env, "--rbind", script)
    }

    /// [`Container::command`], binding the socket's directory with
    /// `bind`: `--rbind` brings the broker's FUSE mount along (a user
    /// namespace must: it may not uncover what a mount below hides),
    /// `--bind` leaves it out.
    fn command_binding(
        broker: &RunningBroker,
        userns: Userns,
        cgroup: Option<&Path>,
        env: &[(&str, &str)],
        bind: &str,
        script: &str,
    ) -> Command {
        let run_dir = broker.socket.parent().unwrap();
        let inside = format!(
            "set -e; mount -t tmpfs tmpfs /run; mkdir /run/baton; mount {bind} {run} /run/baton; \
             export XDG_CONFIG_HOME=/run; {script}",
            run = run_dir.display()
        );
        let mut argv: Vec<String> = Vec::new();
        if let Some(cg) = cgroup {
            argv.extend([
                "sh".into(),
                "-c".into(),
                format!("echo $$ > {}/cgroup.procs && exec \"$@\"", cg.display()),
                "enter-cgroup".into(),
            ]);
        }
        if let Userns::MappedFrom(uid) = userns {
            argv.extend([
                "setpriv".into(),
                format!("--reuid={uid}"),
                format!("--regid={uid}"),
                "--clear-groups".into(),
            ]);
        }
        argv.extend(
            ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"].map(String::from),
        );
        argv.extend(["--mount", "--net"].map(String::from));
        if let Userns::MappedFrom(_) = userns {
            argv.push("--map-root-user".into());
        }
        argv.extend(["--".into(), "sh".into(), "-c".into(), inside]);
        let mut c = Command::new(&argv[0]);
        c.args(&argv[1..])
            .env("BATON_SOCKET", "/run/baton/socket")
            .env("BATON_NO_AUTOSTART", "1")
            .env_remove("MAKEFLAGS")
            .env_remove("CARGO_MAKEFLAGS")
            .env_remove("MAKELEVEL");
        if let Userns::MappedFrom(_) = userns {
            // The host's root broker, seen from a user namespace that does
            // not map host uid 0: the overflow uid.
            c.env("BATON_BROKER_UID", "65534");
        }
        for (k, v) in env {
            c.env(k, v);
        }
        c
    }

    fn start(mut command: Command, cgroup: Option<PathBuf>) -> Self {
        let child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start a container");
        Container { child, cgroup }
    }

    fn finish(mut self) -> Output {
        let child = std::mem::replace(
            &mut self.child,
            Command::new("true").spawn().expect("a placeholder"),
        );
        let out = child.wait_with_output().unwrap();
        let _ = self.child.wait();
        out
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
            let _ = self.child.wait();
        }
        if let Some(cg) = &self.cgroup {
            // Empty once the container's processes are gone.
            let _ = wait_for_rmdir(cg);
        }
    }
}

fn wait_for_rmdir(dir: &Path) -> bool {
    for _ in 0..2000 {
        if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A work directory every container's root may write in, with `jobs`
/// logged jobs of `secs` in a Makefile, logging to `log`.
fn make_dir(name: &str, log: &Path, jobs: usize, secs: &str) -> TempDir {
    let dir = TempDir::new(name);
    chmod(dir.path(), 0o777);
    common::flat_makefile(dir.path(), log, jobs, secs);
    dir
}

/// A shared job log, writable from every container.
fn shared_log(dir: &Path) -> PathBuf {
    chmod(dir, 0o777);
    let log = dir.join("jobs.log");
    std::fs::write(&log, "").unwrap();
    chmod(&log, 0o666);
    log
}

/// The host broker for the containers: root's, admitting RUNNER by uid
/// and GROUPED by group, its socket directory open to search.
fn host_broker(jobs: u32, extra: &[&str]) -> RunningBroker {
    let runner = RUNNER.to_string();
    let grouped = GROUPED.to_string();
    let mut args = vec!["--allow-uid", &runner, "--allow-group", &grouped];
    args.extend(extra);
    let broker = RunningBroker::start_with(jobs, &args);
    chmod(broker.dir.path(), 0o755);
    chmod(broker.socket.parent().unwrap(), 0o755);
    broker
}

fn baton_run_in(dir: &Path, name: &str, style: &str, cmd: &str) -> String {
    format!(
        "cd {dir}; exec {baton} run --name {name} --jobserver-style {style} -- {cmd}",
        dir = dir.display(),
        baton = baton_bin()
    )
}

/// A cgroup v2 directory of the test's own, for a container's label in
/// status; None where there is no writable cgroup v2 hierarchy.
fn cgroup_dir(name: &str) -> Option<PathBuf> {
    let root = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.join("cgroup.procs").exists() && !p.join("tasks").exists())?;
    let dir = root.join(format!("baton-test-{name}-{}", std::process::id()));
    std::fs::create_dir(&dir).ok()?;
    Some(dir)
}

#[test]
fn containers_of_three_makes_and_a_cargo_build_share_one_limit() {
    if !can_act_as_another_user() || !unshare_present() {
        return;
    }
    let broker = host_broker(4, &[]);
    let logs = TempDir::new("ctr-logs");
    let log = shared_log(logs.path());
    let a = make_dir("ctr-a", &log, 12, "0.3");
    let b = make_dir("ctr-b", &log, 12, "0.3");
    let c = make_dir("ctr-c", &log, 12, "0.3");
    let d = TempDir::new("ctr-cargo");
    common::cargo_workspace(d.path(), &log, 6);
    let make43 = common::make43();
    let make44 = common::make44();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let cgroup = cgroup_dir("ctr-c");

    let containers = [
        // A rootless container of the runner's uid: make 4.3 (auto: a pipe).
        Container::start(
            Container::command(
                &broker,
                Userns::MappedFrom(RUNNER),
                None,
                &[],
                &baton_run_in(a.path(), "ctr-a", "auto", make43.to_str().unwrap()),
            ),
            None,
        ),
        // Another, admitted by its group: make 4.4.1, the form auto
        // picks (never the FUSE file: its mount is closed to this uid).
        Container::start(
            Container::command(
                &broker,
                Userns::MappedFrom(GROUPED),
                None,
                &[],
                &baton_run_in(b.path(), "ctr-b", "auto", make44.to_str().unwrap()),
            ),
            None,
        ),
        // Root's container in a cgroup of its own, named by BATON_NAME.
        Container::start(
            Container::command(
                &broker,
                Userns::None,
                cgroup.as_deref(),
                &[("BATON_NAME", "ctr-c")],
                &format!(
                    "cd {}; exec {} run --jobserver-style fifo -- {}",
                    c.path().display(),
                    baton_bin(),
                    make44.display()
                ),
            ),
            cgroup.clone(),
        ),
        // And cargo, offline, its target directory in the work directory.
        Container::start(
            Container::command(
                &broker,
                Userns::None,
                None,
                &[(
                    "CARGO_TARGET_DIR",
                    d.path().join("target").to_str().unwrap(),
                )],
                &format!(
                    "cd {}; exec {} run --name ctr-cargo -- {cargo} build --offline --quiet -j 16",
                    d.path().display(),
                    baton_bin()
                ),
            ),
            None,
        ),
    ];

    // Every container's build shows in status, with its host uid where it
    // is not the broker's, and the cgroup it runs in.
    let mut seen: BTreeMap<String, (Option<u32>, Option<String>)> = BTreeMap::new();
    wait_for(
        Duration::from_secs(120),
        "the four containers' builds in status",
        || {
            for build in broker.status().builds {
                if build.name.starts_with("ctr-") {
                    seen.insert(build.name.clone(), (build.uid, build.cgroup.clone()));
                }
            }
            seen.len() == 4
        },
    );
    let mut outputs = Vec::new();
    for container in containers {
        outputs.push(container.finish());
    }
    for out in &outputs {
        assert!(
            out.status.success(),
            "a container's build failed: {}",
            text(out)
        );
    }
    let (most, started) = max_overlap(&log);
    assert_eq!(started, 12 * 3 + 6, "every job ran once");
    assert!(
        most <= 4,
        "{most} jobs at once across the containers, limit 4"
    );
    broker.wait_all_free();

    // SO_PEERCRED gives the broker the host's uid of a user namespace's
    // root; the broker's own uid is not shown.
    assert_eq!(seen["ctr-a"].0, Some(RUNNER), "{seen:?}");
    assert_eq!(seen["ctr-b"].0, Some(GROUPED), "{seen:?}");
    assert_eq!(seen["ctr-c"].0, None, "{seen:?}");
    if let Some(cg) = &cgroup {
        let name = format!("/{}", cg.file_name().unwrap().to_str().unwrap());
        assert_eq!(seen["ctr-c"].1.as_deref(), Some(name.as_str()), "{seen:?}");
    }
    println!("containers: at most {most} jobs at once of {started}; builds seen: {seen:?}");
}

/// Jobs that log their start and end to their own log and to the shared
/// one, and run until `go` exists.
fn blocking_makefile(dir: &Path, own: &Path, shared: &Path, go: &Path, jobs: usize) {
    let targets: Vec<String> = (0..jobs).map(|i| format!("j{i}")).collect();
    std::fs::write(
        dir.join("Makefile"),
        format!(
            "all: {all}\n{all}:\n\t@echo S >> {own}; echo S >> {shared}; \
             while [ ! -e {go} ]; do sleep 0.02; done; echo E >> {own}; echo E >> {shared}\n\
             .PHONY: all {all}\n",
            all = targets.join(" "),
            own = own.display(),
            shared = shared.display(),
            go = go.display()
        ),
    )
    .unwrap();
}

/// The killed build `id`, orphaned, holds a token per job of its own
/// still running (`jobs`), no more, no fewer.
fn assert_the_orphan_keeps(broker: &RunningBroker, id: u64, jobs: usize) {
    let s = broker.status();
    let orphan = s.builds.iter().find(|b| b.id == id).expect("the orphan");
    assert_eq!(
        orphan.held,
        jobs as u32,
        "the orphan keeps a token per job of its own: {s:#?}\n{}",
        broker.log()
    );
}

/// Jobs started and not yet ended, by their own log.
fn running_in(log: &Path) -> usize {
    let t = std::fs::read_to_string(log).unwrap_or_default();
    let count = |what: &str| t.lines().filter(|l| *l == what).count();
    count("S") - count("E")
}

/// A `kill -9` of a container's `baton run` (not the container's init: a
/// shell is, and stays) while its jobs run, beside another container's
/// build started from the same session with the same pid inside (2): the
/// broker keeps as many tokens as the killed build's own jobs still run,
/// found by the pid they carry in their PID namespace and that namespace,
/// gets them back as they end, and counts each build's jobs apart.
#[test]
fn a_killed_build_in_a_container_returns_its_tokens_only_when_its_jobs_are_gone() {
    if !can_act_as_another_user() || !unshare_present() {
        return;
    }
    let broker = host_broker(4, &["--no-fuse"]);
    let logs = TempDir::new("ctr-kill-logs");
    let shared = shared_log(logs.path());
    let go = logs.path().join("go");
    let mut containers = Vec::new();
    let mut own_logs = Vec::new();
    let mut works = Vec::new();
    for name in ["ctr-killed", "ctr-beside"] {
        let work = TempDir::new(name);
        chmod(work.path(), 0o777);
        let own = logs.path().join(format!("{name}.log"));
        std::fs::write(&own, "").unwrap();
        chmod(&own, 0o666);
        blocking_makefile(work.path(), &own, &shared, &go, 6);
        // The container's init (the shell) stays until the jobs may end:
        // were it to exit, the kernel would kill every process of its
        // namespace.
        // Two tokens each (--max 2), so that both run jobs at once: the
        // jobs never end by themselves to give tokens back.
        let script = format!(
            "cd {}; {} run --max 2 --name {name} -- {} & while [ ! -e {go} ]; do sleep 0.05; done; wait",
            work.path().display(),
            baton_bin(),
            common::make43().display(),
            go = go.display()
        );
        containers.push(Container::start(
            Container::command(&broker, Userns::MappedFrom(RUNNER), None, &[], &script),
            None,
        ));
        own_logs.push(own);
        works.push(work);
    }
    wait_for(
        Duration::from_secs(60),
        "4 jobs running, of both builds",
        || running_in(&shared) == 4 && own_logs.iter().all(|l| running_in(l) > 0),
    );
    let builds = broker.status().builds;
    let build = |name: &str| {
        builds
            .iter()
            .find(|b| b.name == name)
            .cloned()
            .expect("the build in status")
    };
    let (killed, beside) = (build("ctr-killed"), build("ctr-beside"));
    // Each build's jobs, counted apart though their baton runs share a
    // session and a pid (in two namespaces).
    let killed_jobs = running_in(&own_logs[0]);
    assert_eq!(killed.running, Some(killed_jobs as u32), "{killed:?}");
    assert_eq!(
        beside.running,
        Some(running_in(&own_logs[1]) as u32),
        "{beside:?}"
    );
    // Its pid as the broker sees it: the host's.
    unsafe { libc::kill(killed.pid as i32, libc::SIGKILL) };
    let said = format!(
        "baton run pid {} died while its build runs {killed_jobs} job(s)",
        killed.pid
    );
    wait_for(
        Duration::from_secs(20),
        "the orphaned build noticed",
        || broker.log().contains(&said),
    );
    assert_eq!(
        running_in(&own_logs[0]),
        killed_jobs,
        "the jobs outlive their baton run"
    );
    assert_the_orphan_keeps(&broker, killed.id, killed_jobs);
    std::fs::write(&go, "").unwrap();
    broker.wait_all_free();
    let (most, _) = max_overlap(&shared);
    assert!(most <= 4, "{most} at once");
    drop(containers);
}

#[test]
fn a_container_of_a_uid_not_allowed_is_refused_naming_allow_group() {
    if !can_act_as_another_user() || !unshare_present() {
        return;
    }
    let broker = host_broker(2, &["--no-fuse"]);
    let out = Container::start(
        Container::command(
            &broker,
            Userns::MappedFrom(STRANGER),
            None,
            &[],
            &format!("{} status", baton_bin()),
        ),
        None,
    )
    .finish();
    let said = text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains(&format!("uid {STRANGER} may not use this broker")),
        "{said}"
    );
    assert!(said.contains("--allow-group"), "{said}");
    assert!(said.contains(&format!("--allow-uid {STRANGER}")), "{said}");
}

/// The FIFO and pipe styles need nothing from the host but the socket: in
/// a rootless container (its FIFO goes to its own $TMPDIR, since the
/// socket's directory is root's), make 4.4.1 on a FIFO and make 4.3 on a
/// pipe, one after the other, within the limit.
#[test]
fn fifo_and_pipe_styles_work_in_a_user_namespace_with_only_the_socket() {
    if !can_act_as_another_user() || !unshare_present() {
        return;
    }
    let broker = host_broker(3, &[]);
    let logs = TempDir::new("ctr-styles-logs");
    let log = shared_log(logs.path());
    let work = make_dir("ctr-styles", &log, 8, "0.1");
    let script = format!(
        "{fifo}; {pipe}",
        fifo = baton_run_in(
            work.path(),
            "ctr-fifo",
            "fifo",
            common::make44().to_str().unwrap()
        )
        .replacen("exec ", "", 1),
        pipe = baton_run_in(
            work.path(),
            "ctr-pipe",
            "pipe",
            common::make43().to_str().unwrap()
        )
        .replacen("exec ", "", 1),
    );
    let out = Container::start(
        Container::command(&broker, Userns::MappedFrom(RUNNER), None, &[], &script),
        None,
    )
    .finish();
    assert!(out.status.success(), "{}", text(&out));
    let (most, started) = max_overlap(&log);
    assert_eq!(started, 16);
    assert!(most <= 3, "{most} at once, limit 3");
    broker.wait_all_free();
}

/// `auto` gives make 4.4.1 the FUSE file only where the broker's mount is
/// there to use: not in a rootless container (the mount, rbind-mounted
/// along, is closed to its uid), not in a container that bound the
/// socket's directory alone; in root's container with the mount bound
/// in, the file. The limit is 32, where the file pays.
#[test]
fn in_a_container_auto_gives_the_fuse_file_only_where_the_mount_is_usable() {
    if !can_act_as_another_user() || !unshare_present() {
        return;
    }
    let broker = host_broker(32, &[]);
    if !broker.log().contains("FUSE token files at") {
        common::skip(common::Missing::Fuse, "the broker has no FUSE mount here");
        return;
    }
    let logs = TempDir::new("ctr-auto-logs");
    let log = shared_log(logs.path());
    let work = make_dir("ctr-auto", &log, 6, "0.05");
    let make44 = common::make44();
    // No make 4.3 nor gcc for the build to run, which read only R,W.
    let run = format!(
        "cd {}; MAKE={make44} CC=/bin/false exec {} run --explain -- {make44}",
        work.path().display(),
        baton_bin(),
        make44 = make44.display()
    );
    for (userns, bind, expected) in [
        (Userns::MappedFrom(RUNNER), "--rbind", "fifo"),
        (Userns::None, "--bind", "fifo"),
        (Userns::None, "--rbind", "fuse"),
    ] {
        let out = Container::start(
            Container::command_binding(&broker, userns, None, &[], bind, &run),
            None,
        )
        .finish();
        let said = text(&out);
        assert!(out.status.success(), "{said}");
        let form = said
            .lines()
            .find_map(|l| l.strip_prefix("baton: jobserver: "))
            .unwrap_or_else(|| panic!("no form named: {said}"));
        assert!(form.starts_with(expected), "{bind}: {form}\n{said}");
    }
    // Asked for by name where it cannot serve, it is refused in words.
    let out = Container::start(
        Container::command(
            &broker,
            Userns::MappedFrom(RUNNER),
            None,
            &[],
            &run.replace("run --explain", "run --jobserver-style fuse"),
        ),
        None,
    )
    .finish();
    let said = text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("no FUSE mount we may use"), "{said}");
    assert!(said.contains("--jobserver-style fifo"), "{said}");
    let (most, started) = max_overlap(&log);
    assert_eq!(started, 18);
    assert!(most <= 32);
    broker.wait_all_free();
}

/// The static binary `scripts/package --static` makes: `BATON_TEST_STATIC`
/// (scripts/test builds it once), else built here (minutes).
fn static_baton() -> Option<PathBuf> {
    if let Some(bin) = std::env::var_os("BATON_TEST_STATIC") {
        return Some(PathBuf::from(bin));
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new(root.join("scripts/package"))
        .arg("--static")
        .output()
        .expect("run scripts/package --static");
    if !out.status.success() {
        common::skip(
            common::Missing::StaticBuild,
            &format!("scripts/package --static failed: {}", text(&out)),
        );
        return None;
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    Some(PathBuf::from(stdout.lines().last().unwrap().trim()))
}

/// The static binary runs in a root file system that holds nothing else
/// (no libc, no loader, no shell): in a container of its own (mount, PID
/// and network namespaces, chroot into that root, the host broker's
/// socket directory bound in), `baton run` takes the host's tokens for a
/// command (itself, `status`, the only program there) and gives them back.
#[test]
fn the_static_binary_runs_in_an_empty_root_against_the_host_broker() {
    if !can_act_as_another_user() || !unshare_present() {
        return;
    }
    let Some(bin) = static_baton() else {
        return;
    };
    let described = Command::new("file").arg(&bin).output().unwrap();
    let described = String::from_utf8_lossy(&described.stdout).into_owned();
    assert!(
        described.contains("statically linked") || described.contains("static-pie linked"),
        "{described}"
    );
    let broker = host_broker(3, &["--no-fuse"]);
    let root = TempDir::new("empty-root");
    std::fs::create_dir_all(root.path().join("run/baton")).unwrap();
    std::fs::create_dir_all(root.path().join("tmp")).unwrap();
    std::fs::copy(&bin, root.path().join("baton")).unwrap();
    let entries: Vec<_> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(entries.len(), 3, "the root holds baton, run/ and tmp/ only");
    // The host's shell binds the socket's directory in the new mount
    // namespace, then chroot leaves nothing but the root: from there on
    // only /baton runs.
    let script = format!(
        "mount --bind {run} {root}/run/baton && exec chroot {root} /baton run --name empty-root \
         --jobserver-style fifo -- /baton status --json",
        run = broker.socket.parent().unwrap().display(),
        root = root.path().display()
    );
    let out = Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child", "--mount", "--net", "--"])
        .args(["sh", "-c", &script])
        .env("BATON_SOCKET", "/run/baton/socket")
        .env("BATON_NO_AUTOSTART", "1")
        .env("XDG_CONFIG_HOME", "/tmp")
        .env("TMPDIR", "/tmp")
        .env_remove("MAKEFLAGS")
        .output()
        .unwrap();
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("\"name\": \"empty-root\""), "{said}");
    broker.wait_all_free();
}

/// Root's containers may write in the socket's directory, where `baton
/// run` makes its FIFO, and each container's `baton run` is pid 1 of its
/// own namespace: their FIFOs are named by PID namespace as well as pid,
/// so one container's build never replaces or sweeps another's.
#[test]
fn fifos_of_containers_sharing_the_socket_directory_never_collide() {
    if !can_act_as_another_user() || !unshare_present() {
        return;
    }
    let broker = host_broker(4, &["--no-fuse"]);
    let work = TempDir::new("ctr-fifos");
    let go = work.path().join("go");
    let mut containers = Vec::new();
    let mut outs = Vec::new();
    for name in ["one", "two"] {
        let out = work.path().join(format!("{name}.makeflags"));
        let script = format!(
            "exec {} run --jobserver-style fifo -- sh -c 'echo \"$MAKEFLAGS\" > {out}; \
             while [ ! -e {go} ]; do sleep 0.02; done'",
            baton_bin(),
            out = out.display(),
            go = go.display()
        );
        containers.push(Container::start(
            Container::command(&broker, Userns::None, None, &[], &script),
            None,
        ));
        outs.push(out);
    }
    let fifo_of = |out: &Path| {
        let flags = std::fs::read_to_string(out).unwrap_or_default();
        flags
            .split_whitespace()
            .find_map(|w| w.strip_prefix("--jobserver-auth=fifo:"))
            .map(|p| {
                p.replace(
                    "/run/baton",
                    broker.socket.parent().unwrap().to_str().unwrap(),
                )
            })
    };
    wait_for(Duration::from_secs(30), "both builds started", || {
        outs.iter().all(|o| fifo_of(o).is_some())
    });
    let (one, two) = (fifo_of(&outs[0]).unwrap(), fifo_of(&outs[1]).unwrap());
    assert_ne!(one, two, "two containers' builds were given one FIFO");
    use std::os::unix::fs::FileTypeExt;
    for fifo in [&one, &two] {
        let kind = std::fs::symlink_metadata(fifo).map(|m| m.file_type().is_fifo());
        assert!(matches!(kind, Ok(true)), "{fifo} is gone: {kind:?}");
    }
    std::fs::write(&go, "").unwrap();
    for container in containers {
        let out = container.finish();
        assert!(out.status.success(), "{}", text(&out));
    }
    broker.wait_all_free();
}

// Real podman (rootful, Debian's 4.3 with runc): an image imported from a
// tar of a minimal root file system made here, no registry. Every piece
// of podman's state (storage, run root, its tmp and volume directories)
// is in a directory of the test's, removed at the end with its containers
// and image; a container still running when a test ends is killed.

/// Flags this host needs: runc (crun refuses hybrid cgroups here) and
/// ulimits of its own (with podman's default, runc's setrlimit of
/// RLIMIT_NOFILE fails with EPERM here); cgroupfs, podman's choice here,
/// named so that a systemd host runs the same; vfs storage (no overlay
/// needed).
struct Podman {
    state: TempDir,
    image: &'static str,
    next: std::cell::Cell<u32>,
}

impl Podman {
    /// podman with its state in a new temporary directory, and an image
    /// holding `files` (host paths, copied to the same place with the
    /// shared libraries `ldd` names) and the static baton at /bin/baton;
    /// None (a skip) where podman or runc is missing or cannot run it.
    fn with_image(files: &[PathBuf]) -> Option<Self> {
        for tool in ["podman", "runc"] {
            if Command::new(tool).arg("--version").output().is_err() {
                common::skip(common::Missing::Podman, &format!("needs {tool}"));
                return None;
            }
        }
        let bin = static_baton()?;
        let podman = Podman {
            state: TempDir::new("podman"),
            image: "localhost/baton-test:1",
            next: std::cell::Cell::new(0),
        };
        let root = TempDir::new("podman-rootfs");
        for dir in ["bin", "run/baton", "work", "log", "tmp"] {
            std::fs::create_dir_all(root.path().join(dir)).unwrap();
        }
        chmod(&root.path().join("tmp"), 0o1777);
        std::fs::copy(&bin, root.path().join("bin/baton")).unwrap();
        for file in files {
            let ldd = Command::new("ldd").arg(file).output().unwrap();
            let libs = String::from_utf8_lossy(&ldd.stdout)
                .split_whitespace()
                .filter(|w| w.starts_with('/'))
                .map(PathBuf::from)
                .collect::<Vec<_>>();
            for f in std::iter::once(file).chain(&libs) {
                let out = Command::new("cp")
                    .args(["--parents", "-L"])
                    .arg(f)
                    .arg(root.path())
                    .output()
                    .unwrap();
                assert!(out.status.success(), "{}", text(&out));
            }
        }
        let mut tar = Command::new("tar")
            .arg("-C")
            .arg(root.path())
            .args(["-c", "."])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = podman
            .command()
            .args(["import", "-", podman.image])
            .stdin(tar.stdout.take().unwrap())
            .output()
            .unwrap();
        assert!(tar.wait().unwrap().success());
        assert!(out.status.success(), "podman import: {}", text(&out));
        // One container that only says its version: where podman cannot
        // run a container at all here, a skip, not a failure.
        let out = podman
            .run_args("probe", &[], &["/bin/baton", "--version"])
            .output()
            .unwrap();
        if !out.status.success() {
            common::skip(
                common::Missing::Podman,
                &format!("podman cannot run a container here: {}", text(&out)),
            );
            return None;
        }
        Some(podman)
    }

    fn command(&self) -> Command {
        let state = self.state.path();
        let mut c = Command::new("podman");
        c.arg("--root")
            .arg(state.join("storage"))
            .arg("--runroot")
            .arg(state.join("run"))
            .arg("--tmpdir")
            .arg(state.join("tmp"))
            .arg("--volumepath")
            .arg(state.join("volumes"))
            .args(["--storage-driver", "vfs", "--cgroup-manager", "cgroupfs"])
            .args(["--runtime", "runc", "--events-backend", "none"]);
        c
    }

    /// `podman run --rm --name NAME` of the image, without a network, with
    /// `opts` (volumes, env, user) before the image and `argv` after it.
    fn run_args(&self, name: &str, opts: &[String], argv: &[&str]) -> Command {
        let mut c = self.command();
        c.args(["run", "--rm", "--name", name, "--network", "none"])
            .args([
                "--ulimit",
                "nofile=1024:1024",
                "--ulimit",
                "nproc=1024:1024",
            ])
            .args(opts)
            .arg(self.image)
            .args(argv);
        c
    }

    /// A container named after `label` running `argv` in the background,
    /// the broker's socket directory at /run/baton, `log_dir` at /log and
    /// `work` at /work, BATON_SOCKET and BATON_NAME (`label`) set.
    fn start(
        &self,
        broker: &RunningBroker,
        label: &str,
        log_dir: &Path,
        work: &Path,
        user: Option<&str>,
        argv: &[&str],
    ) -> PodmanContainer<'_> {
        let n = self.next.get();
        self.next.set(n + 1);
        let name = format!("baton-test-{}-{n}-{label}", std::process::id());
        let mut opts = vec![
            "-v".to_string(),
            format!("{}:/run/baton", broker.socket.parent().unwrap().display()),
            "-v".into(),
            format!("{}:/log", log_dir.display()),
            "-v".into(),
            format!("{}:/work", work.display()),
            "-e".into(),
            "BATON_SOCKET=/run/baton/socket".into(),
            "-e".into(),
            "BATON_NO_AUTOSTART=1".into(),
            "-e".into(),
            format!("BATON_NAME={label}"),
        ];
        if let Some(user) = user {
            opts.extend(["--user".into(), user.into()]);
        }
        let child = self
            .run_args(&name, &opts, argv)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("podman run");
        PodmanContainer {
            podman: self,
            name,
            child: Some(child),
        }
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        // Containers first (any left running are killed), then the image;
        // then the state directory goes with the TempDir.
        for args in [&["rm", "-af", "-t", "0"][..], &["rmi", "-af"]] {
            let _ = self.command().args(args).output();
        }
    }
}

/// A podman container run in the foreground by a `podman run` child;
/// killed and removed by name on drop if it still runs (killing `podman
/// run` alone would leave the container to conmon).
struct PodmanContainer<'a> {
    podman: &'a Podman,
    name: String,
    child: Option<Child>,
}

impl PodmanContainer<'_> {
    fn finish(mut self) -> Output {
        self.child.take().unwrap().wait_with_output().unwrap()
    }

    /// The host pid of the container's init, by `podman inspect`.
    fn init_pid(&self) -> u32 {
        let out = self
            .podman
            .command()
            .args(["inspect", "--format", "{{.State.Pid}}", &self.name])
            .output()
            .unwrap();
        assert!(out.status.success(), "podman inspect: {}", text(&out));
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    }
}

impl Drop for PodmanContainer<'_> {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if child.try_wait().ok().flatten().is_none() {
                let _ = self.podman.command().args(["kill", &self.name]).output();
                let _ = self
                    .podman
                    .command()
                    .args(["rm", "-f", "-t", "0", &self.name])
                    .output();
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

/// The tools the podman tests' builds run: GNU make 4.3 (copied in from
/// the host), a shell and sleep.
fn podman_tools() -> Vec<PathBuf> {
    vec![
        common::make43(),
        PathBuf::from("/bin/sh"),
        PathBuf::from("/bin/sleep"),
    ]
}

/// The broker's socket directory as docs/containers.md has it: root's,
/// 0755, so that a container's other uids may reach the socket.
fn open_socket_dir(broker: &RunningBroker) {
    chmod(broker.dir.path(), 0o755);
    chmod(broker.socket.parent().unwrap(), 0o755);
}

/// Three podman containers, each running `baton run -- make` (make 4.3,
/// 12 logged jobs) against one host broker `--jobs 4`: the jobs' own log
/// never shows more than 4 running at once across the three, status shows
/// each build (by BATON_NAME, in its container's cgroup), and every token
/// comes back.
#[test]
fn podman_containers_of_three_makes_share_one_limit() {
    if !can_act_as_another_user() {
        return;
    }
    let Some(podman) = Podman::with_image(&podman_tools()) else {
        return;
    };
    let broker = RunningBroker::start_with(4, &[]);
    open_socket_dir(&broker);
    let logs = TempDir::new("podman-logs");
    shared_log(logs.path());
    let work = TempDir::new("podman-work");
    common::flat_makefile(work.path(), Path::new("/log/jobs.log"), 12, "0.3");
    let names = ["podman-a", "podman-b", "podman-c"];
    let containers: Vec<_> = names
        .iter()
        .map(|name| {
            podman.start(
                &broker,
                name,
                logs.path(),
                work.path(),
                None,
                &["/bin/baton", "run", "--", "make", "-f", "/work/Makefile"],
            )
        })
        .collect();
    let mut seen: BTreeMap<String, Option<String>> = BTreeMap::new();
    wait_for(
        Duration::from_secs(120),
        "the three containers' builds in status",
        || {
            for build in broker.status().builds {
                if names.contains(&build.name.as_str()) {
                    seen.insert(build.name.clone(), build.cgroup.clone());
                }
            }
            seen.len() == 3
        },
    );
    for container in containers {
        let out = container.finish();
        assert!(out.status.success(), "a container's build: {}", text(&out));
    }
    let (most, started) = max_overlap(&logs.path().join("jobs.log"));
    assert_eq!(started, 3 * 12, "every job ran once");
    assert!(
        most <= 4,
        "{most} jobs at once across the containers, limit 4"
    );
    broker.wait_all_free();
    // Each in a cgroup of its own, podman's.
    let cgroups: std::collections::BTreeSet<_> = seen.values().flatten().collect();
    assert_eq!(cgroups.len(), 3, "{seen:?}");
    assert!(cgroups.iter().all(|c| c.contains("libpod")), "{seen:?}");
    println!("podman: at most {most} jobs at once of {started}; builds seen: {seen:?}");
}

/// A `kill -9` of one podman container's `baton run` (its init is a shell
/// that stays until the jobs may end) while its jobs run, beside another
/// container's build: the broker keeps a token per job the killed build
/// still runs, and every token is back once they end.
#[test]
fn podman_a_killed_build_returns_its_tokens_only_when_its_jobs_are_gone() {
    if !can_act_as_another_user() {
        return;
    }
    let Some(podman) = Podman::with_image(&podman_tools()) else {
        return;
    };
    let broker = RunningBroker::start_with(4, &[]);
    open_socket_dir(&broker);
    let logs = TempDir::new("podman-kill-logs");
    let shared = shared_log(logs.path());
    let go = logs.path().join("go");
    let mut containers = Vec::new();
    let mut own_logs = Vec::new();
    let mut works = Vec::new();
    for name in ["podman-killed", "podman-beside"] {
        let work = TempDir::new(name);
        let own = logs.path().join(format!("{name}.log"));
        std::fs::write(&own, "").unwrap();
        blocking_makefile(
            work.path(),
            &Path::new("/log").join(format!("{name}.log")),
            Path::new("/log/jobs.log"),
            Path::new("/log/go"),
            6,
        );
        // Two tokens each (--max 2), so both run jobs at once; the shell
        // (the container's init) stays until the jobs may end.
        let script = "/bin/baton run --max 2 -- make -f /work/Makefile & \
                      while [ ! -e /log/go ]; do sleep 0.05; done; wait";
        containers.push(podman.start(
            &broker,
            name,
            logs.path(),
            work.path(),
            None,
            &["/bin/sh", "-c", script],
        ));
        own_logs.push(own);
        works.push(work);
    }
    wait_for(
        Duration::from_secs(120),
        "4 jobs running, of both builds",
        || running_in(&shared) == 4 && own_logs.iter().all(|l| running_in(l) > 0),
    );
    let builds = broker.status().builds;
    let killed = builds
        .iter()
        .find(|b| b.name == "podman-killed")
        .cloned()
        .expect("the build in status");
    // The pid the broker gives is the host's, a child of the container's
    // init as podman knows it.
    let init = containers[0].init_pid();
    assert!(
        common::children(init).contains(&killed.pid),
        "baton run (pid {}) is not a child of the container's init (pid {init})",
        killed.pid
    );
    let killed_jobs = running_in(&own_logs[0]);
    unsafe { libc::kill(killed.pid as i32, libc::SIGKILL) };
    let said = format!(
        "baton run pid {} died while its build runs {killed_jobs} job(s)",
        killed.pid
    );
    wait_for(
        Duration::from_secs(20),
        "the orphaned build noticed",
        || broker.log().contains(&said),
    );
    assert_eq!(running_in(&own_logs[0]), killed_jobs, "the jobs outlive it");
    assert_the_orphan_keeps(&broker, killed.id, killed_jobs);
    std::fs::write(&go, "").unwrap();
    for container in containers {
        // The killed build's shell reports make's end; the other's too.
        container.finish();
    }
    broker.wait_all_free();
    let (most, _) = max_overlap(&shared);
    assert!(most <= 4, "{most} at once");
}

/// A podman container run as a uid the host's root broker does not admit
/// (`--user 1234:1234`, a broker without `--allow-*`, whose socket is
/// then root's alone) is refused in words naming `--allow-group`; with
/// `--allow-uid 1234` (the socket opened to it, the directory 0755 as
/// docs/containers.md says) the same container builds.
#[test]
fn podman_a_uid_not_allowed_is_refused_naming_allow_group_and_admitted_by_allow_uid() {
    if !can_act_as_another_user() {
        return;
    }
    let Some(podman) = Podman::with_image(&podman_tools()) else {
        return;
    };
    let logs = TempDir::new("podman-uid-logs");
    let log = shared_log(logs.path());
    let work = TempDir::new("podman-uid-work");
    common::flat_makefile(work.path(), Path::new("/log/jobs.log"), 4, "0.1");
    let build = ["/bin/baton", "run", "--", "make", "-f", "/work/Makefile"];

    let closed = RunningBroker::start_with(2, &[]);
    open_socket_dir(&closed);
    let out = podman
        .start(
            &closed,
            "podman-stranger",
            logs.path(),
            work.path(),
            Some("1234:1234"),
            &build,
        )
        .finish();
    let said = text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("--allow-group"), "{said}");
    assert_eq!(max_overlap(&log).1, 0, "no job ran: {said}");
    drop(closed);

    // Admitted by uid, by a broker that also admits others: a uid it does
    // not name is refused by the broker, in words naming both options.
    let open = RunningBroker::start_with(2, &["--allow-uid", "1234"]);
    open_socket_dir(&open);
    let out = podman
        .start(
            &open,
            "podman-other",
            logs.path(),
            work.path(),
            Some("4321:4321"),
            &build,
        )
        .finish();
    let said = text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("uid 4321 may not use this broker"), "{said}");
    assert!(said.contains("--allow-group"), "{said}");
    let out = podman
        .start(
            &open,
            "podman-admitted",
            logs.path(),
            work.path(),
            Some("1234:1234"),
            &build,
        )
        .finish();
    assert!(out.status.success(), "{}", text(&out));
    let (most, started) = max_overlap(&log);
    assert_eq!(started, 4);
    assert!(most <= 2, "{most} at once, limit 2");
    open.wait_all_free();
}
