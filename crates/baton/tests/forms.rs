//! `auto` gives each build a jobserver form every client in its tree can
//! read: checked with the real readers (make 4.3 and 4.4.1, gcc 12's
//! lto-wrapper, cargo's jobserver crate, ninja 1.13 and Debian's 1.11,
//! cmake), each build ending with every token back.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

fn assert_success(out: &Output) {
    assert!(
        out.status.success(),
        "build failed:\n{}\n{}",
        stdout(out),
        stderr(out)
    );
}

/// A tool the Debian system provides (installed by scripts/test).
fn system_tool(path: &str) -> PathBuf {
    let path = PathBuf::from(path);
    assert!(
        path.exists(),
        "{} not found: run scripts/test, which installs it",
        path.display()
    );
    path
}

/// `baton run ARGS -- TOOL TOOL_ARGS` in `dir`, without the caller's
/// MAKEFLAGS.
fn run_in(
    broker: &RunningBroker,
    dir: &Path,
    run_args: &[&str],
    tool: &Path,
    tool_args: &[&str],
) -> Command {
    let mut args = run_args.to_vec();
    args.push("--");
    args.push(tool.to_str().unwrap());
    args.extend_from_slice(tool_args);
    let mut cmd = broker.run(&args);
    cmd.current_dir(dir)
        .env_remove("MAKEFLAGS")
        .env_remove("CARGO_MAKEFLAGS")
        .env_remove("MAKE")
        .env_remove("CC");
    cmd
}

const PRINT_MAKEFLAGS: &str = "all:\n\t@echo \"[$$MAKEFLAGS]\"\n";

#[test]
fn makeflags_carry_the_builds_cap_as_gnu_make_writes_it() {
    let broker = RunningBroker::start(3);
    let dir = TempDir::new("makeflags");
    std::fs::write(dir.path().join("Makefile"), PRINT_MAKEFLAGS).unwrap();
    let cases: [(&[&str], PathBuf, &[&str], &str); 4] = [
        (&[], make43(), &["-s"], "[s -j3 --jobserver-auth="),
        (&["--max", "2"], make43(), &[], "[ -j2 --jobserver-auth="),
        (
            &["--jobserver-style", "fifo"],
            make44(),
            &["-s"],
            "[s -j3 --jobserver-auth=fifo:",
        ),
        (
            &["--jobserver-style", "fuse"],
            make44(),
            &["-k", "--no-print-directory"],
            "[k -j3 --jobserver-auth=fifo:",
        ),
    ];
    for (run_args, make, make_args, expected) in cases {
        let out = run_in(&broker, dir.path(), run_args, &make, make_args)
            .output()
            .unwrap();
        assert_success(&out);
        assert!(
            stdout(&out).starts_with(expected),
            "{run_args:?} {make_args:?}: {}",
            stdout(&out)
        );
    }
    broker.assert_all_free();
}

/// `baton run` inside a build that already has a jobserver (a cargo
/// build script, a make recipe) puts its own in both variables cargo and
/// make read: an inherited `--jobserver-auth` and `-j` would name the
/// outer pool's descriptors, and its `-jN`, not this build's share.
#[test]
fn an_inherited_jobserver_in_cargo_makeflags_is_replaced_by_the_builds_own() {
    let broker = RunningBroker::start(3);
    let dir = TempDir::new("inherited-flags");
    let outer = "-j9 --jobserver-auth=7,8";
    let out = run_in(
        &broker,
        dir.path(),
        &[],
        Path::new("/bin/sh"),
        &["-c", r#"printf '%s\n' "$CARGO_MAKEFLAGS" "$MAKEFLAGS""#],
    )
    .env("CARGO_MAKEFLAGS", outer)
    .env("MAKEFLAGS", outer)
    .output()
    .unwrap();
    assert_success(&out);
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    for (var, flags) in ["CARGO_MAKEFLAGS", "MAKEFLAGS"].iter().zip(&lines) {
        assert!(
            flags.contains(" -j3 --jobserver-auth=")
                && !flags.contains("7,8")
                && !flags.contains("-j9"),
            "{var}: {flags}"
        );
    }
    broker.assert_all_free();
}

/// A crate whose build script runs Debian's make 4.3 with cargo's
/// jobserver, as openssl-src and many -sys crates do.
fn crate_running_make(dir: &Path, log: &Path) {
    std::fs::create_dir_all(dir.join("src")).unwrap();
    std::fs::write(
        dir.join("Cargo.toml"),
        "[package]\nname = \"runs-make\"\nversion = \"0.1.0\"\nedition = \"2021\"\n",
    )
    .unwrap();
    std::fs::write(dir.join("src/lib.rs"), "pub fn f() -> u32 { 1 }\n").unwrap();
    flat_makefile(dir, log, 6, "0.1");
    let script = r#"fn main() {
    let flags = std::env::var("CARGO_MAKEFLAGS").unwrap_or_default();
    let out = std::process::Command::new("/usr/bin/make").env("MAKEFLAGS", &flags).output().unwrap();
    if !out.status.success() {
        panic!("make failed under MAKEFLAGS={flags}: {}", String::from_utf8_lossy(&out.stderr));
    }
}
"#;
    std::fs::write(dir.join("build.rs"), script).unwrap();
}

