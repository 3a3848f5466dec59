//! The `json_fields` reward: field-by-field comparison of JSON objects.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

/// `json_fields` arguments.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonFieldsConfig {
    /// Fields to compare (dotted paths reach nested objects), with a
    /// weight each; a list gives each weight 1; default: every field of
    /// the reference object.
    #[serde(default)]
    pub fields: Option<FieldWeights>,
    /// Compare strings trimmed, case-folded and with runs of whitespace as
    /// one space, and numbers (or numeric strings) by value (default true).
    #[serde(default = "yes")]
    pub normalize: bool,
    /// Relative tolerance for numbers (default 1e-6).
    #[serde(default = "default_tolerance")]
    pub tolerance: f64,
}

fn yes() -> bool {
    true
}

fn default_tolerance() -> f64 {
    1e-6
}

/// `fields` of [`JsonFieldsConfig`].
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum FieldWeights {
    /// Names, weight 1 each.
    Names(Vec<String>),
    /// Name → weight.
    Weighted(BTreeMap<String, f64>),
}

/// The weighted fraction of fields of the reference JSON object (`answer`)
/// that the parsed answer's object matches, in [0, 1]. A fenced or
/// surrounded object (```json … ```) is found by its outer braces; an
/// answer that is no JSON object scores 0.
pub fn json_fields_score(got: Option<&str>, want: Option<&str>, cfg: &JsonFieldsConfig) -> f64 {
    let object = |s: &str| -> Option<Value> {
        let (a, b) = (s.find('{')?, s.rfind('}')?);
        serde_json::from_str::<Value>(s.get(a..=b)?)
            .ok()
            .filter(Value::is_object)
    };
    let (Some(got), Some(want)) = (got.and_then(object), want.and_then(object)) else {
        return 0.0;
    };
    let fields: Vec<(String, f64)> = match &cfg.fields {
        Some(FieldWeights::Names(n)) => n.iter().map(|f| (f.clone(), 1.0)).collect(),
        Some(FieldWeights::Weighted(m)) => m.iter().map(|(f, w)| (f.clone(), *w)).collect(),
        None => want
            .as_object()
            .map(|o| o.keys().map(|k| (k.clone(), 1.0)).collect())
            .unwrap_or_default(),
    };
    let total: f64 = fields.iter().map(|(_, w)| w.abs()).sum();
    if total <= 0.0 {
        return 0.0;
    }
    let at = |v: &Value, path: &str| -> Option<Value> {
        path.split('.')
            .try_fold(v, |cur, key| cur.get(key))
            .cloned()
    };
    let matched: f64 = fields
        .iter()
        .filter(|(f, _)| match (at(&got, f), at(&want, f)) {
            (Some(g), Some(w)) => json_equal(&g, &w, cfg),
            _ => false,
        })
        .map(|(_, w)| w.abs())
        .sum();
    matched / total
}

fn json_equal(a: &Value, b: &Value, cfg: &JsonFieldsConfig) -> bool {
    if !cfg.normalize {
        return a == b;
    }
    let number = |v: &Value| match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().replace(',', "").parse::<f64>().ok(),
        _ => None,
    };
    let text = |s: &str| {
        s.split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .to_lowercase()
    };
    match (a, b) {
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| json_equal(p, q, cfg))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| json_equal(v, w, cfg)))
        }
        (Value::String(x), Value::String(y)) if number(a).is_none() || number(b).is_none() => {
            text(x) == text(y)
        }
        _ => match (number(a), number(b)) {
            (Some(x), Some(y)) => (x - y).abs() <= cfg.tolerance * y.abs().max(1.0),
            _ => a == b,
        },
    }
}
