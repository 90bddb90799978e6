//! The remote gate: `oncegate.v1.Gate` over gRPC, with a bearer token, TLS for `https://`
//! addresses, a deadline per call, and the retry policy for calls that are safe to repeat.

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use oncegate_core::gate::{CommitRequest, Gate, GateError, KeyRequest, Renewed, ReserveRequest, Reserved};
use oncegate_core::{Code, View};
use oncegate_proto::v1::gate_client::GateClient;
use oncegate_proto::v1::session_request::Call;
use oncegate_proto::v1::session_response::Result as Out;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::retry::RetryPolicy;
use crate::session::{self, Sessions};

/// What a remote call fails with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The server refused the call, or the call got no answer (`unavailable`).
    #[error("{0}")]
    Refused(Refusal),
    /// The client could not connect.
    #[error("cannot connect to {url}")]
    Connect {
        /// Where it tried.
        url: String,
        /// Why it failed: the transport's error, whose sources say more (a refused
        /// connection, a TLS error).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The client could not be set up (its address, its CA file, its token).
    #[error("client configuration: {0}")]
    Config(String),
    /// The server answered something this client does not understand (a newer server).
    #[error("unexpected answer: {0}")]
    Protocol(String),
}

/// A gRPC status code, as a number and its canonical name (`UNAVAILABLE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrpcCode(i32);

impl GrpcCode {
    /// The status code's number (14 for `UNAVAILABLE`).
    pub fn number(self) -> i32 {
        self.0
    }

    /// The status code's canonical name (`UNAVAILABLE`, `FAILED_PRECONDITION`).
    pub fn name(self) -> String {
        let camel = format!("{:?}", tonic::Code::from(self.0));
        let mut name = String::with_capacity(camel.len() + 4);
        for (i, c) in camel.chars().enumerate() {
            if c.is_ascii_uppercase() && i > 0 {
                name.push('_');
            }
            name.push(c.to_ascii_uppercase());
        }
        name
    }
}

impl From<tonic::Code> for GrpcCode {
    fn from(code: tonic::Code) -> GrpcCode {
        GrpcCode(code as i32)
    }
}

impl std::fmt::Display for GrpcCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// A refused call, with everything the server said about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The contract's code.
    pub code: Code,
    /// The gRPC status code it came with.
    pub grpc: GrpcCode,
    /// The server's message (or the transport's).
    pub message: String,
    /// The request field at fault, for `invalid_argument`.
    pub field: Option<String>,
    /// The configuration key of the limit reached, for `resource_exhausted`.
    pub limit: Option<String>,
    /// What the transport said below the message (a failed handshake says why only here).
    pub causes: Vec<String>,
}

impl Refusal {
    /// A call that got no answer (the stream ended, or the deadline passed).
    pub(crate) fn unanswered(message: String) -> ClientError {
        ClientError::Refused(Refusal {
            code: Code::Unavailable,
            grpc: GrpcCode::from(tonic::Code::Unavailable),
            message,
            field: None,
            limit: None,
            causes: Vec::new(),
        })
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.code.as_str())?;
        self.causes.iter().try_for_each(|cause| write!(f, ": {cause}"))
    }
}

impl GateError for ClientError {
    fn code(&self) -> Code {
        match self {
            ClientError::Refused(refusal) => refusal.code,
            ClientError::Connect { .. } | ClientError::Protocol(_) => Code::Unavailable,
            ClientError::Config(_) => Code::InvalidArgument,
        }
    }
}

impl Refusal {
    /// What a gRPC status says, its trailers and causes included: for the command line's
    /// calls of the Admin service, which this client does not wrap.
    #[doc(hidden)]
    pub fn of_status(status: tonic::Status) -> Refusal {
        let trailer =
            |name: &str| status.metadata().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        Refusal {
            code: oncegate_proto::status::code_of(&status),
            grpc: GrpcCode::from(status.code()),
            message: status.message().to_owned(),
            field: trailer(oncegate_proto::FIELD_METADATA),
            limit: trailer(oncegate_proto::LIMIT_METADATA),
            causes: causes(&status),
        }
    }
}

impl ClientError {
    /// A refused call, from its gRPC status.
    pub(crate) fn of_status(status: tonic::Status) -> ClientError {
        ClientError::Refused(Refusal::of_status(status))
    }
}

/// The chain of sources below an error, outermost first.
fn causes(error: &dyn std::error::Error) -> Vec<String> {
    std::iter::successors(error.source(), |e| e.source()).map(ToString::to_string).collect()
}

/// A bearer token, which `Debug` does not print.
#[derive(Clone)]
struct Redacted(String);

