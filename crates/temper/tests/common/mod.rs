//! Helpers shared by the CLI tests.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

/// A child process, killed when dropped.
pub struct Server(pub std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `temper sandbox serve` with `args` (plus `env`) on a free port;
/// `None` (printing why) where this host has no namespaces for a sandbox.
pub fn sandbox_serve(args: &[&str], env: &[(&str, &str)]) -> Option<(Server, String)> {
    let child = Command::new(env!("CARGO_BIN_EXE_temper"))
        .args(["sandbox", "serve", "--port", "0", "--pool-size", "1"])
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn temper");
    let mut server = Server(child);
    let mut lines = BufReader::new(server.0.stderr.take().expect("stderr")).lines();
    let mut seen = String::new();
    let url = loop {
        let Some(Ok(line)) = lines.next() else {
            eprintln!("SKIPPED: temper sandbox serve exited: {seen}");
            return None;
        };
        if let Some(rest) = line.split("listening on ").nth(1) {
            break rest.trim().to_string();
        }
        seen += &line;
        seen.push('\n');
    };
    std::thread::spawn(move || for _ in lines.by_ref() {});
    Some((server, url))
}
