//! Retrying calls that are safe to repeat, with jittered exponential back-off.
//!
//! Every call of the `Gate` trait is safe to repeat by itself: a reserve repeated after
//! its grant was lost finds the key in progress (held by the lost grant) rather than
//! granting it twice; a commit with the same token and outcome is acknowledged again;
//! release, heartbeat and get change nothing twice. What must never be repeated is the
//! caller's work, and nothing here runs it.

use std::future::Future;
use std::time::Duration;

use oncegate_core::Code;
use oncegate_core::gate::GateError;
use rand::Rng;

/// Which failures are retried, how often, and how long to pause between tries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Tries in all, the first included; 1 retries nothing.
    pub attempts_max: u32,
    /// The pause before the first retry is drawn from `0..=backoff_min`; each retry after
    /// doubles the bound, up to `backoff_max` ("full jitter").
    pub backoff_min: Duration,
    /// The largest bound of a pause.
    pub backoff_max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts_max: 5,
            backoff_min: Duration::from_millis(25),
            backoff_max: Duration::from_secs(1),
        }
    }
}

impl RetryPolicy {
    /// No retries.
    pub const NONE: RetryPolicy =
        RetryPolicy { attempts_max: 1, backoff_min: Duration::ZERO, backoff_max: Duration::ZERO };

    /// Whether a failure with `code` may succeed if tried again: the server or the
    /// network could not serve it (`unavailable`), or a bounded queue was full
    /// (`resource_exhausted`). Refusals of the contract are final.
    pub fn retries(code: Code) -> bool {
        matches!(code, Code::Unavailable | Code::ResourceExhausted)
    }

    /// The pause before retry `n` (1 for the first retry).
    pub(crate) fn pause(&self, n: u32) -> Duration {
        let bound =
            self.backoff_min.saturating_mul(1u32 << n.saturating_sub(1).min(20)).min(self.backoff_max);
        let millis = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX);
        Duration::from_millis(rand::rng().random_range(0..=millis))
    }

    /// Runs `call` until it succeeds, fails for good, or has been tried
    /// `attempts_max` times.
    pub async fn run<T, E, F, Fut>(&self, mut call: F) -> Result<T, E>
    where
        E: GateError,
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let mut tried = 1;
        loop {
            match call().await {
                Err(error) if tried < self.attempts_max && RetryPolicy::retries(error.code()) => {
                    tracing::debug!(%error, tried, "retrying a call that is safe to repeat");
                    tokio::time::sleep(self.pause(tried)).await;
                    tried += 1;
                }
                done => return done,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("{0:?}")]
    struct Failed(Code);

    impl GateError for Failed {
        fn code(&self) -> Code {
            self.0
        }
    }

    fn fast(attempts_max: u32) -> RetryPolicy {
        RetryPolicy {
            attempts_max,
            backoff_min: Duration::from_millis(1),
            backoff_max: Duration::from_millis(2),
        }
    }

    /// Each call fails with the next code of `codes`, then succeeds; returns the result
    /// and the calls made.
    fn run(policy: RetryPolicy, codes: &[Code]) -> (Result<u32, Code>, usize) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let calls = std::cell::Cell::new(0);
        let result = runtime.block_on(policy.run(|| {
            let n = calls.get();
            calls.set(n + 1);
            let answer = codes.get(n).map_or(Ok(7), |code| Err(Failed(*code)));
            async move { answer }
        }));
        (result.map_err(|e| e.0), calls.get())
    }

    #[test]
    fn unavailable_and_exhausted_are_retried_and_refusals_are_final() {
        assert_eq!(run(fast(5), &[Code::Unavailable, Code::ResourceExhausted]), (Ok(7), 3));
        assert_eq!(run(fast(5), &[Code::LeaseLost]), (Err(Code::LeaseLost), 1));
        assert_eq!(
            run(fast(2), &[Code::Unavailable, Code::Unavailable, Code::Unavailable]),
            (Err(Code::Unavailable), 2)
        );
        assert_eq!(run(RetryPolicy::NONE, &[Code::Unavailable]), (Err(Code::Unavailable), 1));
    }

    #[test]
    fn pauses_are_jittered_below_a_doubling_bound() {
        let policy = RetryPolicy {
            attempts_max: 10,
            backoff_min: Duration::from_millis(10),
            backoff_max: Duration::from_millis(50),
        };
        for _ in 0..200 {
            assert!(policy.pause(1) <= Duration::from_millis(10));
            assert!(policy.pause(3) <= Duration::from_millis(40));
            assert!(policy.pause(9) <= Duration::from_millis(50));
        }
    }
}
