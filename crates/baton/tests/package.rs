//! scripts/package: the Debian package, installed with dpkg into a
//! temporary root (never the machine's /usr), runs a real make under the
//! broker it starts, and nothing it installs points back at this checkout.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Builds the package (without the cluster feature: quicker, and the test
/// is about the package, not etcd); returns the .deb.
///
/// scripts/test builds it once before the suite (a release build and
/// cargo-deb's install take minutes, which beside the other tests would
/// only slow them) and names it in `BATON_TEST_DEB`.
fn build_package() -> PathBuf {
    if let Some(deb) = std::env::var_os("BATON_TEST_DEB") {
        return PathBuf::from(deb);
    }
    let out = Command::new(workspace().join("scripts/package"))
        .arg("--no-cluster")
        .output()
        .expect("run scripts/package");
    assert!(
        out.status.success(),
        "scripts/package failed:\n{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let deb = text(&out.stdout)
        .lines()
        .rev()
        .find(|l| l.ends_with(".deb"))
        .map(PathBuf::from)
        .expect("scripts/package names the .deb last");
    assert!(deb.exists(), "{}", deb.display());
    deb
}

/// An empty dpkg database under `root`, for `dpkg --root`.
fn empty_dpkg_root(root: &Path) {
    for dir in ["var/lib/dpkg/info", "var/lib/dpkg/updates", "var/log"] {
        std::fs::create_dir_all(root.join(dir)).unwrap();
    }
    std::fs::write(root.join("var/lib/dpkg/status"), "").unwrap();
    std::fs::write(root.join("var/lib/dpkg/available"), "").unwrap();
}

/// Every regular file under `dir`.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let kind = std::fs::symlink_metadata(&path).unwrap().file_type();
        if kind.is_dir() {
            files.extend(files_under(&path));
        } else if kind.is_file() {
            files.push(path);
        }
    }
    files
}

#[test]
fn the_package_installs_with_dpkg_and_its_baton_runs_make() {
    if unsafe { libc::getuid() } != 0 {
        skip(
            Missing::Root,
            "dpkg --root needs root to install the package",
        );
        return;
    }
    if Command::new("dpkg").arg("--version").output().is_err() {
        skip(Missing::Root, "needs dpkg to install the package");
        return;
    }
    let deb = build_package();
    let root = TempDir::new("dpkg-root");
    empty_dpkg_root(root.path());
    // --force-depends: the temporary root has no libc6 package to depend on
    // (the binary runs on this machine's).
    let install = Command::new("dpkg")
        .arg(format!("--root={}", root.path().display()))
        .args(["--force-depends", "--log=/dev/null", "-i"])
        .arg(&deb)
        .output()
        .unwrap();
    assert!(
        install.status.success(),
        "dpkg -i: {}",
        text(&install.stderr)
    );

    let usr = root.path().join("usr");
    let baton = usr.join("bin/baton");
    for file in [
        "lib/systemd/user/baton.socket",
        "lib/systemd/user/baton.service",
        "share/man/man1/baton.1.gz",
        "share/man/man1/baton-stop.1.gz",
        "share/bash-completion/completions/baton",
        "share/zsh/vendor-completions/_baton",
        "share/fish/vendor_completions.d/baton.fish",
    ] {
        assert!(usr.join(file).exists(), "the package has no /usr/{file}");
    }
    assert!(
        root.path().join("etc/profile.d/baton.sh").exists(),
        "the package has no /etc/profile.d/baton.sh"
    );
    let unit = std::fs::read_to_string(usr.join("lib/systemd/user/baton.service")).unwrap();
    assert!(unit.contains("ExecStart=/usr/bin/baton serve"), "{unit}");

    // A build with the installed binary: it starts its own broker.
    let home = TempDir::new("package-home");
    let build = home.path().join("build");
    std::fs::create_dir_all(&build).unwrap();
    let log = home.path().join("jobs.log");
    flat_makefile(&build, &log, 4, "0.1");
    let env = |cmd: &mut Command| {
        cmd.env("XDG_RUNTIME_DIR", home.path().join("runtime"))
            .env("XDG_CONFIG_HOME", home.path().join("config"))
            .env_remove("BATON_SOCKET")
            .env_remove("BATON_NO_AUTOSTART")
            .env_remove("MAKEFLAGS")
            .env_remove("MFLAGS");
    };
    std::fs::create_dir_all(home.path().join("runtime")).unwrap();
    let mut run = Command::new(&baton);
    run.args(["run", "--"]).arg(make43()).current_dir(&build);
    env(&mut run);
    let out = run.output().unwrap();
    let socket = home.path().join("runtime/baton/socket");
    let broker = baton_client::Client::connect(&socket, "test")
        .ok()
        .and_then(|mut c| c.status().ok())
        .map(|s| s.broker_pid);
    let mut stop = Command::new(&baton);
    stop.arg("stop");
    env(&mut stop);
    let stopped = stop.output().unwrap();
    if let Some(pid) = broker {
        wait_for(Duration::from_secs(10), "the broker to stop", || {
            !pid_alive(pid)
        });
    }
    assert!(
        out.status.success(),
        "baton run -- make: {}",
        text(&out.stderr)
    );
    assert_eq!(max_overlap(&log).1, 4, "every job ran");
    assert!(stopped.status.success(), "{}", text(&stopped.stderr));
    assert!(broker.is_some(), "the installed baton started a broker");

    // Nothing installed names this checkout or its build directory
    // (target/ is inside it): every file dpkg wrote under the root, the
    // package's (/etc/profile.d/baton.sh among them) and its database's
    // (maintainer scripts, conffiles), and what a gzipped one (the man
    // pages) holds uncompressed.
    let checkout = std::fs::canonicalize(workspace()).unwrap();
    let checkout = checkout.to_str().unwrap().as_bytes();
    let names_checkout = |bytes: &[u8]| bytes.windows(checkout.len()).any(|w| w == checkout);
    let files = files_under(root.path());
    let mut unzipped = Vec::new();
    for file in &files {
        let bytes = std::fs::read(file).unwrap();
        assert!(
            !names_checkout(&bytes),
            "{} names the checkout {}",
            file.display(),
            String::from_utf8_lossy(checkout)
        );
        if bytes.starts_with(&[0x1f, 0x8b]) {
            let out = Command::new("gzip")
                .arg("-dc")
                .arg(file)
                .output()
                .expect("gzip");
            assert!(out.status.success(), "gzip -dc {}", file.display());
            assert!(
                !names_checkout(&out.stdout),
                "{} names the checkout {} (uncompressed)",
                file.display(),
                String::from_utf8_lossy(checkout)
            );
            unzipped.push(file.strip_prefix(root.path()).unwrap().to_path_buf());
        }
    }
    // The search saw what a narrower one missed.
    for file in ["etc/profile.d/baton.sh", "usr/bin/baton"] {
        assert!(
            files.contains(&root.path().join(file)),
            "{file} was not searched"
        );
    }
    for page in ["baton.1.gz", "baton-stop.1.gz"] {
        let page = Path::new("usr/share/man/man1").join(page);
        assert!(
            unzipped.contains(&page),
            "{} was not read uncompressed: {unzipped:?}",
            page.display()
        );
    }
}
