//! docs/security.md against the real binary: another user (uid 65534,
//! through setpriv) squats the private directory, plants links beside a
//! socket, runs a broker of its own or knocks on ours; a client floods the
//! broker; a broker runs out of descriptors. Each is refused in words.

mod common;

use common::{
    baton, baton_bin, can_act_as_another_user, output_text, python, wait_for, Guarded,
    RunningBroker, SpawnGuarded, TempDir,
};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

const OTHER: u32 = 65534;

/// `program args...` run as uid and gid 65534, with no supplementary groups.
fn as_other_user(program: &str) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        &format!("--reuid={OTHER}"),
        &format!("--regid={OTHER}"),
        "--clear-groups",
        program,
    ]);
    c
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// A broker run by the other user, stopped by pid on drop.
struct OthersBroker {
    child: Guarded,
    socket: PathBuf,
}

impl OthersBroker {
    /// Serves at `socket`, whose directory the other user owns (it is
    /// made and handed over here if it does not exist).
    fn start(socket: &Path, log: &Path) -> Self {
        let dir = socket.parent().unwrap();
        if !dir.exists() {
            std::fs::create_dir(dir).unwrap();
        }
        std::os::unix::fs::chown(dir, Some(OTHER), Some(OTHER)).unwrap();
        let child = as_other_user(baton_bin())
            .args(["serve", "--jobs", "1000000", "--no-fuse", "--socket"])
            .arg(socket)
            .env_remove("XDG_RUNTIME_DIR")
            .stderr(std::fs::File::create(log).unwrap())
            .spawn_guarded()
            .unwrap();
        wait_for(Duration::from_secs(10), "the other user's broker", || {
            UnixStream::connect(socket).is_ok()
        });
        OthersBroker {
            child,
            socket: socket.to_path_buf(),
        }
    }
}

impl Drop for OthersBroker {
    fn drop(&mut self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// `baton` with `$XDG_RUNTIME_DIR` at `xdg`: its default socket is then
/// `xdg/baton/socket`, a directory a test may squat without touching the
/// machine's own /tmp/baton-$UID.
fn baton_at_default(xdg: &Path) -> Command {
    let mut c = baton();
    c.env("XDG_RUNTIME_DIR", xdg).env_remove("BATON_SOCKET");
    c
}

#[test]
fn a_broker_of_another_user_is_refused_by_status_and_run() {
    if !can_act_as_another_user() {
        return;
    }
    let tmp = TempDir::new("others-broker");
    chmod(tmp.path(), 0o755);
    let socket = tmp.path().join("theirs").join("socket");
    let _theirs = OthersBroker::start(&socket, &tmp.path().join("theirs.log"));

    let status = baton()
        .arg("status")
        .arg("--socket")
        .arg(&socket)
        .output()
        .unwrap();
    let said = output_text(&status);
    assert!(!status.status.success(), "{said}");
    assert!(said.contains(&format!("process of uid {OTHER}")), "{said}");
    assert!(said.contains(&socket.display().to_string()), "{said}");
    assert!(!said.contains("1000000"), "{said}");

    let run = baton()
        .args(["run", "--socket"])
        .arg(&socket)
        .env("BATON_NO_AUTOSTART", "1")
        .args(["--", "sh", "-c", "echo ran with MAKEFLAGS=$MAKEFLAGS"])
        .output()
        .unwrap();
    let said = output_text(&run);
    assert!(!run.status.success(), "{said}");
    assert!(!said.contains("ran with"), "{said}");
    assert!(said.contains(&format!("process of uid {OTHER}")), "{said}");
}

#[test]
fn a_squatted_default_directory_is_refused_by_serve_status_and_run() {
    if !can_act_as_another_user() {
        return;
    }
    let xdg = TempDir::new("squatted");
    chmod(xdg.path(), 0o755);
    let dir = xdg.path().join("baton");
    std::fs::create_dir(&dir).unwrap();
    chmod(&dir, 0o700);
    let _theirs = OthersBroker::start(&dir.join("socket"), &xdg.path().join("theirs.log"));
    chmod(&dir, 0o777);

    for args in [
        &["status"][..],
        &["run", "--", "true"],
        &["serve", "--jobs", "1"],
    ] {
        let out = baton_at_default(xdg.path())
            .args(args)
            .env("BATON_NO_AUTOSTART", "1")
            .output()
            .unwrap();
        let said = output_text(&out);
        assert!(!out.status.success(), "{args:?}: {said}");
        assert!(
            said.contains(&format!("belongs to uid {OTHER}")),
            "{args:?}: {said}"
        );
    }
}

#[test]
fn a_symlinked_default_directory_is_refused_and_its_target_left_alone() {
    if !can_act_as_another_user() {
        return;
    }
    let xdg = TempDir::new("symlinked");
    let ours = xdg.path().join("ours");
    std::fs::create_dir(&ours).unwrap();
    chmod(&ours, 0o755);
    let link = xdg.path().join("baton");
    std::os::unix::fs::symlink(&ours, &link).unwrap();
    std::os::unix::fs::lchown(&link, Some(OTHER), Some(OTHER)).unwrap();

    let mut serve = baton_at_default(xdg.path())
        .args(["serve", "--jobs", "1", "--no-fuse"])
        .stderr(Stdio::piped())
        .spawn_guarded()
        .unwrap();
    let exited = common::wait_timeout(&mut serve, Duration::from_secs(10));
    if exited.is_none() {
        unsafe { libc::kill(serve.id() as i32, libc::SIGTERM) };
        let _ = serve.wait();
    }
    let mut said = String::new();
    serve
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut said)
        .unwrap();
    assert!(
        exited.is_some_and(|s| !s.success()),
        "serve took the link: {said}"
    );
    assert!(said.contains("symbolic link"), "{said}");
    let mode = std::fs::metadata(&ours).unwrap().mode() & 0o777;
    assert_eq!(mode, 0o755, "the link's target was chmod'ed");
    assert!(
        !ours.join("socket").exists(),
        "a socket went through the link"
    );

    let out = baton_at_default(xdg.path()).arg("status").output().unwrap();
    let said = output_text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("symbolic link"), "{said}");
}

