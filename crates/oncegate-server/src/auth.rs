//! Bearer-token authentication: the token selects the tenant, fail-closed.

use oncegate_core::Tenant;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tonic::Status;
use tonic::metadata::MetadataMap;

use crate::status::Refusal;
use crate::{TenantEntry, TokenSha256};

/// The SHA-256 of a token: what the configuration stores (printed as hex).
pub fn token_sha256(token: &str) -> TokenSha256 {
    TokenSha256::Hash(Sha256::digest(token.as_bytes()).into())
}

/// Maps a request's credentials to its tenant.
#[derive(Clone, Debug)]
pub struct Auth {
    /// `(tenant, sha256(token))`; empty means the open `default` tenant.
    tenants: Vec<(Tenant, [u8; 32])>,
}

impl Auth {
    /// Builds the table from the validated tenants (`Config::tenant_entries`).
    pub fn new(tenants: &[TenantEntry]) -> Auth {
        Auth { tenants: tenants.iter().map(|t| (t.tenant.clone(), t.token_sha256)).collect() }
    }

    /// Whether any tenant is configured (otherwise every call is the `default` tenant).
    pub fn is_open(&self) -> bool {
        self.tenants.is_empty()
    }

    /// The tenant whose token a gRPC call carries in `authorization: Bearer <token>`.
    pub fn tenant(&self, metadata: &MetadataMap) -> Result<Tenant, Refusal> {
        self.tenant_of(Authorization::of(metadata.get("authorization").map(|v| v.to_str())))
    }

    /// The tenant whose token an HTTP request carries in `Authorization: Bearer <token>`.
    pub fn tenant_of_headers(&self, headers: &axum::http::HeaderMap) -> Result<Tenant, Refusal> {
        self.tenant_of(Authorization::of(headers.get(axum::http::header::AUTHORIZATION).map(|v| v.to_str())))
    }

    fn tenant_of(&self, authorization: Authorization<'_>) -> Result<Tenant, Refusal> {
        if self.tenants.is_empty() {
            return Ok(Tenant::default_tenant());
        }
        let token = bearer(authorization).map_err(Refusal::Unauthenticated)?;
        let presented: [u8; 32] = Sha256::digest(token.trim().as_bytes()).into();
        // Compare against every tenant without stopping early, so timing does not reveal
        // which tenant (if any) came close.
        let mut found = None;
        for (tenant, hash) in &self.tenants {
            if bool::from(hash.ct_eq(&presented)) {
                found = Some(tenant);
            }
        }
        found.cloned().ok_or(Refusal::Unauthenticated("unknown bearer token"))
    }
}

/// The `authorization` a call carries, as gRPC metadata or an HTTP header.
enum Authorization<'a> {
    Missing,
    NotAscii,
    Value(&'a str),
}

impl<'a> Authorization<'a> {
    fn of<E>(value: Option<Result<&'a str, E>>) -> Authorization<'a> {
        match value {
            None => Authorization::Missing,
            Some(Err(_)) => Authorization::NotAscii,
            Some(Ok(value)) => Authorization::Value(value),
        }
    }
}

/// The token of `authorization: Bearer <token>`, or why there is none.
fn bearer(authorization: Authorization<'_>) -> Result<&str, &'static str> {
    let value = match authorization {
        Authorization::Missing => return Err("missing authorization; send `authorization: Bearer <token>`"),
        Authorization::NotAscii => return Err("authorization is not ascii"),
        Authorization::Value(value) => value,
    };
    value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .ok_or("authorization must be `Bearer <token>`")
}

fn unauthenticated(message: &'static str) -> Status {
    Refusal::Unauthenticated(message).to_status()
}

/// The admin service's credentials: one token hash, or open when the server runs without
/// tenants (loopback only), or closed.
#[derive(Clone, Debug)]
pub enum AdminAuth {
    /// Calls must carry the admin token.
    Token([u8; 32]),
    /// No tenants and no admin token: a local development server.
    Open,
    /// Tenants but no admin token: every admin call is refused.
    Closed,
}

impl AdminAuth {
    /// Builds it from a configuration that passed `Config::check` (which refuses a
    /// malformed hash; were one to get here, the service would stay closed).
    pub fn new(config: &crate::Config) -> AdminAuth {
        match &config.admin.token_sha256 {
            TokenSha256::Hash(hash) => AdminAuth::Token(*hash),
            TokenSha256::Unset if config.tenants.is_empty() => AdminAuth::Open,
            TokenSha256::Unset | TokenSha256::Malformed(_) => AdminAuth::Closed,
        }
    }

    /// Checks a call's credentials.
    pub fn check(&self, metadata: &MetadataMap) -> Result<(), Status> {
        self.check_authorization(Authorization::of(metadata.get("authorization").map(|v| v.to_str())))
    }

    /// Checks the credentials of a call's head, before its message is read.
    pub(crate) fn check_headers(&self, headers: &axum::http::HeaderMap) -> Result<(), Status> {
        self.check_authorization(Authorization::of(
            headers.get(axum::http::header::AUTHORIZATION).map(|v| v.to_str()),
        ))
    }

    fn check_authorization(&self, value: Authorization<'_>) -> Result<(), Status> {
        match self {
            AdminAuth::Open => Ok(()),
            AdminAuth::Closed => Err(unauthenticated(
                "the admin service is disabled: set admin.token_sha256 in the configuration",
            )),
            AdminAuth::Token(hash) => {
                let token = bearer(value).map_err(unauthenticated)?;
                let presented: [u8; 32] = Sha256::digest(token.trim().as_bytes()).into();
                if bool::from(hash.ct_eq(&presented)) {
                    Ok(())
                } else {
                    Err(unauthenticated("wrong admin token"))
                }
            }
        }
    }
}
