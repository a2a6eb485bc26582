//! A real etcd on loopback ports, for `baton bench cluster` and the cluster
//! tests: members started in a directory of the caller's, ended by pid.

use anyhow::{bail, ensure, Context, Result};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Debian's `etcd-server`.
pub const ETCD: &str = "/usr/bin/etcd";
/// Debian's `etcd-client`.
pub const ETCDCTL: &str = "/usr/bin/etcdctl";

/// One member; SIGKILLed by pid on drop, and by the kernel when the
/// thread that started it ends (so start members from a thread that
/// outlives them: the test's own).
pub struct Member {
    name: String,
    client_url: String,
    peer_url: String,
    data: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl Member {
    fn start(&mut self, initial_cluster: &str, state: &str) -> Result<()> {
        ensure!(
            Path::new(ETCD).exists(),
            "no etcd at {ETCD} (install Debian's etcd-server, or run scripts/test)"
        );
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("creating {}", self.log.display()))?;
        let mut command = Command::new(ETCD);
        command
            .args(["--name", &self.name, "--data-dir"])
            .arg(&self.data)
            .args([
                "--listen-client-urls",
                &self.client_url,
                "--advertise-client-urls",
                &self.client_url,
            ])
            .args([
                "--listen-peer-urls",
                &self.peer_url,
                "--initial-advertise-peer-urls",
                &self.peer_url,
            ])
            .args([
                "--initial-cluster",
                initial_cluster,
                "--initial-cluster-state",
                state,
                "--initial-cluster-token",
                "baton",
            ])
            .stdout(Stdio::null())
            .stderr(log);
        // The member dies with the thread that started it. Drop ends it by
        // pid, but a test process killed outright (a mutation run's
        // timeout, a `kill -9`) never drops, and an etcd left behind
        // keeps its ports and its data directory for ever.
        // A starter that died before the prctl took hold would never
        // signal: the parent pid, changed by then, says so.
        let starter = std::process::id() as libc::pid_t;
        // SAFETY: prctl and getppid are async-signal-safe and touch no
        // memory of ours.
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != starter {
                    return Err(std::io::Error::other(
                        "etcd's starter ended before it began",
                    ));
                }
                Ok(())
            });
        }
        let child = command.spawn().context("starting etcd")?;
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL, as a lost machine.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The member's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.kill();
    }
}

/// An etcd cluster of one or more members on loopback ports.
pub struct Etcd {
    /// The members, in the order they were named (m0, m1, ...).
    pub members: Vec<Member>,
    initial_cluster: String,
}

impl Etcd {
    /// Starts `n` members keeping their data and logs under `dir`, and
    /// waits until the cluster answers.
    pub fn start(n: usize, dir: &Path) -> Result<Etcd> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let members = (0..n)
            .map(|i| {
                Ok(Member {
                    name: format!("m{i}"),
                    client_url: format!("http://127.0.0.1:{}", free_port()?),
                    peer_url: format!("http://127.0.0.1:{}", free_port()?),
                    data: dir.join(format!("m{i}")),
                    log: dir.join(format!("m{i}.log")),
                    child: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url))
            .collect::<Vec<_>>()
            .join(",");
        let mut etcd = Etcd {
            members,
            initial_cluster,
        };
        for i in 0..n {
            etcd.start_member(i, "new")?;
        }
        etcd.wait_until_it_answers(Duration::from_secs(60))?;
        Ok(etcd)
    }

    /// Starts member `i` again (`state` "existing") or for the first time ("new").
    pub fn start_member(&mut self, i: usize, state: &str) -> Result<()> {
        let initial = self.initial_cluster.clone();
        self.members[i].start(&initial, state)
    }

    /// Every member's client URL, comma-separated, as `--etcd` takes them.
    pub fn endpoints(&self) -> String {
        self.members
            .iter()
            .map(|m| m.client_url.clone())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `etcdctl ARGS` against the cluster.
    pub fn etcdctl(&self, args: &[&str]) -> Result<Output> {
        ensure!(
            Path::new(ETCDCTL).exists(),
            "no etcdctl at {ETCDCTL} (install Debian's etcd-client, or run scripts/test)"
        );
        Command::new(ETCDCTL)
            .env("ETCDCTL_API", "3")
            .args([
                "--dial-timeout=2s",
                "--command-timeout=3s",
                "--endpoints",
                &self.endpoints(),
            ])
            .args(args)
            .output()
            .context("running etcdctl")
    }

    /// Waits until a read that needs the quorum succeeds.
    pub fn wait_until_it_answers(&self, limit: Duration) -> Result<()> {
        let start = Instant::now();
        while !self.etcdctl(&["get", "/baton-probe"])?.status.success() {
            if start.elapsed() > limit {
                bail!(
                    "etcd did not answer within {} s (its logs are in {})",
                    limit.as_secs(),
                    self.members[0].log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }
}

/// A loopback port nobody listens on now.
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}
