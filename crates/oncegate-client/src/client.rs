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
use tonic::metadata::{Ascii, MetadataMap, MetadataValue};
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
    #[error("cannot connect to {url}: {reason}")]
    Connect {
        /// Where it tried.
        url: String,
        /// Why it failed, with its causes.
        reason: String,
    },
    /// The client could not be set up (its address, its CA file, its token).
    #[error("client configuration: {0}")]
    Config(String),
    /// The server answered something this client does not understand (a newer server).
    #[error("unexpected answer: {0}")]
    Protocol(String),
}

/// A refused call, with everything the server said about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The contract's code.
    pub code: Code,
    /// The gRPC status code it came with.
    pub grpc: tonic::Code,
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
            grpc: tonic::Code::Unavailable,
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

impl From<tonic::Status> for Refusal {
    fn from(status: tonic::Status) -> Refusal {
        let trailer =
            |name: &str| status.metadata().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        Refusal {
            code: oncegate_proto::status::code_of(&status),
            grpc: status.code(),
            message: status.message().to_owned(),
            field: trailer(oncegate_proto::FIELD_METADATA),
            limit: trailer(oncegate_proto::LIMIT_METADATA),
            causes: causes(&status),
        }
    }
}

impl From<tonic::Status> for ClientError {
    fn from(status: tonic::Status) -> ClientError {
        ClientError::Refused(status.into())
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
}

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

    /// Connects (TLS when the address is `https://`).
    pub async fn connect(self) -> Result<Client, ClientError> {
        let token = match &self.token {
            Some(Redacted(token)) => {
                let mut value = MetadataValue::try_from(format!("Bearer {token}"))
                    .map_err(|_| ClientError::Config("the token is not a valid header value".to_owned()))?;
                // Never printed, and never indexed by HPACK (RFC 7541, 7.1.3).
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        let channel = self.endpoint()?.connect().await.map_err(|e| {
            let reason = std::iter::once(e.to_string()).chain(causes(&e)).collect::<Vec<_>>().join(": ");
            ClientError::Connect { url: self.url.clone(), reason }
        })?;
        Ok(Client {
            gate: GateClient::new(channel),
            token,
            timeout: self.timeout,
            retry: self.retry,
            transport: self.transport,
            shared: Arc::default(),
        })
    }

    fn endpoint(&self) -> Result<Endpoint, ClientError> {
        let config = |e: &dyn std::fmt::Display| ClientError::Config(format!("{}: {e}", self.url));
        let mut endpoint = Endpoint::from_shared(self.url.clone()).map_err(|e| config(&e))?;
        endpoint = endpoint.connect_timeout(self.connect_timeout).tcp_nodelay(true);
        let tls_asked = self.tls_ca.is_some() || self.tls_identity.is_some() || self.tls_domain.is_some();
        if !self.url.starts_with("https://") {
            if tls_asked {
                let url = &self.url;
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
    token: Option<MetadataValue<Ascii>>,
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
        }
    }

    /// Connects to `url` with the defaults and no token.
    pub async fn connect(url: impl Into<String>) -> Result<Client, ClientError> {
        Client::builder(url).connect().await
    }

    fn metadata(&self) -> MetadataMap {
        let mut metadata = MetadataMap::new();
        if let Some(token) = &self.token {
            metadata.insert("authorization", token.clone());
        }
        metadata
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
        Ok(match call {
            Call::Reserve(r) => Out::Reserve(gate.reserve(self.request(r, deadline)).await?.into_inner()),
            Call::Commit(r) => Out::Commit(gate.commit(self.request(r, deadline)).await?.into_inner()),
            Call::Release(r) => Out::Release(gate.release(self.request(r, deadline)).await?.into_inner()),
            Call::Heartbeat(r) => {
                Out::Heartbeat(gate.heartbeat(self.request(r, deadline)).await?.into_inner())
            }
            Call::Get(r) => Out::Get(gate.get(self.request(r, deadline)).await?.into_inner()),
            // Only the session task makes cancels, and sends them on its stream.
            Call::Cancel(_) => return Err(ClientError::Protocol("a cancel is no unary call".into())),
        })
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
