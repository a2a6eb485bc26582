//! A map as the list of its (key, value) pairs, for `#[serde(with =
//! "crate::pairs")]`: JSON keys are strings only, and the broker's are
//! numbers and ids. It is also the form brokers before this one wrote for
//! `serve --replace`, which a successor must read.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub fn serialize<'a, M, K, V, S>(map: &'a M, s: S) -> Result<S::Ok, S::Error>
where
    &'a M: IntoIterator<Item = (&'a K, &'a V)>,
    K: Serialize + 'a,
    V: Serialize + 'a,
    S: Serializer,
{
    s.collect_seq(map)
}

pub fn deserialize<'de, M, K, V, D>(d: D) -> Result<M, D::Error>
where
    M: FromIterator<(K, V)>,
    K: Deserialize<'de>,
    V: Deserialize<'de>,
    D: Deserializer<'de>,
{
    Ok(Vec::<(K, V)>::deserialize(d)?.into_iter().collect())
}
