//! Connection bounds shared by `temper serve`, `temper api serve` and
//! `temper sandbox serve`, and the one way each of them serves HTTP.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use temper_server::http::ConnLimits;

/// `--max-connections`, `--header-timeout-s`, `--body-timeout-s`.
#[derive(Args, Clone, Debug)]
pub struct ConnArgs {
    /// Most client connections open at once (more wait to be accepted).
    #[arg(long, default_value_t = ConnLimits::default().max_connections)]
    max_connections: usize,
    /// Seconds a client has to send a request's headers (and the most a
    /// kept-alive connection may sit idle); then it is closed.
    #[arg(long, default_value_t = ConnLimits::default().header_timeout.as_secs())]
    header_timeout_s: u64,
    /// Seconds a client has to send a request's body; then 408.
    #[arg(long, default_value_t = ConnLimits::default().body_timeout.as_secs())]
    body_timeout_s: u64,
}

impl ConnArgs {
    fn limits(&self) -> Result<ConnLimits> {
        if self.max_connections == 0 || self.header_timeout_s == 0 || self.body_timeout_s == 0 {
            anyhow::bail!(
                "--max-connections, --header-timeout-s and --body-timeout-s must be >= 1"
            );
        }
        Ok(ConnLimits {
            max_connections: self.max_connections,
            header_timeout: Duration::from_secs(self.header_timeout_s),
            body_timeout: Duration::from_secs(self.body_timeout_s),
        })
    }
}

/// The multi-threaded runtime the servers run on.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Bind `addr`, print `banner(bound address)` to stderr, then serve
/// `router` within `conn`'s bounds until Ctrl-C: the one start-up of every
/// `temper … serve`.
pub async fn serve(
    router: axum::Router,
    addr: &str,
    conn: &ConnArgs,
    banner: impl FnOnce(SocketAddr) -> String,
) -> Result<()> {
    let limits = conn.limits()?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let local = listener.local_addr().context("reading the bound address")?;
    eprintln!("{}", banner(local));
    temper_server::http::serve(listener, router, limits, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
    .context("serving")
}
