//! `temper-sandbox`: runs untrusted Python and bash programs in Linux
//! namespaces, for code rewards and agent tools.
//!
//! Every [`Sandbox::run`] clones a child into new user, pid, mount, net, ipc,
//! uts and cgroup namespaces. The child maps itself to an unprivileged user
//! (the caller's uid, or `nobody` when the caller is root), assembles a new
//! root from read-only binds of `/usr` and `/etc` plus size-capped tmpfs
//! `/work`, `/tmp` and `/dev/shm`, brings up loopback (the only interface),
//! then forks the program under rlimits, `no_new_privs` and a seccomp deny
//! list. The child stays as pid 1 of its namespace: when the program exits
//! (or the wall-clock timeout kills pid 1) the kernel kills every process it
//! left behind, and nothing is ever created on the host file system.
//!
//! Key design choice: isolation from namespaces the kernel hands to any
//! user, not from a daemon or root helper, so the same code runs on a
//! laptop, in CI and in a container; what the host does not allow is
//! reported by [`doctor`] instead of silently skipped.
//!
//! - [`Sandbox::run`]: one run in fresh namespaces (~3 ms + interpreter start).
//! - [`Pool::run`]: the same isolation from warm workers whose program is a
//!   Python zygote, so a run costs a fork (~1.5 ms for `print(1)`).
//! - [`service::app`]: the SandboxFusion-compatible `POST /run_code` router.
//! - [`doctor`]: which layers this host gives us.
//! - [`Venvs`]: cached virtualenvs for runs that declare Python packages.
//!
//! The code between `clone` and `execve` (`child.rs`) allocates nothing and
//! calls no glibc wrapper that takes locks or signals other threads: the
//! caller may be a multi-threaded server.
//!
//! ```no_run
//! use temper_sandbox::{ExecRequest, Language, Sandbox, SandboxConfig};
//!
//! let sandbox = Sandbox::new(SandboxConfig::default())?;
//! let out = sandbox.run(&ExecRequest::new(Language::Python, "print(6 * 7)"))?;
//! assert_eq!(out.stdout, "42\n");
//! # Ok::<(), temper_sandbox::SandboxError>(())
//! ```
#![deny(missing_docs)]

mod cgroup;
mod child;
mod client;
mod doctor;
mod error;
mod pool;
mod sandbox;
mod seccomp;
mod secret;
pub mod service;
mod session;
mod testcases;
mod types;
mod venvs;

pub use cgroup::{HostCgroup, RunLimits};
pub use client::{Client, ClientError};
pub use doctor::{doctor, Layer};
pub use error::SandboxError;
pub use pool::{Pool, PoolConfig};
pub use sandbox::{Interpreter, Sandbox};
pub use seccomp::denied_syscalls;
pub use secret::{scrub_from_process, API_KEY_ENV};
pub use session::{Session, SessionConfig, Sessions};
pub use testcases::{run_test_cases, CaseResult, TestCase, TestReport};
pub use types::{ExecRequest, ExecResult, ExecStatus, Language, Limits, SandboxConfig};
pub use venvs::{check_requirements, VenvConfig, Venvs, MAX_REQUIREMENTS, MAX_REQUIREMENT_LEN};