/// A directory shared by every user (mode 1777), where the other user
/// has planted links where the broker's lock and mount point go.
fn shared_dir_with_a_planted_link(name: &str, target: &Path) -> (TempDir, PathBuf) {
    let tmp = TempDir::new(name);
    chmod(tmp.path(), 0o755);
    let shared = tmp.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    chmod(&shared, 0o1777);
    let planted = as_other_user("ln")
        .arg("-s")
        .arg(target)
        .arg(shared.join(name))
        .status()
        .unwrap();
    assert!(planted.success());
    (tmp, shared.join("socket"))
}

#[test]
fn a_planted_lock_link_is_refused_and_nothing_is_created_through_it() {
    if !can_act_as_another_user() {
        return;
    }
    let elsewhere = TempDir::new("lock-target");
    let target = elsewhere.path().join("made-by-root");
    let (_tmp, socket) = shared_dir_with_a_planted_link("socket.lock", &target);
    let out = baton()
        .args([
            "serve",
            "--jobs",
            "1",
            "--no-fuse",
            "--idle-timeout",
            "1",
            "--socket",
        ])
        .arg(&socket)
        .output()
        .unwrap();
    let said = output_text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("symbolic link"), "{said}");
    assert!(
        !target.exists(),
        "the broker created a file through the link"
    );
}

#[test]
fn a_planted_mount_point_link_is_refused_and_its_target_not_covered() {
    if !can_act_as_another_user() {
        return;
    }
    if !Path::new("/dev/fuse").exists() {
        common::skip(common::Missing::Fuse, "no /dev/fuse");
        return;
    }
    let elsewhere = TempDir::new("fuse-target");
    std::fs::write(elsewhere.path().join("precious"), "still here").unwrap();
    let (tmp, socket) = shared_dir_with_a_planted_link("fuse", elsewhere.path());
    let log = tmp.path().join("broker.log");
    let mut serve = baton()
        .args(["serve", "--jobs", "1", "--socket"])
        .arg(&socket)
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn_guarded()
        .unwrap();
    wait_for(Duration::from_secs(10), "the broker to listen", || {
        UnixStream::connect(&socket).is_ok()
    });
    let seen = std::fs::read_to_string(elsewhere.path().join("precious"));
    unsafe { libc::kill(serve.id() as i32, libc::SIGTERM) };
    serve.wait().unwrap();
    let said = std::fs::read_to_string(&log).unwrap();
    assert_eq!(seen.ok().as_deref(), Some("still here"), "{said}");
    assert!(said.contains("symbolic link"), "{said}");
    assert!(said.contains("shared with every user"), "{said}");
}

#[test]
fn the_broker_refuses_another_user_even_at_a_socket_open_to_all() {
    if !can_act_as_another_user() {
        return;
    }
    let broker = RunningBroker::start_with(3, &["--no-fuse"]);
    chmod(broker.dir.path(), 0o755);
    chmod(broker.socket.parent().unwrap(), 0o755);
    chmod(&broker.socket, 0o777);
    let out = as_other_user(baton_bin())
        .args(["limit", "1", "--socket"])
        .arg(&broker.socket)
        .output()
        .unwrap();
    let said = output_text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("refuses you"), "{said}");
    assert!(
        said.contains(&format!("uid {OTHER} may not use this broker")),
        "{said}"
    );
    assert_eq!(broker.status().limit, 3, "the other user changed the limit");
    assert!(
        broker.log().contains(&format!("uid {OTHER}")),
        "{}",
        broker.log()
    );
}

#[test]
fn the_handover_socket_is_private_to_its_user() {
    let broker = RunningBroker::start_with(2, &["--no-fuse"]);
    let handover = broker.socket.with_file_name("socket.handover");
    let meta = std::fs::symlink_metadata(&handover).unwrap();
    assert_eq!(
        (meta.uid(), meta.mode() & 0o777),
        (unsafe { libc::geteuid() }, 0o600),
        "{} must be the broker user's alone",
        handover.display()
    );
}