impl std::fmt::Debug for Redacted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// How to reach a server: [`Client::builder`].
#[derive(Clone, Debug)]
pub struct ClientBuilder {
    url: String,
    token: Option<Redacted>,
    tls_ca: Option<PathBuf>,
    tls_identity: Option<(PathBuf, PathBuf)>,
    tls_domain: Option<String>,
    timeout: Duration,
    connect_timeout: Duration,
    retry: RetryPolicy,
    transport: Transport,
    /// More servers of the same deployment, balanced with `url`.
    also: Vec<String>,
    /// Ping interval and the longest wait for its answer.
    keep_alive: Option<(Duration, Duration)>,
    /// Headers sent with every call.
    headers: Vec<(String, String)>,
}

/// The most servers one client balances across.
const ENDPOINTS_MAX: usize = 64;

impl ClientBuilder {
    /// The bearer token sent with every call (the tenant's).
    pub fn token(mut self, token: impl Into<String>) -> ClientBuilder {
        self.token = Some(Redacted(token.into()));
        self
    }

    /// A CA certificate (PEM) to trust beside the system's roots, for `https://`.
    pub fn tls_ca(mut self, path: impl Into<PathBuf>) -> ClientBuilder {
        self.tls_ca = Some(path.into());
        self
    }

    /// This client's certificate and private key (PEM), for a server that requires
    /// mutual TLS.
    pub fn tls_identity(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> ClientBuilder {
        self.tls_identity = Some((cert.into(), key.into()));
        self
    }

    /// The name the server's certificate must carry, when it is not the address's host.
    pub fn tls_domain(mut self, domain: impl Into<String>) -> ClientBuilder {
        self.tls_domain = Some(domain.into());
        self
    }

    /// The longest one call may take (a reserve's `wait_ms` is added to it); default 10 s.
    pub fn timeout(mut self, timeout: Duration) -> ClientBuilder {
        self.timeout = timeout;
        self
    }

    /// The longest connecting may take; default 5 s.
    pub fn connect_timeout(mut self, timeout: Duration) -> ClientBuilder {
        self.connect_timeout = timeout;
        self
    }

    /// How failed calls are retried (see [`RetryPolicy`]).
    pub fn retry(mut self, retry: RetryPolicy) -> ClientBuilder {
        self.retry = retry;
        self
    }

    /// How calls travel (default: over a `Session` stream where the server has it).
    pub fn transport(mut self, transport: Transport) -> ClientBuilder {
        self.transport = transport;
        self
    }

    /// Another server of the same deployment (a node on the same PostgreSQL database):
    /// calls are balanced across every address given, and one that fails is left out
    /// until it answers again. With several, connecting is lazy: an unreachable server
    /// shows as `unavailable` calls, not as a failed `connect`.
    pub fn also(mut self, url: impl Into<String>) -> ClientBuilder {
        self.also.push(url.into());
        self
    }

    /// HTTP/2 keep-alive: a ping every `interval`, even while no call is in flight, and
    /// the connection is given up when one goes unanswered for `timeout` (so a server
    /// that vanished behind a NAT is noticed before the next call waits on it).
    pub fn keep_alive(mut self, interval: Duration, timeout: Duration) -> ClientBuilder {
        self.keep_alive = Some((interval, timeout));
        self
    }

    /// A header sent with every call (a routing or tracing header of the caller's).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> ClientBuilder {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Connects (TLS when the address is `https://`), failing if the server cannot be
    /// reached now; with several addresses ([`ClientBuilder::also`]) it connects lazily.
    pub async fn connect(self) -> Result<Client, ClientError> {
        if !self.also.is_empty() {
            return self.connect_lazy();
        }
        let channel = self
            .endpoint(&self.url)?
            .connect()
            .await
            .map_err(|source| ClientError::Connect { url: self.url.clone(), source: Box::new(source) })?;
        self.on(channel)
    }

    /// A client that connects at its first call (and again after a connection drops);
    /// call from within a Tokio runtime.
    pub fn connect_lazy(self) -> Result<Client, ClientError> {
        let urls = || std::iter::once(&self.url).chain(&self.also);
        if urls().count() > ENDPOINTS_MAX {
            return Err(ClientError::Config(format!("more than {ENDPOINTS_MAX} server addresses")));
        }
        let endpoints = urls().map(|url| self.endpoint(url)).collect::<Result<Vec<_>, _>>()?;
        let channel = match endpoints.as_slice() {
            [one] => one.connect_lazy(),
            _ => Channel::balance_list(endpoints.into_iter()),
        };
        self.on(channel)
    }

    /// A client on a channel the application built itself (its own connector or tower
    /// layers); the builder's token, headers, deadline, retries and transport apply, its
    /// addresses and TLS settings do not.
    pub fn on_channel(self, channel: Channel) -> Result<Client, ClientError> {
        self.on(channel)
    }

    fn on(self, channel: Channel) -> Result<Client, ClientError> {
        let mut metadata = MetadataMap::new();
        if let Some(Redacted(token)) = &self.token {
            let mut value = MetadataValue::try_from(format!("Bearer {token}"))
                .map_err(|_| ClientError::Config("the token is not a valid header value".to_owned()))?;
            // Never printed, and never indexed by HPACK (RFC 7541, 7.1.3).
            value.set_sensitive(true);
            metadata.insert("authorization", value);
        }
        for (name, value) in &self.headers {
            let bad = |what: &str| ClientError::Config(format!("header {name:?}: not a valid {what}"));
            let key =
                tonic::metadata::AsciiMetadataKey::from_bytes(name.as_bytes()).map_err(|_| bad("name"))?;
            let value = MetadataValue::try_from(value.as_str()).map_err(|_| bad("value"))?;
            metadata.append(key, value);
        }
        Ok(Client {
            gate: GateClient::new(channel),
            metadata,
            timeout: self.timeout,
            retry: self.retry,
            transport: self.transport,
            shared: Arc::default(),
        })
    }

    fn endpoint(&self, url: &str) -> Result<Endpoint, ClientError> {
        let config = |e: &dyn std::fmt::Display| ClientError::Config(format!("{url}: {e}"));
        let mut endpoint = Endpoint::from_shared(url.to_owned()).map_err(|e| config(&e))?;
        endpoint = endpoint.connect_timeout(self.connect_timeout).tcp_nodelay(true);
        if let Some((interval, timeout)) = self.keep_alive {
            endpoint = endpoint
                .http2_keep_alive_interval(interval)
                .keep_alive_timeout(timeout)
                .keep_alive_while_idle(true);
        }
        let tls_asked = self.tls_ca.is_some() || self.tls_identity.is_some() || self.tls_domain.is_some();
        if !url.starts_with("https://") {
            if tls_asked {
                return Err(ClientError::Config(format!(
                    "TLS settings need an https:// address; {url} is plaintext"
                )));
            }
            return Ok(endpoint);
        }
        let read = |path: &PathBuf| {
            std::fs::read(path).map_err(|e| ClientError::Config(format!("{}: {e}", path.display())))
        };
        let mut tls = ClientTlsConfig::new().with_native_roots();
        if let Some(path) = &self.tls_ca {
            tls = tls.ca_certificate(Certificate::from_pem(read(path)?));
        }
        if let Some((cert, key)) = &self.tls_identity {
            tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
        }
        if let Some(domain) = &self.tls_domain {
            tls = tls.domain_name(domain.clone());
        }
        endpoint.tls_config(tls).map_err(|e| config(&e))
    }
}

/// How a client's calls travel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Transport {
    /// Multiplexed over one `Session` stream (the default); a reserve that may wait
    /// (`wait_ms > 0`) goes as a unary call, and a server without `Session` gets unary
    /// calls only.
    #[default]
    Session,
    /// One unary RPC per call.
    Unary,
}

