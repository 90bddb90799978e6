//! What a listener's connections may hold, shared by the gRPC port (`oncegate-server`),
//! its metrics listener and the Idempotency-Key proxy (`oncegate-proxy`): a connection's
//! deadlines (its first request head, then an idle timeout) read from what the service
//! has open on it ([`activity`]), the plain HTTP listener ([`serve`]) with its
//! connection limit, and the problem document every HTTP error is ([`problem`]).

pub mod activity;
pub mod problem;
pub mod serve;

pub use problem::Problem;

use std::io;
use std::time::Duration;

/// After an accept error that is not about one connection (out of file descriptors,
/// out of memory), a listener pauses this long instead of spinning on the same error.
pub const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// Errors of `accept` that concern only the connection being accepted.
pub fn per_connection(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset | io::ErrorKind::Interrupted
    )
}