/// Opens `broker`'s directories and its socket `name` (beside the main
/// one) to everybody, then runs Python as another user, connected to that
/// socket as `s` (30 s timeout), and `script` after it.
fn python_at_socket_as_another_user(broker: &RunningBroker, name: &str, script: &str) -> Output {
    chmod(broker.dir.path(), 0o755);
    chmod(broker.socket.parent().unwrap(), 0o755);
    let socket = broker.socket.with_file_name(name);
    chmod(&socket, 0o777);
    let connect = "import socket,sys\n\
        s=socket.socket(socket.AF_UNIX)\n\
        s.connect(sys.argv[1])\n\
        s.settimeout(30)\n";
    as_other_user(python().to_str().unwrap())
        .args(["-c", &format!("{connect}{script}")])
        .arg(&socket)
        .output()
        .unwrap()
}

#[test]
fn the_handover_socket_refuses_another_user() {
    if !can_act_as_another_user() {
        return;
    }
    let broker = RunningBroker::start_with(2, &["--no-fuse"]);
    let mut held = broker.client("holder");
    held.acquire(1).unwrap();
    // What a successor would read first: the state's length. The other
    // user gets nothing, and the broker serves on.
    let out =
        python_at_socket_as_another_user(&broker, "socket.handover", "print(len(s.recv(16)))\n");
    assert_eq!(output_text(&out).trim(), "0", "{}", output_text(&out));
    assert!(broker
        .log()
        .contains("refused a handover asked by another user"));
    assert_eq!(broker.status().held, 1, "the broker serves on");
    held.release(1).unwrap();
}

/// The FUSE keeper holds a killed broker's mount for the next broker of
/// ours, and gives it to its own user only (docs/fuse.md), whatever its
/// socket's mode: a process holding that device could answer every build's
/// reads of the token files. Another user who reaches the keeper's socket
/// once the broker is gone gets no descriptor, the keeper keeps it, and
/// the next broker at the socket serves the same mount.
#[test]
fn the_fuse_keeper_gives_the_mount_to_nobody_else() {
    if !can_act_as_another_user() {
        return;
    }
    let mut broker = RunningBroker::start_with(1, &["--fuse-orphan-grace", "60"]);
    let mount = broker.socket.with_file_name("fuse");
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mounted = mountinfo
        .lines()
        .any(|l| l.split(' ').nth(4) == mount.to_str() && l.contains(" - fuse"));
    if !mounted {
        assert!(
            !common::fuse_should_mount(),
            "the broker did not mount its token files: {}",
            broker.log()
        );
        return common::skip(common::Missing::Fuse, "FUSE is not available here");
    }
    let keeper = *common::children(broker.pid())
        .first()
        .expect("the broker has a keeper");
    broker.stop_with(libc::SIGKILL);
    let out = python_at_socket_as_another_user(
        &broker,
        "socket.fuse-keeper",
        "_,fds,_,_=socket.recv_fds(s,1,1)\nprint(len(fds))\n",
    );
    let kept = common::pid_alive(keeper);
    // The next broker of ours takes the device from the keeper, and
    // unmounts as it stops: nothing is left mounted or running.
    let log = broker.dir.path().join("next.log");
    let mut next = baton()
        .args(["serve", "--jobs", "1", "--socket"])
        .arg(&broker.socket)
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn_guarded()
        .unwrap();
    wait_for(Duration::from_secs(10), "the next broker to serve", || {
        UnixStream::connect(&broker.socket).is_ok()
    });
    unsafe { libc::kill(next.id() as i32, libc::SIGTERM) };
    common::wait_timeout(&mut next, Duration::from_secs(10)).expect("the next broker stops");
    if common::pid_alive(keeper) {
        unsafe { libc::kill(keeper as i32, libc::SIGKILL) };
    }
    assert_eq!(
        output_text(&out).trim(),
        "0",
        "another user was given the mount's device: {}",
        output_text(&out)
    );
    assert!(kept, "the keeper gave its device away and ended");
    let next_log = std::fs::read_to_string(&log).unwrap();
    assert!(
        next_log.contains("serving the mount a killed broker left"),
        "{next_log}"
    );
}

