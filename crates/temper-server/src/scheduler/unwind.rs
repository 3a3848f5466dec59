//! Catching a panic in one batch's work, so it fails that work alone.

use std::panic::{catch_unwind, AssertUnwindSafe};

/// The message of a caught panic's payload (`panic!` gives a `&str` or a
/// `String`).
pub(super) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Run `work`, turning a panic into an error that names it (`what` says
/// which work).
pub(super) fn unwinding<T, E: std::fmt::Display>(
    what: &str,
    work: impl FnOnce() -> Result<T, E>,
) -> Result<T, String> {
    match catch_unwind(AssertUnwindSafe(work)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what} failed: {e}")),
        Err(p) => Err(format!("{what} panicked: {}", panic_message(&*p))),
    }
}
