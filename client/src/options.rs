//! Generation options on the wire: an `a{sv}` dictionary, so that the contract can grow a key
//! without breaking any caller (the way systemd, the portals and NetworkManager evolve their
//! interfaces). [`GenerateParams`] is the Rust form; this module is the one place that names
//! the keys and their types, both ways: a caller sends only the keys that differ from the
//! defaults, and the daemon refuses an unknown key or a value of the wrong type by name.
//!
//! Integer keys accept any D-Bus integer type whose value is in range, and float keys an
//! integer too, so that callers in languages without a `u32` (Python, shell) need no casts.

use std::collections::HashMap;

use serde::ser::{Serialize, SerializeMap, Serializer};
use zbus::zvariant::{OwnedValue, Signature, Type, Value};

use crate::contract::{GRAMMAR_KINDS, GenerateParams};

/// Every key, with the type it takes, in the order the docs list them.
pub const OPTION_KEYS: [(&str, &str); 14] = [
    ("max_tokens", "u"),
    ("temperature", "d"),
    ("top_k", "u"),
    ("top_p", "d"),
    ("repetition_penalty", "d"),
    ("seed", "t"),
    ("stop", "as"),
    ("json_schema", "s"),
    ("lark", "s"),
    ("regex", "s"),
    ("priority", "s"),
    ("first_token_deadline_ms", "u"),
    ("deadline_ms", "u"),
    ("sentences", "b"),
];

impl Type for GenerateParams {
    const SIGNATURE: &'static Signature = <HashMap<String, OwnedValue> as Type>::SIGNATURE;
}

impl Serialize for GenerateParams {
    /// The keys whose values differ from the defaults.
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let d = GenerateParams::default();
        let mut entries: Vec<(&str, Value<'_>)> = Vec::new();
        let mut put = |key, value: Value<'static>, default: bool| {
            if !default {
                entries.push((key, value));
            }
        };
        put(
            "max_tokens",
            self.max_tokens.into(),
            self.max_tokens == d.max_tokens,
        );
        put(
            "temperature",
            self.temperature.into(),
            self.temperature == d.temperature,
        );
        put("top_k", self.top_k.into(), self.top_k == d.top_k);
        put("top_p", self.top_p.into(), self.top_p == d.top_p);
        let penalty = self.repetition_penalty;
        put(
            "repetition_penalty",
            penalty.into(),
            penalty == d.repetition_penalty,
        );
        put("seed", self.seed.into(), self.seed == d.seed);
        put("stop", self.stop.clone().into(), self.stop.is_empty());
        put(
            "priority",
            self.priority.clone().into(),
            self.priority.is_empty(),
        );
        let first = self.first_token_deadline_ms;
        put("first_token_deadline_ms", first.into(), first == 0);
        put(
            "deadline_ms",
            self.deadline_ms.into(),
            self.deadline_ms == 0,
        );
        put("sentences", self.sentences.into(), !self.sentences);
        if !self.grammar_kind.is_empty() || !self.grammar.is_empty() {
            // An unknown kind travels as its own key, for the daemon to refuse by name.
            let kind = self.grammar_kind.as_str();
            entries.push((kind, Value::from(self.grammar.as_str())));
        }
        let mut map = serializer.serialize_map(Some(entries.len()))?;
        for (key, value) in &entries {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

impl GenerateParams {
    /// Reads the options a caller sent. Errors name the key and what it takes.
    pub fn from_options(options: &HashMap<String, OwnedValue>) -> Result<GenerateParams, String> {
        let mut p = GenerateParams::default();
        let mut keys: Vec<&String> = options.keys().collect();
        keys.sort();
        for key in keys {
            let value: &Value<'_> = &options[key];
            let value = match value {
                // A variant inside the variant: what some bindings send for a typed value.
                Value::Value(inner) => inner,
                v => v,
            };
            let v = Typed { key, value };
            match key.as_str() {
                "max_tokens" => p.max_tokens = v.u32()?,
                "temperature" => p.temperature = v.f64()?,
                "top_k" => p.top_k = v.u32()?,
                "top_p" => p.top_p = v.f64()?,
                "repetition_penalty" => p.repetition_penalty = v.f64()?,
                "seed" => p.seed = v.unsigned()?,
                "stop" => p.stop = v.strings()?,
                "priority" => p.priority = v.string()?,
                "first_token_deadline_ms" => p.first_token_deadline_ms = v.u32()?,
                "deadline_ms" => p.deadline_ms = v.u32()?,
                "sentences" => p.sentences = v.bool()?,
                kind if GRAMMAR_KINDS.contains(&kind) => {
                    if !p.grammar_kind.is_empty() {
                        return Err(format!(
                            "options {} and {kind} both set a grammar: give at most one",
                            p.grammar_kind
                        ));
                    }
                    p.grammar = v.string()?;
                    p.grammar_kind = kind.to_string();
                }
                other => {
                    let known: Vec<&str> = OPTION_KEYS.iter().map(|(k, _)| *k).collect();
                    return Err(format!(
                        "unknown option {other:?}; the options are {}",
                        known.join(", ")
                    ));
                }
            }
        }
        Ok(p)
    }
}

/// One option's value, read as the type its key takes.
struct Typed<'a> {
    key: &'a str,
    value: &'a Value<'a>,
}

impl Typed<'_> {
    fn wrong(&self, wanted: &str) -> String {
        format!(
            "option {} takes {wanted}, not a value of type {}",
            self.key,
            self.value.value_signature()
        )
    }