/// A successor (`serve --replace`) takes the running broker's state and
/// every client's connection from whoever answers at the handover socket:
/// it must be a broker of ours. Another user's process, listening there
/// first in a shared directory, is refused before a byte is read.
#[test]
fn a_successor_refuses_to_take_over_from_another_user() {
    if !can_act_as_another_user() {
        return;
    }
    let dir = TempDir::new("handover-squat");
    chmod(dir.path(), 0o1777);
    let socket = dir.path().join("socket");
    let handover = socket.with_file_name("socket.handover");
    // A fake predecessor: a state of its own making, sent to whoever asks.
    let fake = "import socket,sys,time\n\
        s=socket.socket(socket.AF_UNIX)\n\
        s.bind(sys.argv[1])\n\
        s.listen(1)\n\
        print('listening', flush=True)\n\
        s.settimeout(30)\n\
        c,_=s.accept()\n\
        c.sendall((2).to_bytes(8,'little')+(0).to_bytes(8,'little')+b'{}')\n\
        time.sleep(2)\n";
    let mut other = as_other_user(python().to_str().unwrap())
        .args(["-c", fake])
        .arg(&handover)
        .stdout(Stdio::piped())
        .spawn_guarded()
        .unwrap();
    let mut line = String::new();
    BufReader::new(other.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "listening");
    let out = baton()
        .args(["serve", "--jobs", "2", "--no-fuse", "--replace", "--socket"])
        .arg(&socket)
        .output()
        .unwrap();
    let _ = other.kill();
    other.wait().unwrap();
    let said = output_text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("process of uid 65534") && said.contains("refusing to take over"),
        "{said}"
    );
}

/// Resident memory's high-water mark of a process, in kB.
fn peak_rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/PID/status")
}

#[test]
fn a_flood_of_unread_requests_neither_grows_the_broker_nor_delays_others() {
    const LINES: usize = 1_000_000;
    let broker = RunningBroker::start_with(2, &["--no-fuse"]);
    let mut flood = UnixStream::connect(&broker.socket).unwrap();
    let stop = flood.try_clone().unwrap();
    let written = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let flooder = {
        let (written, done) = (written.clone(), done.clone());
        std::thread::spawn(move || {
            flood.write_all(b"HELLO 1 flood\n").unwrap();
            let chunk = b"STATUS\n".repeat(1000);
            for _ in 0..LINES / 1000 {
                if flood.write_all(&chunk).is_err() {
                    break;
                }
                written.fetch_add(1000, Ordering::Relaxed);
            }
            done.store(true, Ordering::Relaxed);
        })
    };
    wait_for(Duration::from_secs(60), "the flood to start", || {
        written.load(Ordering::Relaxed) >= 10_000
    });
    let mut innocent = broker.client("innocent");
    assert!(innocent.try_acquire(1).unwrap());
    let served_during_the_flood = !done.load(Ordering::Relaxed);
    let peak = peak_rss_kb(broker.pid());
    // Ends the flood: the flooder's blocked write fails.
    stop.shutdown(std::net::Shutdown::Both).unwrap();
    common::join_within(flooder, Duration::from_secs(60), "the flooder");
    assert!(
        served_during_the_flood,
        "the innocent client was served only after {} lines had all gone in",
        written.load(Ordering::Relaxed)
    );
    eprintln!("the broker's peak resident memory during the flood: {peak} kB");
    assert!(peak < 64 * 1024, "the broker grew to {peak} kB");
    innocent.release(1).unwrap();
    broker.assert_all_free();
}

#[test]
fn a_broker_out_of_descriptors_answers_full_in_words() {
    // 64 descriptors are kept for the broker's own use: 70 leave 6 clients.
    const NOFILE: u64 = 70;
    let dir = TempDir::new("nofile");
    let socket = dir.path().join("run").join("socket");
    let log = dir.path().join("broker.log");
    let mut serve = baton();
    serve
        .args(["serve", "--jobs", "1", "--no-fuse", "--socket"])
        .arg(&socket)
        .stderr(std::fs::File::create(&log).unwrap());
    // SAFETY: setrlimit is async-signal-safe and touches no memory of ours.
    unsafe {
        serve.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: NOFILE,
                rlim_max: NOFILE,
            };
            match libc::setrlimit(libc::RLIMIT_NOFILE, &limit) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
    let mut serve = serve.spawn_guarded().unwrap();
    wait_for(Duration::from_secs(10), "the broker to listen", || {
        baton_client::Client::connect(&socket, "probe").is_ok()
    });
    // The probe's seat frees when the broker has read its end of file.
    let clients: Vec<_> = (0..6)
        .map(|i| common::connect_once_a_seat_frees(&socket, &format!("c{i}")))
        .collect();
    let out = baton()
        .arg("status")
        .arg("--socket")
        .arg(&socket)
        .output()
        .unwrap();
    let said = output_text(&out);
    drop(clients);
    unsafe { libc::kill(serve.id() as i32, libc::SIGTERM) };
    serve.wait().unwrap();
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains(&format!(
            "the broker at {} serves its maximum of 6 clients",
            socket.display()
        )),
        "{said}\n{logged}"
    );
    assert!(
        logged.contains("lets the broker serve 6 clients"),
        "{logged}"
    );
}

