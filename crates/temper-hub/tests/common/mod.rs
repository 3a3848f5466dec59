//! Helpers shared by the hub's integration tests.

use std::path::Path;

/// Every path under `root`, relative and sorted: a directory's visible state,
/// to show an operation left it as it was.
pub fn listing(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir") {
            let p = e.expect("entry").path();
            out.push(p.strip_prefix(root).expect("prefix").display().to_string());
            if p.is_dir() {
                stack.push(p);
            }
        }
    }
    out.sort();
    out
}
