//! TLS on the gRPC port (rustls, through tonic): the server's certificate and key and,
//! for mutual TLS, the CA that must have signed every client's certificate, read from the
//! paths the configuration names. A problem names the setting and the file.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tonic::transport::{Certificate, Identity, ServerTlsConfig};

use crate::ServerConfig;

/// Why the TLS files could not be used.
#[derive(Debug, thiserror::Error)]
#[error("{field} ({}): {reason}", .path.display())]
pub struct TlsError {
    /// The setting that names the file.
    pub field: &'static str,
    /// The file.
    pub path: PathBuf,
    /// What is wrong with it.
    pub reason: String,
}

/// The server's TLS settings, or `None` when the gRPC port speaks plaintext. The
/// settings are tried here, key first and client CA second, so that a key that does not
/// match its certificate and a client CA that holds no usable certificate are each
/// reported under their own setting before anything starts.
pub(crate) fn server_tls(server: &ServerConfig) -> Result<Option<ServerTlsConfig>, TlsError> {
    let Some((cert_path, key_path)) = server.tls_files() else {
        return Ok(None);
    };
    let cert = read_pem("server.tls_cert_path", cert_path, &["CERTIFICATE"])?;
    let key = read_pem("server.tls_key_path", key_path, PRIVATE_KEY_KINDS)?;
    let timeout = Duration::from_millis(server.handshake_timeout_ms);
    let tls = ServerTlsConfig::new().identity(Identity::from_pem(cert, key)).timeout(timeout);
    try_build(&tls).map_err(|reason| TlsError {
        field: "server.tls_key_path",
        path: key_path.to_owned(),
        reason: format!("does not go with server.tls_cert_path ({}): {reason}", cert_path.display()),
    })?;
    let Some(ca_path) = server.tls_client_ca() else {
        return Ok(Some(tls));
    };
    let ca = read_pem("server.tls_client_ca_path", ca_path, &["CERTIFICATE"])?;
    let tls = tls.client_ca_root(Certificate::from_pem(ca));
    try_build(&tls).map_err(|reason| TlsError {
        field: "server.tls_client_ca_path",
        path: ca_path.to_owned(),
        reason,
    })?;
    Ok(Some(tls))
}

/// Builds tonic's TLS acceptor from `tls`, as `serve` will.
fn try_build(tls: &ServerTlsConfig) -> Result<(), String> {
    tonic::transport::Server::builder().tls_config(tls.clone()).map(drop).map_err(|e| error_chain(&e))
}

/// The PEM labels of an unencrypted private key: PKCS#8, PKCS#1 (RSA) and SEC1 (EC).
const PRIVATE_KEY_KINDS: &[&str] = &["PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY"];

/// Reads a PEM file and checks that it holds a block of one of the expected kinds, so
/// that swapped files, a certificate request or an encrypted key are reported by name
/// rather than as a failed handshake.
fn read_pem(field: &'static str, path: &Path, kinds: &[&str]) -> Result<Vec<u8>, TlsError> {
    let error = |reason: String| TlsError { field, path: path.to_owned(), reason };
    let pem = std::fs::read(path).map_err(|e| error(e.to_string()))?;
    let text = String::from_utf8_lossy(&pem);
    let labels: Vec<&str> = text
        .lines()
        .filter_map(|line| line.trim().strip_prefix("-----BEGIN ")?.strip_suffix("-----"))
        .collect();
    if labels.iter().any(|label| kinds.contains(label)) {
        return Ok(pem);
    }
    if labels.contains(&"ENCRYPTED PRIVATE KEY") {
        return Err(error(
            "holds an encrypted key; oncegate reads unencrypted keys (keep the file mode 0600)".into(),
        ));
    }
    Err(error(format!("holds no PEM block of kind {} (found {labels:?})", kinds.join(" or "))))
}

/// The whole chain of a transport error: tonic's own message is often just
/// "transport error", and the cause (a key that does not match, an unsupported
/// algorithm) is further down.
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let causes = std::iter::successors(error.source(), |e| e.source()).map(ToString::to_string);
    std::iter::once(error.to_string()).chain(causes).collect::<Vec<_>>().join(": ")
}