/// The C client (clients/c, compiled here) and the Python client
/// (clients/python) against a broker of the other user.
#[test]
fn the_c_and_python_clients_refuse_a_broker_of_another_user_unless_told_its_uid() {
    if !can_act_as_another_user() {
        return;
    }
    let tmp = TempDir::new("others-broker-c-py");
    chmod(tmp.path(), 0o755);
    let socket = tmp.path().join("theirs").join("socket");
    let _theirs = OthersBroker::start(&socket, &tmp.path().join("theirs.log"));
    let clients = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../clients");

    let program = tmp.path().join("connect.c");
    std::fs::write(
        &program,
        "#include <baton.h>\n#include <errno.h>\n#include <stdio.h>\n#include <string.h>\n\
         int main(int argc, char **argv) {\n\
           baton_t *c = baton_connect(argv[1], \"c\", NULL);\n\
           if (c) { printf(\"connected, limit %u\\n\", baton_limit(c)); return 0; }\n\
           printf(\"refused: %s\\n\", strerror(errno));\n\
           return errno == EPERM ? 3 : 1;\n\
         }\n",
    )
    .unwrap();
    let sources: Vec<PathBuf> = std::fs::read_dir(clients.join("c/src"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "c"))
        .collect();
    let binary = tmp.path().join("connect");
    let built = Command::new("cc")
        .args(["-D_GNU_SOURCE", "-I"])
        .arg(clients.join("c/include"))
        .args(&sources)
        .arg(&program)
        .arg("-o")
        .arg(&binary)
        .output()
        .expect("cc (the C client's tests need a C compiler)");
    assert!(built.status.success(), "{}", output_text(&built));
    let c = Command::new(&binary).arg(&socket).output().unwrap();
    assert_eq!(c.status.code(), Some(3), "C client: {}", output_text(&c));
    assert!(
        output_text(&c).contains("Operation not permitted"),
        "{}",
        output_text(&c)
    );

    let connect = "import sys, baton_client\n\
        try:\n    baton_client.Client(sys.argv[1])\n\
        except baton_client.BatonError as e:\n    print(e); sys.exit(3)\n\
        print('connected')\n";
    let py = Command::new(python())
        .args(["-c", connect])
        .arg(&socket)
        .env("PYTHONPATH", clients.join("python/src"))
        .output()
        .unwrap();
    let said = output_text(&py);
    assert_eq!(py.status.code(), Some(3), "Python client: {said}");
    assert!(said.contains(&format!("process of uid {OTHER}")), "{said}");
    assert!(
        said.contains(&format!("BATON_BROKER_UID={OTHER}")),
        "{said}"
    );

    // Told to trust that uid (a host broker seen from a user namespace,
    // docs/containers.md), both connect; its broker serves root.
    let c = Command::new(&binary)
        .arg(&socket)
        .env("BATON_BROKER_UID", OTHER.to_string())
        .output()
        .unwrap();
    assert_eq!(c.status.code(), Some(0), "C client: {}", output_text(&c));
    assert!(
        output_text(&c).contains("connected, limit"),
        "{}",
        output_text(&c)
    );
    let py = Command::new(python())
        .args(["-c", connect])
        .arg(&socket)
        .env("PYTHONPATH", clients.join("python/src"))
        .env("BATON_BROKER_UID", OTHER.to_string())
        .output()
        .unwrap();
    assert_eq!(
        py.status.code(),
        Some(0),
        "Python client: {}",
        output_text(&py)
    );
}

/// A `--socket` in a directory every user may write to, without the
/// sticky bit that keeps each name to its owner, is refused in words.
#[test]
fn a_socket_in_a_world_writable_directory_without_the_sticky_bit_is_refused() {
    let tmp = TempDir::new("open-dir");
    let open = tmp.path().join("open");
    std::fs::create_dir(&open).unwrap();
    chmod(&open, 0o777);
    let out = baton()
        .args([
            "serve",
            "--jobs",
            "1",
            "--no-fuse",
            "--idle-timeout",
            "1",
            "--socket",
        ])
        .arg(open.join("socket"))
        .output()
        .unwrap();
    let said = output_text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("writable by every user and not sticky"),
        "{said}"
    );
    assert!(!open.join("socket").exists());
}

/// A uid and a group no account has: the admitted user of the tests below.
const MEMBER: u32 = 1234;
const MEMBERS_GROUP: u32 = 4321;

/// `baton ARGS...` at `broker`'s socket as uid MEMBER with primary gid
/// `gid` and supplementary `groups`, in `cwd`, with a config home of its
/// own (root's is closed to it) and no autostart.
fn as_member(
    broker: &RunningBroker,
    gid: u32,
    groups: &[u32],
    cwd: &Path,
    args: &[&str],
) -> Output {
    let mut c = Command::new("setpriv");
    c.args([&format!("--reuid={MEMBER}"), &format!("--regid={gid}")]);
    match groups {
        [] => c.arg("--clear-groups"),
        _ => c.arg(format!(
            "--groups={}",
            groups
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        )),
    };
    c.arg(baton_bin())
        .args(args)
        .arg("--socket")
        .arg(&broker.socket)
        .current_dir(cwd)
        .env("XDG_CONFIG_HOME", cwd)
        .env("BATON_NO_AUTOSTART", "1")
        .output()
        .unwrap()
}

