//! docs/security.md against the real binary: another user (uid 65534,
//! through setpriv) squats the private directory, plants links beside a
//! socket, runs a broker of its own or knocks on ours; a client floods the
//! broker; a broker runs out of descriptors. Each is refused in words.

mod common;

use common::{
    baton, baton_bin, can_act_as_another_user, output_text, python, wait_for, Broker, Guarded,
    SpawnGuarded, TempDir,
};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
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
    let broker = Broker::start_with(3, &["--no-fuse"]);
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
fn the_handover_socket_refuses_another_user() {
    if !can_act_as_another_user() {
        return;
    }
    let broker = Broker::start_with(2, &["--no-fuse"]);
    let mut held = broker.client("holder");
    held.acquire(1).unwrap();
    chmod(broker.dir.path(), 0o755);
    chmod(broker.socket.parent().unwrap(), 0o755);
    let handover = broker.socket.with_file_name("socket.handover");
    chmod(&handover, 0o777);
    // What a successor would read first: the state's length. The other
    // user gets nothing, and the broker serves on.
    let read = "import socket,sys\n\
        s=socket.socket(socket.AF_UNIX)\n\
        s.connect(sys.argv[1])\n\
        s.settimeout(30)\n\
        print(len(s.recv(16)))\n";
    let out = as_other_user(python().to_str().unwrap())
        .args(["-c", read])
        .arg(&handover)
        .output()
        .unwrap();
    assert_eq!(output_text(&out).trim(), "0", "{}", output_text(&out));
    assert!(broker
        .log()
        .contains("refused a handover asked by another user"));
    assert_eq!(broker.status().held, 1, "the broker serves on");
    held.release(1).unwrap();
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
    let broker = Broker::start_with(2, &["--no-fuse"]);
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
    let clients: Vec<_> = (0..6)
        .map(|i| baton_client::Client::connect(&socket, &format!("c{i}")).unwrap())
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
fn the_c_and_python_clients_refuse_a_broker_of_another_user() {
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
