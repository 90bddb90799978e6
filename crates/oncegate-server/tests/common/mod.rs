//! The real server, in-process on port 0, for the server's integration tests.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;

use oncegate_engine::{Engine, Faults, ManualClock};
use oncegate_proto::v1::gate_client::GateClient;
use oncegate_server::Config;
use tokio::sync::oneshot;
use tonic::transport::Channel;

/// The fixed start of every test's manual clock.
pub const T0: u64 = 1_700_000_000_000;

/// A server running in this process until `stop`.
pub struct Running {
    pub addr: SocketAddr,
    pub engine: Engine,
    pub faults: Faults,
    stop: Option<oneshot::Sender<()>>,
    served: tokio::task::JoinHandle<()>,
    _dir: Option<tempfile::TempDir>,
}

impl Running {
    pub async fn client(&self) -> GateClient<Channel> {
        GateClient::connect(format!("http://{}", self.addr)).await.expect("connects")
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.addr)).unwrap().connect().await.expect("connects")
    }

    /// Stops accepting, waits for the server to finish, and hands the engine back.
    pub async fn stop(mut self) -> Engine {
        let _ = self.stop.take().expect("running").send(());
        self.served.await.expect("server task");
        self.engine
    }
}

/// Starts `serve` with a manual clock at `T0` and a fault seam; `dir` is kept alive with
/// the server when given.
pub async fn start_in(config: Config, dir: Option<tempfile::TempDir>) -> Running {
    let faults = Faults::default();
    let engine = Engine::open_with(config.engine.clone(), Arc::new(ManualClock::new(T0)), faults.clone())
        .expect("engine opens");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let served = {
        let engine = engine.clone();
        tokio::spawn(async move {
            oncegate_server::serve(engine, &config, listener, async {
                let _ = stopped.await;
            })
            .await
            .expect("serves");
        })
    };
    Running { addr, engine, faults, stop: Some(stop), served, _dir: dir }
}

/// `GET path` over HTTP/1.1; returns the status code and the body.
pub fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let mut socket = std::net::TcpStream::connect(addr).unwrap();
    write!(socket, "GET {path} HTTP/1.1\r\nHost: oncegate\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    socket.read_to_string(&mut response).unwrap();
    let status = response.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (status, body)
}