/// A broker started as root (its own user) with `allow`, its socket's
/// directories made searchable by others, as the operator would
/// (docs/containers.md).
fn broker_admitting(allow: &[&str]) -> RunningBroker {
    let mut args = vec!["--no-fuse"];
    args.extend(allow);
    let broker = RunningBroker::start_with(4, &args);
    chmod(broker.dir.path(), 0o755);
    chmod(broker.socket.parent().unwrap(), 0o755);
    broker
}

#[test]
fn another_uid_is_refused_in_words_that_name_the_options_to_admit_it() {
    if !can_act_as_another_user() {
        return;
    }
    let broker = broker_admitting(&[]);
    chmod(&broker.socket, 0o777);
    let out = as_member(&broker, MEMBER, &[], broker.dir.path(), &["status"]);
    let said = output_text(&out);
    assert!(!out.status.success(), "{said}");
    for words in [
        format!("uid {MEMBER} may not use this broker"),
        "it serves uid 0 (root) only".to_string(),
        format!("--allow-uid {MEMBER}"),
        "--allow-group GROUP".to_string(),
    ] {
        assert!(said.contains(&words), "{words:?} not in: {said}");
    }
}

#[test]
fn an_allowed_uid_runs_its_builds_and_reads_status_but_cannot_administer() {
    if !can_act_as_another_user() {
        return;
    }
    let broker = broker_admitting(&["--allow-uid", &MEMBER.to_string()]);
    // The broker opened its socket file to the uids it admits; the
    // connection's uid decides the rest.
    let mode = std::fs::symlink_metadata(&broker.socket).unwrap().mode() & 0o777;
    assert_eq!(mode, 0o666, "the socket's mode");
    let status = as_member(
        &broker,
        MEMBER,
        &[],
        broker.dir.path(),
        &["status", "--json"],
    );
    assert!(status.status.success(), "{}", output_text(&status));
    assert!(
        output_text(&status).contains("\"limit\": 4"),
        "{}",
        output_text(&status)
    );

    // A real build of the member's own: make 4.3 under `baton run` (its
    // FIFO goes to the member's $TMPDIR: the socket's directory is root's).
    let work = TempDir::new("member-build");
    chmod(work.path(), 0o777);
    let log = work.path().join("jobs.log");
    std::fs::write(&log, "").unwrap();
    chmod(&log, 0o666);
    common::flat_makefile(work.path(), &log, 10, "0.2");
    let make = common::make43();
    let make = make.to_str().unwrap();
    let style_and_cmd = ["--jobserver-style", "pipe", "--", make];
    // as_member puts `--socket` last: `run` takes it before `--`.
    let out = {
        let mut c = Command::new("setpriv");
        c.args([
            &format!("--reuid={MEMBER}"),
            &format!("--regid={MEMBER}"),
            "--clear-groups",
            baton_bin(),
            "run",
            "--socket",
        ])
        .arg(&broker.socket)
        .args(style_and_cmd)
        .current_dir(work.path())
        .env("XDG_CONFIG_HOME", work.path())
        .env("BATON_NO_AUTOSTART", "1")
        .output()
        .unwrap()
    };
    assert!(out.status.success(), "{}", output_text(&out));
    let (most, started) = common::max_overlap(&log);
    assert_eq!(started, 10);
    assert!(most <= 4, "{most} jobs at once under a limit of 4");
    broker.wait_all_free();

    // Administration is the owner's.
    for (args, words) in [
        (&["limit", "1"][..], "may not change the limit"),
        (&["limit", "--max-load", "3"][..], "may not set a gate"),
        (&["stop"][..], "may not stop the broker"),
    ] {
        let out = as_member(&broker, MEMBER, &[], work.path(), args);
        let said = output_text(&out);
        assert!(!out.status.success(), "{args:?}: {said}");
        assert!(said.contains(&format!("uid {MEMBER} {words}")), "{said}");
        assert!(said.contains("only uid 0 and root"), "{said}");
    }
    let s = broker.status();
    assert_eq!(s.limit, 4, "a member changed the limit");
    assert!(s.gates.is_empty(), "a member set a gate: {:?}", s.gates);
    assert!(
        common::pid_alive(broker.pid()),
        "a member stopped the broker"
    );
    // Another uid is still refused.
    let stranger = as_other_user(baton_bin())
        .args(["status", "--socket"])
        .arg(&broker.socket)
        .output()
        .unwrap();
    assert!(output_text(&stranger).contains(&format!("uid {OTHER} may not use this broker")));
    assert!(
        output_text(&stranger).contains(&format!("uid {MEMBER}")),
        "{}",
        output_text(&stranger)
    );
}