    /// Any integer type, when the value is not negative.
    fn unsigned(&self) -> Result<u64, String> {
        let signed = match *self.value {
            Value::U8(n) => return Ok(n.into()),
            Value::U16(n) => return Ok(n.into()),
            Value::U32(n) => return Ok(n.into()),
            Value::U64(n) => return Ok(n),
            Value::I16(n) => i64::from(n),
            Value::I32(n) => i64::from(n),
            Value::I64(n) => n,
            _ => return Err(self.wrong("an unsigned integer")),
        };
        u64::try_from(signed).map_err(|_| format!("option {} cannot be negative", self.key))
    }

    fn u32(&self) -> Result<u32, String> {
        let n = self.unsigned()?;
        u32::try_from(n).map_err(|_| format!("option {} is over {}", self.key, u32::MAX))
    }

    /// A double, or an integer of any type.
    fn f64(&self) -> Result<f64, String> {
        match *self.value {
            Value::F64(x) => Ok(x),
            Value::U8(_) | Value::U16(_) | Value::U32(_) | Value::U64(_) => {
                Ok(self.unsigned()? as f64)
            }
            Value::I16(n) => Ok(n.into()),
            Value::I32(n) => Ok(n.into()),
            Value::I64(n) => Ok(n as f64),
            _ => Err(self.wrong("a number (d)")),
        }
    }

    fn string(&self) -> Result<String, String> {
        match self.value {
            Value::Str(s) => Ok(s.to_string()),
            _ => Err(self.wrong("a string (s)")),
        }
    }

    fn strings(&self) -> Result<Vec<String>, String> {
        let wrong = || self.wrong("an array of strings (as)");
        let Value::Array(items) = self.value else {
            return Err(wrong());
        };
        (items.iter())
            .map(|item| match item {
                Value::Str(s) => Ok(s.to_string()),
                _ => Err(wrong()),
            })
            .collect()
    }

    fn bool(&self) -> Result<bool, String> {
        match *self.value {
            Value::Bool(b) => Ok(b),
            _ => Err(self.wrong("a boolean (b)")),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use zbus::zvariant::serialized::Context;
    use zbus::zvariant::{LE, to_bytes};

    /// What the daemon reads from `p` sent over the wire.
    fn round_trip(p: &GenerateParams) -> Result<GenerateParams, String> {
        let ctxt = Context::new_dbus(LE, 0);
        let bytes = to_bytes(ctxt, p).unwrap();
        let (options, _): (HashMap<String, OwnedValue>, _) = bytes.deserialize().unwrap();
        GenerateParams::from_options(&options)
    }

    fn options(entries: &[(&str, Value<'_>)]) -> HashMap<String, OwnedValue> {
        (entries.iter())
            .map(|(k, v)| (k.to_string(), v.try_to_owned().unwrap()))
            .collect()
    }

    #[test]
    fn every_option_survives_the_wire() {
        let p = GenerateParams {
            max_tokens: 7,
            temperature: 0.5,
            top_k: 40,
            top_p: 0.9,
            repetition_penalty: 1.1,
            seed: u64::MAX,
            stop: vec!["\n".into(), "END".into()],
            grammar_kind: "regex".into(),
            grammar: "[0-9]+".into(),
            priority: "background".into(),
            first_token_deadline_ms: 100,
            deadline_ms: 2000,
            sentences: true,
        };
        assert_eq!(round_trip(&p), Ok(p));
        assert_eq!(
            round_trip(&GenerateParams::default()),
            Ok(GenerateParams::default())
        );
        assert_eq!(GenerateParams::SIGNATURE.to_string(), "a{sv}");
    }

    #[test]
    fn defaults_are_not_sent() {
        let ctxt = Context::new_dbus(LE, 0);
        let empty = to_bytes(ctxt, &HashMap::<String, OwnedValue>::new()).unwrap();
        let default = to_bytes(ctxt, &GenerateParams::default()).unwrap();
        assert_eq!(default.bytes(), empty.bytes());
    }

    #[test]
    fn integers_of_any_width_and_sign_are_read_when_in_range() {
        let p = GenerateParams::from_options(&options(&[
            ("max_tokens", Value::I32(12)),
            ("seed", Value::I64(3)),
            ("temperature", Value::U32(1)),
            ("top_k", Value::Value(Box::new(Value::U8(5)))),
        ]))
        .unwrap();
        assert_eq!(
            (p.max_tokens, p.seed, p.temperature, p.top_k),
            (12, 3, 1.0, 5)
        );
    }

    #[test]
    fn unknown_keys_and_wrong_types_are_refused_by_name() {
        let refuse = |entries: &[(&str, Value<'_>)]| {
            GenerateParams::from_options(&options(entries)).unwrap_err()
        };
        let e = refuse(&[("max_token", Value::U32(1))]);
        assert!(
            e.contains("unknown option \"max_token\"") && e.contains("max_tokens"),
            "{e}"
        );
        let e = refuse(&[("max_tokens", Value::from("12"))]);
        assert_eq!(
            e,
            "option max_tokens takes an unsigned integer, not a value of type s"
        );
        let e = refuse(&[("max_tokens", Value::I32(-1))]);
        assert_eq!(e, "option max_tokens cannot be negative");
        let e = refuse(&[("max_tokens", Value::U64(1 << 40))]);
        assert!(e.contains("is over"), "{e}");
        let e = refuse(&[("stop", Value::from(vec![1u32, 2]))]);
        assert!(e.contains("an array of strings (as)"), "{e}");
        let e = refuse(&[("sentences", Value::U8(1))]);
        assert!(e.contains("a boolean (b)"), "{e}");
        let e = refuse(&[("regex", Value::from("a")), ("lark", Value::from("b"))]);
        assert!(e.contains("at most one"), "{e}");
    }
}
