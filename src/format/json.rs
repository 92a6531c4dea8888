//! Shallow JSON reading for the streamed readers of JSON files
//! (`trainer_state.json`, safetensors headers): values skipped but checked
//! ([`SkipJson`]), scalars kept ([`JsonScalar`]), and the visitor methods
//! that give a fixed value for the types a reader does not want
//! ([`scalars_give`], [`seq_gives`], [`map_gives`]).
//!
//! Every value goes through serde_json's checked parse (strings of valid
//! UTF-8 without a lone surrogate, numbers in range, at most 128 levels
//! deep), as parsing it into a `serde_json::Value` tree does, without the
//! tree. serde's `IgnoredAny` checks none of this, and keeps a byte per
//! level of nesting.

use serde::de::{self, Deserializer, Visitor};
use serde_json::Number;

/// Visitor methods giving `$v` for numbers, strings, booleans and null.
macro_rules! scalars_give {
    ($v:expr) => {
        fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
            Ok($v)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
            Ok($v)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
            Ok($v)
        }
        fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
            Ok($v)
        }
        fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
            Ok($v)
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok($v)
        }
    };
}

/// A visitor method giving `$v` for an array, skipped ([`SkipJson`]).
macro_rules! seq_gives {
    ($v:expr) => {
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut a: A,
        ) -> Result<Self::Value, A::Error> {
            while a
                .next_element::<$crate::format::json::SkipJson>()?
                .is_some()
            {}
            Ok($v)
        }
    };
}

/// A visitor method giving `$v` for an object, skipped ([`SkipJson`]).
macro_rules! map_gives {
    ($v:expr) => {
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut a: A,
        ) -> Result<Self::Value, A::Error> {
            use $crate::format::json::SkipJson;
            while a.next_entry::<SkipJson, SkipJson>()?.is_some() {}
            Ok($v)
        }
    };
}

pub(crate) use {map_gives, scalars_give, seq_gives};

/// Any JSON value, skipped but checked; nothing is kept.
pub(crate) struct SkipJson;

impl<'de> de::Deserialize<'de> for SkipJson {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = SkipJson;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            scalars_give!(SkipJson);
            seq_gives!(SkipJson);
            map_gives!(SkipJson);
        }
        d.deserialize_any(V)
    }
}

/// A JSON value as a reader keeping only scalars sees it: a number, a
/// string, or anything else (skipped).
pub(crate) enum JsonScalar {
    Num(Number),
    Str(String),
    Other,
}

impl JsonScalar {
    /// The value as a whole number of 0 or more.
    pub(crate) fn as_u64(&self) -> Option<u64> {
        match self {
            JsonScalar::Num(n) => n.as_u64(),
            _ => None,
        }
    }
}

impl<'de> de::Deserialize<'de> for JsonScalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = JsonScalar;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_u64<E>(self, v: u64) -> Result<JsonScalar, E> {
                Ok(JsonScalar::Num(v.into()))
            }
            fn visit_i64<E>(self, v: i64) -> Result<JsonScalar, E> {
                Ok(JsonScalar::Num(v.into()))
            }
            fn visit_f64<E>(self, v: f64) -> Result<JsonScalar, E> {
                Ok(Number::from_f64(v).map_or(JsonScalar::Other, JsonScalar::Num))
            }
            fn visit_str<E>(self, v: &str) -> Result<JsonScalar, E> {
                Ok(JsonScalar::Str(v.to_owned()))
            }
            fn visit_bool<E>(self, _: bool) -> Result<JsonScalar, E> {
                Ok(JsonScalar::Other)
            }
            fn visit_unit<E>(self) -> Result<JsonScalar, E> {
                Ok(JsonScalar::Other)
            }
            seq_gives!(JsonScalar::Other);
            map_gives!(JsonScalar::Other);
        }
        d.deserialize_any(V)
    }
}
