//! The client against a server as a network deployment runs it: mutual TLS and a
//! tenant's bearer token.

#[path = "../../oncegate-server/tests/common/mod.rs"]
mod common;

use common::certs::Pki;
use oncegate_client::{Client, GateError, GateExt, OnceError, OnceOptions, Ran, WorkError};
use oncegate_core::Code;
use oncegate_server::{TenantConfig, token_sha256};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_speaks_mutual_tls_with_a_token_and_hears_refusals_by_code() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path(), "gate");
    let (cert, key, ca) = (pki.server.cert.clone(), pki.server.key.clone(), pki.ca.clone());
    let server = common::start_with(move |c| {
        c.server.tls_cert_path = Some(cert);
        c.server.tls_key_path = Some(key);
        c.server.tls_client_ca_path = Some(ca);
        c.tenants = vec![TenantConfig {
            name: "acme".into(),
            token_sha256: token_sha256("acme-secret"),
            ..TenantConfig::default()
        }];
    })
    .await;
    let url = format!("https://{}", server.addr);
    let builder = Client::builder(url).tls_ca(&pki.ca).tls_identity(&pki.client.cert, &pki.client.key);

    let with_token = builder.clone().token("acme-secret");
    let client = with_token.clone().connect().await.unwrap();
    // Neither the builder nor the client prints the token (both derive `Debug`, and a
    // service that logs its client would have logged `Bearer acme-secret`).
    for printed in [format!("{with_token:?}"), format!("{client:?}")] {
        assert!(!printed.contains("acme-secret"), "{printed}");
    }
    let ran = client
        .once("live", "k", OnceOptions::default(), |_| async { Ok::<_, WorkError<()>>(b"ok".to_vec()) });
    assert_eq!(ran.await.unwrap(), Ran::Now(b"ok".to_vec()));

    let anonymous = builder.connect().await.unwrap();
    let refused = anonymous
        .once("live", "k2", OnceOptions::default(), |_| async { Ok::<_, WorkError<()>>(Vec::new()) });
    match refused.await {
        Err(OnceError::Gate(error)) => assert_eq!(error.code(), Code::Unauthenticated, "{error}"),
        other => panic!("a call without the token is refused: {other:?}"),
    }
    drop((client, anonymous));
    server.stop().await;
}
