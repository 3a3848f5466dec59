//! Test hooks that make the engine panic as a kernel `assert!` would
//! (feature `fault-hooks`, enabled only by this crate's tests).

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

static PANIC_ON_TOKEN: AtomicU32 = AtomicU32::new(u32::MAX);
static PANIC_IN_LOOP: AtomicBool = AtomicBool::new(false);

/// Every prefill forward over a prompt holding token `id` panics.
pub fn panic_on_token(id: u32) {
    PANIC_ON_TOKEN.store(id, Ordering::SeqCst);
}

/// The loop's next step panics outside any batch's work (once).
pub fn panic_in_loop() {
    PANIC_IN_LOOP.store(true, Ordering::SeqCst);
}

pub(super) fn check_prefill(ids: &[u32]) {
    let id = PANIC_ON_TOKEN.load(Ordering::SeqCst);
    assert!(!ids.contains(&id), "fault hook: token {id} in a prefill");
}

pub(super) fn check_loop() {
    if PANIC_IN_LOOP.swap(false, Ordering::SeqCst) {
        panic!("fault hook: the batch loop's own state");
    }
}