#[test]
fn a_build_script_running_make_4_3_builds_under_auto() {
    let broker = RunningBroker::start(2);
    let dir = TempDir::new("cargo-make");
    let log = dir.path().join("jobs.log");
    crate_running_make(dir.path(), &log);
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = run_in(
        &broker,
        dir.path(),
        &["--explain"],
        Path::new(&cargo),
        &["build", "--offline", "--quiet"],
    )
    .env("CARGO_TARGET_DIR", dir.path().join("target"))
    .env(
        "PATH",
        format!("/usr/bin:{}", std::env::var("PATH").unwrap()),
    )
    .output()
    .unwrap();
    assert_success(&out);
    assert!(stderr(&out).contains("jobserver: pipe"), "{}", stderr(&out));
    let (max, started) = max_overlap(&log);
    assert_eq!(started, 6, "make ran every job");
    assert!((1..=2).contains(&max), "{max} jobs at once under --jobs 2");
    broker.assert_all_free();
}

/// Object files for two LTO links, each with several functions gcc keeps
/// apart (one LTRANS partition each) and long enough to see in /proc.
fn lto_objects(dir: &Path) {
    let mut main = String::from("#include <stdio.h>\n");
    for f in 0..4 {
        let mut body = format!("__attribute__((noinline)) unsigned f{f}(unsigned x) {{\n");
        for i in 0..1500 {
            body.push_str(&format!(
                "  x = x * {} + (x >> {}) ^ {i}u;\n",
                2 * i + 3,
                i % 13 + 1
            ));
        }
        body.push_str("  return x;\n}\n");
        std::fs::write(dir.join(format!("f{f}.c")), body).unwrap();
        main.push_str(&format!("unsigned f{f}(unsigned);\n"));
    }
    main.push_str("int main(int c, char **v) { printf(\"%u\\n\", f0(c) + f1(c) + f2(c) + f3(c)); return 0; }\n");
    std::fs::write(dir.join("main.c"), main).unwrap();
    let out = Command::new("gcc")
        .args([
            "-O1", "-flto", "-c", "f0.c", "f1.c", "f2.c", "f3.c", "main.c",
        ])
        .current_dir(dir)
        .output()
        .unwrap();
    assert_success(&out);
    let objects = "f0.o f1.o f2.o f3.o main.o";
    let link = format!("\t+gcc -v -O1 -flto=auto -flto-partition=max -o $@ {objects}\n");
    std::fs::write(
        dir.join("Makefile"),
        format!("all: p q\np q: {objects}\n{link}"),
    )
    .unwrap();
}

/// LTRANS compilers (`lto1 -fltrans`) running now in `dirs` (other tests
/// may link at the same time).
fn ltrans_running(dirs: &[&Path]) -> usize {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return 0;
    };
    procs
        .flatten()
        .filter(|p| {
            std::fs::read_link(p.path().join("cwd")).is_ok_and(|cwd| dirs.contains(&cwd.as_path()))
        })
        .filter_map(|p| std::fs::read(p.path().join("cmdline")).ok())
        .filter(|c| {
            let words: Vec<&[u8]> = c.split(|b| *b == 0).collect();
            words.first().is_some_and(|w| w.ends_with(b"lto1"))
                && words.iter().any(|w| *w == b"-fltrans")
        })
        .count()
}

