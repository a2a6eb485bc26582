//! docs/protocol.md is the contract: its example session is replayed here
//! against the real broker, byte for byte.

mod common;

use common::RunningBroker;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;

fn doc_session() -> Vec<(char, String)> {
    let doc = include_str!("../../../docs/protocol.md");
    let section = doc
        .split("## A complete session")
        .nth(1)
        .expect("the doc has a complete session");
    let block = section
        .split("```")
        .nth(1)
        .expect("the session is in a code block");
    block
        .lines()
        .filter_map(|l| {
            let (who, text) = l.split_once(": ")?;
            let text = text.strip_suffix("\\n").expect("every line shows its \\n");
            Some((who.chars().next()?, format!("{text}\n")))
        })
        .collect()
}

#[test]
fn the_documented_session_is_what_the_broker_says() {
    let session = doc_session();
    assert!(session.len() >= 10, "the session was found");
    let broker = RunningBroker::start(2);
    let mut stream = UnixStream::connect(&broker.socket).unwrap();
    let mut replies = BufReader::new(stream.try_clone().unwrap());
    for (who, text) in session {
        match who {
            'C' => stream.write_all(text.as_bytes()).unwrap(),
            'S' => {
                let mut line = String::new();
                replies.read_line(&mut line).unwrap();
                assert_eq!(line, text);
            }
            other => panic!("unknown speaker {other}"),
        }
    }
    let mut rest = String::new();
    assert_eq!(
        replies.read_line(&mut rest).unwrap(),
        0,
        "the broker closed the connection"
    );
}