/// A connection to an oncegate server; cheap to clone (clones share the connection and
/// the session stream).
#[derive(Clone, Debug)]
pub struct Client {
    gate: GateClient<Channel>,
    /// The token and the caller's headers, sent with every call.
    metadata: MetadataMap,
    timeout: Duration,
    retry: RetryPolicy,
    transport: Transport,
    shared: Arc<Shared>,
}

/// What clones of a client share.
#[derive(Debug, Default)]
struct Shared {
    sessions: Sessions,
    /// Set once the server answered that it has no `Session` call.
    unary_only: AtomicBool,
}

impl Client {
    /// A builder for `url` (`http://host:port` or `https://host:port`).
    pub fn builder(url: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            url: url.into(),
            token: None,
            tls_ca: None,
            tls_identity: None,
            tls_domain: None,
            timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            retry: RetryPolicy::default(),
            transport: Transport::default(),
            also: Vec::new(),
            keep_alive: None,
            headers: Vec::new(),
        }
    }

    /// Connects to `url` with the defaults and no token.
    pub async fn connect(url: impl Into<String>) -> Result<Client, ClientError> {
        Client::builder(url).connect().await
    }

    /// This client with another deadline per call (a reserve's wait is added to it), on
    /// the same connection and session stream. It bounds each call (and each of its
    /// retries), not a whole `once`: bound that with [`crate::OnceOptions::wait`] and
    /// [`crate::OnceOptions::commit_retry_for`], or a timeout around it.
    pub fn with_timeout(&self, timeout: Duration) -> Client {
        Client { timeout, ..self.clone() }
    }

    fn metadata(&self) -> MetadataMap {
        self.metadata.clone()
    }

    /// One call, on the session stream or as a unary RPC, within the client's deadline
    /// plus `extra` (a reserve's wait). A refusal comes back as the error.
    async fn call(&self, call: Call, extra: Duration) -> Result<Out, ClientError> {
        let deadline = self.timeout + extra;
        let late = || Refusal::unanswered(format!("no answer within {} ms", deadline.as_millis()));
        let mut call = call;
        // A reserve that may wait goes as a unary call: parked on the server it must not
        // hold up the stream's other calls (a holder's heartbeat or commit behind a
        // crowd of waiters would lose its lease).
        let parks = !extra.is_zero();
        if self.transport == Transport::Session && !parks && !self.shared.unary_only.load(Ordering::Relaxed) {
            let metadata = self.metadata();
            // Read before the stream may have to be opened: that counts against the time too.
            let ends_at = session::deadline_from_now(deadline);
            let sent = self.shared.sessions.call(&self.gate, &metadata, call, ends_at);
            match tokio::time::timeout(deadline, sent).await.map_err(|_| late())?? {
                Ok(Out::Refusal(refusal)) => return Err(session::refused(refusal)),
                Ok(out) => return Ok(out),
                Err(unsent) => {
                    self.shared.unary_only.store(true, Ordering::Relaxed);
                    call = unsent;
                }
            }
        }
        self.unary(call, deadline).await
    }

    async fn unary(&self, call: Call, deadline: Duration) -> Result<Out, ClientError> {
        let mut gate = self.gate.clone();
        let answered = match call {
            Call::Reserve(r) => {
                gate.reserve(self.request(r, deadline)).await.map(|a| Out::Reserve(a.into_inner()))
            }
            Call::Commit(r) => {
                gate.commit(self.request(r, deadline)).await.map(|a| Out::Commit(a.into_inner()))
            }
            Call::Release(r) => {
                gate.release(self.request(r, deadline)).await.map(|a| Out::Release(a.into_inner()))
            }
            Call::Heartbeat(r) => {
                gate.heartbeat(self.request(r, deadline)).await.map(|a| Out::Heartbeat(a.into_inner()))
            }
            Call::Get(r) => gate.get(self.request(r, deadline)).await.map(|a| Out::Get(a.into_inner())),
            // Only the session task makes cancels, and sends them on its stream.
            Call::Cancel(_) => return Err(ClientError::Protocol("a cancel is no unary call".into())),
        };
        answered.map_err(ClientError::of_status)
    }

    /// A unary request with the token and the deadline.
    fn request<T>(&self, message: T, deadline: Duration) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(deadline);
        *request.metadata_mut() = self.metadata();
        request
    }
}