/// Runs the builds at once while sampling /proc; returns their outputs
/// and the most LTRANS compilers seen at once in their directories.
fn sample_ltrans(builds: Vec<Command>, dirs: &[&Path]) -> (Vec<Output>, usize) {
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let mut most = 0;
            while !done.load(Ordering::Relaxed) {
                most = most.max(ltrans_running(dirs));
                std::thread::sleep(Duration::from_millis(1));
            }
            most
        });
        let children: Vec<_> = builds
            .into_iter()
            .map(|mut b| {
                b.stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn_guarded()
                    .unwrap()
            })
            .collect();
        let outputs = children
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect();
        done.store(true, Ordering::Relaxed);
        (outputs, sampler.join().unwrap())
    })
}

/// Both links of a build used the R,W jobserver, in parallel through make
/// (gcc -v says so), with no fallback to serial or to its own -j.
fn assert_lto_used_the_jobserver(out: &Output) {
    assert_success(out);
    let err = stderr(out);
    assert!(err.contains("jobserver: pipe"), "{err}");
    assert_eq!(
        err.matches("Using make jobserver").count(),
        2,
        "both links used the jobserver: {err}"
    );
    assert!(
        !err.contains("serial compilation") && !err.contains("jobserver is not available"),
        "{err}"
    );
}

fn check_lto_links(make: PathBuf, make_args: &[&str]) {
    let broker = RunningBroker::start(2);
    let dir = TempDir::new("lto");
    lto_objects(dir.path());
    let build = run_in(&broker, dir.path(), &["--explain"], &make, make_args);
    let (outs, most) = sample_ltrans(vec![build], &[dir.path()]);
    assert_lto_used_the_jobserver(&outs[0]);
    assert!(
        (1..=2).contains(&most),
        "{most} LTRANS compilers at once under --jobs 2"
    );
    broker.assert_all_free();
}

#[test]
fn lto_links_stay_within_the_limit_under_make_4_3() {
    check_lto_links(make43(), &["-s"]);
    check_lto_links(make43(), &[]);
}

#[test]
fn lto_links_stay_within_the_limit_under_make_4_4() {
    check_lto_links(make44(), &["-s"]);
    check_lto_links(make44(), &[]);
}

#[test]
fn two_lto_builds_at_once_stay_within_one_limit() {
    let broker = RunningBroker::start(2);
    let dirs = [TempDir::new("lto-a"), TempDir::new("lto-b")];
    for dir in &dirs {
        lto_objects(dir.path());
    }
    let builds = vec![
        run_in(&broker, dirs[0].path(), &["--explain"], &make43(), &["-s"]),
        run_in(&broker, dirs[1].path(), &["--explain"], &make44(), &["-s"]),
    ];
    let (outs, most) = sample_ltrans(builds, &[dirs[0].path(), dirs[1].path()]);
    for out in &outs {
        assert_lto_used_the_jobserver(out);
    }
    assert!(
        (1..=2).contains(&most),
        "{most} LTRANS compilers at once in two builds under --jobs 2"
    );
    broker.assert_all_free();
}

#[test]
fn ninja_that_runs_make_4_3_gets_the_pipe_form_and_builds() {
    let broker = RunningBroker::start(2);
    let dir = TempDir::new("ninja-make");
    let sub = dir.path().join("sub");
    std::fs::create_dir_all(&sub).unwrap();
    let log = dir.path().join("jobs.log");
    flat_makefile(&sub, &log, 4, "0.05");
    std::fs::write(
        dir.path().join("build.ninja"),
        "rule ext\n  command = make -s -C sub && touch $out\nbuild ext.stamp: ext\n",
    )
    .unwrap();
    let out = run_in(&broker, dir.path(), &["--explain"], &ninja(), &[])
        .env("PATH", "/usr/bin:/bin")
        .output()
        .unwrap();
    assert_success(&out);
    assert!(stderr(&out).contains("jobserver: pipe"), "{}", stderr(&out));
    let (max, started) = max_overlap(&log);
    assert_eq!(started, 4);
    assert!(max <= 2, "{max} jobs at once under --jobs 2");
    broker.assert_all_free();
}

fn assert_ninja_used_fifo(out: &Output) {
    let text = stdout(out);
    assert!(
        text.contains("Jobserver mode detected") && text.contains("--jobserver-auth=fifo:"),
        "{text}"
    );
    assert!(!text.contains("'pipe' mode"), "{text}");
}

