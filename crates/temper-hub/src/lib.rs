//! `temper-hub`: the environments hub — versioned environment packages,
//! a self-hosted registry server with a web page, and the client and
//! local cache that `temper env push/pull` and `temper eval owner/name@^1`
//! use.
//!
//! - [`package`]: an environment directory (env.toml, data files, README,
//!   an optional external program) packed into one deterministic `.tar.gz`
//!   with a [`PackageManifest`]; [`package::check_archive`] (streaming; one
//!   function for packing, publishing and unpacking) checks an archive
//!   against non-canonical or clashing paths, path traversal, links, device
//!   files, over-long names and versions, size or ratio bombs and a broken
//!   gzip trailer.
//! - [`server`]: `temper hub serve` — [`server::app`] over a [`MetaStore`]
//!   ([`SqliteMeta`]) and a [`BlobStore`] ([`FsBlobs`]); tokens with scopes,
//!   hashed at rest; Prometheus metrics; the web page ([`web`]).
//! - [`client`]: [`HubClient`] for the HTTP API, [`Cache`] for pulled
//!   packages, [`pull`] from a reference to a directory.
//! - [`refs`]: `owner/name[@version or range]`.
//!
//! Key design choice: a package is named by the sha256 of its bytes, and
//! packing is deterministic, so "the same environment" means the same
//! digest on every machine. The server stores archives by digest
//! (write-once, so publish is "store blob, then insert one row" and the
//! row's primary key decides races), and a run records the digest it used.
//!
//! ```
//! use temper_hub::package::{pack_dir, read_archive, Limits};
//!
//! let dir = tempfile::tempdir()?;
//! std::fs::write(dir.path().join("env.toml"), r#"
//! name = "doubling"
//! namespace = "acme"
//! version = "0.1.0"
//! description = "Double a number."
//! [dataset]
//! eval = "eval.jsonl"
//! [[rubric]]
//! function = "exact_match"
//! "#)?;
//! std::fs::write(dir.path().join("eval.jsonl"), "{\"question\": \"2?\", \"answer\": \"4\"}\n")?;
//! let a = pack_dir(dir.path(), None)?;
//! let b = pack_dir(dir.path(), None)?;
//! assert_eq!(a.digest, b.digest); // deterministic
//! let (manifest, files) = read_archive(&a.bytes, &Limits::default())?;
//! assert_eq!(manifest.id(), "acme/doubling");
//! assert_eq!(files.len(), 2);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

pub mod client;
mod error;
pub mod package;
pub mod refs;
pub mod server;
pub mod store;
pub mod web;

pub use client::{pull, Cache, Cached, HubClient, Progress, Wanted};
pub use error::HubError;
pub use package::{pack_dir, PackageManifest, Packed};
pub use refs::{EnvRef, VersionSpec};
pub use server::{app, HubSettings, HubState, PackageInfo, PackageSummary};
pub use store::{BlobStore, FsBlobs, MetaStore, Query, Scope, SqliteMeta, VersionInfo};
