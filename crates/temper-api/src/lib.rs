//! The wire types of temper's training API — the tinker protocol
//! (`docs/tinker-protocol.md`). Both sides depend on this crate, so the
//! client (`temper-client`'s `RemoteTrainer`) and the server
//! (`temper-server`'s `training_api`) encode and decode the same messages
//! and neither depends on the other.
//!
//! [`proto`]: the protobuf messages (`forward_backward` and `asample`
//! bodies and results), written out with `prost` derives; the JSON bodies
//! are plain `serde_json` values on both sides.
#![deny(missing_docs)]

pub mod proto;
