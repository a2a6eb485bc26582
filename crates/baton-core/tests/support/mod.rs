//! What the property tests share.

/// How many cases a property runs: `default`, or fewer if PROPTEST_CASES
/// asks for fewer. proptest reads that variable only for its own default
/// config, and these tests set their own counts; honouring it as a cap
/// lets scripts/mutants run every property once per mutant in seconds,
/// while the suite keeps the full counts.
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(default, |cap: u32| cap.min(default))
}
