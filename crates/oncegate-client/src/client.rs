//! The remote gate: `oncegate.v1.Gate` over gRPC, with a bearer token, TLS for `https://`
//! addresses, a deadline per call, and the retry policy for calls that are safe to repeat.

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use oncegate_core::gate::{CommitRequest, Gate, GateError, KeyRequest, Renewed, ReserveRequest, Reserved};
use oncegate_core::{Code, View};
use oncegate_proto::v1::gate_client::GateClient;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::retry::RetryPolicy;
use crate::wire;

/// What a remote call fails with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The server answered with a refusal (or the transport failed, as `unavailable`).
    #[error("{message} ({})", code.as_str())]
    Refused {
        /// The contract's code.
        code: Code,
        /// The server's message.
        message: String,
    },
    /// The client could not be set up (its address, its CA file, its token).
    #[error("client configuration: {0}")]
    Config(String),
    /// The server answered something this client does not understand (a newer server).
    #[error("unexpected answer: {0}")]
    Protocol(String),
}

impl GateError for ClientError {
    fn code(&self) -> Code {
        match self {
            ClientError::Refused { code, .. } => *code,
            ClientError::Config(_) => Code::InvalidArgument,
            ClientError::Protocol(_) => Code::Unavailable,
        }
    }
}

impl From<tonic::Status> for ClientError {
    fn from(status: tonic::Status) -> ClientError {
        let code = oncegate_proto::status::code_of(&status);
        let causes: Vec<String> = std::iter::successors(std::error::Error::source(&status), |e| e.source())
            .map(ToString::to_string)
            .collect();
        let message = if causes.is_empty() {
            status.message().to_owned()
        } else {
            format!("{}: {}", status.message(), causes.join(": "))
        };
        ClientError::Refused { code, message }
    }
}

/// How to reach a server: [`Client::builder`].
#[derive(Clone, Debug)]
pub struct ClientBuilder {
    url: String,
    token: Option<String>,
    tls_ca: Option<PathBuf>,
    timeout: Duration,
    connect_timeout: Duration,
    retry: RetryPolicy,
}

impl ClientBuilder {
    /// The bearer token sent with every call (the tenant's).
    pub fn token(mut self, token: impl Into<String>) -> ClientBuilder {
        self.token = Some(token.into());
        self
    }

    /// A CA certificate (PEM) to trust beside the system's roots, for `https://`.
    pub fn tls_ca(mut self, path: impl Into<PathBuf>) -> ClientBuilder {
        self.tls_ca = Some(path.into());
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

    /// Connects (TLS when the address is `https://`).
    pub async fn connect(self) -> Result<Client, ClientError> {
        let token = match &self.token {
            Some(token) => Some(
                MetadataValue::try_from(format!("Bearer {token}"))
                    .map_err(|_| ClientError::Config("the token is not a valid header value".to_owned()))?,
            ),
            None => None,
        };
        let channel = self.endpoint()?.connect().await.map_err(|e| ClientError::Refused {
            code: Code::Unavailable,
            message: format!("cannot connect to {}: {e}", self.url),
        })?;
        Ok(Client { gate: GateClient::new(channel), token, timeout: self.timeout, retry: self.retry })
    }

    fn endpoint(&self) -> Result<Endpoint, ClientError> {
        let config = |e: &dyn std::fmt::Display| ClientError::Config(format!("{}: {e}", self.url));
        let mut endpoint = Endpoint::from_shared(self.url.clone()).map_err(|e| config(&e))?;
        endpoint = endpoint.connect_timeout(self.connect_timeout).tcp_nodelay(true);
        if self.url.starts_with("https://") {
            let mut tls = ClientTlsConfig::new().with_native_roots();
            if let Some(path) = &self.tls_ca {
                let pem = std::fs::read(path)
                    .map_err(|e| ClientError::Config(format!("{}: {e}", path.display())))?;
                tls = tls.ca_certificate(Certificate::from_pem(pem));
            }
            endpoint = endpoint.tls_config(tls).map_err(|e| config(&e))?;
        }
        Ok(endpoint)
    }
}

/// A connection to an oncegate server; cheap to clone (clones share the connection).
#[derive(Clone, Debug)]
pub struct Client {
    gate: GateClient<Channel>,
    token: Option<MetadataValue<Ascii>>,
    timeout: Duration,
    retry: RetryPolicy,
}

impl Client {
    /// A builder for `url` (`http://host:port` or `https://host:port`).
    pub fn builder(url: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            url: url.into(),
            token: None,
            tls_ca: None,
            timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            retry: RetryPolicy::default(),
        }
    }

    /// Connects to `url` with the defaults and no token.
    pub async fn connect(url: impl Into<String>) -> Result<Client, ClientError> {
        Client::builder(url).connect().await
    }

    /// A request with the token and the deadline.
    fn request<T>(&self, message: T, extra: Duration) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(self.timeout + extra);
        if let Some(token) = &self.token {
            request.metadata_mut().insert("authorization", token.clone());
        }
        request
    }
}

impl Gate for Client {
    type Error = ClientError;

    fn reserve(&self, request: ReserveRequest) -> impl Future<Output = Result<Reserved, ClientError>> + Send {
        let wait = Duration::from_millis(request.wait_ms);
        self.retry.run(move || {
            let (mut gate, request) =
                (self.gate.clone(), self.request(wire::reserve_request(request.clone()), wait));
            async move { wire::reserved(gate.reserve(request).await?.into_inner()) }
        })
    }

    fn commit(&self, request: CommitRequest) -> impl Future<Output = Result<u64, ClientError>> + Send {
        self.retry.run(move || {
            let (mut gate, request) =
                (self.gate.clone(), self.request(wire::commit_request(request.clone()), Duration::ZERO));
            async move { Ok(gate.commit(request).await?.into_inner().expires_at_ms) }
        })
    }

    fn release(&self, request: KeyRequest) -> impl Future<Output = Result<(), ClientError>> + Send {
        self.retry.run(move || {
            let (mut gate, request) =
                (self.gate.clone(), self.request(wire::release_request(request.clone()), Duration::ZERO));
            async move { gate.release(request).await.map(|_| ()).map_err(ClientError::from) }
        })
    }

    fn heartbeat(&self, request: KeyRequest) -> impl Future<Output = Result<Renewed, ClientError>> + Send {
        self.retry.run(move || {
            let (mut gate, request) =
                (self.gate.clone(), self.request(wire::heartbeat_request(request.clone()), Duration::ZERO));
            async move { Ok(wire::renewed(gate.heartbeat(request).await?.into_inner())) }
        })
    }

    fn get(&self, request: KeyRequest) -> impl Future<Output = Result<View, ClientError>> + Send {
        self.retry.run(move || {
            let (mut gate, request) =
                (self.gate.clone(), self.request(wire::get_request(request.clone()), Duration::ZERO));
            async move { wire::view(gate.get(request).await?.into_inner()) }
        })
    }
}