#[test]
fn an_allowed_group_admits_its_members_by_primary_or_supplementary_gid() {
    if !can_act_as_another_user() {
        return;
    }
    let broker = broker_admitting(&["--allow-group", &MEMBERS_GROUP.to_string()]);
    // The one group allowed gets the socket file, 0660.
    let meta = std::fs::symlink_metadata(&broker.socket).unwrap();
    assert_eq!((meta.gid(), meta.mode() & 0o777), (MEMBERS_GROUP, 0o660));
    let dir = broker.dir.path();
    let by_supplementary = as_member(&broker, MEMBER, &[MEMBERS_GROUP], dir, &["status"]);
    assert!(
        by_supplementary.status.success(),
        "{}",
        output_text(&by_supplementary)
    );
    let by_primary = as_member(&broker, MEMBERS_GROUP, &[], dir, &["status"]);
    assert!(by_primary.status.success(), "{}", output_text(&by_primary));
    // Outside the group: the socket's mode already keeps it out; opened
    // to all, the broker still does, naming the options.
    chmod(&broker.socket, 0o666);
    let outside = as_member(&broker, MEMBER, &[], dir, &["status"]);
    let said = output_text(&outside);
    assert!(!outside.status.success(), "{said}");
    assert!(
        said.contains(&format!("members of gid {MEMBERS_GROUP}")),
        "{said}"
    );
    assert!(said.contains("--allow-group"), "{said}");
}

/// `allow-uid` in the config file admits as `--allow-uid` does, even with
/// `--jobs` on the command line (the file is then read for who else is
/// served); `--allow-uid` on the command line wins over it.
#[test]
fn the_config_file_admits_other_uids_too() {
    if !can_act_as_another_user() {
        return;
    }
    let home = TempDir::new("allow-config");
    std::fs::create_dir_all(home.path().join("baton")).unwrap();
    std::fs::write(
        home.path().join("baton/config.toml"),
        format!("allow-uid = [{MEMBER}]\n"),
    )
    .unwrap();
    let config_home = format!("XDG_CONFIG_HOME={}", home.path().display());
    for (cli, admitted) in [(None, true), (Some("4242"), false)] {
        let mut extra = vec!["--no-fuse"];
        if let Some(uid) = cli {
            extra.extend(["--allow-uid", uid]);
        }
        let broker = RunningBroker::start_under(&["env", &config_home], 2, &extra);
        chmod(broker.dir.path(), 0o755);
        chmod(broker.socket.parent().unwrap(), 0o755);
        let out = as_member(&broker, MEMBER, &[], broker.dir.path(), &["status"]);
        assert_eq!(
            out.status.success(),
            admitted,
            "{cli:?}: {}",
            output_text(&out)
        );
    }
}

/// `--allow-uid` on the command line replaces the file's `allow-uid`
/// only: the file's `allow-group` still admits its members, with
/// `--jobs` given too (the file is then read only for who is served).
#[test]
fn the_config_files_groups_admit_beside_allow_uid_on_the_command_line() {
    if !can_act_as_another_user() {
        return;
    }
    let home = TempDir::new("allow-group-config");
    std::fs::create_dir_all(home.path().join("baton")).unwrap();
    std::fs::write(
        home.path().join("baton/config.toml"),
        format!("allow-group = [{MEMBERS_GROUP}]\n"),
    )
    .unwrap();
    let config_home = format!("XDG_CONFIG_HOME={}", home.path().display());
    let extra = ["--no-fuse", "--allow-uid", "4242"];
    let broker = RunningBroker::start_under(&["env", &config_home], 2, &extra);
    chmod(broker.dir.path(), 0o755);
    chmod(broker.socket.parent().unwrap(), 0o755);
    let dir = broker.dir.path();
    let out = as_member(&broker, MEMBERS_GROUP, &[], dir, &["status"]);
    assert!(out.status.success(), "{}", output_text(&out));
}

/// A member may say it holds what a broker before this one granted it
/// (`HOLD`, as `baton run` re-attaching does), but never more than the
/// limit: another user cannot hold the pool past its limit at will.
#[test]
fn a_member_may_hold_again_no_more_than_the_limit() {
    if !can_act_as_another_user() {
        return;
    }
    let broker = broker_admitting(&["--allow-uid", &MEMBER.to_string()]);
    let session = "import socket, sys\n\
        s = socket.socket(socket.AF_UNIX)\n\
        s.connect(sys.argv[1])\n\
        f = s.makefile('rw')\n\
        for line in ['HELLO 1 member', 'HOLD 5', 'HOLD 3', 'HOLD 2']:\n\
        \x20   f.write(line + '\\n'); f.flush(); print(f.readline().strip())\n";
    let out = Command::new("setpriv")
        .args([
            &format!("--reuid={MEMBER}"),
            &format!("--regid={MEMBER}"),
            "--clear-groups",
        ])
        .arg(python())
        .args(["-c", session])
        .arg(&broker.socket)
        .output()
        .unwrap();
    let said = output_text(&out);
    let replies: Vec<&str> = said.lines().collect();
    assert_eq!(replies.len(), 4, "{said}");
    assert!(
        replies[1].starts_with("ERR range uid 1234 may hold at most the limit (4)"),
        "{said}"
    );
    assert!(replies[2].starts_with("GRANTED 3 3"), "{said}");
    assert!(replies[3].starts_with("ERR range"), "{said}");
    // Its connection closed, everything is back.
    broker.wait_all_free();
}

