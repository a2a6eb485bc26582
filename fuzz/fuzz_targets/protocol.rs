//! The wire protocol's decoders on any bytes: never a panic, and whatever
//! decodes encodes back to itself (a request the broker accepts is one the
//! client library can write; a reply the client accepts, one the broker
//! can send).
#![no_main]

use baton_core::protocol::{parse_reply_line, parse_request, ReplyHead, MAX_LINE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The broker splits a connection's bytes at '\n' and refuses longer
    // lines before decoding; the decoder sees every line of the input.
    for line in data.split(|&b| b == b'\n').filter(|l| l.len() < MAX_LINE) {
        request_round_trips(line);
        if let Ok(text) = std::str::from_utf8(line) {
            reply_round_trips(text);
        }
    }
});

fn request_round_trips(line: &[u8]) {
    let Ok(request) = parse_request(line) else {
        return;
    };
    let again = parse_request(request.to_string().as_bytes());
    assert_eq!(
        again.as_ref(),
        Ok(&request),
        "{:?} decodes to {request:?}, whose line {:?} decodes to {again:?}",
        String::from_utf8_lossy(line),
        request.to_string()
    );
}

fn reply_round_trips(line: &str) {
    let Ok(ReplyHead::Complete(reply)) = parse_reply_line(line) else {
        return;
    };
    let wire = String::from_utf8(reply.encode()).expect("replies are text");
    let again = parse_reply_line(wire.strip_suffix('\n').expect("a reply ends its line"));
    assert_eq!(
        again.as_ref(),
        Ok(&ReplyHead::Complete(reply.clone())),
        "{line:?} decodes to {reply:?}, whose line {wire:?} decodes to {again:?}"
    );
}
