//! TensorBoard event files (`[log] tensorboard = true`): the run's metrics
//! as scalars and a few samples as text, in
//! `events.out.tfevents.<time>.<host>.<pid>.temper` beside `metrics.jsonl`,
//! readable by TensorBoard and by tools that import its logs (`wandb sync
//! --sync-tensorboard`).
//!
//! The format: TFRecord framing (little-endian u64 length, masked CRC32C
//! of the length, the bytes, masked CRC32C of the bytes) around
//! `tensorflow.Event` protocol buffers, the first of which names the file
//! version. Only the fields written here are declared.

use std::io::Write;
use std::path::{Path, PathBuf};

use prost::Message;
use serde_json::{Map, Value};

use crate::error::{Result, RlError};

/// `tensorflow.Event` (event.proto): the fields written here.
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value`: a scalar (`simple_value`) or a tensor with
/// the plugin that reads it.
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
    #[prost(message, optional, tag = "8")]
    tensor: Option<TensorProto>,
    #[prost(message, optional, tag = "9")]
    metadata: Option<SummaryMetadata>,
}

/// `tensorflow.SummaryMetadata`.
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    plugin_data: Option<PluginData>,
}

/// `tensorflow.SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, prost::Message)]
struct PluginData {
    #[prost(string, tag = "1")]
    plugin_name: String,
}

/// `tensorflow.TensorProto`: a scalar string tensor.
#[derive(Clone, PartialEq, prost::Message)]
struct TensorProto {
    /// `DT_STRING` = 7.
    #[prost(int32, tag = "1")]
    dtype: i32,
    #[prost(message, optional, tag = "2")]
    tensor_shape: Option<TensorShape>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    string_val: Vec<Vec<u8>>,
}

/// `tensorflow.TensorShapeProto` (no dims: a scalar).
#[derive(Clone, PartialEq, prost::Message)]
struct TensorShape {}

const DT_STRING: i32 = 7;

/// CRC-32C (Castagnoli), bitwise: event files are small.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// TFRecord's masked CRC.
fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    (c.rotate_right(15)).wrapping_add(0xa282_ead8)
}

/// One TFRecord around `data`.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// An open event file.
pub struct EventWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl EventWriter {
    /// Start a new event file in `dir` (each session of a run writes its
    /// own, as TensorBoard's writers do; TensorBoard reads them all).
    pub fn create(dir: &Path) -> Result<Self> {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .ok()
            .filter(|h| !h.is_empty() && !h.contains('/'))
            .unwrap_or_else(|| "localhost".into());
        let t = now();
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}.temper",
            t as u64,
            std::process::id()
        ));
        let file = std::fs::File::create(&path).map_err(|e| RlError::io(&path, e))?;
        let mut w = Self { path, file };
        w.write(&Event {
            wall_time: t,
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
        })?;
        Ok(w)
    }

    fn write(&mut self, e: &Event) -> Result<()> {
        self.file
            .write_all(&record(&e.encode_to_vec()))
            .and_then(|_| self.file.flush())
            .map_err(|err| RlError::io(&self.path, err))
    }

    /// Every numeric value of a `metrics.jsonl` record (but `step`) as a
    /// scalar at its `step`.
    pub fn scalars(&mut self, record: &Map<String, Value>) -> Result<()> {
        let step = record.get("step").and_then(Value::as_i64).unwrap_or(0);
        let value = record
            .iter()
            .filter(|(k, _)| k.as_str() != "step")
            .filter_map(|(k, v)| {
                Some(SummaryValue {
                    tag: k.clone(),
                    simple_value: Some(v.as_f64()? as f32),
                    ..Default::default()
                })
            })
            .collect();
        self.write(&Event {
            wall_time: now(),
            step,
            file_version: None,
            summary: Some(Summary { value }),
        })
    }

    /// `text` (Markdown) under `tag` at `step`, for TensorBoard's text tab.
    pub fn text(&mut self, step: u64, tag: &str, text: &str) -> Result<()> {
        let value = SummaryValue {
            tag: tag.into(),
            simple_value: None,
            tensor: Some(TensorProto {
                dtype: DT_STRING,
                tensor_shape: Some(TensorShape {}),
                string_val: vec![text.as_bytes().to_vec()],
            }),
            metadata: Some(SummaryMetadata {
                plugin_data: Some(PluginData {
                    plugin_name: "text".into(),
                }),
            }),
        };
        self.write(&Event {
            wall_time: now(),
            step: i64::try_from(step).unwrap_or(i64::MAX),
            file_version: None,
            summary: Some(Summary { value: vec![value] }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The CRC-32C of "123456789" (RFC 3720's check value).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn records_frame_and_decode_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        let rec = serde_json::json!({"step": 3, "reward/mean": 0.5, "alerts": ["x"]});
        w.scalars(rec.as_object().unwrap()).unwrap();
        w.text(3, "samples", "**hi**").unwrap();
        let bytes = std::fs::read(&w.path).unwrap();
        let mut events = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
            let crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
            assert_eq!(crc, masked_crc(&bytes[at..at + 8]));
            let data = &bytes[at + 12..at + 12 + len];
            let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
            assert_eq!(crc, masked_crc(data));
            events.push(Event::decode(data).unwrap());
            at += 16 + len;
        }
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        let s = events[1].summary.as_ref().unwrap();
        assert_eq!(events[1].step, 3);
        // Non-numbers (the alerts list) are not scalars.
        assert_eq!(s.value.len(), 1);
        assert_eq!(
            (s.value[0].tag.as_str(), s.value[0].simple_value),
            ("reward/mean", Some(0.5))
        );
        let t = &events[2].summary.as_ref().unwrap().value[0];
        assert_eq!(t.tensor.as_ref().unwrap().string_val[0], b"**hi**");
    }
}
