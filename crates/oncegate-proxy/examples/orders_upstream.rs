//! A stand-in for the service behind `oncegate proxy` in the README's walk-through: every
//! POST places an order (`201`, `{"order":"A-<n>"}`) and says so on stderr, so that one
//! can watch the proxy run it once however often the client retries.
//!
//! `cargo run -p oncegate-proxy --example orders_upstream` listens on 127.0.0.1:9000 (or the first argument).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::http::{StatusCode, header};

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::io::Result<()> {
    let addr = std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:9000".to_owned());
    let placed = Arc::new(AtomicU64::new(0));
    let place = move |uri: axum::http::Uri| async move {
        let n = placed.fetch_add(1, Ordering::SeqCst) + 1;
        eprintln!("upstream: placed order A-{n} for POST {uri}");
        (
            StatusCode::CREATED,
            [(header::CONTENT_TYPE, "application/json")],
            format!("{{\"order\":\"A-{n}\"}}"),
        )
    };
    let router = axum::Router::new().fallback(axum::routing::post(place));
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    eprintln!("upstream: listening on {addr}");
    axum::serve(listener, router).await
}
