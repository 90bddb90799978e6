//! What a networked deployment relies on, through the real server: TLS and mutual TLS
//! with good, missing and wrong certificates (made at test time), the metrics listener
//! apart from the gRPC port, the connection limit, the exposure rules that the library
//! `serve` applies to the address it is really given, and owner-only data files.

mod common;

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::certs::{Pair, Pki};
use common::{Running, config_in, granted, http_get, reserve, start_in, start_with};
use oncegate_engine::Engine;
use oncegate_proto::v1::gate_client::GateClient;
use oncegate_server::{Config, Listeners, ServeError, TenantConfig, token_sha256};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

/// How a test client dials.
struct Dial<'a> {
    /// The CA the client trusts.
    ca: &'a Path,
    /// The certificate the client presents, if any.
    identity: Option<&'a Pair>,
}

async fn dial_tls(addr: SocketAddr, dial: Dial<'_>) -> Result<GateClient<Channel>, tonic::transport::Error> {
    let mut tls =
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(std::fs::read(dial.ca).unwrap()));
    if let Some(pair) = dial.identity {
        tls = tls.identity(Identity::from_pem(
            std::fs::read(&pair.cert).unwrap(),
            std::fs::read(&pair.key).unwrap(),
        ));
    }
    let channel = Channel::from_shared(format!("https://{addr}")).unwrap().tls_config(tls)?.connect().await?;
    Ok(GateClient::new(channel))
}

/// Whether a reserve over this dial is served; a failed handshake may show at connect
/// or at the first call, depending on when the server rejects it.
async fn served(addr: SocketAddr, dial: Dial<'_>) -> bool {
    match dial_tls(addr, dial).await {
        Ok(mut client) => client.reserve(reserve("tls")).await.is_ok(),
        Err(_) => false,
    }
}

