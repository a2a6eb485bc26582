//! What the property tests share.

/// How many cases a property runs: `default`, or fewer if PROPTEST_CASES
/// asks for fewer. proptest reads that variable only for its own default
/// config, and these tests set their own counts; honouring it as a cap
/// lets scripts/mutants run every property once per mutant in seconds,
/// while the suite keeps the full counts.
#[allow(dead_code)] // the model tests that share this module have no properties
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(default, |cap: u32| cap.min(default))
}

/// With BATON_TEST_FAIL_FAST set (scripts/mutants sets it), the first
/// panic on any thread ends the test binary, failed. libtest waits for
/// every test before it exits, and a mutant that makes one test fail
/// often makes another wait for ever (a thread whose grant never comes),
/// which would cost the mutation run its whole timeout. The hook prints
/// the panic first, as libtest would.
#[allow(dead_code)] // not every file that shares this module has such tests
pub fn fail_fast() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    if std::env::var_os("BATON_TEST_FAIL_FAST").is_none() {
        return;
    }
    INSTALLED.call_once(|| {
        let report = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            report(info);
            eprintln!("stopped at the first failure (BATON_TEST_FAIL_FAST)");
            std::process::exit(101);
        }));
    });
}
