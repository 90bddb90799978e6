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

/// The server's TLS settings, or `None` when the gRPC port speaks plaintext.
pub(crate) fn server_tls(server: &ServerConfig) -> Result<Option<ServerTlsConfig>, TlsError> {
    let (Some(cert), Some(key)) = (&server.tls_cert_path, &server.tls_key_path) else {
        return Ok(None);
    };
    let cert = read_pem("server.tls_cert_path", cert, "CERTIFICATE")?;
    let key = read_pem("server.tls_key_path", key, "PRIVATE KEY")?;
    let mut tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(cert, key))
        .timeout(Duration::from_millis(server.tls_handshake_timeout_ms));
    if let Some(ca) = &server.tls_client_ca_path {
        tls = tls.client_ca_root(Certificate::from_pem(read_pem(
            "server.tls_client_ca_path",
            ca,
            "CERTIFICATE",
        )?));
    }
    Ok(Some(tls))
}

/// Reads a PEM file and checks that it holds a block of the expected kind, so that a
/// swapped certificate and key are reported by name rather than as a handshake failure.
fn read_pem(field: &'static str, path: &Path, kind: &str) -> Result<Vec<u8>, TlsError> {
    let error = |reason: String| TlsError { field, path: path.to_owned(), reason };
    let pem = std::fs::read(path).map_err(|e| error(e.to_string()))?;
    let text = String::from_utf8_lossy(&pem);
    let holds_kind = text.lines().any(|line| line.starts_with("-----BEGIN ") && line.contains(kind));
    if !holds_kind {
        return Err(error(format!("holds no PEM block of kind {kind}")));
    }
    Ok(pem)
}

/// The whole chain of a transport error: tonic's own message is often just
/// "transport error", and the cause (a key that does not match, an unsupported
/// algorithm) is further down.
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
