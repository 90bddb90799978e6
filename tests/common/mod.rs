//! Running the built `oncegate` binary as a child process, for the root package's tests.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;

pub const BIN: &str = env!("CARGO_BIN_EXE_oncegate");

/// A running `oncegate serve`.
pub struct Server {
    pub child: Child,
    /// `http://127.0.0.1:PORT`.
    pub addr: String,
    /// The metrics listener, `127.0.0.1:PORT`.
    pub metrics: String,
}

/// The value of a `name=value` field of a log line.
fn field(line: &str, name: &str) -> String {
    let at = line.find(name).map_or(line.len(), |at| at + name.len());
    line[at..].split_whitespace().next().unwrap_or("").to_owned()
}

impl Server {
    /// Starts `oncegate serve --listen 127.0.0.1:0` on `data_dir` and waits for its
    /// "listening" log line, which carries the port.
    pub fn start(data_dir: &Path, extra: &[&str]) -> Server {
        Server::start_at(data_dir, "127.0.0.1:0", extra)
    }

    /// [`Server::start`] listening on `listen` (a restarted server takes its address
    /// back, so that its clients find it).
    pub fn start_at(data_dir: &Path, listen: &str, extra: &[&str]) -> Server {
        let mut child = Command::new(BIN)
            .args(["serve", "--listen", listen, "--metrics-listen", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .args(extra)
            .env("ONCEGATE_LOG_FORMAT", "text")
            .env_remove("RUST_LOG")
            .env_remove("ONCEGATE_CONFIG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("server starts");
        let stderr = child.stderr.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        // Keep draining the log after the address is found, so the pipe never fills.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if line.contains("listening") {
                    let _ = tx.send(Ok((field(&line, "addr="), field(&line, "metrics="))));
                } else if line.contains("ERROR") || line.starts_with("Error") {
                    let _ = tx.send(Err(line));
                }
            }
        });
        let (addr, metrics) = rx.recv().expect("the server logs its address").expect("the server starts");
        Server { child, addr: format!("http://{addr}"), metrics }
    }

    /// Sends SIGTERM and waits; returns whether the exit was clean.
    pub fn terminate(mut self) -> bool {
        let status =
            Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().expect("kill");
        assert!(status.success());
        self.child.wait().expect("wait").success()
    }

    /// SIGKILL: no destructor, no flush, no shutdown protocol runs.
    pub fn kill(mut self) {
        self.child.kill().expect("kill");
        let _ = self.child.wait();
    }
}
