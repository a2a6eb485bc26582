//! docs/protocol-vectors.json, the exchanges every client library replays,
//! replayed here against the real broker byte for byte, so the vectors are
//! what the broker says.

mod common;

use common::{wait_for, RunningBroker};
use serde_json::Value;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

const HANG_GUARD: Duration = Duration::from_secs(10);

struct Conn {
    writer: UnixStream,
    reader: BufReader<UnixStream>,
}

impl Conn {
    fn open(path: &std::path::Path) -> Self {
        let writer = UnixStream::connect(path).expect("connect to the broker");
        writer.set_read_timeout(Some(HANG_GUARD)).unwrap();
        Conn {
            reader: BufReader::new(writer.try_clone().unwrap()),
            writer,
        }
    }

    fn line(&mut self) -> String {
        let mut line = String::new();
        self.reader
            .read_line(&mut line)
            .expect("a reply within the hang guard");
        line
    }

    fn status(&mut self) -> Value {
        self.writer.write_all(b"STATUS\n").unwrap();
        let head = self.line();
        let len: usize = head
            .strip_prefix("STATUS ")
            .and_then(|n| n.trim_end().parse().ok())
            .unwrap_or_else(|| panic!("not a STATUS reply: {head:?}"));
        let mut body = vec![0; len + 1];
        self.reader.read_exact(&mut body).unwrap();
        assert_eq!(body.pop(), Some(b'\n'));
        serde_json::from_slice(&body).unwrap()
    }
}

/// Every key given matches, recursively; lists element by element.
fn matches(expected: &Value, actual: &Value) -> bool {
    match (expected, actual) {
        (Value::Object(e), Value::Object(a)) => e
            .iter()
            .all(|(k, v)| a.get(k).is_some_and(|av| matches(v, av))),
        (Value::Array(e), Value::Array(a)) => {
            e.len() == a.len() && e.iter().zip(a).all(|(ev, av)| matches(ev, av))
        }
        _ => expected == actual,
    }
}

fn replay(vector: &Value) {
    let name = vector["name"].as_str().unwrap();
    let max_clients = vector
        .get("max_clients")
        .map(|n| n.as_u64().unwrap().to_string());
    let extra: Vec<&str> = max_clients
        .iter()
        .flat_map(|n| ["--max-clients", n.as_str()])
        .collect();
    let broker = RunningBroker::start_with(vector["jobs"].as_u64().unwrap() as u32, &extra);
    let mut conns: HashMap<String, Conn> = HashMap::new();
    let mut fillers = Vec::new();
    for step in vector["steps"].as_array().unwrap() {
        let (who, op, arg) = (
            step[0].as_str().unwrap(),
            step[1].as_str().unwrap(),
            step.get(2),
        );
        if op == "fill" {
            fillers.extend(
                (0..arg.unwrap().as_u64().unwrap())
                    .map(|_| UnixStream::connect(&broker.socket).unwrap()),
            );
            continue;
        }
        let conn = conns
            .entry(who.to_string())
            .or_insert_with(|| Conn::open(&broker.socket));
        match op {
            "send" => conn
                .writer
                .write_all(arg.unwrap().as_str().unwrap().as_bytes())
                .unwrap(),
            "recv" => assert_eq!(
                conn.line(),
                arg.unwrap().as_str().unwrap(),
                "{name}: what {who} read"
            ),
            "status" => {
                let got = conn.status();
                assert!(
                    matches(arg.unwrap(), &got),
                    "{name}: {who}'s status {got} does not match {}",
                    arg.unwrap()
                );
            }
            "status_until" => wait_for(
                HANG_GUARD,
                &format!("{name}: a status matching {}", arg.unwrap()),
                || matches(arg.unwrap(), &conn.status()),
            ),
            "closed" => assert_eq!(conn.line(), "", "{name}: the broker closed {who}"),
            "close" => drop(conns.remove(who)),
            other => panic!("{name}: unknown op {other}"),
        }
    }
}

#[test]
fn every_vector_is_what_the_broker_says() {
    let doc: Value =
        serde_json::from_str(include_str!("../../../docs/protocol-vectors.json")).unwrap();
    let vectors = doc["vectors"].as_array().unwrap();
    assert!(vectors.len() >= 15, "the vectors were found");
    for vector in vectors {
        replay(vector);
    }
}

#[test]
fn the_vectors_cover_every_error_code() {
    let doc = include_str!("../../../docs/protocol-vectors.json");
    for code in [
        "malformed",
        "too-long",
        "version",
        "hello",
        "busy",
        "full",
        "over-release",
        "range",
    ] {
        assert!(
            doc.contains(&format!("ERR {code} ")),
            "no vector shows ERR {code}"
        );
    }
}