/// A member whose successor's options no longer admit it keeps its
/// connection and the tokens its build holds through `serve --replace`,
/// but only as a member: the successor never gives it the owner's rights.
#[test]
fn a_member_the_successor_does_not_admit_stays_a_member() {
    if !can_act_as_another_user() {
        return;
    }
    let mut broker = broker_admitting(&["--allow-uid", &MEMBER.to_string()]);
    // A relay: each line on stdin goes to the broker, its reply to stdout.
    let relay = "import socket, sys\n\
        s = socket.socket(socket.AF_UNIX)\n\
        s.connect(sys.argv[1])\n\
        f = s.makefile('rw')\n\
        for line in sys.stdin:\n\
        \x20   f.write(line); f.flush(); print(f.readline().strip(), flush=True)\n";
    let mut member = Command::new("setpriv")
        .args([
            &format!("--reuid={MEMBER}"),
            &format!("--regid={MEMBER}"),
            "--clear-groups",
        ])
        .arg(python())
        .args(["-c", relay])
        .arg(&broker.socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn_guarded()
        .unwrap();
    let mut to_broker = member.stdin.take().unwrap();
    let mut replies = BufReader::new(member.stdout.take().unwrap());
    let mut ask = |request: &str| {
        writeln!(to_broker, "{request}").unwrap();
        let mut reply = String::new();
        replies.read_line(&mut reply).unwrap();
        reply.trim_end().to_string()
    };
    assert!(ask("HELLO 1 member").starts_with("OK 1 "));
    assert_eq!(ask("ACQUIRE 1"), "GRANTED 1 1");

    // The successor admits nobody but its own user.
    let _successor = broker
        .successor(4, &["--no-fuse"])
        .stderr(Stdio::null())
        .spawn_guarded()
        .expect("start the successor");
    broker.wait_exit(Duration::from_secs(30));
    assert_eq!(broker.status().held, 1, "the member's token came along");

    assert_eq!(ask("RELEASE 1"), "RELEASED 1 0");
    // Refused, which closes its connection.
    let limit = ask("LIMIT 1");
    assert!(
        limit.starts_with(&format!("ERR denied uid {MEMBER} may not change the limit")),
        "{limit}"
    );
    assert_eq!(broker.status().limit, 4, "the member changed the limit");
    broker.wait_all_free();
}

/// Other users cannot reach a socket in baton's own private directory
/// (0700): asked to admit them there, `serve` refuses in words that say
/// where to put the socket instead, and starts nothing. A bad group is
/// refused the same way.
#[test]
fn admitting_others_in_the_private_directory_or_an_unknown_group_is_refused() {
    let xdg = TempDir::new("allow-private");
    let out = baton_at_default(xdg.path())
        .args(["serve", "--jobs", "2", "--no-fuse", "--allow-uid", "1234"])
        .output()
        .unwrap();
    let said = output_text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("baton's private directory"), "{said}");
    assert!(said.contains("--socket"), "{said}");
    assert!(
        !xdg.path().join("baton/socket").exists(),
        "a socket appeared"
    );

    let dir = TempDir::new("allow-bad-group");
    let out = baton()
        .args([
            "serve",
            "--jobs",
            "2",
            "--no-fuse",
            "--allow-group",
            "no-such-group-here",
            "--socket",
        ])
        .arg(dir.path().join("run/socket"))
        .output()
        .unwrap();
    let said = output_text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("--allow-group no-such-group-here: no such group"),
        "{said}"
    );
}

/// With `--allow-group`, the broker warns at start when the users it
/// admits cannot search its socket's directory, and only then: the group
/// it allows may, through the directory's group bits, when the directory
/// belongs to that group; anyone may through its others' bits.
#[test]
fn the_socket_directory_draws_a_warning_only_when_the_admitted_cannot_search_it() {
    if !can_act_as_another_user() {
        return; // recorded: chown needs root
    }
    for (mode, gid, warned) in [
        (0o750, MEMBERS_GROUP, false),
        (0o700, MEMBERS_GROUP, true),
        (0o750, 0, true),
        (0o701, 0, false),
    ] {
        let tmp = TempDir::new("group-dir");
        let run = tmp.path().join("run");
        std::fs::create_dir(&run).unwrap();
        std::os::unix::fs::chown(&run, None, Some(gid)).unwrap();
        chmod(&run, mode);
        let out = baton()
            .args(["serve", "--jobs", "1", "--no-fuse", "--idle-timeout", "1"])
            .args(["--allow-group", &MEMBERS_GROUP.to_string(), "--socket"])
            .arg(run.join("socket"))
            .output()
            .unwrap();
        let said = output_text(&out);
        assert!(out.status.success(), "{said}");
        assert_eq!(
            said.contains("cannot be searched by the users --allow-uid/--allow-group admit"),
            warned,
            "mode {mode:o}, group {gid}: {said}"
        );
    }
}
