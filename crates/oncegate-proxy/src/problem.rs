//! Errors as `application/problem+json` (RFC 9457), each with oncegate's stable code: the
//! same document the server's HTTP API answers with.

pub use oncegate_listen::Problem;
