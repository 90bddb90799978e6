//! Certificates made at test time with rcgen: a CA, a server certificate for `localhost`
//! and `127.0.0.1`, and a client certificate, written as PEM files. The root package's
//! CLI tests include this file too.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
};

/// A certificate and its private key, as PEM files.
pub struct Pair {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A CA and what it signed.
pub struct Pki {
    /// The CA's certificate (PEM).
    pub ca: PathBuf,
    /// Valid for `localhost` and `127.0.0.1`, for serving.
    pub server: Pair,
    /// For a client's side of mutual TLS.
    pub client: Pair,
}

impl Pki {
    /// A new CA named `name`, its files in `dir` prefixed with `name`.
    pub fn new(dir: &Path, name: &str) -> Pki {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, format!("{name} test CA"));
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let ca_path = dir.join(format!("{name}-ca.crt"));
        std::fs::write(&ca_path, ca.pem()).unwrap();
        let issue = |file: &str, names: Vec<String>, usage: ExtendedKeyUsagePurpose| {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(names).unwrap();
            params.distinguished_name.push(DnType::CommonName, format!("{name} {file}"));
            params.extended_key_usages = vec![usage];
            let cert = params.signed_by(&key, &ca).unwrap();
            let pair = Pair {
                cert: dir.join(format!("{name}-{file}.crt")),
                key: dir.join(format!("{name}-{file}.key")),
            };
            std::fs::write(&pair.cert, cert.pem()).unwrap();
            std::fs::write(&pair.key, key.serialize_pem()).unwrap();
            pair
        };
        let server = issue(
            "server",
            vec!["localhost".to_owned(), "127.0.0.1".to_owned()],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let client = issue("client", vec!["client.test".to_owned()], ExtendedKeyUsagePurpose::ClientAuth);
        Pki { ca: ca_path, server, client }
    }
}
