//! The connection loop every temper server runs: `axum::serve` plus the
//! bounds it lacks — a cap on open connections, a deadline for a request's
//! headers (also the idle limit of a kept-alive connection) and one for its
//! body — so idle or half-sent connections cannot pile up before auth.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower_http::timeout::RequestBodyTimeoutLayer;

/// Connection bounds (each server's `--max-connections`, `--header-timeout-s`,
/// `--body-timeout-s`).
#[derive(Clone, Debug)]
pub struct ConnLimits {
    /// Most connections open at once; further clients wait in the kernel's
    /// accept backlog until one closes.
    pub max_connections: usize,
    /// A request's headers must arrive within this (from the connection's
    /// start, or from the end of the previous response on a kept-alive
    /// connection), else the connection is closed.
    pub header_timeout: Duration,
    /// A request's body must arrive within this, else 408.
    pub body_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(300),
        }
    }
}

/// Serve `router` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let router = router.layer(RequestBodyTimeoutLayer::new(limits.body_timeout));
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            () = &mut shutdown => return Ok(()),
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return Ok(()),
            },
        };
        let (stream, _) = tokio::select! {
            () = &mut shutdown => return Ok(()),
            a = listener.accept() => match a {
                Ok(a) => a,
                // Out of file descriptors and the like: wait, then go on.
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let service = TowerToHyperService::new(router.clone());
        let header_timeout = limits.header_timeout;
        tokio::spawn(async move {
            // HTTP/1 only: the auto (h1/h2) builder waits for a client's
            // first bytes with no deadline at all.
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades();
            if let Err(e) = conn.await {
                tracing::debug!("connection ended: {e}");
            }
            drop(permit);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn start(limits: ConnLimits) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::new().route("/health", get(|| async { "ok" }));
        tokio::spawn(serve(listener, router, limits, std::future::pending()));
        addr
    }

    async fn get_health(addr: std::net::SocketAddr) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    /// Whether the server closed `s` (read returns 0 or an error) within `wait`.
    async fn closed_within(s: &mut tokio::net::TcpStream, wait: Duration) -> bool {
        let mut buf = [0u8; 256];
        loop {
            match tokio::time::timeout(wait, s.read(&mut buf)).await {
                Err(_) => return false,
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => continue, // e.g. a 408 before the close
            }
        }
    }

    #[tokio::test]
    async fn idle_and_half_sent_connections_are_closed_after_the_header_timeout() {
        let addr = start(ConnLimits {
            header_timeout: Duration::from_millis(300),
            ..Default::default()
        })
        .await;
        let mut idle = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut half = tokio::net::TcpStream::connect(addr).await.unwrap();
        half.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n")
            .await
            .unwrap();
        assert!(closed_within(&mut idle, Duration::from_secs(5)).await);
        assert!(closed_within(&mut half, Duration::from_secs(5)).await);
        assert!(get_health(addr).await.ends_with("ok"));
    }

    #[tokio::test]
    async fn connections_beyond_the_cap_wait_and_idle_ones_cannot_starve_health() {
        let addr = start(ConnLimits {
            max_connections: 4,
            header_timeout: Duration::from_millis(500),
            ..Default::default()
        })
        .await;
        let mut idle = Vec::new();
        for _ in 0..16 {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        // Every idle socket is closed by the header timeout in turn, so a
        // real request still gets through.
        let reply = tokio::time::timeout(Duration::from_secs(20), get_health(addr))
            .await
            .expect("health answered despite 16 idle connections");
        assert!(reply.ends_with("ok"), "{reply}");
    }
}
