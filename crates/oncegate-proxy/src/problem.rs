//! Errors as `application/problem+json` (RFC 9457), each with oncegate's stable code.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// One problem document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The HTTP status.
    pub status: StatusCode,
    /// A short, stable summary.
    pub title: &'static str,
    /// The stable code (`in_progress`, `mismatch`, `invalid_argument`, ...).
    pub code: &'static str,
    /// What happened to this request.
    pub detail: String,
    /// Seconds to wait before retrying (`Retry-After`), for `409` and `503`.
    pub retry_after_s: Option<u64>,
}

impl Problem {
    /// A problem without `Retry-After`.
    pub fn new(status: StatusCode, title: &'static str, code: &'static str, detail: String) -> Problem {
        Problem { status, title, code, detail, retry_after_s: None }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "type": format!("https://oncegate.dev/problems/{}", self.code),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
            "code": self.code,
        });
        let mut response = (self.status, body.to_string()).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if let Some(seconds) = self.retry_after_s {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}