#[test]
fn ninja_1_13_keeps_the_fifo_form_beside_make_4_3() {
    let broker = RunningBroker::start(2);
    let dir = TempDir::new("ninja-fifo");
    let log = dir.path().join("jobs.log");
    flat_ninja(dir.path(), &log, 8, "0.05");
    let out = run_in(&broker, dir.path(), &["--explain"], &ninja(), &[])
        .env("PATH", "/usr/bin:/bin")
        .output()
        .unwrap();
    assert_success(&out);
    assert!(stderr(&out).contains("jobserver: fifo"), "{}", stderr(&out));
    assert_ninja_used_fifo(&out);
    let (max, started) = max_overlap(&log);
    assert_eq!(started, 8);
    assert!(max <= 2, "{max} jobs at once under --jobs 2");
    broker.assert_all_free();
}

#[test]
fn cmake_build_of_a_ninja_project_gets_the_fifo_form() {
    let cmake = system_tool("/usr/bin/cmake");
    let broker = RunningBroker::start(2);
    let dir = TempDir::new("cmake");
    let src = dir.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(
        src.join("CMakeLists.txt"),
        "cmake_minimum_required(VERSION 3.13)\nproject(p C)\nadd_executable(p a.c b.c)\n",
    )
    .unwrap();
    std::fs::write(
        src.join("a.c"),
        "int b(void);\nint main(void) { return b(); }\n",
    )
    .unwrap();
    std::fs::write(src.join("b.c"), "int b(void) { return 0; }\n").unwrap();
    let build_dir = dir.path().join("build");
    let configure = Command::new(&cmake)
        .args(["-G", "Ninja", "-S"])
        .arg(&src)
        .arg("-B")
        .arg(&build_dir)
        .arg(format!("-DCMAKE_MAKE_PROGRAM={}", ninja().display()))
        .env_remove("MAKEFLAGS")
        .output()
        .unwrap();
    assert_success(&configure);
    let out = run_in(
        &broker,
        dir.path(),
        &["--explain"],
        &cmake,
        &["--build", "build"],
    )
    .output()
    .unwrap();
    assert_success(&out);
    assert!(stderr(&out).contains("jobserver: fifo"), "{}", stderr(&out));
    assert_ninja_used_fifo(&out);
    broker.assert_all_free();
}

#[test]
fn debian_ninja_1_11_gets_a_warning() {
    let old_ninja = system_tool("/usr/bin/ninja");
    let broker = RunningBroker::start(2);
    let dir = TempDir::new("ninja-old");
    let log = dir.path().join("jobs.log");
    flat_ninja(dir.path(), &log, 2, "0.01");
    let out = run_in(&broker, dir.path(), &[], &old_ninja, &[])
        .output()
        .unwrap();
    assert_success(&out);
    let warning = stderr(&out)
        .lines()
        .find(|l| l.contains("is no jobserver client"))
        .map(str::to_string);
    let warning = warning.unwrap_or_else(|| panic!("no warning: {}", stderr(&out)));
    assert!(
        warning.starts_with("baton: ninja 1.11")
            && warning.contains("/usr/bin/ninja")
            && warning.contains("1.13"),
        "{warning}"
    );
    broker.assert_all_free();
}

#[test]
fn make_with_its_own_jobs_gets_a_warning() {
    let broker = RunningBroker::start(2);
    let dir = TempDir::new("forced-jobs");
    std::fs::write(dir.path().join("Makefile"), PRINT_MAKEFLAGS).unwrap();
    let out = run_in(&broker, dir.path(), &[], &make43(), &["-j3"])
        .output()
        .unwrap();
    assert_success(&out);
    let err = stderr(&out);
    assert!(
        err.lines().any(|l| l.starts_with("baton: make 4.3")
            && l.contains("-j3")
            && l.contains("drop -j3")),
        "{err}"
    );
    broker.assert_all_free();
}

