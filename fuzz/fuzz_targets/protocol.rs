//! The wire protocol's decoders on any bytes: never a panic, and whatever
//! decodes encodes back to itself (a request the broker accepts is one the
//! client library can write; a reply the client accepts, one the broker
//! can send). The same bytes then go to the broker's session (the
//! protocol's rules, baton-broker's src/session.rs) in two reads split at
//! a point the input chooses: no panic, the books balance, every reply is
//! a whole line the client decodes, and a client that hangs up leaves
//! every token free.
#![no_main]

use baton_broker::fuzzing::{set_log_level, Access, Admission, Broker, Context, Session};
use baton_broker::LogLevel;
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
    session_keeps_the_books(data);
});

fn session_keeps_the_books(data: &[u8]) {
    set_log_level(LogLevel::Warn);
    // The input's length says who the client is and where the bytes
    // split, so that every byte stays a byte of the conversation (the
    // seeds are whole requests).
    let access = if data.len() % 2 == 0 {
        Access::Owner
    } else {
        Access::Member
    };
    let split = data.len() / 3;
    let mut broker = Broker::new(3).expect("a pool of 3");
    let admission = Admission::new(vec![], vec![]);
    let mut session = Session::new(1, 1000, access);
    session.receive(b"HELLO 1 fuzz\n");
    for chunk in [&data[..split], &data[split..]] {
        session.receive(chunk);
        session.process(&mut Context {
            broker: &mut broker,
            admission: &admission,
            command_line: &|_| String::new(),
        });
        let status = broker.status();
        assert_eq!(
            status.free,
            status.limit.saturating_sub(status.held),
            "{status:?}"
        );
    }
    let replies = String::from_utf8(std::mem::take(&mut session.outbuf)).expect("replies are text");
    assert!(
        replies.is_empty() || replies.ends_with('\n'),
        "a reply cut short: {replies:?}"
    );
    for line in replies.lines() {
        if line.starts_with('{') {
            continue; // a STATUS body (its own line after the head)
        }
        assert!(
            matches!(parse_reply_line(line), Ok(_)),
            "the broker replied {line:?}, which the client cannot decode"
        );
    }
    if let Some(id) = session.hang_up() {
        broker.disconnect(id);
    }
    let status = broker.status();
    assert_eq!(
        status.free, status.limit,
        "a client that hung up left tokens held: {status:?}"
    );
}

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