async fn tls_server(pki: &Pki, client_ca: Option<&Path>) -> Running {
    let (cert, key) = (pki.server.cert.clone(), pki.server.key.clone());
    let client_ca = client_ca.map(Path::to_owned);
    start_with(move |c| {
        c.server.tls_cert_path = Some(cert);
        c.server.tls_key_path = Some(key);
        c.server.tls_client_ca_path = client_ca;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_serves_clients_that_trust_its_certificate_and_only_them() {
    let dir = tempfile::tempdir().unwrap();
    let (pki, stranger) = (Pki::new(dir.path(), "ours"), Pki::new(dir.path(), "stranger"));
    let server = tls_server(&pki, None).await;

    let mut client = dial_tls(server.addr, Dial { ca: &pki.ca, identity: None }).await.unwrap();
    granted(&client.reserve(reserve("over-tls")).await.unwrap().into_inner());
    assert!(
        !served(server.addr, Dial { ca: &stranger.ca, identity: None }).await,
        "a client that does not trust the server's CA must not get through"
    );
    // A plaintext client speaks HTTP/2 to a TLS port: it gets no answer, and the server
    // goes on serving.
    let plaintext = Channel::from_shared(format!("http://{}", server.addr)).unwrap().connect().await;
    if let Ok(channel) = plaintext {
        GateClient::new(channel).reserve(reserve("plaintext")).await.unwrap_err();
    }
    granted(&client.reserve(reserve("still-serving")).await.unwrap().into_inner());
    drop(client);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_serves_only_clients_with_a_certificate_from_its_ca() {
    let dir = tempfile::tempdir().unwrap();
    let (pki, stranger) = (Pki::new(dir.path(), "ours"), Pki::new(dir.path(), "stranger"));
    let server = tls_server(&pki, Some(&pki.ca)).await;

    assert!(served(server.addr, Dial { ca: &pki.ca, identity: Some(&pki.client) }).await);
    assert!(!served(server.addr, Dial { ca: &pki.ca, identity: None }).await, "no client certificate");
    assert!(
        !served(server.addr, Dial { ca: &pki.ca, identity: Some(&stranger.client) }).await,
        "a client certificate from another CA"
    );
    assert!(served(server.addr, Dial { ca: &pki.ca, identity: Some(&pki.client) }).await, "still serving");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_files_that_cannot_be_used_are_refused_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path(), "ours");
    let cases = [
        (dir.path().join("missing.crt"), pki.server.key.clone(), "server.tls_cert_path"),
        // A key where the certificate belongs.
        (pki.server.key.clone(), pki.server.key.clone(), "server.tls_cert_path"),
        (pki.server.cert.clone(), pki.server.cert.clone(), "server.tls_key_path"),
    ];
    // A key that is well-formed but belongs to another certificate.
    let stranger = Pki::new(dir.path(), "stranger");
    let mut cases = cases.to_vec();
    cases.push((pki.server.cert.clone(), stranger.server.key.clone(), "server.tls_key_path"));
    for (cert, key, field) in cases {
        let mut config = config_in(&dir.path().join("data"));
        config.server.tls_cert_path = Some(cert);
        config.server.tls_key_path = Some(key);
        let error = serve_once(config, "127.0.0.1:0").await.unwrap_err();
        assert!(matches!(&error, ServeError::Tls(e) if e.field == field), "{field}: {error}");
    }
    // A client CA file that holds no certificate.
    let mut config = config_in(&dir.path().join("data"));
    config.server.tls_cert_path = Some(pki.server.cert.clone());
    config.server.tls_key_path = Some(pki.server.key.clone());
    config.server.tls_client_ca_path = Some(pki.client.key.clone());
    let error = serve_once(config, "127.0.0.1:0").await.unwrap_err();
    assert!(matches!(&error, ServeError::Tls(e) if e.field == "server.tls_client_ca_path"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_served_on_their_own_listener_never_on_the_grpc_port() {
    let server = start_with(|_| {}).await;
    let mut client = server.client().await;
    client.reserve(reserve("seen")).await.unwrap();
    let (gate, metrics) = (server.addr, server.metrics_addr);
    for path in ["/metrics", "/healthz", "/readyz"] {
        let (status, body) = tokio::task::spawn_blocking(move || http_get(gate, path)).await.unwrap();
        // The gRPC port knows no such path: a `404` problem document, never metrics.
        assert_eq!(status, 404, "{path} on the gRPC port answered {status}: {body}");
        assert!(!body.contains("oncegate_requests_total") && body.contains("no route"), "{body}");
        let (status, _) = tokio::task::spawn_blocking(move || http_get(metrics, path)).await.unwrap();
        assert_eq!(status, 200, "{path} on the metrics listener");
    }
    let (_, body) = tokio::task::spawn_blocking(move || http_get(metrics, "/metrics")).await.unwrap();
    assert!(body.contains("oncegate_requests_total"), "{body}");
    drop(client);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_limit_are_closed_and_the_slot_comes_back() {
    let server = start_with(|c| {
        c.server.connections_max = 1;
        c.server.connections_per_peer_max = 1;
    })
    .await;
    let mut first = server.client().await;
    granted(&first.reserve(reserve("first")).await.unwrap().into_inner());
    let second = Channel::from_shared(format!("http://{}", server.addr)).unwrap().connect().await;
    if let Ok(channel) = second {
        GateClient::new(channel).reserve(reserve("second")).await.unwrap_err();
    }
    // The first connection still serves.
    granted(&first.reserve(reserve("first-again")).await.unwrap().into_inner());
    drop(first);
    // Once the server has seen the first connection close, its slot serves another;
    // the close travels asynchronously, so a few attempts may still meet a full server.
    let mut attempts = 0;
    let mut third = loop {
        attempts += 1;
        assert!(attempts < 10_000, "the slot never came back");
        let Ok(channel) = Channel::from_shared(format!("http://{}", server.addr)).unwrap().connect().await
        else {
            continue;
        };
        let mut client = GateClient::new(channel);
        if client.reserve(reserve("third")).await.is_ok() {
            break client;
        }
    };
    third
        .get(oncegate_proto::v1::GetRequest { namespace: "live".into(), key: "third".into() })
        .await
        .unwrap();
    drop(third);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_cannot_take_every_connection() {
    let server = start_with(|c| c.server.connections_per_peer_max = 2).await;
    let mut first = server.client().await;
    let mut second = server.client().await;
    granted(&first.reserve(reserve("first")).await.unwrap().into_inner());
    granted(&second.reserve(reserve("second")).await.unwrap().into_inner());
    let third = Channel::from_shared(format!("http://{}", server.addr)).unwrap().connect().await;
    if let Ok(channel) = third {
        GateClient::new(channel).reserve(reserve("third")).await.unwrap_err();
    }
    drop((first, second));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_is_closed_at_the_handshake_deadline() {
    use std::io::Read;
    let server = start_with(|c| c.server.handshake_timeout_ms = 100).await;
    let addr = server.addr;
    let closed = tokio::task::spawn_blocking(move || {
        let mut silent = std::net::TcpStream::connect(addr).unwrap();
        // A safety net for a broken server, not a measurement: the server closes the
        // socket after 100 ms.
        silent.set_read_timeout(Some(std::time::Duration::from_secs(60))).unwrap();
        silent.read(&mut [0u8; 16])
    });
    assert_eq!(closed.await.unwrap().unwrap(), 0, "the server closed the silent socket");
    let mut client = server.client().await;
    granted(&client.reserve(reserve("after")).await.unwrap().into_inner());
    drop(client);
    server.stop().await;
}

/// Runs the library `serve` on a listener bound to `bind`, stopping at once if it starts.
async fn serve_once(config: Config, bind: &str) -> Result<(), ServeError> {
    let engine = Engine::open(config.engine.clone()).unwrap();
    let gate = tokio::net::TcpListener::bind(bind).await.unwrap();
    let listeners = Listeners { gate, metrics: None };
    let served = oncegate_server::serve(engine.clone(), &config, listeners, async {}).await;
    tokio::task::spawn_blocking(move || engine.shutdown()).await.unwrap();
    served
}

fn problems(error: &ServeError) -> Vec<String> {
    match error {
        ServeError::Config(problems) => problems.iter().map(|p| p.field.clone()).collect(),
        other => panic!("expected a configuration refusal, got {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_serve_refuses_an_open_listener_that_the_binary_would_refuse() {
    let dir = tempfile::tempdir().unwrap();
    let tenant =
        || TenantConfig { name: "acme".into(), token_sha256: token_sha256("s"), ..TenantConfig::default() };

    // No tenants: only loopback, whatever `server.listen` says.
    let open = config_in(dir.path());
    assert!(open.check().is_ok(), "server.listen is loopback");
    let error = serve_once(open.clone(), "0.0.0.0:0").await.unwrap_err();
    assert_eq!(problems(&error), ["server.listen"], "{error}");

    // Tenants off loopback: TLS, or plaintext allowed in so many words.
    let mut tenants = open.clone();
    tenants.tenants = vec![tenant()];
    let error = serve_once(tenants.clone(), "0.0.0.0:0").await.unwrap_err();
    assert_eq!(problems(&error), ["server.tls_cert_path"], "{error}");
    tenants.server.plaintext_allowed = true;
    serve_once(tenants.clone(), "0.0.0.0:0").await.expect("plaintext allowed explicitly");

    // The admin token must be its own.
    let mut shared = tenants.clone();
    shared.admin.token_sha256 = token_sha256("s");
    let error = serve_once(shared, "127.0.0.1:0").await.unwrap_err();
    assert_eq!(problems(&error), ["admin.token_sha256"], "{error}");
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// The names under `dir`, each checked owner-only on the way: directories 0700, files
/// 0600.
fn owner_only_names(dir: &Path) -> Vec<String> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            assert_eq!(mode(&path), 0o700, "{}", path.display());
            names.extend(owner_only_names(&path).into_iter().map(|inner| format!("{name}/{inner}")));
        } else {
            assert_eq!(mode(&path), 0o600, "{}", path.display());
        }
        names.push(name);
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_data_directory_and_every_file_in_it_are_owner_only() {
    let expected = ["shard-0000.sqlite", "shard-0000.sqlite-wal", "shard-0000.epoch"];
    let parent = tempfile::tempdir().unwrap();
    let data = parent.path().join("created-by-oncegate").join("data");
    let server = start_in(config_in(&data), None).await;
    let mut client = server.client().await;
    granted(&client.reserve(reserve("mode")).await.unwrap().into_inner());
    assert_eq!(mode(&data), 0o700, "{}", data.display());
    assert_eq!(mode(data.parent().unwrap()), 0o700, "a parent oncegate created");
    let names = owner_only_names(&data);
    for name in expected {
        assert!(names.iter().any(|f| f == name), "{name} in {names:?}");
    }
    // The WAL index is in the process's memory (SQLite's unix-excl VFS): no mapped file
    // that a full disk could answer with SIGBUS.
    assert!(!names.iter().any(|f| f.ends_with("-shm")), "{names:?}");
    drop(client);
    server.stop().await;
}