/// `auto` asks make its version once and remembers the answer beside the
/// socket, keyed by the file that runs: a second build asks nothing, and
/// a make replaced in place (an upgrade: 4.3 to 4.4.1 under one path) is
/// asked again and is judged as what it is.
#[test]
fn tool_versions_are_asked_once_and_again_when_the_tool_changes() {
    let broker = RunningBroker::start(4);
    let dir = TempDir::new("probes");
    let (bin, calls) = (dir.path().join("bin"), dir.path().join("calls"));
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::write(dir.path().join("Makefile"), "all:\n\t@true\n").unwrap();
    // make on PATH is a wrapper that notes each call, then runs real make.
    let make = bin.join("make");
    let wrap = |real: &Path| {
        let script = format!(
            "#!/bin/sh\necho \"$*\" >> {}\nexec {} \"$@\"\n",
            calls.display(),
            real.display()
        );
        std::fs::write(&make, script).unwrap();
        std::fs::set_permissions(&make, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
    };
    let calls_so_far = || {
        std::fs::read_to_string(&calls)
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.starts_with("-s"))
            .count()
    };
    let build = || {
        let path = format!("{}:/usr/bin:/bin", bin.display());
        let out = run_in(
            &broker,
            dir.path(),
            &["--explain"],
            Path::new("make"),
            &["-s"],
        )
        .env("PATH", path)
        .output()
        .unwrap();
        assert_success(&out);
        stderr(&out)
    };
    wrap(&make43());
    let first = build();
    assert!(
        first.contains("make 4.3") && first.contains("reads only R,W"),
        "{first}"
    );
    let asked = calls_so_far();
    assert!(asked > 0, "make was never asked its version");
    assert_eq!(
        build(),
        first,
        "the remembered answers choose as the asked ones did"
    );
    assert_eq!(calls_so_far(), asked, "the second build asked make again");

    wrap(&make44());
    let upgraded = build();
    assert!(calls_so_far() > asked, "a changed make was not asked again");
    assert!(
        upgraded.contains("make 4.4.1") && upgraded.contains("reads both forms"),
        "{upgraded}"
    );
    let kept = broker.socket.parent().unwrap().join("probes");
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&kept).unwrap().permissions());
    assert_eq!(
        mode & 0o077,
        0,
        "the answers are readable by others: {mode:o}"
    );
    broker.assert_all_free();
}

/// The bin directory of the test venv, with pip, meson-python, meson and
/// ninja 1.13 (scripts/test installs them).
fn meson_python_venv() -> PathBuf {
    let python = tool("BATON_TEST_PYTHON", || ninja().with_file_name("python"));
    let has = Command::new(&python)
        .args(["-c", "import mesonpy, mesonbuild"])
        .status()
        .unwrap();
    assert!(
        has.success(),
        "{} has no meson-python: run scripts/test, which installs it",
        python.display()
    );
    python.parent().unwrap().to_path_buf()
}