/// A reply of another call than the one sent (a server bug, or a newer protocol).
fn mismatched(expected: &str) -> ClientError {
    ClientError::Protocol(format!("a {expected} was answered with another call's reply"))
}

/// An answer this client cannot read (a newer server's enum, a missing oneof).
fn protocol(invalid: oncegate_core::Invalid) -> ClientError {
    ClientError::Protocol(format!("the server's answer: {invalid}"))
}

impl Gate for Client {
    type Error = ClientError;

    fn reserve(&self, request: ReserveRequest) -> impl Future<Output = Result<Reserved, ClientError>> + Send {
        let wait = Duration::from_millis(request.wait_ms);
        self.retry.run(move || {
            let call = self.call(Call::Reserve(request.clone().into()), wait);
            async move {
                let Out::Reserve(reply) = call.await? else { return Err(mismatched("reserve")) };
                Reserved::try_from(reply).map_err(protocol)
            }
        })
    }

    fn commit(&self, request: CommitRequest) -> impl Future<Output = Result<u64, ClientError>> + Send {
        self.retry.run(move || {
            let call = self.call(Call::Commit(request.clone().into()), Duration::ZERO);
            async move {
                let Out::Commit(reply) = call.await? else { return Err(mismatched("commit")) };
                Ok(reply.expires_at_ms)
            }
        })
    }

    fn release(&self, request: KeyRequest) -> impl Future<Output = Result<(), ClientError>> + Send {
        self.retry.run(move || {
            let call = self.call(Call::Release(request.clone().into()), Duration::ZERO);
            async move {
                let Out::Release(_) = call.await? else { return Err(mismatched("release")) };
                Ok(())
            }
        })
    }

    fn heartbeat(&self, request: KeyRequest) -> impl Future<Output = Result<Renewed, ClientError>> + Send {
        self.retry.run(move || {
            let call = self.call(Call::Heartbeat(request.clone().into()), Duration::ZERO);
            async move {
                let Out::Heartbeat(reply) = call.await? else { return Err(mismatched("heartbeat")) };
                Ok(reply.into())
            }
        })
    }

    fn get(&self, request: KeyRequest) -> impl Future<Output = Result<View, ClientError>> + Send {
        self.retry.run(move || {
            let call = self.call(Call::Get(request.clone().into()), Duration::ZERO);
            async move {
                let Out::Get(reply) = call.await? else { return Err(mismatched("get")) };
                View::try_from(reply).map_err(protocol)
            }
        })
    }
}
