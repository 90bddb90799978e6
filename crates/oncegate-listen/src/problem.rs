//! Errors as `application/problem+json` (RFC 9457), each with oncegate's stable code: the
//! one document the HTTP API and the Idempotency-Key proxy answer with.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// One problem document.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Problem {
    /// `https://oncegate.dev/problems/{code}`.
    #[serde(rename = "type")]
    pub kind: String,
    /// A short, stable summary.
    pub title: &'static str,
    /// The HTTP status.
    #[serde(serialize_with = "status_code")]
    #[cfg_attr(feature = "openapi", schema(value_type = u16))]
    pub status: StatusCode,
    /// What happened to this request, naming the field, the value and the limit.
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub detail: Box<str>,
    /// The stable code: `invalid_argument`, `in_progress`, `lease_lost`, `unavailable`, ...
    pub code: &'static str,
    /// The request field at fault, for `invalid_argument`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<&'static str>,
    /// The limit reached, for `resource_exhausted`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<&'static str>,
    /// Seconds to wait before retrying (`Retry-After`).
    #[serde(skip)]
    pub retry_after_s: Option<u32>,
}

fn status_code<S: serde::Serializer>(status: &StatusCode, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_u16(status.as_u16())
}

/// Whole seconds to wait before retrying after `ms` (at least 1, at most `u32::MAX`).
pub fn retry_after_s(ms: u64) -> u32 {
    u32::try_from(ms.div_ceil(1_000).max(1)).unwrap_or(u32::MAX)
}

impl Problem {
    /// A problem without a field, a limit or `Retry-After`.
    pub fn new(status: StatusCode, title: &'static str, code: &'static str, detail: String) -> Problem {
        Problem {
            kind: format!("https://oncegate.dev/problems/{code}"),
            title,
            status,
            detail: detail.into_boxed_str(),
            code,
            field: None,
            limit: None,
            retry_after_s: None,
        }
    }
}

impl IntoResponse for Problem {
    /// The document with its content type, `Retry-After` when it has one, and
    /// `WWW-Authenticate: Bearer` for `unauthenticated`.
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self).unwrap_or_default();
        let mut response = (self.status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if self.code == "unauthenticated" {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(seconds) = self.retry_after_s {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The document carries RFC 9457's members and the stable code; the optional ones
    /// appear only when set.
    #[test]
    fn a_problem_serializes_as_rfc_9457() {
        let mut problem = Problem::new(StatusCode::CONFLICT, "In progress", "in_progress", "busy".into());
        let json = serde_json::to_value(&problem).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"type": "https://oncegate.dev/problems/in_progress", "title": "In progress",
                "status": 409, "detail": "busy", "code": "in_progress"})
        );
        problem.field = Some("key");
        assert_eq!(serde_json::to_value(&problem).unwrap()["field"], "key");
    }
}