/// A meson-python package of a C extension of `files` sources, and a CC
/// that logs each compile of them (a second long) to `log`.
fn meson_python_package(dir: &Path, log: &Path, files: usize) -> PathBuf {
    let src = dir.join("pkg");
    std::fs::create_dir_all(src.join("src")).unwrap();
    std::fs::write(
        src.join("pyproject.toml"),
        "[build-system]\nbuild-backend = \"mesonpy\"\nrequires = [\"meson-python\"]\n\
         [project]\nname = \"tiny\"\nversion = \"0.1\"\n",
    )
    .unwrap();
    let mut sources = vec!["'src/m.c'".to_string()];
    for i in 0..files {
        std::fs::write(
            src.join(format!("src/f{i}.c")),
            format!("int f{i}(void) {{ return {i}; }}\n"),
        )
        .unwrap();
        sources.push(format!("'src/f{i}.c'"));
    }
    std::fs::write(
        src.join("src/m.c"),
        "#include <Python.h>\nstatic struct PyModuleDef m = {PyModuleDef_HEAD_INIT, \"tiny\", NULL, -1, NULL};\n\
         PyMODINIT_FUNC PyInit_tiny(void) { return PyModule_Create(&m); }\n",
    )
    .unwrap();
    std::fs::write(
        src.join("meson.build"),
        format!(
            "project('tiny', 'c')\npy = import('python').find_installation()\n\
             py.extension_module('tiny', {}, install: true)\n",
            sources.join(", ")
        ),
    )
    .unwrap();
    // meson runs the compiler to check it first: only the package's own
    // compiles are logged jobs.
    let cc = dir.join("cc-log");
    std::fs::write(
        &cc,
        format!(
            "#!/bin/sh\ncase \"$*\" in\n*\" -c \"*src/*) echo S >> {log}; sleep 1; gcc \"$@\"; rc=$?; echo E >> {log}; exit $rc;;\nesac\nexec gcc \"$@\"\n",
            log = log.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&cc, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    src
}

/// pip starts meson-python, and meson-python ninja, with Python's default
/// close_fds=True: an R,W jobserver never reaches ninja, which then runs
/// its own jobs. Debian's make 4.3 and gcc 12 are on PATH, as on the
/// machines where that happened.
#[test]
fn a_meson_python_package_built_by_pip_stays_within_the_limit() {
    let venv = meson_python_venv();
    // Wheels of meson-python and what it needs, for the isolated build
    // environment pip makes without the network (scripts/test fetches them).
    let wheelhouse = venv.parent().unwrap().join("wheelhouse");
    assert!(
        wheelhouse.is_dir(),
        "{} not found: run scripts/test, which fills it",
        wheelhouse.display()
    );
    let broker = RunningBroker::start(2);
    let isolated = ["--no-index", "--find-links", wheelhouse.to_str().unwrap()];
    for isolation in [&["--no-build-isolation"][..], &isolated[..]] {
        let dir = TempDir::new("meson-python");
        let log = dir.path().join("jobs.log");
        let src = meson_python_package(dir.path(), &log, 5);
        let wheels = dir.path().join("wheels");
        let mut pip_args = vec!["wheel", "--no-deps", "-w", wheels.to_str().unwrap()];
        pip_args.extend_from_slice(isolation);
        pip_args.push(".");
        let out = run_in(&broker, &src, &["--explain"], &venv.join("pip"), &pip_args)
            .env("CC", dir.path().join("cc-log"))
            .env("PIP_CACHE_DIR", dir.path().join("pip-cache"))
            .env("PATH", format!("{}:/usr/bin:/bin", venv.display()))
            .output()
            .unwrap();
        assert_success(&out);
        let err = stderr(&out);
        let (max, started) = max_overlap(&log);
        assert_eq!(
            started, 6,
            "{isolation:?}: every source was compiled: {err}"
        );
        assert!(
            (1..=2).contains(&max),
            "{isolation:?}: {max} compilers at once under --jobs 2"
        );
        assert!(
            err.contains("jobserver: fifo") && err.contains("is a Python program"),
            "{err}"
        );
        // No form serves gcc 12's LTO past pip: said before the build starts.
        assert!(
            err.lines()
                .any(|l| l.starts_with("baton: gcc 12") && l.contains("LTRANS jobs past the limit")),
            "{err}"
        );
        broker.assert_all_free();
    }
}

fn assert_refused(out: &Output, names: &[&str]) {
    let err = stderr(out);
    assert!(!out.status.success(), "not refused: {err}");
    for name in names {
        assert!(err.contains(name), "no {name:?} in: {err}");
    }
    assert!(err.contains("--force"), "{err}");
}

#[test]
fn explicit_fifo_is_refused_where_a_build_script_runs_make_4_3() {
    let broker = RunningBroker::start(2);
    let dir = TempDir::new("cargo-make-fifo");
    let log = dir.path().join("jobs.log");
    crate_running_make(dir.path(), &log);
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = run_in(
        &broker,
        dir.path(),
        &["--jobserver-style", "fifo"],
        Path::new(&cargo),
        &["build", "--offline", "--quiet"],
    )
    .env("CARGO_TARGET_DIR", dir.path().join("target"))
    .env(
        "PATH",
        format!("/usr/bin:{}", std::env::var("PATH").unwrap()),
    )
    .output()
    .unwrap();
    assert_refused(
        &out,
        &["--jobserver-style fifo", "make 4.3", "build scripts"],
    );
    assert!(!dir.path().join("target").exists(), "cargo ran");
    broker.assert_all_free();
}

#[test]
fn explicit_fifo_and_fuse_are_refused_for_gcc_12_lto_links() {
    let probe = Command::new("gcc")
        .arg("-dumpfullversion")
        .output()
        .unwrap();
    let major: u32 = stdout(&probe)
        .split('.')
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        major < 13,
        "gcc {major} reads fifo: this test needs Debian's gcc 12"
    );
    let broker = RunningBroker::start(2);
    let dir = TempDir::new("lto-fifo");
    lto_objects(dir.path());
    for style in ["fifo", "fuse"] {
        let out = run_in(
            &broker,
            dir.path(),
            &["--jobserver-style", style],
            &make44(),
            &["-s"],
        )
        .output()
        .unwrap();
        assert_refused(&out, &[style, "gcc 12", "-flto", "LTRANS"]);
        assert!(!dir.path().join("p").exists(), "make ran");
    }
    broker.assert_all_free();
}

#[test]
fn explicit_fuse_is_refused_for_ninja() {
    let broker = RunningBroker::start(2);
    let dir = TempDir::new("ninja-fuse");
    let log = dir.path().join("jobs.log");
    flat_ninja(dir.path(), &log, 4, "0.05");
    let out = run_in(
        &broker,
        dir.path(),
        &["--jobserver-style", "fuse"],
        &ninja(),
        &[],
    )
    .output()
    .unwrap();
    assert_refused(&out, &["ninja 1.13", "real FIFO"]);
    assert!(!log.exists(), "ninja ran");
    let forced = ["--jobserver-style", "fuse", "--force"];
    let out = run_in(&broker, dir.path(), &forced, &ninja(), &[])
        .output()
        .unwrap();
    assert_success(&out);
    assert!(stderr(&out).contains("running anyway"), "{}", stderr(&out));
    assert_eq!(max_overlap(&log).1, 4, "ninja built under --force");
    broker.assert_all_free();
}

/// The pipe form's descriptors never reach past pip: refused before pip
/// runs.
#[test]
fn explicit_pipe_is_refused_for_a_python_driver() {
    let pip = meson_python_venv().join("pip");
    let broker = RunningBroker::start(2);
    let dir = TempDir::new("pip-pipe");
    let out = run_in(
        &broker,
        dir.path(),
        &["--jobserver-style", "pipe"],
        &pip,
        &["--version"],
    )
    .output()
    .unwrap();
    assert_refused(
        &out,
        &[
            "--jobserver-style pipe",
            "is a Python program",
            "Invalid file descriptors",
        ],
    );
    assert!(!stdout(&out).contains("pip "), "pip ran: {}", stdout(&out));
    broker.assert_all_free();
}

/// `$(MAKE) -j4 -C sub` starts a private pool of 4, and so does
/// `$(MAKE) $(MFLAGS)`, whose MFLAGS carry the -j2 of the build's own
/// MAKEFLAGS: make says so in its own warning, and baton names each at
/// the end, with the jobs it ran on no token.
#[test]
fn a_sub_make_forcing_its_own_jobs_is_named_at_the_end() {
    let broker = RunningBroker::start(2);
    let dir = TempDir::new("forced-submake");
    let (sub, sub2) = (dir.path().join("sub"), dir.path().join("sub2"));
    let log = dir.path().join("jobs.log");
    std::fs::create_dir_all(&sub).unwrap();
    std::fs::create_dir_all(&sub2).unwrap();
    flat_makefile(&sub, &log, 4, "1");
    flat_makefile(&sub2, &dir.path().join("jobs2.log"), 2, "1");
    std::fs::write(
        dir.path().join("Makefile"),
        "all: one two\none:\n\t$(MAKE) -s -j4 -C sub\ntwo:\n\t$(MAKE) $(MFLAGS) -C sub2\n",
    )
    .unwrap();
    let out = run_in(&broker, dir.path(), &[], &make44(), &["-s"])
        .output()
        .unwrap();
    assert_success(&out);
    let err = stderr(&out);
    let named = |jobs: &str, sub: &Path| -> String {
        let lines: Vec<&str> = err
            .lines()
            .filter(|l| l.starts_with("baton: a sub-make forced") && l.contains(jobs))
            .collect();
        assert_eq!(lines.len(), 1, "{jobs}: {err}");
        assert!(
            lines[0].contains(&format!("in {} ran up to", sub.display())),
            "{}\n{err}",
            lines[0]
        );
        lines[0].to_string()
    };
    let line = named("forced -j4", &sub);
    assert!(line.contains("`") && line.contains("-j4 -C sub`"), "{line}");
    // The watcher samples the tree: it sees at most what the jobs logged.
    let seen: usize = line
        .split("up to ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in {line}"));
    let (max, _) = max_overlap(&log);
    assert!(
        (2..=max).contains(&seen) && line.contains(&format!("{} of them on no token", seen - 1)),
        "{line} ({max} jobs at once in the log)"
    );
    named("forced -j2", &sub2);
    broker.assert_all_free();
}
